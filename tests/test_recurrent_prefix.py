"""A hybrid's next turn after its cached prefix (recurrent_prefix.py): rows restored from their
stored states and run only on their new tokens, left-padded together, compute what each whole
sequence computes alone; a multi-turn episode sampled through the prefix cache draws what it draws
without it while prefilling only each turn's new tokens; and through the local client."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import transformers
from backend_helpers import (
    assert_drew_alike,
    assert_logprobs_of_a_plain_forward,
    reference_function,
    tiny_qwen3_5,
    worst_relative_error,
)
from transformers import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5

from grpo import models
from grpo.backends.local import delta_rule, recurrent_prefix, recurrent_sampler, sampler
from grpo.backends.local.prefix_cache import PrefixCache
from grpo.types import SamplingParams

CPU = torch.device("cpu")


def _kernels(monkeypatch, path: str, module=modeling_qwen3_5) -> None:
    """transformers' reference functions ("reference"), or grpo's fitted ones ("kernels"), for
    this test in ``module`` (put back after)."""
    for name in delta_rule.REFERENCES:
        monkeypatch.setattr(module, name, reference_function(module, name))
    if path == "kernels":
        assert delta_rule.fit_prefill(tiny_qwen3_5()[0] if module is modeling_qwen3_5 else tiny_qwen3_next()) == 2


def tiny_qwen3_next(vocab_size: int = 2048):
    """A random Qwen3-Next: two gated-delta-rule layers (their a and b from one projection,
    ``in_proj_ba``), one attention layer, small experts."""
    config = transformers.Qwen3NextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab_size, layer_types=["linear_attention", "linear_attention", "full_attention"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(config).eval()


def _whole(model, tokens: list[int]) -> tuple[torch.Tensor, DynamicCache]:
    """The last position's logits of ``tokens`` run alone from nothing, and the cache it leaves."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True).logits[0, -1].float()
    return logits, cache


def _continued(model, prompts: list[list[int]], known: list[int]):
    """Each prompt's logits and batch cache from its first ``known`` tokens' stored entry (0:
    nothing stored), its other tokens left-padded behind the most new tokens, one forward."""
    entries = []
    for p, k in zip(prompts, known, strict=True):
        if k:
            _, cache = _whole(model, p[:k])
            entries.append((k, *recurrent_prefix.row_entry(cache, 0, torch.arange(k))))
        else:
            entries.append(None)
    return recurrent_sampler._prefill_after(model, prompts, entries, 0, CPU)


PROMPT_LENGTHS = [30, 41, 19, 70]
KNOWN = [12, 40, 0, 3]  # new tokens: 18, 1 (a whole turn cached but its last token), 19 (fresh), 67 (two chunks)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(5, 2000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize(("family", "path"), [("qwen3_5", "reference"), ("qwen3_5", "kernels"),
                                              ("qwen3_next", "reference"), ("qwen3_next", "kernels")])
def test_new_tokens_after_restored_states_compute_what_the_whole_sequence_computes(monkeypatch, family, path) -> None:
    """Rows of different cached and new lengths (one with nothing cached), one batch: each row's
    next-token logits, and the states and keys it leaves, are its whole sequence's run alone
    (float32 rounding); without the neutral padding they are not (the restored states decay over
    the padding, the window is read as zeros). Qwen3-Next's a and b come from one projection."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    _kernels(monkeypatch, path, modeling_qwen3_5 if family == "qwen3_5" else modeling_qwen3_next)
    model = tiny_qwen3_5()[0] if family == "qwen3_5" else tiny_qwen3_next()
    prompts = _prompts()
    cache, mask, logits = _continued(model, prompts, KNOWN)
    assert mask.shape == (4, max(KNOWN) + max(n - k for n, k in zip(PROMPT_LENGTHS, KNOWN, strict=True)))
    for j, prompt in enumerate(prompts):
        want, alone = _whole(model, prompt)
        assert worst_relative_error(logits[j], want) < 1e-5
        got_kv, got_states = recurrent_prefix.row_entry(cache, j, mask[j].nonzero()[:, 0])
        want_kv, want_states = recurrent_prefix.row_entry(alone, 0, torch.arange(len(prompt)))
        for got, want_pair in zip([*got_kv, *got_states], [*want_kv, *want_states], strict=True):
            for a, b in zip(got, want_pair, strict=True):
                assert a.shape == b.shape and worst_relative_error(a, b) < 1e-5
    # what transformers computes on the same batch by itself (its padding zeroed, not neutral)
    monkeypatch.setattr(recurrent_prefix, "neutral_left_padding", lambda *args: contextlib.nullcontext())
    _, _, plain = _continued(model, prompts, KNOWN)
    off = [worst_relative_error(plain[j], _whole(model, p)[0]) for j, p in enumerate(prompts)]
    assert max(off[2], off[3]) < 1e-5, off  # (the longest new part, unpadded; a fresh row, its state zero)
    assert min(off[0], off[1]) > 1e-2, off  # restored rows behind padding


def test_in_bfloat16_the_kernels_continuation_is_as_close_to_float32_as_a_whole_pass() -> None:
    """bf16 through grpo's kernels: a row continued after its restored states is as far from the
    float32 model's logits as the bf16 whole sequence is (its own rounding, not padding's)."""
    model, _ = tiny_qwen3_5(torch.bfloat16)
    delta_rule.fit_prefill(model)
    exact, _ = tiny_qwen3_5(torch.float32)
    prompts = _prompts()
    _, _, logits = _continued(model, prompts, KNOWN)
    for j, prompt in enumerate(prompts):
        truth = _whole(exact, prompt)[0]
        whole = worst_relative_error(_whole(model, prompt)[0], truth)
        assert worst_relative_error(logits[j], truth) <= 2 * whole + 2**-8, (j, whole)


def _play(model, tokenizer, prefix_cache: PrefixCache | None, turns: int = 3, budget_rows: int | None = None):
    """Two first prompts (one of two samples), then each episode's next turn on its whole context
    plus a reply of its own length; at the last turn a sibling's re-rendered answer too (the first
    prompt plus other tokens). Each turn's requests and stats. ``budget_rows``: at most that many
    rows decode at once, the others joining as rows finish (the i-th request of a turn then has
    3 + 2i tokens to sample, so that rows finish apart)."""
    budget = {} if budget_rows is None else dict(row_bytes=lambda positions: 1000, budget=1000 * budget_rows)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    requests = [sampler.GenerationRequest([1, 504, 3458, 314, 253, 1345, 28], 2, params),
                sampler.GenerationRequest([1, 9906, 30], 1, params)]
    first = [r.prompt for r in requests for _ in range(r.num_samples)]
    out = []
    for turn in range(turns):
        if budget_rows is not None:
            for i, r in enumerate(requests):
                r.params = dataclasses.replace(r.params, max_tokens=3 + 2 * i)
        stats = sampler.generate(model, requests, tokenizer, CPU, prefix_cache=prefix_cache, **budget)
        out.append((requests, stats))
        if turn == turns - 1:
            return out
        replies = [[42, 43, 44], [42], [42, 43, 44, 45, 46]]
        requests = [sampler.GenerationRequest(r.prompt + s.tokens + reply, 1, params)
                    for (r, s), reply in zip([(r, s) for r in requests for s in r.sequences], replies, strict=True)]
        if turn == turns - 2:
            requests.append(sampler.GenerationRequest(first[0] + [7, 8, 9], 1, params))


def _assert_sampled_alike(model, turns, reference) -> None:
    """Each turn of ``turns`` (``_play``'s) drew the ``reference`` turn's tokens and stop reasons from
    as many prompt tokens, its logprobs within float32 rounding of the reference's and of a plain
    forward's."""
    for (got, stats), (want, want_stats) in zip(turns, reference, strict=True):
        assert_drew_alike(got, want)
        assert_logprobs_of_a_plain_forward(model, got)
        assert stats.prompt_tokens == want_stats.prompt_tokens


def test_episodes_sample_the_same_through_the_cache_and_prefill_only_their_new_tokens() -> None:
    model, _ = tiny_qwen3_5()
    tokenizer = models.load_tokenizer("tiny")
    cache = PrefixCache(2**26)
    cached = _play(model, tokenizer, cache)
    _assert_sampled_alike(model, cached, _play(model, tokenizer, None))
    (_, first), (second_requests, second), (third_requests, third) = [(r, s) for r, s in cached]
    assert first.prefix_hits == 0 and first.prefilled_tokens == 7 + 3
    # a finished row is stored without its last token (never fed back): that token and the reply
    # are what the next turn computes, all episodes in one forward
    assert second.prefix_hits == 3 and second.prefilled_tokens == (1 + 3) + (1 + 1) + (1 + 5)
    # the sibling's other answer starts from the first prompt's entry, kept beside the longer ones
    assert third.prefix_hits == 4 and third.prefilled_tokens == second.prefilled_tokens + 3
    assert third.prefix_hit_tokens == sum(len(r.prompt) for r in third_requests) - third.prefilled_tokens
    assert len(third_requests) == 4 and len(second_requests) == 3


def test_episodes_that_join_a_running_batch_continue_from_their_restored_states() -> None:
    """Two rows at a time: each turn's later episodes are prefilled after their cached states while
    the earlier ones decode, and join their batch; they draw what they draw all in one batch
    without the cache."""
    model, _ = tiny_qwen3_5()
    tokenizer = models.load_tokenizer("tiny")
    joining = _play(model, tokenizer, PrefixCache(2**26), budget_rows=2)
    _assert_sampled_alike(model, joining, _play(model, tokenizer, None, budget_rows=10**6))
    (_, first), (_, second), (_, third) = joining
    assert [s.admissions for s in (first, second, third)] == [2, 2, 3]  # (3, 3 and 4 requests, 2 rows at once)
    assert max(s.peak_rows for _, s in joining) == 2
    assert second.prefix_hits == 3 and third.prefix_hits == 4


def test_turns_of_one_new_token_each_run_as_a_decoding_step_from_the_restored_states() -> None:
    """Every row's next prompt is its last one and what it sampled, nothing else: one new token a
    row (the last sampled, never fed), which the model takes as a decoding step on the restored
    states -- the same draws as without the cache, a plain forward's logprobs."""
    model, _ = tiny_qwen3_5()
    tokenizer = models.load_tokenizer("tiny")
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3)

    def play(cache):
        first = [sampler.GenerationRequest([1, 504, 3458, 314, 253, 1345, 28], 2, params)]
        sampler.generate(model, first, tokenizer, CPU, prefix_cache=cache)
        second = [sampler.GenerationRequest(first[0].prompt + s.tokens, 1, params) for s in first[0].sequences]
        return second, sampler.generate(model, second, tokenizer, CPU, prefix_cache=cache)

    (got, stats), (want, _) = play(PrefixCache(2**26)), play(None)
    assert stats.prefix_hits == 2 and stats.prefilled_tokens == 2
    for a, b in zip(got, want, strict=True):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        assert a.sequences[0].logprobs == pytest.approx(b.sequences[0].logprobs, abs=1e-5)
    assert_logprobs_of_a_plain_forward(model, got)


def test_a_model_whose_padding_cannot_be_neutralised_prefills_every_prompt_whole() -> None:
    """Granite 4's state-space layers compute their decay otherwise: no entry is read or written,
    and sampling is as without a cache; Qwen3.5 and Qwen3-Next can."""
    tokenizer = models.load_tokenizer("tiny")
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=1, mamba_expand=1, num_local_experts=0, shared_intermediate_size=128)
    torch.manual_seed(0)
    granite = transformers.GraniteMoeHybridForCausalLM(config).eval()
    assert not recurrent_prefix.continuable(granite)
    assert recurrent_prefix.continuable(tiny_qwen3_5()[0]) and recurrent_prefix.continuable(tiny_qwen3_next())
    cache = PrefixCache(2**26)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    request = sampler.GenerationRequest([1, 504, 3458], 1, params)
    sampler.generate(granite, [request], tokenizer, CPU, prefix_cache=cache)
    again = sampler.GenerationRequest(request.prompt + request.sequences[0].tokens + [42], 1, params)
    stats = sampler.generate(granite, [again], tokenizer, CPU, prefix_cache=cache)
    assert len(cache) == 0 and stats.prefix_hits == 0 and stats.prefilled_tokens == len(again.prompt)


def test_a_hybrids_sampling_client_reads_its_episodes_states_from_the_cache(tmp_path) -> None:
    """Through the local client (its engine's kernels, its folded adapter): turn 2 of an episode
    computes only the turn's last sampled token and the reply, and samples what compute_logprobs
    says of the whole sequence."""
    from grpo.backends.local.clients import ServiceClient
    from grpo.types import ModelInput

    model, tokenizer = tiny_qwen3_5()
    model.save_pretrained(tmp_path / "qwen3_5")
    tokenizer.save_pretrained(tmp_path / "qwen3_5")
    service = ServiceClient(checkpoint_dir=tmp_path / "ckpt", device="cpu", dtype="float32")
    training = service.create_lora_training_client(str(tmp_path / "qwen3_5"), rank=4, seed=0)
    client = training.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    prompt = [1, 504, 3458, 314, 253, 1345, 28]
    turn1 = client.sample(ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    context = prompt + turn1.tokens + [42, 43, 44]
    before = client.sampler_stats()
    turn2 = client.sample(ModelInput.from_ints(context), 1, params).result().sequences[0]
    after = client.sampler_stats()
    assert after["prefix_hits"] - before["prefix_hits"] == 1
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == 1 + 3
    assert after["prefix_cache_bytes"] > 0
    whole = client.compute_logprobs(ModelInput.from_ints(context + turn2.tokens)).result()[len(context):]
    assert turn2.logprobs == pytest.approx(whole, abs=1e-4)
    service.close()


@pytest.mark.parametrize(("dtype", "gap"), [("fp32", 1e-4), ("bf16", 1e-2)])
def test_a_hybrids_agent_episodes_read_their_turns_from_the_cache_and_train_on_policy(tmp_path, dtype, gap) -> None:
    """grpo's own loop on a tiny Qwen3.5 (ToyAgent: three turns an episode, observations between):
    each later turn is read from the cache up to its new tokens, and the trainer's logprobs of the
    model's tokens are the sampler's within the precision's rounding (tests/test_episodes.py's
    bounds; bf16: the sampler's packed copy) -- the restored states are the episode's."""
    from toy_agent import ToyAgent

    from grpo.backends.local.clients import ServiceClient
    from grpo.record.runlog import read_jsonl
    from grpo.rl.loop import run_grpo

    model, tokenizer = tiny_qwen3_5()
    model.save_pretrained(tmp_path / "qwen3_5")
    tokenizer.save_pretrained(tmp_path / "qwen3_5")
    service = ServiceClient(checkpoint_dir=tmp_path / "checkpoints", dtype=dtype)
    run_grpo(ToyAgent(num_items=4, max_turns=3),
             {"base_model": str(tmp_path / "qwen3_5"), "steps": 2, "batch_size": 2, "group_size": 2, "max_tokens": 16,
              "report": False, "progress": False, "learning_rate": 1e-3, "eval_samples": 2},
             service_client=service, run_dir=tmp_path / "run")
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["episode/turns"] == 3 and row["datums"] > 0
        # (0.58 and 0.59 here: the first turns' prompts are prefilled whole, a group's once)
        assert row["sampler/prefix_hit_rate"] > 0.4, row["sampler/prefix_hit_rate"]
        assert row["logprob/max_abs_diff"] < gap, row["logprob/max_abs_diff"]
