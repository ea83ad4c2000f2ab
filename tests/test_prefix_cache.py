"""The sampler's prefix cache (grpo/backends/local/prefix_cache.py): what a lookup finds, what the
byte budget evicts, that other weights' entries are never read; and on the packaged SmolLM2, that
a multi-turn episode sampled through the cache draws the same tokens with the same logprobs (fp32
rounding) as without it while prefilling only each turn's new tokens."""

from __future__ import annotations

import pytest
import torch

from grpo import models
from grpo.backends.local import prompt_logprobs, sampler
from grpo.backends.local.clients import ServiceClient
from grpo.backends.local.prefix_cache import PrefixCache
from grpo.backends.local.trunk import common_trunk
from grpo.types import AdamParams, Datum, ModelInput, SamplingParams, TensorData

CPU = torch.device("cpu")


def kv(tokens: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys/values whose column i encodes token i (so a test can see which entry a lookup read)."""
    col = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(1, 1, len(tokens), 2).clone()
    return [(col + layer, -col - layer) for layer in range(layers)]


BYTES_PER_TOKEN = 2 * 2 * 2 * 4  # layers * (k, v) * head_dim * fp32


def test_lookup_finds_the_longest_shared_prefix_and_leaves_a_token_to_compute():
    cache = PrefixCache(10**6)
    cache.store([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))
    cache.store([1, 2, 9], kv([1, 2, 9]))
    assert cache.lookup([7, 1, 2]) is None  # nothing shared from the start
    # shares 1, 2, 3 with the first entry: a prefix inside an entry counts (attention is causal)
    length, found = cache.lookup([1, 2, 3, 8, 8])
    assert length == 3 and found[0][0][0, 0, :, 0].tolist() == [1, 2, 3] and found[1][1][0, 0, :, 0].tolist() == [-2, -3, -4]
    # the whole entry matches, but the last prompt token must still be computed for its logits
    assert cache.lookup([1, 2, 3, 4, 5])[0] == 4
    assert cache.lookup([1, 2, 9, 4])[1][0][0][0, 0, :, 0].tolist() == [1, 2, 9]
    assert (cache.stats.lookups, cache.stats.hits, cache.stats.hit_tokens) == (4, 3, 10)


def test_a_stored_prefix_is_replaced_by_its_extension_and_not_stored_twice():
    cache = PrefixCache(10**6)
    cache.store([1, 2, 3], kv([1, 2, 3]))
    cache.store([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))  # prompt, then prompt + answer
    assert len(cache) == 1 and cache.bytes == 5 * BYTES_PER_TOKEN
    cache.store([1, 2], kv([1, 2]))  # already covered by the stored sequence
    assert len(cache) == 1 and cache.stats.stores == 2
    assert cache.lookup([1, 2, 3, 4, 5, 6])[0] == 5


def test_the_byte_budget_evicts_the_least_recently_used_entry():
    cache = PrefixCache(8 * BYTES_PER_TOKEN)
    cache.store([1, 2, 3], kv([1, 2, 3]))
    cache.store([4, 5, 6], kv([4, 5, 6]))
    cache.lookup([1, 2, 3, 0])  # [1, 2, 3] is now the more recently used
    cache.store([7, 8, 9], kv([7, 8, 9]))  # 9 tokens would not fit: [4, 5, 6] goes
    assert cache.bytes == 6 * BYTES_PER_TOKEN and cache.stats.evictions == 1
    assert cache.lookup([4, 5, 6, 0]) is None and cache.lookup([1, 2, 3, 0])[0] == 3
    # a node shared by an evicted entry and a kept one still leads to the kept one
    cache.store([7, 8, 1], kv([7, 8, 1]))
    assert cache.lookup([7, 8, 1, 0])[0] == 3
    cache.store(list(range(20, 40)), kv(list(range(20, 40))))  # larger than the whole budget: not kept
    assert cache.lookup([20, 21, 22]) is None and cache.bytes <= cache.max_bytes


def test_other_weights_entries_are_dropped():
    cache = PrefixCache(10**6)
    cache.bind(("lora0", "live", 0))
    cache.store([1, 2, 3], kv([1, 2, 3]))
    cache.bind(("lora0", "live", 0))
    assert cache.lookup([1, 2, 3, 4]) is not None
    cache.bind(("lora0", "live", 1))  # an optimizer step later
    assert cache.lookup([1, 2, 3, 4]) is None and cache.bytes == 0 and cache.stats.invalidations == 1


def states(marker: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A hybrid's end states for one linear layer (a conv window, a recurrent state) marked ``marker``."""
    return [(torch.full((1, 4, 3), float(marker)), torch.full((1, 2, 2, 2), float(marker)))]


STATE_BYTES = (4 * 3 + 2 * 2 * 2) * 4


def test_entries_with_end_states_are_read_only_whole_and_keep_what_they_extend():
    """A hybrid's entries (recurrent_prefix.py): a lookup finds the longest stored sequence that is a
    whole prefix of the prompt (a state is valid only at its end) leaving a token to compute; a
    longer entry drops none it extends (a sibling or a re-rendered turn may start from the shorter);
    the same sequence is not stored twice; the states count against the budget."""
    cache = PrefixCache(10**6)
    cache.store([1, 2, 3], kv([1, 2, 3], layers=1), states(3))
    cache.store([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5], layers=1), states(5))
    assert len(cache) == 2 and cache.bytes == 8 * BYTES_PER_TOKEN // 2 + 2 * STATE_BYTES
    length, found, end = cache.lookup_end([1, 2, 3, 4, 5, 6])
    assert length == 5 and end[0][1].unique().tolist() == [5.0] and found[0][0][0, 0, :, 0].tolist() == [1, 2, 3, 4, 5]
    assert cache.lookup_end([1, 2, 3, 4, 9])[0] == 3  # parts from the longer inside it: the shorter's end
    assert cache.lookup_end([1, 2, 3, 4, 5])[0] == 3  # the whole entry, but its last token must be computed
    assert cache.lookup_end([1, 2, 7]) is None and cache.lookup_end([1, 2, 3]) is None
    assert cache.lookup([1, 2, 3, 4, 5, 6]) is None  # (a partial lookup reads no end states)
    cache.store([1, 2, 3], kv([1, 2, 3], layers=1), states(9))  # stored already: kept as it was
    assert len(cache) == 2 and cache.lookup_end([1, 2, 3, 0])[2][0][0].unique().tolist() == [3.0]
    with pytest.raises(ValueError, match="cover 2 positions, tokens 3"):
        cache.store([1, 2, 8], kv([1, 2], layers=1), states(0))
    small = PrefixCache(3 * BYTES_PER_TOKEN // 2 + STATE_BYTES)  # one entry of three tokens with its states
    small.store([1, 2, 3], kv([1, 2, 3], layers=1), states(3))
    small.store([4, 5, 6], kv([4, 5, 6], layers=1), states(6))
    assert len(small) == 1 and small.stats.evictions == 1 and small.lookup_end([4, 5, 6, 0])[0] == 3


# --------------------------------------------------------------------------- the packaged model


@pytest.fixture(scope="module")
def smollm2():
    return models.load_model("smollm2", device=CPU, dtype=torch.float32), models.load_tokenizer("smollm2")


def chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def play(model, tokenizer, prefix_cache: PrefixCache | None, params: SamplingParams, turns: int = 3):
    """A guessing game of ``turns`` turns, two episodes of one prompt: turn 1 is one request with
    num_samples=2, each later turn one request per episode on its whole context plus a reply.
    Each turn's (context, sequence) per episode, each turn's stats, and the reply's length."""
    reply = tokenizer.encode("<|im_end|>\n<|im_start|>user\nToo low. Again.<|im_end|>\n<|im_start|>assistant\n")
    prompt = chat(tokenizer, "Guess my number between 0 and 1000. Answer with Guess: N and nothing else.")
    contexts, out, stats = [prompt, prompt], [], []
    for turn in range(turns):
        if turn == 0:
            requests = [sampler.GenerationRequest(prompt, 2, params)]
        else:
            requests = [sampler.GenerationRequest(c, 1, params) for c in contexts]
        stats.append(sampler.generate(model, requests, tokenizer, CPU, prefix_cache=prefix_cache))
        sequences = [s for r in requests for s in r.sequences]
        out.append(list(zip(contexts, sequences, strict=True)))
        contexts = [c + s.tokens + reply for c, s in zip(contexts, sequences, strict=True)]
    return out, stats, len(reply)


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, temperature=0.0),
                                    SamplingParams(max_tokens=10, temperature=1.0, seed=7)], ids=["greedy", "seeded"])
def test_episodes_sample_the_same_through_the_cache_and_prefill_only_new_tokens(smollm2, params):
    model, tokenizer = smollm2
    cache = PrefixCache(2**30)
    cached, stats, reply = play(model, tokenizer, cache, params)
    plain, plain_stats, _ = play(model, tokenizer, None, params)
    gaps = {"cache": 0.0, "forward": 0.0}
    for turn_cached, turn_plain in zip(cached, plain, strict=True):
        for (context, a), (_, b) in zip(turn_cached, turn_plain, strict=True):
            assert a.tokens == b.tokens
            # the trainer's numbers: one forward pass over the whole sequence
            forward = prompt_logprobs.prompt_logprobs(model, [context + a.tokens], CPU)[0][len(context):]
            gaps["cache"] = max(gaps["cache"], *(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
            gaps["forward"] = max(gaps["forward"], *(abs(x - y) for x, y in zip(b.logprobs, forward, strict=True)))
    # fp32 rounding: keys computed while decoding instead of in a prefill move a logprob by about
    # as much as the sampler already differs from a forward pass, which is the CPU's kernels' own
    # (1.1e-5 on an Intel Xeon with AMX; 2.8e-5 with avx2 kernels, whose forward gap was 4.4e-5)
    assert gaps["cache"] <= 2 * gaps["forward"] + 1e-6 and gaps["cache"] < 1e-4, gaps
    # turn 1: one prefill of the prompt for both episodes; later turns: each episode computes its
    # last sampled token (never fed back) and the reply, the rest comes from its finished row (at
    # most: greedy episodes are alike, and the second reads all but one token from the first)
    assert stats[0].prefilled_tokens == stats[0].prompt_tokens
    for turn in (1, 2):
        assert stats[turn].prefix_hits == 2 and stats[turn].prefilled_tokens <= 2 * (reply + 1)
        # without the cache, every distinct context is prefilled (alike ones once), the start
        # they share (the episode so far, up to where the samples parted) once for all
        distinct = [list(c) for c in {tuple(c) for c, _ in plain[turn]}]
        trunk = common_trunk(distinct)
        assert plain_stats[turn].prefilled_tokens == trunk + sum(len(c) - trunk for c in distinct)
    assert stats[2].prefix_hit_tokens / stats[2].prompt_tokens > 0.8


@pytest.mark.slow
def test_a_sampling_client_reads_the_cache_until_its_weights_change(tmp_path):
    """Through the local client: turn 2 hits; after an optimizer step the next sampler's logprobs
    are its own weights' (nothing computed by the old weights is read), as compute_logprobs says."""
    service = ServiceClient(checkpoint_dir=tmp_path, memory_budget_mb=256)
    training = service.create_lora_training_client("smollm2", rank=4, seed=0)
    tokenizer = training.get_tokenizer()
    prompt = chat(tokenizer, "Name a colour.")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = training.save_weights_and_get_sampling_client()
    turn1 = first.sample(ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    context = prompt + turn1.tokens + tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnother.<|im_end|>\n")
    before = first.sampler_stats()
    first.sample(ModelInput.from_ints(context), 1, params).result()
    after = first.sampler_stats()
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == len(prompt) + len(turn1.tokens) - 1
    assert after["prefix_cache_bytes"] > 0

    datum = Datum(model_input=ModelInput.from_ints(context[:-1]),
                  loss_fn_inputs={"target_tokens": TensorData.from_torch(torch.tensor(context[1:])),
                                  "weights": TensorData.from_torch(torch.ones(len(context) - 1))})
    training.forward_backward([datum], "cross_entropy").result()
    # the training step got the cache's memory back: its entries would be stale after optim_step
    assert first.sampler_stats()["prefix_cache_bytes"] == 0
    training.optim_step(AdamParams(learning_rate=1e-2)).result()
    second = training.save_weights_and_get_sampling_client()
    again = second.sample(ModelInput.from_ints(context), 1, params).result().sequences[0]
    assert second.sampler_stats()["prefix_hits"] == after["prefix_hits"]  # the old entries are gone
    full = second.compute_logprobs(ModelInput.from_ints(context + again.tokens)).result()[len(context):]
    old = first.compute_logprobs(ModelInput.from_ints(context + again.tokens)).result()[len(context):]
    assert max(abs(a - b) for a, b in zip(again.logprobs, full, strict=True)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(full, old, strict=True)) > 1e-3  # the step did move them
    service.close()


LAYER_TYPES = [["full_attention"] * 2, ["sliding_attention", "full_attention"]]


def small_model(tokenizer, layer_types: list[str]):
    """A small random model with a sliding window of 3 where ``layer_types`` says so."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=tokenizer.vocab_size, sliding_window=3, use_sliding_window=True,
                         layer_types=layer_types, max_window_layers=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def assert_plain_forward_logprobs(model, requests: list[sampler.GenerationRequest]) -> None:
    """Every sampled token's logprob is the model's own full forward pass's over prompt + sample."""
    for req in requests:
        seq = req.sequences[0]
        ids = torch.tensor([req.prompt + seq.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(req.prompt) - 1:-1].float()
        plain = torch.log_softmax(logits, -1).gather(-1, ids[0, len(req.prompt):, None])[:, 0]
        assert seq.logprobs == pytest.approx(plain.tolist(), abs=1e-5)


@pytest.mark.parametrize("layer_types", LAYER_TYPES)
def test_a_turn_read_from_the_cache_has_a_plain_forward_pass_logprobs(tokenizer, layer_types):
    """A small random model, sliding-window layers too (the suffix's attention after a cached
    prefix must still see only the window): turn 2 of two episodes is prefilled after its cached
    turn 1, and every sampled token's logprob equals the model's own full forward pass."""
    model = small_model(tokenizer, layer_types)
    cache = PrefixCache(2**24)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    first = [sampler.GenerationRequest([1, 504, 3458, 314, 253, 1345, 28], 2, params)]
    sampler.generate(model, first, tokenizer, CPU, prefix_cache=cache)
    second = [sampler.GenerationRequest(first[0].prompt + s.tokens + [42, 43, 44], 1, params) for s in first[0].sequences]
    stats = sampler.generate(model, second, tokenizer, CPU, prefix_cache=cache)
    assert stats.prefix_hits == 2 and stats.prefilled_tokens <= 2 * 4
    assert_plain_forward_logprobs(model, second)


@pytest.mark.parametrize("layer_types", LAYER_TYPES)
def test_next_turns_of_different_lengths_are_prefilled_in_one_batch(tokenizer, layer_types):
    """Three episodes of two first prompts of different lengths reach turn 2 with replies of
    different lengths: their prompts differ in both the cached part and the new part, are
    prefilled in one forward after their cached prefixes (padding left of the prefix and right of
    the new tokens), compute only their new tokens, and sample with a plain forward's logprobs."""
    model = small_model(tokenizer, layer_types)
    cache = PrefixCache(2**24)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    first = [sampler.GenerationRequest([1, 504, 3458, 314, 253, 1345, 28], 2, params),
             sampler.GenerationRequest([1, 9906, 30], 1, params)]
    sampler.generate(model, first, tokenizer, CPU, prefix_cache=cache)
    (a1, a2), (b1,) = first[0].sequences, first[1].sequences
    replies = [[42, 43, 44], [42], [42, 43, 44, 45, 46]]
    second = [sampler.GenerationRequest(prompt + s.tokens + reply, 1, params)
              for prompt, s, reply in zip([first[0].prompt, first[0].prompt, first[1].prompt], [a1, a2, b1], replies,
                                          strict=True)]
    prefills = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: prefills.append(kwargs["input_ids"].shape) if kwargs["input_ids"].shape[1] > 1 else None,
        with_kwargs=True)
    try:
        stats = sampler.generate(model, second, tokenizer, CPU, prefix_cache=cache)
    finally:
        hook.remove()
    # each finished row of turn 1 was stored without its last token (never fed back): that token
    # and the reply are what turn 2 computes, all three prompts in one forward
    assert stats.prefix_hits == 3 and stats.prefilled_tokens == sum(1 + len(r) for r in replies)
    assert prefills == [torch.Size([3, 1 + max(len(r) for r in replies)])]
    assert_plain_forward_logprobs(model, second)


def test_the_bench_scripts_episodes_mode_measures_the_cache_off_and_on():
    """scripts/prefix_cache_bench.py episodes on the tiny model: one JSON line per setting, the same
    prompt tokens, fewer prefilled with the cache, and the ratio of their sampling times."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "prefix_cache_bench.py"
    done = subprocess.run([sys.executable, str(script), "episodes", "tiny", "3", "2", "4", "5"], check=True,
                          capture_output=True, text=True, timeout=600)
    off, on, ratio = (json.loads(line) for line in done.stdout.strip().splitlines()[-3:])
    assert (off["prefix_cache_mb"], on["prefix_cache_mb"]) == (0, "auto") and off["episodes"] == on["episodes"] == 3
    assert off["prompt_tokens"] == on["prompt_tokens"] == off["prefilled_tokens"] > on["prefilled_tokens"]
    assert on["prefix_hits"] == 3 and len(on["turn_s"]) == 2 and ratio["ratio_on_over_off"] > 0
