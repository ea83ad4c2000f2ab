"""The trainer's attention over packed sequences alone: time and rate of grpo's kernel, forward and backward.

Usage (from the repository root):

    .venv/bin/python scripts/attention_rate.py                  # every shape, bf16
    .venv/bin/python scripts/attention_rate.py --dtype fp32 --shapes long

A GRPO micro-batch as the trainer packs it (grpo/backends/local/packed_attention.py): each prompt
once, then its group's answers, each continuing the prompt (its queries see the prompt's keys and
its own). Shapes: ``bench`` is scripts/bench.py's pass (8 prompts of 47 tokens, 4 answers of 13
each; SmolLM2-135M's 9 query and 3 key heads of 64), ``long`` the same prompts with answers of
256-512 tokens, ``mha`` SmolLM2-1.7B's 32 heads of 64 (one key head each) over 2 prompts x 4
answers of 16, ``qwen3`` the long shape with Qwen3-0.6B's 16 query and 8 key heads of 128, ``gemma3``
the long shape with Gemma-3-270M's (and -1B's) 4 query heads over 1 key head of 256 in a sliding
layer's 512-token window, ``gemma2`` the bench's pass with Gemma-2-2B's 8 query and 4 key heads of
256, its scores capped at 50 (``gemma2-long`` the long shape). The rate
counts the useful work only: two products a (query, key) pair forward (scores, weighted values), five
backward (scores again, the weights' gradient, the query, key and value gradients), ``2 x head dim``
FLOPs each -- nothing past a query's last key, nor before its window. A multiply-add core's float32 peak is the rate to
hold it against (the kernel sums in float32): on the AMD EPYC (Zen 4) of docs/benchmark.md, 235
GFLOP/s on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# name: (prompts, prompt tokens, answers per prompt, answer lengths (cycled), query heads, key heads, head dim)
SHAPES = {
    "bench": (8, 47, 4, [13], 9, 3, 64),
    "long": (8, 100, 4, [256, 512, 384, 512], 9, 3, 64),
    "mha": (2, 47, 4, [16], 32, 32, 64),
    "qwen3": (8, 100, 4, [256, 512, 384, 512], 16, 8, 128),
    "gemma3": (8, 100, 4, [256, 512, 384, 512], 4, 1, 256),
    "gemma2": (8, 47, 4, [13], 8, 4, 256),
    "gemma2-long": (8, 100, 4, [256, 512, 384, 512], 8, 4, 256),
}
# name: (sliding window, scores' cap), where the shape has them (0: none)
RULES = {"gemma3": (512, 0.0), "gemma2": (0, 50.0), "gemma2-long": (0, 50.0)}


def plan(prompts: int, prompt_len: int, group: int, answers: list[int], window: int = 0):
    """The kernel's ``seqs`` ([q_start, q_len, prefix, key_offset] rows) and ``key_rows`` for
    prompts each followed by ``group`` answers, as the trainer's ``PackedPass`` makes them; the rows
    of the pass; its (query, key) pairs (within ``window`` keys, where one is given)."""
    from grpo.backends.local.packed_attention import PackedPass

    lengths, continues = [], []
    for p in range(prompts):
        first = len(lengths)
        lengths.append(prompt_len)
        continues.append(None)
        for g in range(group):
            lengths.append(answers[(p * group + g) % len(answers)])
            continues.append(first)
    packed = PackedPass(lengths, torch.device("cpu"), continues=continues)
    seqs, key_rows = packed.native_plan()
    pairs = sum(min(prefix + j + 1, window or prefix + j + 1) for _, q, prefix, _ in seqs.tolist() for j in range(q))
    return seqs, key_rows, packed.tokens, pairs


def measure(ops, shape, dtype: torch.dtype, repeats: int,
            kernels: tuple[bool, ...] = (False,)) -> dict[bool, dict[str, tuple[float, float]]]:
    """``{dot: {"forward" | "backward": (seconds a call, GFLOP/s)}}`` for each of ``kernels`` (the
    products by float32 multiply-adds, False, or by avx512_bf16's dot product, True): the median of
    five timings, the kernels taking turns within each so that the machine's moods fall on both."""
    prompts, prompt_len, group, answers, heads, kv_heads, dim, rule = shape
    seqs, key_rows, rows, pairs = plan(prompts, prompt_len, group, answers, rule[0])
    gen = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(rows, heads * dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(rows, kv_heads * dim, generator=gen).to(dtype) for _ in range(2))
    scale = dim ** -0.5
    result = {}
    for name, products in (("forward", 2), ("backward", 5)):
        calls = {}
        for dot in kernels:
            out, lse = ops.packed_attention(q, k, v, seqs, key_rows, heads, kv_heads, scale, dot, *rule)
            if name == "forward":
                calls[dot] = lambda dot=dot: ops.packed_attention(q, k, v, seqs, key_rows, heads, kv_heads, scale, dot,
                                                                  *rule)
            else:
                calls[dot] = lambda dot=dot, out=out, lse=lse: ops.packed_attention_backward(
                    grad, q, k, v, out, lse, seqs, key_rows, heads, kv_heads, scale, dot, *rule)
            calls[dot]()  # (first touch of the kernel's buffers)
        times = {dot: [] for dot in kernels}
        for _ in range(5):
            for dot, call in calls.items():
                start = time.perf_counter()
                for _ in range(repeats):
                    call()
                times[dot].append((time.perf_counter() - start) / repeats)
        for dot in kernels:
            seconds = statistics.median(times[dot])
            result.setdefault(dot, {})[name] = (seconds, pairs * heads * products * 2 * dim / seconds / 1e9)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    args = parser.parse_args()

    from grpo.models import native_kernels

    ops = native_kernels.kernels()
    if ops is None:
        raise SystemExit("grpo's native kernels are not available here (switched off, or the build failed: said above)")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    # bf16's products by avx512_bf16's dot product too, where the kernels are built with it (the trainer
    # takes that where kernel_probe.py measured it faster)
    kernels = (False, True) if dtype == torch.bfloat16 and ops.stream_dot_available() else (False,)
    print(f"# packed attention, {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| shape | rows | products by | forward ms | forward GFLOP/s | backward ms | backward GFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.shapes:
        shape = (*SHAPES[name], RULES.get(name, (0, 0.0)))
        result = measure(ops, shape, dtype, repeats=2 if "long" in name or name in ("qwen3", "gemma3") else 20,
                         kernels=kernels)
        rows = plan(*shape[:4])[2]
        for dot in kernels:
            (fs, fr), (bs, br) = result[dot]["forward"], result[dot]["backward"]
            print(f"| {name} | {rows} | {'dot products' if dot else 'multiply-adds'} | {fs * 1e3:.2f} | {fr:.0f} | "
                  f"{bs * 1e3:.2f} | {br:.0f} |")
        if len(kernels) == 2:
            (f0, _), (b0, _) = result[False]["forward"], result[False]["backward"]
            (f1, _), (b1, _) = result[True]["forward"], result[True]["backward"]
            print(f"| {name} | {rows} | dot / multiply-adds speed | {f0 / f1:.2f}x | | {b0 / b1:.2f}x | |")


if __name__ == "__main__":
    main()
