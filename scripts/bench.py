"""grpo against TRL's GRPOTrainer on the same GRPO step, plus sampler and trainer micro-benchmarks.

Usage (from the repository root; ``make bench`` builds .venv-bench and runs this):

    .venv-bench/bin/python scripts/bench.py [--steps 3] [--warmup 1] [--reps 3] [--json out.json]

Configuration (docs/benchmark.md): the packaged SmolLM2-135M-Instruct (fp32 on CPU, bf16 on
CUDA), 8 two-digit addition prompts x 4 samples per step, max_tokens 32, temperature 1.0, LoRA
rank 16 on every linear layer of the decoder, AdamW at 2e-5, no KL term, exact-match reward.

Each framework runs in its own child process (so peak memory is its own), and the parent steps
them alternately after a warm-up: shared-CPU noise then hits both sides alike, and the medians
and their ratio are what to read. A third child times grpo's sampler against plain
``model.generate`` and grpo's forward_backward + optim_step against a plain peft forward +
backward + AdamW on the same batch, alternating the two each repetition; those peers run a
transformers + peft model of their own, on PyTorch's own kernels (``plain_peft_model``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

MARK = "@@bench "  # child -> parent lines start with this; anything else a library prints is ignored
ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- shared setup


@dataclass(frozen=True)
class Problem:
    messages: list[dict[str, str]]
    answer: str


def make_problems(n: int, seed: int = 0) -> list[Problem]:
    """``n`` two-digit additions, the same for every framework (fixed seed)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        messages = [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}]
        out.append(Problem(messages, str(a + b)))
    return out


def exact_match(text: str, answer: str) -> float:
    """1.0 when the completion, stripped, is exactly the answer."""
    return 1.0 if text.strip() == answer else 0.0


def trl_default_datums(groups, reference=None, beta: float = 0.0) -> list:
    """Datums for ``forward_backward(ppo)`` with TRL's defaults: rewards scaled by the group std,
    loss averaged over the batch's tokens, every group kept (scripts/scaling.py uses them too).
    ``beta`` > 0: a KL penalty to ``reference`` (the base model's sampling client), whose logprobs
    of every sample are computed as grpo's loop computes them (``loop.reference_logprobs``)."""
    from grpo.rl import advantages, loop

    group_adv = advantages.compute_advantages(groups, "std", "keep")
    samples = advantages.select_for_training(groups, group_adv, skip_flat_groups=False, overlong="keep")
    ref = loop.reference_logprobs(reference, samples) if beta > 0 else None
    return advantages.build_datums(samples, "ppo", "token_mean", beta, ref)[0]


def trainable_groups(problems, prompt_ids, responses) -> list:
    """Scored groups whose rewards always spread (exact match plus 0.1 per sample index): exact
    match rarely fires on a small or random model, and a flat group would be skipped, so every
    group stays trainable and a timed step always trains the same amount."""
    from grpo.rl import rollouts

    return [rollouts.ScoredGroup(rollouts.Group(i, p, ids, rs),
                                 [exact_match(r.text, p.answer) + 0.1 * k for k, r in enumerate(rs)],
                                 [{} for _ in rs], [])
            for i, (p, ids, rs) in enumerate(zip(problems, prompt_ids, responses, strict=True))]


def timed_trainable_step(tc, problems, prompt_ids, group: int, params, tokenizer, adam) -> tuple[list, dict[str, float]]:
    """One GRPO step through the client API on ``trainable_groups``: a fresh sampling client,
    ``group`` samples per prompt, TRL-default datums, ``forward_backward(ppo)`` + ``optim_step``.
    Returns the scored groups and the seconds of sampling, building datums and training."""
    from grpo.rl import rollouts

    t0 = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client()
    responses = rollouts.sample_groups(sampler, prompt_ids, group, lambda _: params, tokenizer)
    t1 = time.perf_counter()
    groups = trainable_groups(problems, prompt_ids, responses)
    datums = trl_default_datums(groups)
    t2 = time.perf_counter()
    tc.forward_backward(datums, "ppo").result()
    tc.optim_step(adam).result()
    t3 = time.perf_counter()
    return groups, {"sample_s": t1 - t0, "datums_s": t2 - t1, "train_s": t3 - t2}


def count_decode_steps() -> dict[str, int]:
    """Count the sampler's decode steps and the rows they carried (it picks tokens once a step).
    Rows per step is what sets sampling's cost per token on a CPU: a matmul over 4 rows reaches a
    fraction of the FLOP/s of one over 64."""
    from grpo.backends.local import sampler

    counts = {"steps": 0, "rows": 0}
    choose = sampler._choose_tokens

    def counted(logits, rows, device, **lookup):
        counts["steps"] += 1
        counts["rows"] += len(rows)
        return choose(logits, rows, device, **lookup)

    sampler._choose_tokens = counted
    return counts


def device_and_dtypes(args: argparse.Namespace) -> tuple[str, str, str]:
    """The device, and the trainer's and the sampler's precision: bf16 on CUDA; on a CPU what
    ``--precision`` says, ``auto`` resolved by grpo's probe as a run resolves it (cached per
    machine: every child process gets the same answer)."""
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        return device, "bfloat16", "bfloat16"
    if args.precision != "auto":
        name = {"fp32": "float32", "bf16": "bfloat16"}[args.precision]
        return device, name, name
    if args.resolved:  # (the parent's answer: main)
        train, sample = args.resolved.split(",")
        return device, train, sample
    from grpo import models
    from grpo.models import dtype_probe, precision

    # (the probe measures on grpo's computing thread whoever calls it: dtype_probe.measured_once)
    shapes = dtype_probe.Shapes.from_config(models.load_config(args.model))
    train, sample = (str(precision.resolve(key, "auto", torch.device(device), shapes)).removeprefix("torch.")
                     for key in ("train_dtype", "sample_dtype"))
    return device, train, sample


def lora_targets(model: Any) -> list[str]:
    """Every Linear of the decoder layers (not lm_head): what peft's "all-linear" selects."""
    from torch import nn

    out = model.get_output_embeddings()
    return sorted({name.split(".")[-1] for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m is not out})


def plain_model(args: argparse.Namespace, device: str, dtype: str) -> Any:
    """The model as a transformers user has it: PyTorch's own Linear kernels, not the oneDNN ones
    grpo's model loader switches a CPU float32 model to (grpo/models/cpu_linear.py)."""
    from grpo import models
    from grpo.models import cpu_linear

    model = models.load_model(args.model, device=device, dtype=dtype)
    cpu_linear.use_torch_linears(model)
    return model


def peer_lora(model: Any, rank: int) -> Any:
    """The peers' LoRA (TRL's and the micro-benchmarks'), as grpo's adapter: rank, alpha 2 x rank,
    every Linear of the decoder, no dropout."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=lora_targets(model),
                      bias="none", task_type="CAUSAL_LM")


def plain_peft_model(args: argparse.Namespace, device: str, dtype: str) -> Any:
    """The micro-benchmarks' peer: the model as a transformers + peft user has it -- PyTorch's own
    Linear kernels, peft's LoRA layers as peft computes them -- a copy of its own, so that nothing
    grpo does to its model (oneDNN Linears, the kernel its probe chose, its LoRA forward) reaches
    the reference."""
    from peft import get_peft_model

    base = plain_model(args, device, dtype)
    return get_peft_model(base, peer_lora(base, args.rank))


def emit(**payload: Any) -> None:
    print(MARK + json.dumps(payload), flush=True)


def wait_go() -> bool:
    """Block until the parent says go (True) or quit (False)."""
    line = sys.stdin.readline().strip()
    return line == "go"


def memory_report(device: str) -> dict[str, float]:
    report = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.startswith("cuda"):
        import torch

        report["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return report


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------- grpo worker


def worker_grpo(args: argparse.Namespace) -> None:
    import hardware_floors

    from grpo.backends.local import ServiceClient, sections
    from grpo.backends.local.trunk import common_trunk
    from grpo.models import computing
    from grpo.rl import rollouts
    from grpo.types import AdamParams, SamplingParams

    device, dtype, sample_dtype = device_and_dtypes(args)
    service = ServiceClient(device=device, train_dtype=dtype, sample_dtype=sample_dtype)
    tc = service.create_lora_training_client(args.model, rank=args.rank, seed=0, train_unembed=False)
    # --beta: the KL penalty's reference, the base model (the adapter left out), as grpo's loop has it
    reference = service.create_sampling_client(base_model=args.model) if args.beta > 0 else None
    tokenizer = tc.get_tokenizer()
    decode = count_decode_steps()
    problems = make_problems(args.prompts * (args.warmup + args.steps))
    prompt_ids = [tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False) for p in problems]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[tokenizer.eos_token_id])
    adam = AdamParams(learning_rate=args.lr, grad_clip_norm=1.0)  # TRL clips at 1.0 by default
    timed = []  # the timed steps' shapes, for what the kernels alone take at them
    for step in range(args.warmup + args.steps):
        emit(event="ready")
        if not wait_go():
            break
        batch = range(step * args.prompts, (step + 1) * args.prompts)
        sync(device)
        decode.update(steps=0, rows=0)
        with sections.recording() as (seconds, _):
            t0 = time.perf_counter()
            sampler = tc.save_weights_and_get_sampling_client()
            # seeded per prompt: the same code samples the same tokens in every run, so two runs
            # (or two commits whose sampling is bit-equal) do the same work
            responses = rollouts.sample_groups(sampler, [prompt_ids[i] for i in batch], args.group,
                                               lambda k, step=step: replace(params, seed=step * 1000 + k), tokenizer)
            groups = [rollouts.ScoredGroup(rollouts.Group(i, problems[i], prompt_ids[i], rs),
                                           [exact_match(r.text, problems[i].answer) for r in rs], [{} for _ in rs], [])
                      for i, rs in zip(batch, responses, strict=True)]
            t1 = time.perf_counter()
            datums = trl_default_datums(groups, reference, args.beta)
            fb = tc.forward_backward(datums, "ppo")
            opt = tc.optim_step(adam)
            fb.result()
            opt.result()
            sync(device)
            t2 = time.perf_counter()
        tokens = sum(len(r.tokens) for g in groups for r in g.group.rollouts)
        # the prompt tokens the step runs: each group's prompt once, their common start once
        # (trunk.common_trunk: the trainer and the sampler's prefill both share it)
        prompts = [prompt_ids[i] for i in batch]
        trunk = common_trunk(prompts)
        prompt_tokens = trunk + sum(len(p) - trunk for p in prompts)
        reward = statistics.mean(x for g in groups for x in g.rewards)
        if step >= args.warmup:
            timed.append({"decode_steps": decode["steps"], "rows_decoded": decode["rows"],
                          "processed_tokens": prompt_tokens + tokens, "tokens": tokens})
        emit(event="step", seconds=t2 - t0, sample_s=t1 - t0, train_s=t2 - t1, tokens=tokens, reward=reward,
             decode_steps=decode["steps"], rows_decoded=decode["rows"], prompt_tokens=prompt_tokens,
             # each group's prompt is trained once, shared by its samples (trainer.plan_sharing)
             processed_tokens=prompt_tokens + tokens,
             decode_forward_s=seconds.get("grpo.sample.decode_forward", 0.0),
             # --beta: the reference's logprobs (prompt_logprobs.py), inside train_s
             reference_s=seconds.get("grpo.sample.prompt_logprobs", 0.0),
             train_compute_s=seconds.get("grpo.train.decoder_forward", 0.0)
             + seconds.get("grpo.train.unembed_loss_backward", 0.0))
    # peak memory is the steps': read before the measurements below allocate weights and buffers of their own
    memory = memory_report(device)
    config = tc.engine.model.config
    precision, sample_precision = ("bf16" if name == "bfloat16" else "fp32" for name in (dtype, sample_dtype))
    # a decoding step streams the sampler's weights: its own precision's bytes where the two differ
    size = hardware_floors.ModelSize.of(tc.engine.model, sample_precision)
    floors = None
    if device == "cpu":  # measured where grpo's kernels ran (computing.py), after the steps
        machine = computing.run(hardware_floors.measure, config.hidden_size, config.intermediate_size, precision)
        alone = computing.run(
            hardware_floors.kernels_alone, size, precision, rows_per_decode_step(timed),
            int(median([e["processed_tokens"] for e in timed])), int(median([e["tokens"] for e in timed])),
            sample_dtype=sample_precision, layout=tc.engine.sample_layout) if timed else {}
        floors = {**hardware_floors.as_dict(machine, size), "kernels_alone": alone, "sample_dtype": sample_precision,
                  "layout": tc.engine.sample_layout}
    emit(event="done", **memory, **({"floors": floors} if floors else {}))


# --------------------------------------------------------------------------- TRL worker


def worker_trl(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo import models
    from grpo.models import cpu_linear

    # TRL computes on this thread: nothing of grpo's may start its computing thread here (whose
    # OpenMP team beside this one would slow TRL), and the oneDNN check behind grpo's Linears runs
    # there -- so PyTorch's own Linears from the start, as TRL's users have them
    os.environ[cpu_linear.ENV_SWITCH] = "torch"
    device, dtype, _ = device_and_dtypes(args)
    model = plain_model(args, device, dtype)  # TRL as its users run it
    tokenizer = models.load_tokenizer(args.model)
    n_steps = args.warmup + args.steps
    problems = make_problems(args.prompts * n_steps)
    dataset = Dataset.from_list([{"prompt": p.messages, "answer": p.answer} for p in problems])

    def reward(completions: list, answer: list[str], **_: Any) -> list[float]:
        return [exact_match(c[0]["content"] if isinstance(c, list) else c, a)
                for c, a in zip(completions, answer, strict=True)]

    cuda = device.startswith("cuda")
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        per_device_train_batch_size=args.prompts * args.group,  # TRL counts completions
        num_generations=args.group,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_tokens,
        temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        beta=args.beta, use_vllm=False, num_iterations=1,
        # TRL defaults to activation checkpointing; grpo does not checkpoint the decoder, so
        # compare like for like (--trl-gradient-checkpointing turns TRL's default back on).
        gradient_checkpointing=args.trl_gradient_checkpointing,
        bf16=dtype == "bfloat16", use_cpu=not cuda,
        max_steps=n_steps, logging_steps=10**6, save_strategy="no", report_to=[],
        disable_tqdm=True, shuffle_dataset=False, dataloader_num_workers=0, seed=0,
    )
    lora = peer_lora(model, args.rank)

    class Pace(TrainerCallback):
        """Hand control to the parent between optimizer steps and time each step."""

        def __init__(self) -> None:
            self.t0 = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            emit(event="ready")
            if not wait_go():
                raise SystemExit(0)
            sync(device)
            self.t0 = time.perf_counter()
            timings.clear()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            sync(device)
            seconds = time.perf_counter() - self.t0
            sample_s = timings.get("generate", 0.0)
            emit(event="step", seconds=seconds, sample_s=sample_s, train_s=seconds - sample_s,
                 tokens=timings.get("tokens", 0), reward=timings.get("reward", 0.0))

    timings: dict[str, float] = {}
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[Pace()])
    # Split TRL's step into generation+scoring and the rest, as grpo's is split.
    generate_and_score = trainer._generate_and_score_completions

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = generate_and_score(*a, **k)
        sync(device)
        timings["generate"] = time.perf_counter() - t
        timings["tokens"] = int(out["completion_mask"].sum())
        return out

    trainer._generate_and_score_completions = timed
    torch.manual_seed(0)
    trainer.train()
    emit(event="done", **memory_report(device))


# --------------------------------------------------------------------------- micro worker


def worker_micro(args: argparse.Namespace) -> None:
    import torch
    from transformers import GenerationConfig

    from grpo.backends.local import ServiceClient
    from grpo.rl.advantages import build_datum
    from grpo.rl.rollouts import Rollout
    from grpo.types import AdamParams, ModelInput, SamplingParams

    device, dtype, sample_dtype = device_and_dtypes(args)
    service = ServiceClient(device=device, train_dtype=dtype, sample_dtype=sample_dtype)
    tc = service.create_lora_training_client(args.model, rank=args.rank, seed=0, train_unembed=False)
    tokenizer = tc.get_tokenizer()
    # loaded on grpo's computing thread, where the peers run too: a model loaded on this thread
    # would leave a second OpenMP team in the process (grpo/models/computing.py)
    model = tc.handle.call(lambda: plain_peft_model(args, device, dtype))
    problems = make_problems(args.prompts)
    prompts = [tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for p in problems]
    sampler = tc.save_weights_and_get_sampling_client()
    # No stop: every row generates exactly max_tokens on both sides, so tokens/s compare directly.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)

    def grpo_sample() -> tuple[int, list]:
        futures = [sampler.sample(ModelInput.from_ints(p), args.group, params) for p in prompts]
        results = [f.result() for f in futures]
        return sum(len(s.tokens) for r in results for s in r.sequences), results

    pad = tokenizer.pad_token_id
    rows = [p for p in prompts for _ in range(args.group)]
    width = max(len(p) for p in rows)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
    gen_config = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=1.0,
                                  max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                  pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)

    def plain_generate() -> tuple[int, None]:
        out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=gen_config)
        return int(out[:, width:].numel()), None

    # Training batch: the sequences of one sample, advantages that are not all zero.
    _, results = grpo_sample()
    gen = torch.Generator().manual_seed(0)
    datums = []
    for prompt, result in zip(prompts, results, strict=True):
        for seq in result.sequences:
            adv = float(torch.randn((), generator=gen)) / 100
            resp = Rollout(tokens=list(seq.tokens), logprobs=list(seq.logprobs), stop_reason=seq.stop_reason, text="")
            datums.append(build_datum(prompt, resp, [adv] * len(seq.tokens)))
    adam = AdamParams(learning_rate=args.lr)

    def grpo_train() -> tuple[int, None]:
        fb = tc.forward_backward(datums, "ppo")
        opt = tc.optim_step(adam)
        fb.result()
        opt.result()
        return 0, None

    seq_width = max(d.model_input.length for d in datums)

    def padded(key: str, dtype_: Any) -> torch.Tensor:
        rows_ = [list(d.loss_fn_inputs[key].data) for d in datums]
        return torch.tensor([r + [0] * (seq_width - len(r)) for r in rows_], dtype=dtype_, device=device)

    ids = torch.tensor([d.model_input.to_ints() + [0] * (seq_width - d.model_input.length) for d in datums], device=device)
    mask = torch.tensor([[1] * d.model_input.length + [0] * (seq_width - d.model_input.length) for d in datums], device=device)
    targets, weights = padded("target_tokens", torch.long), padded("weights", torch.float32)
    old, adv = padded("logprobs", torch.float32), padded("advantages", torch.float32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    def plain_train() -> tuple[int, None]:
        # What a peft user writes: full logits, log_softmax, gather, PPO-clip, backward, AdamW.
        logits = model(input_ids=ids, attention_mask=mask).logits
        lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
        ratio = torch.exp(lp - old)
        loss = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * weights).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return 0, None

    def timed(fn: Callable[[], tuple[int, Any]]) -> tuple[float, int]:
        sync(device)
        t = time.perf_counter()
        n, _ = fn()
        sync(device)
        return time.perf_counter() - t, n

    def on_engine_thread(fn: Callable[[], tuple[int, Any]]) -> Callable[[], tuple[int, Any]]:
        # The peers run on the thread grpo computes on: PyTorch's OpenMP teams of two computing
        # threads slow each other on a machine with few cores (grpo/models/computing.py),
        # and a peft user's script computes on one thread too.
        return lambda: tc.handle.call(fn)

    cases = {"grpo_sample": grpo_sample, "generate": on_engine_thread(plain_generate),
             "grpo_train": grpo_train, "peft_train": on_engine_thread(plain_train)}
    for fn in cases.values():  # warm-up
        fn()
    for rep in range(args.reps):
        pairs = [("grpo_sample", "generate"), ("grpo_train", "peft_train")]
        for a, b in pairs:
            for name in ((a, b) if rep % 2 == 0 else (b, a)):
                seconds, tokens = timed(cases[name])
                emit(event="micro", case=name, seconds=seconds, tokens=tokens)
    emit(event="done", **memory_report(device))


# --------------------------------------------------------------------------- parent


class Child:
    """A worker process driven line by line over stdin/stdout."""

    def __init__(self, role: str, args: argparse.Namespace, python: str, log_dir: Path):
        cmd = [python, str(Path(__file__).resolve()), "--worker", role, *forwarded(args)]
        self.role = role
        self.log = log_dir / f"{role}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log.open("w"), text=True, env=env, cwd=ROOT)
        self.ready = False
        self.done: dict[str, Any] | None = None

    def next_event(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        self.proc.wait()
        tail = self.log.read_text()[-3000:]
        raise RuntimeError(f"{self.role} worker exited ({self.proc.returncode}) before reporting; log tail:\n{tail}")

    def expect(self, *events: str) -> dict[str, Any]:
        event = self.next_event()
        if event["event"] not in events:
            raise RuntimeError(f"{self.role} worker sent {event}, expected {events}")
        return event

    def send(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def step(self) -> dict[str, Any]:
        """One step; returns once the worker is idle again, so the next one runs alone."""
        if self.done is None and not self.ready:
            self.expect("ready")
        self.send("go")
        event = self.expect("step")
        after = self.expect("ready", "done")  # TRL ends its loop by itself after max_steps
        self.ready = after["event"] == "ready"
        self.done = after if after["event"] == "done" else None
        if self.done is not None:
            # A worker that is done exits by itself: let it finish here, or its teardown (TRL's
            # 7 GB freed, its threads joined) runs beside the other framework's next step. It
            # did: grpo's step after TRL's last sampled 1.0-1.5 s slower in every bench run.
            self.proc.wait()
        return event

    def finish(self) -> dict[str, Any]:
        if self.done is None:
            if not self.ready:
                self.expect("ready")
            self.send("quit")
            self.done = self.expect("done")
        self.proc.wait()
        return self.done


def forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--precision", args.precision,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--reps", str(args.reps), "--prompts", str(args.prompts), "--group", str(args.group),
           "--max-tokens", str(args.max_tokens), "--rank", str(args.rank), "--lr", str(args.lr),
           "--beta", str(args.beta)]
    out += ["--resolved", args.resolved] if args.resolved else []
    return out + (["--trl-gradient-checkpointing"] if args.trl_gradient_checkpointing else [])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rows_per_decode_step(events: list[dict[str, Any]]) -> float:
    """The timed steps' rows per decoding step (median rows over median steps): what the decoding
    floor is taken at, in the goals table, and the kernels alone, in grpo's worker."""
    return median([e["rows_decoded"] for e in events]) / max(median([e["decode_steps"] for e in events]), 1)


def run_steps(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    roles = ["grpo"] + ([] if args.no_trl else ["trl"])
    children = {}
    for role in roles:  # start one at a time so loading does not compete for the CPU
        children[role] = Child(role, args, sys.executable, log_dir)
        children[role].expect("ready")
        children[role].ready = True
    steps: dict[str, list[dict[str, Any]]] = {r: [] for r in roles}
    for i in range(args.warmup + args.steps):
        order = roles if i % 2 == 0 else roles[::-1]  # A/B then B/A
        for role in order:
            event = children[role].step()
            if i >= args.warmup:
                steps[role].append(event)
            reference = f" incl. reference {event['reference_s']:.2f}s" if event.get("reference_s") else ""
            print(f"  step {i:2d} {role:4s} {event['seconds']:6.2f}s  (sample {event['sample_s']:5.2f}s, "
                  f"train {event['train_s']:5.2f}s{reference}, {event['tokens']} tokens, reward {event['reward']:.2f})"
                  + ("  [warm-up]" if i < args.warmup else ""), flush=True)
    memory = {role: child.finish() for role, child in children.items()}
    return {"steps": steps, "memory": memory}


def run_micro(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    child = Child("micro", args, sys.executable, log_dir)
    cases: dict[str, list[dict[str, Any]]] = {}
    while True:
        event = child.next_event()
        if event["event"] == "done":
            break
        cases.setdefault(event["case"], []).append(event)
        print(f"  {event['case']:12s} {event['seconds']:6.2f}s", flush=True)
    child.proc.wait()
    return {"cases": cases, "memory": event}


def machine() -> str:
    import torch

    from grpo.models.dtype_probe import cpu_description

    cpu = cpu_description()
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} CPUs (torch threads {torch.get_num_threads()}){gpu}; "
            f"python {platform.python_version()}, torch {torch.__version__}")


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("transformers", "peft", "trl", "accelerate"):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} -")
    return ", ".join(out)


def summarize(args: argparse.Namespace, step_result: dict[str, Any], micro: dict[str, Any] | None) -> dict[str, Any]:
    summary: dict[str, Any] = {"config": vars(args), "machine": machine(), "versions": versions()}
    steps = step_result["steps"]
    print(f"\n== full GRPO step (median of {args.steps} alternating steps)")
    for role, events in steps.items():
        med = {k: median([e[k] for e in events]) for k in ("seconds", "sample_s", "train_s")}
        mem = step_result["memory"][role]
        summary[role] = {**med, **{k: v for k, v in mem.items() if k != "event"}}
        cuda = f", peak CUDA {mem['peak_cuda_mb']:.0f} MB" if "peak_cuda_mb" in mem else ""
        print(f"  {role:4s} {med['seconds']:6.2f} s/step  (sampling {med['sample_s']:.2f} s, "
              f"training {med['train_s']:.2f} s)  peak RSS {mem['peak_rss_mb']:.0f} MB{cuda}")
    if "trl" in steps:
        ratios = [g["seconds"] / t["seconds"] for g, t in zip(steps["grpo"], steps["trl"], strict=True)]
        summary["step_ratio"] = median(ratios)
        mem_key = "peak_cuda_mb" if "peak_cuda_mb" in summary["grpo"] else "peak_rss_mb"
        summary["memory_ratio"] = summary["grpo"][mem_key] / summary["trl"][mem_key]
        print(f"  grpo / TRL step time: {summary['step_ratio']:.2f}  (target <= 0.50)")
        print(f"  grpo / TRL peak memory ({mem_key}): {summary['memory_ratio']:.2f}  (target <= 1.00)")
    if micro:
        cases = micro["cases"]
        tps = {c: median([e["tokens"] / e["seconds"] for e in cases[c]]) for c in ("grpo_sample", "generate")}
        train = {c: median([e["seconds"] for e in cases[c]]) for c in ("grpo_train", "peft_train")}
        summary["sampling_tokens_per_s"] = tps
        summary["sampling_speedup"] = tps["grpo_sample"] / tps["generate"]
        summary["train_seconds"] = train
        summary["train_ratio"] = train["grpo_train"] / train["peft_train"]
        print(f"\n== sampling, {args.prompts}x{args.group} rows x {args.max_tokens} tokens (median of {args.reps})")
        print(f"  grpo sampler {tps['grpo_sample']:7.1f} tok/s   model.generate {tps['generate']:7.1f} tok/s   "
              f"speed-up {summary['sampling_speedup']:.2f}x  (target >= 1.5)")
        print(f"\n== training, forward+backward+AdamW on the same {args.prompts * args.group} sequences")
        print(f"  grpo {train['grpo_train']:.2f} s   plain peft {train['peft_train']:.2f} s   "
              f"ratio {summary['train_ratio']:.2f}  (target <= 1.10)")
    floors = step_result["memory"]["grpo"].get("floors")
    if floors:
        summary["against_hardware"] = against_hardware(steps["grpo"], floors, summary.get("step_ratio"))
    print(f"\nmachine: {summary['machine']}\nversions: {summary['versions']}")
    return summary


# Goals (issue #41): ratios measured in one run, reported against their goal, never asserted.
GOALS = {"step_vs_trl": 0.40, "step_vs_trl_bf16": 0.25, "decode_vs_stream": 1.5, "train_of_peak": 0.50}


def against_hardware(events: list[dict[str, Any]], floors: dict[str, Any], step_ratio: float | None) -> dict[str, float]:
    """grpo's step against TRL and against the machine's floors (scripts/hardware_floors.py), as
    one table: each row a measured ratio, its goal, and whether it is met."""
    import hardware_floors

    machine = hardware_floors.Machine(**floors["machine"])
    size = hardware_floors.ModelSize.from_dict(floors["model"])
    alone = floors.get("kernels_alone") or {}
    med = {k: median([e[k] for e in events]) for k in (
        "seconds", "sample_s", "train_s", "decode_steps", "rows_decoded", "prompt_tokens", "processed_tokens",
        "tokens", "decode_forward_s", "train_compute_s")}
    rows = rows_per_decode_step(events)
    decode = hardware_floors.decode_step_floor_s(size, machine, rows)
    decode_ms = 1000 * med["decode_forward_s"] / max(med["decode_steps"], 1)
    floor = hardware_floors.step_floor_s(size, machine, int(med["decode_steps"]), int(med["rows_decoded"]),
                                         int(med["prompt_tokens"]), int(med["processed_tokens"]), int(med["tokens"]))
    flops = hardware_floors.train_flops(size, med["processed_tokens"], med["tokens"])
    train_gflops = flops / max(med["train_compute_s"], 1e-9) / 1e9
    out = {"decode_ms": decode_ms, "decode_stream_floor_ms": 1000 * decode["stream_s"],
           "decode_compute_floor_ms": 1000 * decode["compute_s"], "rows_per_decode_step": rows,
           "train_gflops": train_gflops, "peak_gflops": machine.peak_gflops, "bandwidth_gbs": machine.bandwidth_gbs,
           "step_s": med["seconds"], "step_floor_s": floor["step_s"]}
    # each row: what, grpo's value, the same with the matmul kernels alone (everything else free), goal, met
    table = []
    if step_ratio is not None:  # in bf16 (where the machine measured it faster) the goal is stricter
        goal = GOALS["step_vs_trl_bf16" if machine.dtype == "bf16" else "step_vs_trl"]
        table.append((f"step, grpo / TRL (time, {machine.dtype})", f"{step_ratio:.2f}", "-", f"<= {goal:.2f}",
                      step_ratio <= goal))
    ratio = decode_ms / out["decode_stream_floor_ms"]
    linears = ""
    if "decode_linears_s" in alone:
        out["decode_linears_ms"] = 1000 * alone["decode_linears_s"]
        linears = f"{out['decode_linears_ms'] / out['decode_stream_floor_ms']:.2f}x ({out['decode_linears_ms']:.1f} ms)"
    layout = {"stream": ", streaming layout", "stream_dot": ", streaming layout, bf16 dot products",
              "onednn": ", oneDNN's layout"}.get(floors.get("layout"), "")
    table.append((f"decoding step / weight-stream floor ({floors.get('sample_dtype', machine.dtype)}{layout}: "
                  f"{decode_ms:.1f} ms / {out['decode_stream_floor_ms']:.1f} ms; "
                  f"{rows:.1f} rows, compute floor {out['decode_compute_floor_ms']:.1f} ms)", f"{ratio:.2f}x",
                  linears or "-", f"<= {GOALS['decode_vs_stream']:.1f}x", ratio <= GOALS["decode_vs_stream"]))
    share = train_gflops / machine.peak_gflops
    matmuls = ""
    if "train_matmuls_s" in alone:
        out["train_matmuls_gflops"] = flops / max(alone["train_matmuls_s"], 1e-9) / 1e9
        matmuls = f"{out['train_matmuls_gflops'] / machine.peak_gflops:.0%} ({out['train_matmuls_gflops']:.0f} GFLOP/s)"
    table.append((f"training matmul rate / peak ({train_gflops:.0f} / {machine.peak_gflops:.0f} {machine.dtype} GFLOP/s)",
                  f"{share:.0%}", matmuls or "-", f">= {GOALS['train_of_peak']:.0%}", share >= GOALS["train_of_peak"]))
    table.append((f"step / hardware floor ({med['seconds']:.2f} s / {floor['step_s']:.2f} s: sampling "
                  f"{floor['sample_s']:.2f} s, training {floor['train_s']:.2f} s)", f"{med['seconds'] / floor['step_s']:.2f}x",
                  "-", "-", None))
    kernel = {"onednn": "oneDNN's", "torch": "torch.mm's"}.get(machine.kernel, machine.kernel)
    print(f"\n== grpo against TRL and the hardware ({machine.peak_gflops:.0f} {machine.dtype} GFLOP/s matmul peak, {kernel}, "
          f"{machine.bandwidth_gbs:.1f} GB/s copy, measured in this run)")
    print("| what | measured | the matmul kernels alone | goal | met |")
    print("| --- | --- | --- | --- | --- |")
    for what, value, kernels, goal, met in table:
        print(f"| {what} | {value} | {kernels} | {goal} | {'-' if met is None else ('yes' if met else 'no')} |")
    print("(the matmul kernels alone: the step's own Linears at its shapes with everything else free, "
          "scripts/hardware_floors.py: where they miss a goal, the kernels on this machine do)")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="base_model name (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "auto"],
                   help="on a CPU: grpo's train and sample dtype, and TRL's (bf16: its model in bf16 and bf16=True); "
                        "auto: what grpo's auto resolves to on this machine (CUDA: always bf16)")
    p.add_argument("--steps", type=int, default=3, help="timed GRPO steps per framework")
    p.add_argument("--warmup", type=int, default=1, help="untimed GRPO steps per framework first")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each micro-benchmark")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--beta", type=float, default=0.0,
                   help="KL penalty to the base model: TRL's beta, grpo's kl_penalty_coef (each computes the "
                        "reference's logprobs of every sample; default 0, TRL's own default)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="leave TRL's default activation checkpointing on (off: like grpo)")
    p.add_argument("--no-trl", action="store_true", help="skip TRL (grpo steps and micro-benchmarks only)")
    p.add_argument("--no-micro", action="store_true", help="skip the sampler/trainer micro-benchmarks")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--worker", choices=["grpo", "trl", "micro"], help=argparse.SUPPRESS)
    p.add_argument("--resolved", help=argparse.SUPPRESS)  # auto's train,sample dtypes, from the parent
    args = p.parse_args(argv)
    for name in ("steps", "reps", "prompts", "group", "max_tokens", "rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        {"grpo": worker_grpo, "trl": worker_trl, "micro": worker_micro}[args.worker](args)
        return
    if not args.no_trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("TRL is not installed in this environment: run `make bench` (it builds .venv-bench), "
                     "or pass --no-trl")
    started = time.perf_counter()
    if args.precision == "auto":
        # resolved here, once, and handed to the workers: resolving asks oneDNN a question on the
        # process's computing thread, and in TRL's worker that thread's OpenMP team would sit beside
        # the one TRL computes on (two teams on two cores: every parallel region waits for wake-ups)
        _, train, sample = device_and_dtypes(args)
        args.resolved = f"{train},{sample}"
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        log_dir = Path(tmp)
        print(f"GRPO step: {args.model}, {args.prompts} prompts x {args.group} samples, max_tokens {args.max_tokens}, "
              f"LoRA r{args.rank}, lr {args.lr}, {args.warmup} warm-up + {args.steps} timed steps each"
              + (f", KL penalty to the base model (beta {args.beta})" if args.beta > 0 else ""))
        step_result = run_steps(args, log_dir)
        micro = None if args.no_micro else (print("\nmicro-benchmarks:"), run_micro(args, log_dir))[1]
    summary = summarize(args, step_result, micro)
    summary["wall_s"] = time.perf_counter() - started
    print(f"total {summary['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
