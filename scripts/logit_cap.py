"""Gemma 2's cap on its logits (softcap * tanh(logits / softcap)): PyTorch's three operators against grpo's kernel.

Usage (from the repository root):

    .venv/bin/python scripts/logit_cap.py [--vocab 49152 256000] [--positions 256]

The trainer's loss head over one chunk of positions, forward and backward, bf16 (the unembedding's
product included, a SmolLM2-wide hidden state of 576): the cap by PyTorch's div, tanh and mul before
the native loss head (what ``ScaledLogits`` did) against the cap inside the loss head's pass
(``native_layers.target_logprobs(..., softcap)``). Then the sampler's cap on a decoding step's logits,
in place: ``div_().tanh_().mul_()`` against ``soft_cap_``. Medians of alternating timings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_ms(calls: dict, repeats: int, inner: int = 1) -> dict[str, float]:
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(inner):
                call()
            times[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _rows(ops, native_layers, vocab: int, positions: int, cap: float, gen: torch.Generator) -> list[str]:
    hidden = torch.randn(positions, 576, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, 576, generator=gen) * 0.05).bfloat16()
    targets = torch.randint(0, vocab, (positions,), generator=gen)

    def operators():
        logits = torch.tanh(hidden @ weight.t() / cap) * cap
        native_layers.target_logprobs(logits, targets)[0].sum().backward()

    def fused():
        native_layers.target_logprobs(hidden @ weight.t(), targets, cap)[0].sum().backward()

    ms = _median_ms({"operators": operators, "kernel": fused}, repeats=5)
    lines = [f"| loss head, forward + backward (product included) | {vocab} | {positions} | {ms['operators']:.1f} | "
             f"{ms['kernel']:.1f} | {ms['kernel'] / ms['operators']:.2f} |"]
    for rows in (8, 32):
        logits = torch.randn(rows, vocab, generator=gen).bfloat16() * 40
        ms = _median_ms({"operators": lambda logits=logits: logits.div_(cap).tanh_().mul_(cap),
                         "kernel": lambda logits=logits: ops.soft_cap_(logits, cap)}, repeats=7, inner=10)
        lines.append(f"| decoding step's logits, in place | {vocab} | {rows} | {ms['operators']:.2f} | "
                     f"{ms['kernel']:.2f} | {ms['kernel'] / ms['operators']:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 256000])
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--cap", type=float, default=30.0)
    args = parser.parse_args()

    from grpo.backends.local import native_layers
    from grpo.models import native_kernels

    ops = native_kernels.kernels()
    if ops is None:
        raise SystemExit("grpo's native kernels are not available here (switched off, or the build failed: said above)")
    cap = args.cap
    gen = torch.Generator().manual_seed(0)
    print(f"# Gemma 2's logit cap, bf16, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| what | vocabulary | rows | PyTorch's operators ms | grpo's kernel ms | kernel / PyTorch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for vocab in args.vocab:
        for line in _rows(ops, native_layers, vocab, args.positions, cap, gen):
            print(line)


if __name__ == "__main__":
    main()
