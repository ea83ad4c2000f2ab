"""What one decoding step of grpo's sampler costs against the rows it carries, and against the floors.

Usage (from the repository root):

    .venv/bin/python scripts/decode_step_cost.py                       # auto precision, 1-32 rows
    .venv/bin/python scripts/decode_step_cost.py --precision fp32 --rows 1,8,32 --steps 64

The sampler as a run uses it (the bench's model and LoRA, r16 on every decoder Linear, as a side
path in bf16), through ``generate``: one prompt, ``rows`` samples of it, no stop token, so every
step carries all of them. A step's cost is ``(generate of steps + 1 tokens - generate of 1 token) /
steps``: the whole step as a run pays it -- the layers, the unembedding, choosing tokens and the
loop's own Python -- with the prefill taken out; the fastest of three calls counts. The rows'
contexts grow from the prompt's length over the steps.

Against the floors of the same machine, measured in the same run (scripts/hardware_floors.py): the
weight stream (every weight read once a step, at the copy bandwidth) and the compute (the rows'
matmuls at the matmul peak). On a CPU few rows are the stream's and many the compute's; a run's
long tail -- the last one or two rows of a group whose answer runs long -- is all stream: at 256
tokens, 155 of the bench's 255 decoding steps carried one or two rows (docs/benchmark.md).

Until 2026-11-29 this script timed the model alone (transformers' forward, fp32, no sampler, no
LoRA); the numbers docs/benchmark.md quotes from it before that date are of that.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="the sampler's precision; auto as a run resolves it (grpo's probe, cached per machine)")
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--steps", type=int, default=48, help="decoding steps timed per row count")
    args = parser.parse_args()

    import torch
    from bench import make_problems
    from hardware_floors import ModelSize, decode_step_floor_s, measure

    from grpo import models
    from grpo.backends.local import ServiceClient, computing
    from grpo.backends.local import sampler as local_sampler
    from grpo.models import dtype_probe, precision
    from grpo.types import SamplingParams

    dtype = args.precision
    if dtype == "auto":
        shapes = dtype_probe.Shapes.from_config(models.load_config(args.model))
        dtype = "bf16" if precision.resolve("sample_dtype", "auto", torch.device("cpu"), shapes) is torch.bfloat16 \
            else "fp32"
    service = ServiceClient(device="cpu", train_dtype=dtype, sample_dtype=dtype)
    tc = service.create_lora_training_client(args.model, rank=16, seed=0, train_unembed=False)
    tokenizer, engine = tc.get_tokenizer(), tc.engine
    (problem,) = make_problems(1, seed=1)
    prompt = tokenizer.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)

    def seconds(rows: int, tokens: int) -> float:
        """The fastest of three ``generate`` calls of ``rows`` samples of ``tokens`` tokens each."""
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1)  # (no stop: every row runs on)
        best = float("inf")
        with engine.sampling_model(tc.adapter) as model:
            for _ in range(3):
                request = local_sampler.GenerationRequest(prompt, rows, params)
                start = time.perf_counter()
                local_sampler.generate(model, [request], tokenizer, engine.device)
                best = min(best, time.perf_counter() - start)
        return best

    sizes = [int(r) for r in args.rows.split(",")]
    step_s = {}
    for rows in sizes:  # (on the engine's computing thread, where sampling runs: computing.py)
        full, prefill = tc.handle.call(lambda r=rows: (seconds(r, args.steps + 1), seconds(r, 1)))
        step_s[rows] = (full - prefill) / args.steps
    config = engine.model.config
    machine = computing.run(measure, config.hidden_size, config.intermediate_size, dtype)
    size = ModelSize.of(engine.model, dtype)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {args.model}, sampler {dtype} ({engine.sample_layout} layout), LoRA r16 side paths, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, commit {commit or '?'}")
    print(f"# CPU: {dtype_probe.cpu_description()}")
    print(f"# prompt {len(prompt)} tokens, contexts {len(prompt)}-{len(prompt) + args.steps}; weights "
          f"{size.weight_bytes / 1e6:.0f} MB a step; machine: {machine.bandwidth_gbs:.1f} GB/s copy, "
          f"{machine.peak_gflops:.0f} GFLOP/s matmul peak")
    print()
    print("| rows | ms a step | stream floor ms | compute floor ms | step / the larger floor | "
          "step / (stream + compute) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows, s in step_s.items():
        floor = decode_step_floor_s(size, machine, rows)
        print(f"| {rows} | {1e3 * s:.1f} | {1e3 * floor['stream_s']:.1f} | {1e3 * floor['compute_s']:.1f} | "
              f"{s / floor['floor_s']:.2f}x | {s / (floor['stream_s'] + floor['compute_s']):.2f}x |")


if __name__ == "__main__":
    main()
