"""The sampler's slot cache: every row at its own position, rows admitted while others decode,
finished rows replaced by moving only the rows that must move; and sampling through it draws
what each request draws alone, with logprobs of a plain forward pass (sliding windows too)."""

from __future__ import annotations

import pytest
import torch
from backend_helpers import assert_logprobs_of_a_plain_forward
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from grpo import models
from grpo.backends.local import sampler
from grpo.backends.local.kv_cache import SlotCache
from grpo.backends.local.trunk import common_trunk
from grpo.types import SamplingParams

STOP_IDS = list(range(3000, 9000))
CONFIG = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=16, vocab_size=32)


def prefill(lengths: list[int], gen: torch.Generator) -> tuple[DynamicCache, list[torch.Tensor]]:
    """A left-padded prefill cache of prompts of ``lengths`` (2 layers, 1 head, dim 4), and each
    prompt's own keys of layer 0 ([1, length, 4])."""
    width = max(lengths)
    cache = DynamicCache()
    for layer in range(2):
        k = torch.randn(len(lengths), 1, width, 4, generator=gen)
        cache.update(k, k + 100, layer)
    return cache, [cache.layers[0].keys[i:i + 1, :, width - n:] for i, n in enumerate(lengths)]


def decode(cache: SlotCache, rows: int, gen: torch.Generator) -> list[torch.Tensor]:
    """One decode step: a new key per row in every layer; returns layer 0's new keys."""
    cache.set_step()
    new = torch.randn(rows, 1, 1, 4, generator=gen)
    for layer in cache.layers:
        keys, values = layer.update(new, new + 100)
        assert keys.shape == (rows, 1, max(cache.lengths) + 1, 4)
        assert all(torch.equal(values[r, :, :n + 1], keys[r, :, :n + 1] + 100) for r, n in enumerate(cache.lengths))
    cache.lengths = [n + 1 for n in cache.lengths]
    return list(new[:, :, 0])


def test_rows_decode_at_their_own_positions_through_admission_and_finishing():
    gen = torch.Generator().manual_seed(0)
    cache = SlotCache(CONFIG, slots=5, capacity=12, device=torch.device("cpu"))
    first, (p0, p1) = prefill([5, 2], gen)
    cache.write_prompt(0, 2, first, 0, 0)  # prompt 0 fanned out to two rows
    cache.write_prompt(2, 1, first, 1, 3)  # prompt 1 without its 3 columns of padding
    expected = [p0[0], p0[0], p1[0]]  # each row's keys so far, [1, length, 4]
    for _ in range(2):
        for r, k in enumerate(decode(cache, 3, gen)):
            expected[r] = torch.cat([expected[r], k[:, None]], dim=1)
    # a request admitted while the others are 2 tokens into their answers starts at its own length
    second, (p2,) = prefill([3], gen)
    cache.write_prompt(3, 2, second, 0, 0)
    expected += [p2[0], p2[0]]
    for r, k in enumerate(decode(cache, 5, gen)):
        expected[r] = torch.cat([expected[r], k[:, None]], dim=1)
    assert cache.lengths == [8, 8, 5, 4, 4]

    def held(r: int) -> torch.Tensor:
        return cache.layers[0].keys[r, :, : cache.lengths[r]]

    assert all(torch.equal(held(r), expected[r]) for r in range(5))
    # rows 0 and 2 finish: row 3 moves into slot 0, row 4 into slot 2, row 1 stays where it is
    untouched = cache.layers[0]._keys[1].clone()
    order = cache.keep([1, 3, 4])
    assert order == [3, 1, 4] and cache.lengths == [4, 8, 4]
    assert torch.equal(cache.layers[0]._keys[1], untouched)
    expected = [expected[r] for r in order]
    for r, k in enumerate(decode(cache, 3, gen)):
        expected[r] = torch.cat([expected[r], k[:, None]], dim=1)
    assert all(torch.equal(held(r), expected[r]) for r in range(3))


def test_rows_holding_copies_of_one_prompt_are_named_to_attention_through_admission_and_finishing():
    """A prompt fanned out to a group's rows, or written again from the same source with its copy's
    id, is read once for the rows holding it: each decode step names, per row, the first row with
    the same copy (``shared_from``) and the prompt's columns (``shared``) -- following the rows as
    finished ones are replaced; nothing where no two rows share."""
    gen = torch.Generator().manual_seed(0)
    cache = SlotCache(CONFIG, slots=6, capacity=12, device=torch.device("cpu"))
    first, _ = prefill([5, 2], gen)
    cache.write_prompt(0, 1, first, 1, 3)  # prompt 1 alone
    cache.set_step()
    assert cache.step.shared_from is None and cache.step.shared is None
    copy = cache.new_copy()
    cache.write_prompt(1, 2, first, 0, 0, copy_of=copy)  # prompt 0 to two rows
    cache.write_prompt(3, 1, first, 0, 0, copy_of=copy)  # and to one more, from the same source
    cache.lengths = [n + 1 for n in cache.lengths]
    cache.set_step()
    assert cache.step.shared_from.tolist() == [0, 1, 1, 1] and cache.step.shared.tolist() == [2, 5, 5, 5]
    second, _ = prefill([3], gen)
    cache.write_prompt(4, 2, second, 0, 0)  # a group admitted later: a copy of its own
    cache.set_step()
    assert cache.step.shared_from.tolist() == [0, 1, 1, 1, 4, 4]
    assert cache.step.shared.tolist() == [2, 5, 5, 5, 3, 3]
    order = cache.keep([2, 3, 5])  # rows 0, 1 and 4 finish: row 3 moves into slot 0, row 5 into slot 1
    assert order == [3, 5, 2]
    cache.set_step()
    assert cache.step.shared_from.tolist() == [0, 1, 0] and cache.step.shared.tolist() == [5, 3, 5]
    cache.keep([0, 1])
    cache.set_step()
    assert cache.step.shared_from is None


def test_decode_mask_shows_each_row_its_own_columns_and_only_the_window_where_sliding():
    cache = SlotCache(Qwen2Config(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                                  intermediate_size=16, vocab_size=32, sliding_window=3, use_sliding_window=True,
                                  layer_types=["sliding_attention", "full_attention"]),
                      slots=2, capacity=8, device=torch.device("cpu"))
    cache.lengths = [5, 2]
    _, mask = cache.set_step()
    assert mask["full_attention"][:, 0, 0].tolist() == [[True] * 6, [True] * 3 + [False] * 3]
    assert mask["sliding_attention"][:, 0, 0].tolist() == [[False] * 3 + [True] * 3, [True] * 3 + [False] * 3]
    every_layer_windowed = SlotCache(MistralConfig(sliding_window=3, **SIZES), slots=2, capacity=8,
                                     device=torch.device("cpu"))
    every_layer_windowed.lengths = [5, 2]
    _, mask = every_layer_windowed.set_step()
    assert mask[:, 0, 0].tolist() == [[False] * 3 + [True] * 3, [True] * 3 + [False] * 3]  # one mask, no mapping


def test_models_with_other_layer_kinds_are_refused():
    config = Qwen2Config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"attention-only models .* has \['linear_attention'\] layers"):
        SlotCache(config, slots=1, capacity=4, device=torch.device("cpu"))


def requests(prompts, seed0=11) -> list[sampler.GenerationRequest]:
    return [sampler.GenerationRequest(p, 4, SamplingParams(max_tokens=6 + 5 * i, temperature=1.0, seed=seed0 + i,
                                                           stop=STOP_IDS))
            for i, p in enumerate(prompts)]


def test_continuous_batching_draws_what_each_request_draws_alone(tokenizer):
    """Five rows at once for 16: requests are let in as rows finish (rows stop at scattered steps,
    an eighth of the tiny model's vocabulary stops a row), and each request's samples are the
    ones it gives alone."""
    model = models.load_model("tiny")
    prompts = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906, 30], [1, *range(42, 52)], [1, 5, 6]]
    alone = []
    for req in requests(prompts):
        sampler.generate(model, [req], tokenizer, torch.device("cpu"))
        alone += req.sequences
    batched = requests(prompts)
    stats = sampler.generate(model, batched, tokenizer, torch.device("cpu"), row_bytes=lambda n: 1, budget=5)
    together = [s for req in batched for s in req.sequences]
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    assert [s.stop_reason for s in together] == [s.stop_reason for s in alone]
    assert {s.stop_reason for s in alone} == {"stop", "length"}, "the test needs rows that stop early"
    for a, b in zip(together, alone, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert stats.admissions == 4 and stats.peak_rows == 5
    # requests overlapped: fewer decoding steps than one request after another
    assert stats.decode_steps < sum(max(len(s.tokens) for s in alone[4 * i:4 * i + 4]) for i in range(4))
    assert stats.rows_decoded >= sum(len(s.tokens) for s in alone) - 16  # a row's first token needs no step


def test_prompts_under_one_trunk_prefill_it_once_and_draw_what_each_draws_alone(tokenizer):
    """Prompts that begin alike (a system prompt) run the trunk once and the rest of each prompt
    after it, one admission; each request draws what it draws alone, with the logprobs of a plain
    forward pass of the whole sequence."""
    model = models.load_model("tiny")
    trunk = [1, *range(600, 612)]  # 13 tokens
    prompts = [trunk + [504, 3458, 314], trunk + [9906], trunk + [*range(42, 52)]]
    assert common_trunk(prompts) == 13
    assert common_trunk(prompts[:1]) == 0 and common_trunk([trunk + [5], [1, 2, 3]]) == 0
    assert common_trunk([trunk + [5], trunk + [5, 6]]) == 13  # each prompt keeps a token of its own
    assert common_trunk(prompts, min_tokens=14) == 0
    alone = []
    for req in requests(prompts):
        sampler.generate(model, [req], tokenizer, torch.device("cpu"))
        alone += req.sequences
    batched = requests(prompts)
    stats = sampler.generate(model, batched, tokenizer, torch.device("cpu"))
    assert stats.admissions == 1
    assert stats.prefilled_tokens == 13 + 3 + 1 + 10 and stats.prompt_tokens == sum(map(len, prompts))
    together = [s for req in batched for s in req.sequences]
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    for a, b in zip(together, alone, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert_logprobs_of_a_plain_forward(model, batched)


SIZES = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention", "full_attention"], "mistral",
                                         "gemma2", "gpt_oss"])
def test_sampled_logprobs_equal_a_plain_forward(tokenizer, layer_types):
    """Rows of different prompt lengths admitted at different times, decoding past a 3-token
    sliding window: each sampled token's logprob equals the model's own full forward pass. A
    Qwen2 of full layers, of a windowed and a full one (a mask per kind), a Mistral of windowed
    layers only (one mask: its forward takes no mapping; Mistral-7B-v0.1 windows 4096 tokens),
    and two models whose attention is eager, which adds its mask to the scores: Gemma 2 (its
    scores soft-capped) and GPT-OSS (its softmax with a sink per head)."""
    attention = "sdpa"
    if layer_types == "mistral":
        config = MistralConfig(vocab_size=tokenizer.vocab_size, sliding_window=3, **SIZES)
    elif layer_types == "gemma2":
        config, attention = Gemma2Config(vocab_size=tokenizer.vocab_size, sliding_window=3, head_dim=8, **SIZES), "eager"
    elif layer_types == "gpt_oss":
        config, attention = GptOssConfig(vocab_size=tokenizer.vocab_size, sliding_window=3, head_dim=8,
                                         num_local_experts=2, num_experts_per_tok=1, **SIZES), "eager"
    else:
        config = Qwen2Config(vocab_size=tokenizer.vocab_size, sliding_window=3, use_sliding_window=True,
                             layer_types=layer_types, max_window_layers=0, **SIZES)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    if attention == "eager":
        assert "sliding_attention" in SlotCache(config, 1, 4, torch.device("cpu")).kinds
    prompts = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906], [1, *range(42, 52)]]
    batched = requests(prompts)
    stats = sampler.generate(model, batched, tokenizer, torch.device("cpu"), row_bytes=lambda n: 1, budget=6)
    assert stats.admissions >= 2
    assert_logprobs_of_a_plain_forward(model, batched)


def test_slot_buffers_are_freed_when_generate_returns(tokenizer, monkeypatch):
    """The slot buffers (a gigabyte or more at a full budget) go when ``generate`` returns, by
    reference counting alone: with the cycle collector off, nothing keeps them for the training
    step that follows."""
    import gc
    import weakref

    made: list[SlotCache] = []

    class Recorded(SlotCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(sampler, "SlotCache", Recorded)
    model = models.load_model("tiny")
    batched = requests([[1, 504, 3458, 314], [1, 9906, 30]])
    gc.disable()
    try:
        sampler.generate(model, batched, tokenizer, torch.device("cpu"), row_bytes=lambda n: 1, budget=5)
        (cache,) = made
        buffers = [weakref.ref(layer._keys) for layer in cache.layers]
        made.clear()
        del cache
        assert buffers and all(ref() is None for ref in buffers)
    finally:
        gc.enable()
