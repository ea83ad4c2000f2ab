"""The memory budget: sampling a bounded number of rows at once (continuous batching) and training
in budget-sized micro-batches change how the work is cut, never what it computes (tiny model)."""

from __future__ import annotations

import os
import threading
from collections import deque

import pytest
import torch
from backend_helpers import adapter_tensors, perturb_adapter, rl_datum, tiny_qwen3_5

from grpo import models, types
from grpo.backends.local import ServiceClient, heap, memory, sampler, trainer

# 6 prompts of different lengths, 4 samples each: a GRPO step in miniature
PROMPTS = [[1, *range(200 + 7 * k, 200 + 7 * k + 5 + 3 * k)] for k in range(6)]
BUDGET_MB = 1.5  # tiny model: 5 rows sampled at once (one request and a bit), ~180 tokens per micro-batch


def step(svc: ServiceClient, counts: dict) -> tuple[list, dict, float]:
    """Sample a group per prompt, then one forward_backward on them; the samples, the
    adapter's gradients and the loss."""
    client = svc.create_lora_training_client("tiny", seed=0, rank=8)
    perturb_adapter(client, seed=3, scale=0.3)
    sampling = client.save_weights_and_get_sampling_client()
    futures = [sampling.sample(types.ModelInput.from_ints(p), 4,
                               types.SamplingParams(max_tokens=24, temperature=1.0, seed=50 + i))
               for i, p in enumerate(PROMPTS)]
    samples = [[(s.tokens, s.logprobs) for s in f.result().sequences] for f in futures]
    datums = [rl_datum(p, tokens, 0.25 * (k + 1), logprobs)
              for p, group in zip(PROMPTS, samples, strict=True) for k, (tokens, logprobs) in enumerate(group)]
    out = client.forward_backward(datums, "ppo").result()
    counts["trained_tokens"] = sum(len(d.model_input.to_ints()) for d in datums)
    return samples, adapter_tensors(client, "grad"), out.metrics["loss:sum"]


@pytest.fixture
def counts(monkeypatch) -> dict:
    """What the real sampler (one GenerationStats per generation) and trainer did."""
    seen = {"generations": [], "micro_batches": [], "released": []}
    real_generate, real_partition, real_release = sampler.generate, trainer.partition, heap.release_free_memory

    def generate(model, requests, *args, **kwargs):
        stats = real_generate(model, requests, *args, **kwargs)
        seen["generations"].append((len(requests), stats))
        return stats

    def partition(*args, **kwargs):
        batches = real_partition(*args, **kwargs)
        seen["micro_batches"].append(len(batches))
        return batches

    def release(device, keep=0):
        seen["released"].append((len(seen["generations"]), sum(seen["micro_batches"])))
        return real_release(device, keep)

    monkeypatch.setattr(sampler, "generate", generate)
    monkeypatch.setattr(trainer, "partition", partition)
    monkeypatch.setattr(heap, "release_free_memory", release)
    return seen


def test_a_small_budget_gives_the_unbounded_samples_and_gradients(tmp_path, counts) -> None:
    unbounded = step(ServiceClient(checkpoint_dir=tmp_path, device="cpu", dtype="float32", memory_budget_mb=0), counts)
    [(requests, stats)] = counts["generations"]
    assert (requests, stats.admissions, stats.peak_rows) == (6, 1, 24)
    counts["generations"].clear()
    counts["micro_batches"].clear()
    counts["released"].clear()
    bounded = step(ServiceClient(checkpoint_dir=tmp_path, device="cpu", dtype="float32", memory_budget_mb=BUDGET_MB),
                   counts)
    # the budget really cut the work: one generation whose requests were let in as rows finished,
    # never more rows at once than the budget holds; micro-batches in the order the trainer tried
    [(requests, stats)] = counts["generations"]
    assert requests == 6 and stats.admissions >= 3 and 4 <= stats.peak_rows < 8
    assert max(counts["micro_batches"]) >= 3
    # what sampling freed went back to the OS before training, and what training freed after it
    assert (1, 0) in counts["released"] and counts["released"][-1] == (1, sum(counts["micro_batches"]))

    samples_u, grads_u, loss_u = unbounded
    samples_b, grads_b, loss_b = bounded
    assert [[t for t, _ in g] for g in samples_b] == [[t for t, _ in g] for g in samples_u]  # the same tokens
    for gu, gb in zip(samples_u, samples_b, strict=True):
        for (_, lu), (_, lb) in zip(gu, gb, strict=True):
            assert torch.allclose(torch.tensor(lb), torch.tensor(lu), atol=1e-5)
    assert loss_b == pytest.approx(loss_u, rel=1e-5, abs=1e-6)
    assert grads_b.keys() == grads_u.keys()
    for name in grads_u:
        # float rounding: a sum of a few hundred per-position terms, some cancelling
        scale = float(grads_u[name].abs().max())
        assert float((grads_b[name] - grads_u[name]).abs().max()) <= 1e-5 * scale, name
    assert any(g.abs().sum() > 0 for g in grads_u.values())


def test_budget_settings_and_their_errors() -> None:
    cpu = torch.device("cpu")
    assert memory.resolve_budget(0, cpu) is None
    assert memory.resolve_budget(3, cpu) == 3 * 2**20
    assert memory.resolve_budget("auto", cpu) == memory.total_memory(cpu) // 16
    for bad in (-1, "lots", True):
        with pytest.raises(ValueError, match="memory_budget_mb"):
            ServiceClient(memory_budget_mb=bad)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        ServiceClient(micro_batch_tokens=0)


def _saved_per_token(client, decode, responses: int = 4, length: int = 120) -> float:
    """What autograd keeps per processed token of a group (PROMPTS[5] and ``responses`` answers of
    ``length`` tokens) through ``decode`` (the trainer's shared decoder call), counted by a hook:
    each saved storage once, the parameters' not."""
    gen = torch.Generator().manual_seed(0)
    datums = [rl_datum(PROMPTS[5], torch.randint(100, 2000, (length,), generator=gen).tolist(), 0.1 * k,
                       [-2.0] * length) for k in range(responses)]
    prepared = trainer.prepare(datums, "ppo", client.engine.vocab_size, client.engine.check_tokens)
    params = {p.untyped_storage().data_ptr() for p in client.engine.peft_model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with client.engine.use(client.adapter), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # the decoder only: the unembedding holds one chunk of positions at a time (trainer.py)
        units = trainer.shared_micro_batches(trainer.plan_sharing(prepared)[0], None)[0]
        dec_out = decode(client.engine.causal_lm(), units, client.engine.device)
    del dec_out
    return sum(seen.values()) / (len(PROMPTS[5]) + responses * length)


def test_training_bytes_per_token_cover_what_autograd_saves(tmp_path) -> None:
    """The estimate the micro-batch size comes from is not below what autograd really keeps per
    processed token (saved tensors counted by a hook), nor more than twice it."""
    svc = ServiceClient(checkpoint_dir=tmp_path, device="cpu", dtype="float32", memory_budget_mb=0)
    client = svc.create_lora_training_client("tiny", seed=0, rank=16, train_unembed=False)
    measured = _saved_per_token(client, trainer.run_decoder_shared)
    estimate = memory.train_bytes_per_token(client.engine.causal_lm().config, torch.float32)
    assert measured <= estimate <= 2 * measured, (measured, estimate)


def test_a_hybrids_training_bytes_per_token_count_its_linear_layers(tmp_path) -> None:
    """A Qwen3.5's linear-attention layers keep more per token than attention layers do (their
    convolution's input and output, their gated norm's): the estimate covers them, on the packed
    path hybrids train on, and stays within twice what they keep."""
    model, tokenizer = tiny_qwen3_5()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    svc = ServiceClient(checkpoint_dir=tmp_path / "ckpt", device="cpu", dtype="float32", memory_budget_mb=0)
    client = svc.create_lora_training_client(str(tmp_path / "model"), seed=0, rank=16, train_unembed=False)
    measured = _saved_per_token(client, trainer.run_decoder_shared_packed)
    estimate = memory.train_bytes_per_token(client.engine.causal_lm().config, torch.float32)
    assert measured <= estimate <= 2 * measured, (measured, estimate)


# Two layers of real models' widths (the tiny models' are so narrow that LoRA's rank-sized inputs,
# counted at rank 64, outweigh everything else): (config class, causal LM class, sizes)
REAL_WIDTHS = {
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                                        num_key_value_heads=3)),
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(hidden_size=1024, intermediate_size=3072,
                                                           num_attention_heads=16, num_key_value_heads=8, head_dim=128)),
    # a norm before and after attention and after the MLP, q and k normalised per head: four norms a layer
    "gemma3-1b": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(hidden_size=1152, intermediate_size=6912,
                                                                num_attention_heads=4, num_key_value_heads=1,
                                                                head_dim=256, sliding_window=512)),
    # mixtures of experts: each token's experts keep their own activations (2 of 8; 8 of 16)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(hidden_size=1024, intermediate_size=3584,
                                                            num_attention_heads=16, num_key_value_heads=8,
                                                            num_local_experts=8, num_experts_per_tok=2)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(hidden_size=1024, intermediate_size=3072,
                                                                moe_intermediate_size=768, num_attention_heads=16,
                                                                num_key_value_heads=4, head_dim=128, num_experts=16,
                                                                num_experts_per_tok=8)),
    # norms after attention and the MLP instead of before, q and k normalised over all heads
    "olmo2-1b": ("Olmo2Config", "Olmo2ForCausalLM", dict(hidden_size=2048, intermediate_size=8192,
                                                         num_attention_heads=16, num_key_value_heads=16)),
}


@pytest.mark.parametrize("shape", list(REAL_WIDTHS))
def test_training_bytes_per_token_at_real_widths_cover_what_autograd_saves(tmp_path, shape) -> None:
    """At real models' widths, in bf16 as they train here, the estimate covers what a hook finds
    autograd keeping per token and stays within twice it (Gemma 3's four norms a layer were 8%
    above the two-norm count, Qwen3-MoE's eight experts a token 46% above a dense MLP's count)."""
    import transformers

    config_name, model_name, sizes = REAL_WIDTHS[shape]
    tokenizer = models.load_tokenizer("tiny")
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), num_hidden_layers=2,
                                                pad_token_id=tokenizer.pad_token_id, **sizes)
    torch.manual_seed(0)
    getattr(transformers, model_name)(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    svc = ServiceClient(checkpoint_dir=tmp_path / "ckpt", device="cpu", dtype="bf16", memory_budget_mb=0)
    client = svc.create_lora_training_client(str(tmp_path / "model"), seed=0, rank=16, train_unembed=False)
    measured = _saved_per_token(client, trainer.run_decoder_shared_packed, length=60)
    model = client.engine.causal_lm()
    estimate = memory.train_bytes_per_token(model.config, torch.bfloat16, memory.layer_norms_of(model))
    assert measured <= estimate <= 2 * measured, (measured, estimate)
    svc.close()


def test_partition_cuts_where_padding_costs_more_than_a_batch() -> None:
    lengths = [3, 3, 4, 4, 100]
    batches = trainer.partition(lengths, lambda n: None, lambda n: 0, lambda n: n, None)
    assert batches == [[3, 3, 4, 4], [100]]  # not one batch padded to 100 (5 x 100 tokens)
    budgeted = trainer.partition(lengths, lambda n: None, lambda n: 0, lambda n: n, 8)
    assert all(len(b) * max(b) <= 8 or len(b) == 1 for b in budgeted)
    assert [n for b in budgeted for n in b] == lengths


def test_the_batch_holds_what_the_budget_allows_and_admits_whole_requests_in_order() -> None:
    params = types.SamplingParams(max_tokens=10)
    reqs = [sampler.GenerationRequest([1] * 5, n, params) for n in (2, 3, 1, 8, 2)]
    assert sampler.row_capacity(reqs) == 15
    row_bytes = lambda length: 100 * length  # noqa: E731  a row of 15 positions costs 1500
    assert sampler.batch_rows(reqs, row_bytes, budget=6 * 1500) == 6  # the 8-row request runs whole, alone
    assert sampler.batch_rows(reqs, row_bytes, budget=10 * 1500) == 10
    assert sampler.batch_rows(reqs, row_bytes, budget=None) == 16
    pending = deque(reqs)
    assert [r.num_samples for r in sampler._admissions(pending, 6, nothing_running=True)] == [2, 3, 1]
    assert sampler._admissions(pending, 7, nothing_running=False) == []  # 8 rows wait, and so do the 2 behind
    assert [r.num_samples for r in sampler._admissions(pending, 6, nothing_running=True)] == [8]  # alone
    assert [r.num_samples for r in sampler._admissions(pending, 2, nothing_running=False)] == [2]


def test_rows_beside_others_stay_within_the_budget_and_an_oversized_request_runs_alone(tokenizer) -> None:
    """Room for 6 rows: the small requests never decode more than 6 rows at once, although the
    8-row request (alone) makes the cache hold 8."""
    model = models.load_model("tiny")
    sizes = [2, 3, 1, 2, 8, 2]
    reqs = [sampler.GenerationRequest([1, 40 + i, 7], n, types.SamplingParams(max_tokens=3 + i, temperature=1.0, seed=i))
            for i, n in enumerate(sizes)]
    steps: list[list] = []
    real_choose = sampler._choose_tokens

    def choose(logits, rows, device, **lookup):
        steps.append([row.request for row in rows])
        return real_choose(logits, rows, device, **lookup)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler, "_choose_tokens", choose)
        stats = sampler.generate(model, reqs, tokenizer, torch.device("cpu"), row_bytes=lambda n: 1, budget=6)
    big = reqs[4]
    assert all(len(rows) <= 6 or all(r is big for r in rows) for rows in steps)
    assert any(len(rows) == 8 for rows in steps) and stats.peak_rows == 8
    assert [len(r.sequences) for r in reqs] == sizes


def rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(heap.free_bytes() is None, reason="needs glibc's malloc_trim and mallinfo2")
def test_memory_another_thread_freed_goes_back_to_the_os() -> None:
    """What a worker thread frees below a live tensor stays in its malloc arena (the process
    keeps it) until ``release_free_memory`` hands it back."""
    measured: dict[str, int] = {}

    def work() -> None:
        tensors = [torch.ones(25_000) for _ in range(2_000)]  # 100 KB each: malloc's heap, not mmap
        last = tensors[-1]
        measured["full"] = rss_bytes()
        del tensors
        measured["freed"] = rss_bytes()
        assert heap.release_free_memory(torch.device("cpu"))
        measured["released"] = rss_bytes()
        del last

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    mb = 2**20
    assert measured["full"] - measured["freed"] < 50 * mb, measured  # freed, yet still held
    assert measured["freed"] - measured["released"] > 150 * mb, measured
    assert not heap.release_free_memory(torch.device("meta"))  # only the CPU's heap is trimmed


@pytest.mark.skipif(heap.free_bytes() is None, reason="needs glibc's mallinfo2")
def test_freed_memory_is_kept_up_to_the_cap_then_given_back() -> None:
    """After ``keep_for_reuse`` malloc keeps what a call frees for the next one; the trim after
    a call happens only once the free memory malloc holds passes the cap it is given."""
    assert heap.keep_for_reuse(torch.device("cpu"))
    assert not heap.keep_for_reuse(torch.device("meta"))
    mb = 2**20
    tensors = [torch.ones(8 * mb // 4) for _ in range(40)]  # 8 MiB each: heap blocks, not mmaps
    last = torch.ones(1024)  # allocated after them, so the freed blocks lie below a live one
    full = rss_bytes()
    free_before = heap.free_bytes()
    del tensors
    assert rss_bytes() > full - 50 * mb  # freed, yet still held: nothing trimmed them
    held = heap.free_bytes() - free_before
    assert held > 250 * mb, held
    assert not heap.release_free_memory(torch.device("cpu"), keep=heap.free_bytes() + 1)  # under the cap
    assert rss_bytes() > full - 50 * mb
    assert heap.release_free_memory(torch.device("cpu"), keep=heap.free_bytes() - 1)  # over it: trimmed
    assert rss_bytes() < full - 250 * mb
    del last


def test_a_hybrid_row_holds_its_recurrent_states_and_keys_only_for_its_attention_layers() -> None:
    """Qwen3.5's three linear-attention layers of four keep a float32 state per row (value heads x
    key dim x value dim, counted twice: a shrinking batch copies it) and a convolution window; only
    its one attention layer grows with the row's positions."""
    import transformers

    config = transformers.Qwen3_5TextConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                            linear_value_head_dim=32, linear_conv_kernel_dim=4,
                                            layer_types=["linear_attention"] * 3 + ["full_attention"])
    per_position = memory.sample_bytes_per_row(config, torch.bfloat16, 11) - memory.sample_bytes_per_row(
        config, torch.bfloat16, 10)
    assert per_position == 2 * 2 * 16 * 1 * 2 + 2 * 4 * 16 * 2  # one layer's K and V, and the expansion of a layer's
    fixed = memory.sample_bytes_per_row(config, torch.bfloat16, 0)
    state, conv = 4 * 16 * 32 * 4, (2 * 2 * 16 + 4 * 32) * 4 * 2
    assert fixed == 1000 * (4 + 4 + 4 + 8) + 3 * (2 * state + conv)
