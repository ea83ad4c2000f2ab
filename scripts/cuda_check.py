"""Check the local backend on whatever device it picks (CUDA bf16 when a GPU is present).

    python scripts/cuda_check.py [base_model] [--sample-dtype bf16] [--train-dtype fp32] [--steps 20]

``base_model`` defaults to smollm2; the dtypes to ``auto`` (bf16 for both on CUDA). Prints the device and dtypes, sampling throughput (on CUDA also without CUDA graphs), how far the
trainer's logprobs are from the sampler's on the sampled tokens (the on-policy importance ratio's
error), and whether 20 cross-entropy steps on a fixed batch cut the loss — the engine's behaviour,
not a benchmark.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import grpo as mint
from grpo import types
from grpo.backends.local import graph_decode
from grpo.rl.adapter import chat_prompt_tokens

QUESTIONS = [f"What is {a} + {b}? Give only the answer." for a, b in
             [(3, 4), (12, 9), (7, 8), (25, 17), (6, 6), (40, 2), (9, 1), (33, 33)]]


def main(base_model: str, sample_dtype: str, train_dtype: str, steps: int) -> None:
    service = mint.ServiceClient(sample_dtype=sample_dtype, train_dtype=train_dtype)
    training = service.create_lora_training_client(base_model=base_model, rank=16, seed=0)
    engine = training.engine
    print(f"base_model={base_model} device={engine.device} train_dtype={engine.dtype} sample_dtype={engine.sample_dtype} "
          f"gpu={torch.cuda.get_device_name() if engine.device.type == 'cuda' else '-'}")
    tokenizer = training.get_tokenizer()
    prompts = [chat_prompt_tokens(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    sampler = training.save_weights_and_get_sampling_client("check")
    params = types.SamplingParams(max_tokens=32, temperature=1.0, seed=0)

    def sample_all():
        futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=4, sampling_params=params) for p in prompts]
        return [f.result() for f in futures]

    sample_all()  # warm-up
    _sync(engine)
    t0 = time.perf_counter()
    results = sample_all()
    _sync(engine)
    seconds = time.perf_counter() - t0
    generated = sum(len(s.tokens) for r in results for s in r.sequences)
    print(f"sampling: {generated} tokens in {seconds:.2f} s = {generated / seconds:.0f} tokens/s (8 prompts x 4)")
    if engine.device.type == "cuda":  # the same calls without CUDA graphs (graph_decode.py)
        os.environ[graph_decode.ENV_SWITCH] = "0"
        try:
            sample_all()
            _sync(engine)
            t0 = time.perf_counter()
            plain = sample_all()
            _sync(engine)
            eager = time.perf_counter() - t0
        finally:
            del os.environ[graph_decode.ENV_SWITCH]
        n = sum(len(s.tokens) for r in plain for s in r.sequences)
        print(f"sampling without CUDA graphs: {n / eager:.0f} tokens/s; graphs {eager / seconds * generated / n:.2f}x faster")

    datums, sampled_lp = [], []
    for prompt, result in zip(prompts, results, strict=True):
        for seq in result.sequences:
            tokens = prompt + seq.tokens
            n = len(prompt) - 1
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:], "weights": [0.0] * n + [1.0] * len(seq.tokens)}))
            sampled_lp.append((n, seq.logprobs))
    out = training.forward(datums, loss_fn="cross_entropy").result()
    diffs = [abs(a - b) for (n, lp), o in zip(sampled_lp, out.loss_fn_outputs, strict=True)
             for a, b in zip(lp, o["logprobs"].tolist()[n:], strict=True)]
    print(f"sampler vs trainer logprobs on {len(diffs)} tokens: max |diff| {max(diffs):.2e}, "
          f"mean {sum(diffs) / len(diffs):.2e}")

    if steps <= 0:
        return
    first = last = None
    _sync(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        fb = training.forward_backward(datums, loss_fn="cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        first = fb.metrics["loss:sum"] if first is None else first
        last = fb.metrics["loss:sum"]
    _sync(engine)
    per_step = (time.perf_counter() - t0) / steps
    print(f"cross_entropy on {len(datums)} sequences: loss {first:.1f} -> {last:.1f} after {steps} steps "
          f"({last / first:.2f}x), {per_step * 1000:.0f} ms per forward_backward + optim_step")
    if engine.device.type == "cuda":
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
        # How host-bound a training call is: its kernels, and their GPU time against its wall time
        # (an H100 ran ~9,500 kernels and ~30 ms of GPU work in a 0.37 s call, docs/benchmark.md).
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            training.forward_backward(datums, loss_fn="cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            _sync(engine)
            wall = time.perf_counter() - t0
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        gpu_s = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
        print(f"one training call under the profiler: {wall * 1000:.0f} ms, {kernels} kernels, "
              f"{gpu_s * 1000:.1f} ms of GPU time ({gpu_s / wall:.0%} busy)")


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base_model", nargs="?", default="smollm2")
    parser.add_argument("--sample-dtype", default="auto", help="auto | fp32 | bf16")
    parser.add_argument("--train-dtype", default="auto", help="auto | fp32 | bf16")
    parser.add_argument("--steps", type=int, default=20, help="cross-entropy steps timed (0: stop after the logprob gap)")
    args = parser.parse_args()
    main(args.base_model, args.sample_dtype, args.train_dtype, args.steps)
