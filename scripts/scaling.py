"""How grpo's step time and memory grow with group size, response length, prompts and model size.

Usage (from the repository root):

    .venv/bin/python scripts/scaling.py                  # every row, prints the markdown table
    .venv/bin/python scripts/scaling.py --rows shapes    # the packaged model's shape rows only
    .venv/bin/python scripts/scaling.py --rows models --json out.json
    .venv/bin/python scripts/scaling.py --unbounded      # the same rows with no memory budget
    .venv/bin/python scripts/scaling.py --rows shapes --fixed-length   # no stop: every response max_tokens long
    .venv/bin/python scripts/scaling.py --rows shapes --steps 4        # memory over a longer run
    .venv/bin/python scripts/scaling.py --rows shapes --precision fp32,bf16-sample,bf16   # each row per precision

Each row runs in a fresh child process (its peak RSS is its own): one warm-up step of the row's
own shape on other problems (pays one-time costs: folding LoRA for sampling, the optimizer's
state, the allocator's first pages of a step that size, about 2.5 s on 8 x 4 x 32, a third of
its training time; ``--cold`` warms up with a 1 x 2 x 4 step instead, as the 2026-11-23 rows did;
``--steps N`` runs N - 1 warm-up steps, each on new problems, and reports each step's peak RSS:
what a longer run holds shows there, not in one step), then one timed GRPO step through the
client API: ``save_weights_and_get_sampling_client``, one ``sample`` call per prompt, the
package's advantages and datums, ``forward_backward(ppo)`` + ``optim_step``. The packaged
SmolLM2-135M rows stop at end of turn, as a real run does; the larger models are built from their
architectures with random weights (no hub needed) and sample without stop, so every response is
exactly ``max_tokens`` long.

Efficiency: the matmul FLOPs the step had to do (2 x parameters per token forward; training adds
the backward through the inputs, 2x more, for every token the decoder processed) divided by the
step's time, against the FLOP/s a plain torch matmul of the model's own shapes reaches on the same
machine in the same run, in the training precision (the bf16 peak for bf16 rows).

Precision (``--precision``, a comma-separated list; every row runs once per entry): ``fp32`` (train
and sample fp32, today's default on CPUs without bf16), ``bf16`` (both bf16), ``bf16-sample``
(fp32 training, bf16 sampling: backend.sample_dtype=bf16). On a CPU without avx512_bf16/AMX bf16 is
emulated and slower than fp32; such rows measure that, not what bf16 hardware does.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
MARK = "@@scaling "
# --precision name -> (train_dtype, sample_dtype)
PRECISIONS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "bf16-sample": ("fp32", "bf16")}

# Architectures of public checkpoints, built with random weights (tokenizer: SmolLM2's; the 1B
# model keeps its own 128k vocabulary size, so its unembedding costs what the real one does).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "SmolLM2-360M (random)": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                  num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
                                  tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192),
    "Llama-3.2-1B (random)": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192),
}

# (model, prompts, group, max_tokens)
SHAPE_ROWS = [("smollm2", 8, 4, 32), ("smollm2", 8, 16, 32), ("smollm2", 32, 4, 32), ("smollm2", 8, 4, 128),
              ("smollm2", 8, 16, 128), ("smollm2", 8, 16, 256)]
MODEL_ROWS = [("SmolLM2-360M (random)", 8, 4, 32), ("Llama-3.2-1B (random)", 4, 4, 32)]
SMOKE_ROWS = [("tiny", 2, 2, 4)]  # the random tiny test model: checks the script, measures nothing


def emit(**payload: Any) -> None:
    print(MARK + json.dumps(payload), flush=True)


# --------------------------------------------------------------------------- child


def patch_random_model(arch: dict[str, Any]) -> None:
    """Make base_model "tiny" build ``arch`` instead of the test model (random weights)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from grpo import models

    def load_model(name, device=None, dtype=None, seed=0):
        tokenizer = models.load_tokenizer(name)
        config = LlamaConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-5, **arch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
        return model.to(device or "cpu").eval()

    models.load_model = load_model


def matmul_gflops(hidden: int, intermediate: int, tokens: int = 512, seconds: float = 1.0,
                  dtype: str = "fp32") -> float:
    """GFLOP/s of plain torch matmuls of the model's MLP shapes on ``tokens`` rows in ``dtype``."""
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    x = torch.randn(tokens, hidden, dtype=torch_dtype)
    w = torch.randn(hidden, intermediate, dtype=torch_dtype)
    torch.mm(x, w)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(x, w)
        n += 1
    return 2 * tokens * hidden * intermediate * n / (time.perf_counter() - t0) / 1e9


def reset_peak() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def current_peak_mb() -> float | None:
    """Peak RSS since the last ``reset_peak``, in MB; None where /proc has no VmHWM."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def worker(row: dict[str, Any]) -> None:
    from bench import count_decode_steps, make_problems, timed_trainable_step

    from grpo.backends.local import ServiceClient
    from grpo.backends.local.trunk import common_trunk
    from grpo.types import AdamParams, SamplingParams

    model_name = row["model"]
    if model_name in ARCHITECTURES:
        patch_random_model(ARCHITECTURES[model_name])
        base, stop = "tiny", False
    else:
        base, stop = model_name, not row.get("fixed_length", False)
    train_dtype, sample_dtype = PRECISIONS[row.get("precision", "fp32")]
    service = ServiceClient(device="cpu", train_dtype=train_dtype, sample_dtype=sample_dtype, **row.get("service", {}))
    tc = service.create_lora_training_client(base, rank=16, seed=0, train_unembed=False)
    tokenizer = tc.get_tokenizer()
    engine = tc.engine
    config = engine.model.config
    params_matmul = sum(p.numel() for n, p in engine.model.named_parameters() if "embed_tokens" not in n)
    if getattr(config, "tie_word_embeddings", False):
        params_matmul += engine.model.get_output_embeddings().weight.numel()
    adam = AdamParams(learning_rate=2e-5, grad_clip_norm=1.0)
    decode = count_decode_steps()

    def step(problems, group: int, max_tokens: int) -> dict[str, float]:
        prompt_ids = [tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False) for p in problems]
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1,
                                stop=[tokenizer.eos_token_id] if stop else None)
        decode.update(steps=0, rows=0)
        groups, seconds = timed_trainable_step(tc, problems, prompt_ids, group, params, tokenizer, adam)
        sampled = sum(len(r.tokens) for g in groups for r in g.group.rollouts)
        # each group's prompt once, their common start once (trunk.common_trunk: the sampler and the trainer)
        trunk = common_trunk(prompt_ids)
        prompt_tokens = trunk + sum(len(ids) - trunk for ids in prompt_ids)
        # what the decoder processes in training: each group's prompt once (shared), every response
        processed = prompt_tokens + sampled
        return {"sample_s": seconds["sample_s"], "train_s": seconds["train_s"], "sampled": sampled, "prompt_tokens": prompt_tokens,
                "processed": processed, "decode_steps": decode["steps"], "decode_rows": decode["rows"]}

    steps, prompts = row.get("steps", 2), row["prompts"]
    problems = make_problems(steps * prompts, seed=7)
    load_peak = current_peak_mb()  # the peak windows below reset what ru_maxrss reads too
    step_peaks = []
    for k in range(steps):
        reset_peak()
        if k == 0 and row.get("cold"):
            step(problems[:1], 2, 4)
        else:
            timed = step(problems[k * prompts:(k + 1) * prompts], row["group"], row["max_tokens"])
        step_peaks.append(current_peak_mb())
    flops = 2 * params_matmul * (timed["prompt_tokens"] + timed["sampled"]) + 4 * params_matmul * timed["processed"]
    peaks = [p for p in (load_peak, *step_peaks) if p is not None]
    peak = max(peaks) if peaks else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gflops = matmul_gflops(config.hidden_size, config.intermediate_size, dtype=train_dtype)
    emit(**row, **timed, flops=flops, peak_rss_mb=peak, step_peaks_mb=step_peaks, matmul_gflops=gflops,
         params=params_matmul)


# --------------------------------------------------------------------------- parent


def run_row(row: dict[str, Any], timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(row)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"row {row} failed:\n{proc.stderr[-3000:]}")


def rows_per_step(r: dict[str, Any]) -> str:
    return f"{r['decode_rows'] / r['decode_steps']:.1f}" if r.get("decode_steps") else "-"


def table(results: list[dict[str, Any]]) -> str:
    head = ("| model | prompts x group x max_tokens | sampled tokens | step (sample + train) | sampled tok/s | "
            "sample ms/token | mean rows per decoding step | trained tok/s | train ms/token | train ms/processed token | "
            "efficiency | peak RSS |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in results:
        step = r["sample_s"] + r["train_s"]
        eff = r["flops"] / step / (r["matmul_gflops"] * 1e9)
        lines.append(
            f"| {r['model']}{' (no stop)' if r.get('fixed_length') else ''} [{r.get('precision', 'fp32')}] | {r['prompts']} x {r['group']} x {r['max_tokens']} | {r['sampled']:,} | "
            f"{step:.1f} s ({r['sample_s']:.1f} + {r['train_s']:.1f}) | {r['sampled'] / r['sample_s']:.0f} | "
            f"{1000 * r['sample_s'] / r['sampled']:.2f} | {rows_per_step(r)} | "
            f"{r['sampled'] / r['train_s']:.0f} | {1000 * r['train_s'] / r['sampled']:.2f} | "
            f"{1000 * r['train_s'] / r['processed']:.2f} | {100 * eff:.0f}% of {r['matmul_gflops']:.0f} "
            f"{PRECISIONS[r.get('precision', 'fp32')][0]} GFLOP/s | "
            f"{r['peak_rss_mb'] / 1024:.2f} GB |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", choices=["all", "shapes", "models", "smoke"], default="all")
    p.add_argument("--only", help="comma-separated row numbers (0-based) of the chosen rows")
    p.add_argument("--unbounded", action="store_true", help="memory_budget_mb=0: one sampling wave, one micro-batch")
    p.add_argument("--fixed-length", action="store_true",
                   help="sample without stop, every response max_tokens long: every decoding step carries every row")
    p.add_argument("--cold", action="store_true",
                   help="warm up with a 1 x 2 x 4 step, not one of the row's shape: the timed step pays first-size costs")
    p.add_argument("--steps", type=int, default=2,
                   help="steps per row, on different problems; the last is timed, peak RSS covers them all (>= 2)")
    p.add_argument("--precision", default="fp32",
                   help=f"comma-separated, each row runs once per entry: {', '.join(PRECISIONS)} (see above)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per row")
    p.add_argument("--json", type=Path, help="also write the rows' measurements here")
    p.add_argument("--from-json", type=Path, nargs="+", help="print the table of rows saved with --json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.from_json:
        results = [r for path in args.from_json for r in json.loads(path.read_text())]
        print(table(results))
        print(spread(results))
        return
    if args.steps < 2:
        p.error(f"--steps must be at least 2 (a warm-up and the timed step), got {args.steps}")
    rows = {"all": SHAPE_ROWS + MODEL_ROWS, "shapes": SHAPE_ROWS, "models": MODEL_ROWS, "smoke": SMOKE_ROWS}[args.rows]
    if args.only:
        rows = [rows[int(i)] for i in args.only.split(",")]
    precisions = args.precision.split(",")
    bad = [x for x in precisions if x not in PRECISIONS]
    if bad:
        p.error(f"--precision {','.join(bad)} is invalid; valid: {', '.join(PRECISIONS)}")
    service = {"memory_budget_mb": 0} if args.unbounded else {}
    results = []
    t0 = time.perf_counter()
    for (model, prompts, group, max_tokens), precision in [(r, x) for r in rows for x in precisions]:
        row = {"model": model, "prompts": prompts, "group": group, "max_tokens": max_tokens, "service": service,
               "fixed_length": args.fixed_length, "cold": args.cold, "steps": args.steps, "precision": precision}
        results.append(run_row(row, args.timeout))
        print(f"# {model} [{precision}] {prompts}x{group}x{max_tokens}: "
              f"{results[-1]['sample_s'] + results[-1]['train_s']:.1f} s, "
              f"peak {results[-1]['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    import torch

    from grpo.models.dtype_probe import cpu_description

    print(f"Machine: {cpu_description()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; total {time.perf_counter() - t0:.0f} s\n")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(spread(results))


def spread(results: list[dict[str, Any]]) -> str:
    """Largest over smallest per-token cost and peak RSS among the packaged model's rows (rows
    sampled without stop are compared among themselves)."""
    lines = []
    for fixed, precision in [(f, x) for f in (False, True) for x in PRECISIONS]:
        rows = [r for r in results if r["model"] == "smollm2" and bool(r.get("fixed_length")) == fixed
                and r.get("precision", "fp32") == precision]
        if len(rows) < 2:
            continue

        def ratio(key, rows=rows) -> float:
            values = [key(r) for r in rows]
            return max(values) / min(values)

        first = next((r for r in rows if (r["prompts"], r["group"], r["max_tokens"]) == (8, 4, 32)), rows[0])
        label = "" if precision == "fp32" else f" [{precision}]"
        peak = max(r["peak_rss_mb"] for r in rows) / first["peak_rss_mb"]
        lines.append(
            f"Across the SmolLM2-135M rows{label}{' sampled without stop' if fixed else ''}: train ms/processed token "
            f"max/min {ratio(lambda r: r['train_s'] / r['processed']):.2f}x (per sampled token "
            f"{ratio(lambda r: r['train_s'] / r['sampled']):.2f}x), "
            f"sample ms/token max/min {ratio(lambda r: r['sample_s'] / r['sampled']):.2f}x, "
            f"largest peak RSS / the 8 x 4 x 32 row's {peak:.2f}x.")
    for r in results:
        peaks = r.get("step_peaks_mb") or []
        if len(peaks) > 2 and all(peaks):  # None where /proc has no VmHWM
            lines.append(f"Peak RSS by step, {r['model']} {r['prompts']} x {r['group']} x {r['max_tokens']}: "
                         + ", ".join(f"{p / 1024:.2f}" for p in peaks) + " GB")
    return "\n" + "\n".join(lines) if lines else ""


if __name__ == "__main__":
    main()
