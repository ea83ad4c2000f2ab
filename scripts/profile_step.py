"""Where one GRPO step of the benchmark's shape spends its time, from torch.profiler.

Usage (from the repository root):

    .venv/bin/python scripts/profile_step.py                       # fp32, the bench shape
    .venv/bin/python scripts/profile_step.py --precision bf16       # train and sample in bf16
    .venv/bin/python scripts/profile_step.py --precision bf16-sample --ops 20 --trace step.json
    python scripts/profile_step.py --device cuda --precision bf16 --model OUT   # on a GPU (random model: random_model.py)

The step is scripts/bench.py's (8 two-digit addition prompts x 4 samples, 32 tokens, SmolLM2-135M,
LoRA r16 on every decoder Linear, ``forward_backward(ppo)`` + ``optim_step``), run through the
client API after one warm-up step, with the profiler recording every thread: the engine's worker
thread does the work, the main thread only waits on futures. The sections are the ranges the
backend marks with ``record_function`` (``grpo.sample.*``, ``grpo.train.*``); "sampler, the rest"
is the decode loop's own Python between them (row bookkeeping, stop checks, the KV cache's slot
moves and masks), and "outside the engine" is the wall time no range covers (futures, building
datums, the tokenizer). ``--ops`` lists the heaviest operators of the decoding forward and of a
training call, each profiled on the computing thread (grpo/models/computing.py) where it
runs: profiled from the main thread, a second OpenMP team slowed every kernel of it by ~1.5x.
On CUDA an operator's seconds are its host time (launching, not running, its kernels: a small
model's step is bound by launches there), and each profile also counts the GPU kernels and their
GPU time against the profiled wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PRECISIONS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "bf16-sample": ("fp32", "bf16")}
# (label, the range whose time it is, ranges nested inside it whose time is reported separately)
SECTIONS = [
    ("sampling: LoRA folded / installed for the sampler", "grpo.sample.install_lora", ()),
    ("sampling: prefill", "grpo.sample.prefill", ()),
    ("sampling: decoding forward (the model)", "grpo.sample.decode_forward", ()),
    ("sampling: choosing tokens from logits", "grpo.sample.choose_tokens", ()),
    ("training: decoder forward", "grpo.train.decoder_forward", ()),
    ("training: unembedding + loss + its backward", "grpo.train.unembed_loss_backward", ("grpo.train.decoder_backward",)),
    ("training: decoder backward", "grpo.train.decoder_backward", ()),
    ("training: optimizer", "grpo.train.optimizer", ()),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ops", type=int, default=12, help="heaviest operators of the decoding forward to list")
    parser.add_argument("--trace", type=Path, help="also write a Chrome trace of the profiled sampling call here")
    args = parser.parse_args()

    import torch
    from bench import make_problems, timed_trainable_step

    from grpo.backends.local import ServiceClient, sections
    from grpo.models import dtype_probe
    from grpo.types import AdamParams, SamplingParams

    train_dtype, sample_dtype = PRECISIONS[args.precision]
    service = ServiceClient(device=args.device, train_dtype=train_dtype, sample_dtype=sample_dtype)
    tc = service.create_lora_training_client(args.model, rank=16, seed=0, train_unembed=False)
    tokenizer = tc.get_tokenizer()
    adam = AdamParams(learning_rate=2e-5, grad_clip_norm=1.0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1, stop=[tokenizer.eos_token_id])

    def step(seed: int) -> dict[str, float]:
        problems = make_problems(args.prompts, seed=seed)
        prompts = [tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False) for p in problems]
        groups, seconds = timed_trainable_step(tc, problems, prompts, args.group, params, tokenizer, adam)
        return {**seconds, "sampled": sum(len(r.tokens) for g in groups for r in g.group.rollouts)}

    step(seed=100)  # warm-up: first-touch allocations, the optimizer's state, the first fold
    with sections.recording() as (seconds, calls):
        wall0 = time.perf_counter()
        timing = step(seed=0)
        wall = time.perf_counter() - wall0

    print(f"# one GRPO step, {args.prompts} prompts x {args.group} samples x {args.max_tokens} tokens, "
          f"{args.model}, precision {args.precision}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"# CPU: {dtype_probe.cpu_description()}")
    print(f"# step {wall:.2f} s (sample {timing['sample_s']:.2f} s incl. LoRA install, datums "
          f"{timing['datums_s']:.3f} s, train {timing['train_s']:.2f} s); {timing['sampled']} tokens sampled")
    print()
    print("| section | seconds | share of the step | calls |")
    print("| --- | --- | --- | --- |")
    rows = []
    for label, name, nested in SECTIONS:
        rows.append((label, seconds.get(name, 0.0) - sum(seconds.get(n, 0.0) for n in nested), calls.get(name, 0)))
    in_generate = seconds.get("grpo.sample.generate", 0.0) - sum(
        seconds.get(n, 0.0) for n in ("grpo.sample.prefill", "grpo.sample.decode_forward", "grpo.sample.choose_tokens"))
    rows.append(("sampling: the decode loop's own Python (rows, stop checks, slots, masks)", in_generate, None))
    sampling_rest = timing["sample_s"] - seconds.get("grpo.sample.generate", 0.0) - seconds.get("grpo.sample.install_lora", 0.0)
    rows.append(("sampling: outside the sampler (futures, batching requests, snapshot)", sampling_rest, None))
    training_rest = timing["train_s"] - sum(seconds.get(n, 0.0) for n in (
        "grpo.train.decoder_forward", "grpo.train.unembed_loss_backward", "grpo.train.optimizer"))
    rows.append(("training: outside the sections (datums to tensors, futures, gradient norm)", training_rest, None))
    rows.append(("between (advantages, datums)", wall - timing["sample_s"] - timing["train_s"], None))
    for label, secs, n in rows:
        print(f"| {label} | {secs:.3f} | {secs / wall:.0%} | {'' if n is None else n} |")

    if args.ops:
        decode_operators(tc, tokenizer, params, args)
        training_operators(tc, tokenizer, params, adam, args, step)


def decode_operators(tc, tokenizer, params, args) -> None:
    """The heaviest operators of the sampler's decoding forward: the same sampling call run under
    torch.profiler on the engine's computing thread (the profiler records the thread that starts
    it; run from another thread, a second OpenMP team would slow every kernel, computing.py)."""
    from bench import make_problems
    from torch.profiler import profile

    from grpo.backends.local import sampler as local_sampler

    engine = tc.engine
    activities = _activities(engine.device)
    problems = make_problems(args.prompts, seed=1)
    requests = [local_sampler.GenerationRequest(
        tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=False),
        args.group, params) for p in problems]

    def profiled_call():  # on the engine's computing thread, where sampling runs
        with engine.sampling_model(tc.adapter) as model:
            local_sampler.generate(model, requests, tokenizer, engine.device)  # warm
            with profile(activities=activities) as prof:
                wall0 = time.perf_counter()
                local_sampler.generate(model, requests, tokenizer, engine.device)
                _synchronize(engine.device)
                prof.wall_s = time.perf_counter() - wall0
        return prof

    prof = tc.handle.call(profiled_call)
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    spans = _spans(prof.events(), ("grpo.sample.decode_forward",))
    forward = sum(end - start for start, end in spans) / 1e6
    print()
    print(f"Decoding forward under torch.profiler (same call on the computing thread): {forward:.3f} s over "
          f"{len(spans)} steps, {1000 * forward / max(len(spans), 1):.1f} ms a step")
    _gpu_line(prof, prof.wall_s, "the sampling call")
    _operator_table(prof.events(), spans, "the decoding forward", args.ops)


def training_operators(tc, tokenizer, params, adam, args, step) -> None:
    """The heaviest operators of one ``forward_backward`` of a step: the profiler is started and
    stopped on the computing thread, where training runs."""
    from torch.profiler import profile

    from grpo.types import APIFuture

    holder = {}

    def start():
        holder["prof"] = profile(activities=_activities(tc.engine.device))
        holder["prof"].__enter__()
        holder["wall0"] = time.perf_counter()

    def stop():
        _synchronize(tc.engine.device)
        holder["wall_s"] = time.perf_counter() - holder["wall0"]
        holder["prof"].__exit__(None, None, None)

    real_forward_backward = tc.forward_backward

    def profiled_forward_backward(*a, **kw):
        tc.handle.call(start)
        result = real_forward_backward(*a, **kw).result()
        tc.handle.call(stop)
        return APIFuture.completed(result)  # what the step reads back

    tc.forward_backward = profiled_forward_backward
    try:
        step(seed=2)
    finally:
        del tc.forward_backward
    events = holder["prof"].events()
    spans = _spans(events, ("grpo.train.decoder_forward", "grpo.train.unembed_loss_backward"))
    total = sum(end - start for start, end in spans) / 1e6
    print()
    print(f"forward_backward under torch.profiler (decoder forward, unembedding, loss, backward): {total:.3f} s")
    _gpu_line(holder["prof"], holder["wall_s"], "the forward_backward call")
    _operator_table(events, spans, "forward_backward", args.ops)


def _activities(device) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_line(prof, wall_s: float, what: str) -> None:
    """On CUDA: how many kernels ``what`` launched and how busy they kept the GPU."""
    import torch

    # (the ranges grpo marks appear on the GPU's timeline too, as annotations: not kernels)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False) and not e.name.startswith("grpo.")]
    if not kernels:
        return
    gpu_s = sum(e.self_device_time_total for e in kernels) / 1e6
    syncs = sum(1 for e in prof.events() if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    print(f"{what}: {wall_s:.3f} s wall, {len(kernels)} GPU kernels, {gpu_s * 1000:.1f} ms of GPU time "
          f"({gpu_s / wall_s:.0%} busy), {syncs} host synchronisations")


def _spans(events, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """The host-side ranges of ``names`` (on CUDA each range is also recorded on the GPU's timeline)."""
    import torch

    return [(e.time_range.start, e.time_range.end) for e in events
            if e.name in names and e.device_type == torch.autograd.DeviceType.CPU]


def _operator_table(events, spans: list[tuple[int, int]], what: str, limit: int) -> None:
    """The ``limit`` heaviest operators (self time) inside ``spans``, and the time between them."""
    total = sum(end - start for start, end in spans) / 1e6
    import torch

    ops: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        if (not e.name.startswith("grpo.") and e.device_type == torch.autograd.DeviceType.CPU
                and any(s <= e.time_range.start and e.time_range.end <= t for s, t in spans)):
            ops[e.name] += e.self_cpu_time_total / 1e6
            calls[e.name] += 1
    print()
    print(f"| operator in {what} | seconds (self) | share | calls |")
    print("| --- | --- | --- | --- |")
    for name, secs in sorted(ops.items(), key=lambda kv: -kv[1])[:limit]:
        print(f"| {name} | {secs:.3f} | {secs / total:.0%} | {calls[name]} |")
    other = max(total - sum(ops.values()), 0.0)
    print(f"| (between operators: Python, dispatch) | {other:.3f} | {other / total:.0%} | |")


if __name__ == "__main__":
    main()
