"""What one decoding step of the model costs against the number of rows it carries (CPU, fp32).

Usage (from the repository root):

    .venv/bin/python scripts/decode_step_cost.py [--model smollm2] [--context 100]

The model alone -- no sampler, no LoRA -- through transformers' KV cache, greedy, median of ten
steps per batch size. On a CPU a step first reads every weight from memory once, whatever the
number of rows, then does each row's arithmetic: the per-token cost of sampling falls with the
rows a step carries, which is what sets "sample ms/token" in scripts/scaling.py's table. The last
column is each batch size's cost per token over the largest batch's, measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from grpo import models


def step_ms(model, rows: int, context: int, steps: int = 12) -> float:
    """Median milliseconds of one decoding step for ``rows`` rows ``context`` tokens in."""
    ids = torch.randint(10, model.config.vocab_size - 1, (rows, context))
    times = []
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    times = sorted(times[2:])  # the first steps pay first-touch costs
    return 1000 * times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=100, help="tokens already in each row's cache")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,96")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = models.load_model(args.model, "cpu", torch.float32).eval()
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    sizes = [int(r) for r in args.rows.split(",")]
    measured = {rows: step_ms(model, rows, args.context) for rows in sizes}
    floor = measured[sizes[-1]] / sizes[-1]
    print(f"{args.model}: {weights_mb:.0f} MiB of weights, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| rows | ms per step | ms per token | per token / the largest batch's |")
    print("| --- | --- | --- | --- |")
    for rows, ms in measured.items():
        print(f"| {rows} | {ms:.1f} | {ms / rows:.2f} | {ms / rows / floor:.2f}x |")
    small, large = sizes[len(sizes) // 2], sizes[-1]
    per_row = (measured[large] - measured[small]) / (large - small)
    fixed = measured[large] - per_row * large
    print(f"Fit over {small}-{large} rows: {fixed:.1f} ms per step + {per_row:.2f} ms per row "
          f"({weights_mb / fixed:.1f} MiB/ms if the fixed part is the weight stream)")


if __name__ == "__main__":
    main()
