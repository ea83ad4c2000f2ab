"""What ``auto`` means on this CPU: the model's own matmul shapes timed in fp32 and in bf16.

Whether bf16 beats fp32 on a CPU is not written in its flags: on an AMX Xeon bf16 sampling ran
1.3-1.7x slower than fp32, on CPUs without bf16 instructions up to 19x slower, and where bf16 is
native the answer depends on the shapes (a decoding step streams the weights, where half the bytes
help; training is compute-bound, where the kernel decides). So the first ``auto`` for a model on a
machine times both precisions on that model's shapes, for each role separately:

- ``sample``: a decoding step, a handful of rows (``DECODE_ROWS``) through the Linears of the
  model's own number of layers (up to ``DECODE_BYTES``), each timed right after another as the
  sampler's steps follow each other, so that the cache holds what it would then (a Xeon here has a
  480 MiB last-level cache: SmolLM2's bf16 weights fit in it, its fp32 weights do not); the layers
  are built as the sampler builds them: packed weights, fp32 with LoRA folded in, bf16 as the
  sampler's copy with sibling projections stacked and LoRA as a bf16 side path. Each precision is
  timed in each packed layout it could use where grpo's native kernels are loaded (oneDNN's and the
  streaming one; bf16 also the streaming layout's dot-product kernel, where built with avx512_bf16:
  ``sampler_layouts``, cpu_linear.py), and the fastest counts: the sampler packs in whichever
  measured fastest (kernel_probe.py);
- ``train``: a forward and backward pass of ``TRAIN_ROWS`` tokens through one layer's Linears and
  the unembedding, as the trainer runs them: the frozen base in the precision timed (input
  gradient only), LoRA's fp32 weights cast to it and added inside the matmul (lora_linear.py).
  fp32 is timed through both float32 kernels, oneDNN's and PyTorch's, and the faster counts: a
  float32 model trains through whichever measured faster on the machine (kernel_probe.py), and
  timing only oneDNN made fp32 training look ~1.2x slower than it runs on an AMX Xeon.

Only the Linears (with their LoRA) are timed: they are nearly all of the FLOPs and bytes, but
attention, norms and sampling are not, so the probe ranks the precisions rather than predicting a
step's time. Each role's time is scaled to the whole model (layers x layer + unembedding). fp32
and bf16 runs alternate op by op (a training matmul, a decoding step's layers), so load from other
processes falls on both, and each op's fastest run counts: other processes only ever add time (on a busy 2-core machine a
2-thread matmul can wait milliseconds for its second core), so the minimum is the machine's speed
and a median its load. bf16 is chosen for a role only when it measured at least ``MARGIN``
faster, and for training only where sampling is bf16 too (``choose``): ``auto`` is never slower
than fp32 beyond measurement noise, and noise (which slows both alike) leans towards fp32. Delete
the cache file to measure again.

The result is cached in ``$GRPO_CACHE/precision.json`` (and in this process) keyed by CPU model,
its instruction sets (``instruction_sets``), torch version, thread count, fp32 Linear kernel, the
shapes and the probe's own version, so the probe (about 10 s on a quiet machine; 2.1 GB peak
resident for SmolLM2 with both layouts timed, 1.3 GB with one: python -m grpo.models.dtype_probe,
Intel Xeon with avx512, 2 cores; bf16's dot-product kernel, where timed too, holds one more packed
copy of the bf16 weights, 270 MB) is paid once per machine and model shape; the choice and its numbers
are printed once, when measured.
``GRPO_PRECISION_PROBE=off`` skips the probe: ``auto`` is then fp32 on a CPU. So is it, for the run,
where the load average is at least the number of cores and those cores are still busy when looked
at (``machine_busy``): a measurement there would time the other processes, and be cached.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from grpo import models
from grpo.checks import env_switch
from grpo.models import computing

ROLES = ("sample", "train")
T = TypeVar("T")
# bf16 must measure this many times faster than fp32 to be chosen: the probe times the Linears
# only, and leans towards bf16 -- on an AMX Xeon (probe version 2) it measured bf16 decoding
# 1.43-1.54x and training 1.59-1.68x faster where the whole sampler ran 1.3x and the training pass
# 1.35x faster; its first version, timing each Linear alone, even put bf16 decoding ahead on an
# EPYC where the whole bf16 sampler ran 1.5-1.8x slower (docs/benchmark.md).
MARGIN = 1.25
DECODE_ROWS = 32  # rows of one decoding step: the default batch_size x group_size (8 x 4) as it starts
TRAIN_ROWS = 128  # tokens of one training matmul chain
DECODE_BYTES = 1 << 30  # fp32 layer weights a probed decoding step reads at most (the whole model up to there)
HEAD_DECODE_BYTES = 256 << 20  # the unembedding's rows timed per decoding step (scaled to the vocabulary)
# What the probe times and how; part of the cache key, so that a new way of measuring measures again.
# 3: the bf16 LoRA side paths it times go through packed A and B (cpu_linear.LoraSideProduct).
# 4: training's LoRA product added into the base output in place, as the trainer now does.
# 5: fp32 training timed through both float32 kernels, the faster counting (kernel_probe.py).
# 6: fp32 decoding timed in both packed layouts, the faster counting (kernel_probe.py).
# 7: bf16 decoding in both layouts too, its LoRA side paths in the base's layout; a decoding step of
#    32 rows (16 before): at 16 the streaming bf16 step measured 1.30x faster than fp32's on an Intel
#    Xeon without AMX, where a sampling call of the default shape (8 x 4) ran 1.18x faster.
# 8: bf16 decoding in the streaming layout's dot-product kernel too, where built (avx512_bf16).
# (The native kernels' own changes are in the key as their build's digest: machine_key.)
PROBE_VERSION = 8
HEAD_TRAIN_ROWS = 4096  # the unembedding's rows timed per training pass (compute-bound: scales linearly)
LORA_RANK = 16  # the API's default rank; every Linear adapted (train_attn/mlp/unembed default on)
LORA_SCALING = 2.0  # alpha = 2 * rank
BUDGET_S = 2.0  # measuring time, both roles and both precisions
MAX_REPS = 7
ENV_SWITCH = "GRPO_PRECISION_PROBE"


@dataclass(frozen=True)
class Shapes:
    """The Linear shapes of a decoder: what the probe times."""

    hidden: int
    intermediate: int
    q_out: int  # attention heads x head dim
    kv_out: int  # key/value heads x head dim
    vocab: int
    layers: int

    @classmethod
    def from_config(cls, config: Any) -> Shapes | None:
        """The shapes of a transformers config; None where it does not name them (then ``auto`` is fp32)."""
        config = models.text_config(config)
        try:
            hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
            kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
            return cls(hidden, int(config.intermediate_size), heads * head_dim, kv_heads * head_dim,
                       int(config.vocab_size), int(config.num_hidden_layers))
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            return None

    def signature(self) -> str:
        return (f"h{self.hidden}-i{self.intermediate}-q{self.q_out}-kv{self.kv_out}"
                f"-v{self.vocab}-l{self.layers}")


@dataclass(frozen=True)
class Timing:
    """One role's measured seconds per model step in fp32 and in bf16."""

    fp32_s: float
    bf16_s: float

    @property
    def choice(self) -> str:
        return "bf16" if self.bf16_s * MARGIN <= self.fp32_s else "fp32"

    @property
    def bf16_slowdown(self) -> float:
        """How many times slower bf16 measured than fp32 (below 1: faster)."""
        return self.bf16_s / self.fp32_s


# (shapes) -> {role: (fp32 seconds, bf16 seconds)} (and, optionally, BY_KERNEL: {kernel: fp32 training
# seconds} and BY_LAYOUT[dtype]: {layout: decoding seconds}); tests pass a fake one
Timer = Callable[[Shapes], dict[str, tuple[float, float]]]
Op = Callable[[], Any]  # one matmul (forward, or forward and backward) of the probe

_memo: dict[str, dict[str, Timing] | None] = {}
# measure()'s seconds of fp32 training per float32 kernel, and of decoding per packed layout in each
# precision, beside the roles (where both were timed)
BY_KERNEL = "fp32_train_by_kernel"
BY_LAYOUT = {"fp32": "fp32_sample_by_layout", "bf16": "bf16_sample_by_layout"}
BY_VARIANT = (BY_KERNEL, *BY_LAYOUT.values())
_by_variant_memo: dict[str, dict[str, dict[str, float]]] = {}
_lock = threading.Lock()


def enabled() -> bool:
    """Whether ``auto`` may time the model (``GRPO_PRECISION_PROBE``: on, the default, or off)."""
    return env_switch(ENV_SWITCH)


# Environment variables that cap the instruction sets the kernels use (oneDNN, MKL); ATen's own
# cap (ATEN_CPU_CAPABILITY) shows in torch's capability, which the key names.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_description() -> str:
    """The CPU model and its vector and matrix instruction sets (avx*, amx*), as every recorded
    number is to name them, and any cap set on the kernels' instruction sets (a run emulating a
    lesser CPU says so)."""
    caps = _caps_set(("ATEN_CPU_CAPABILITY", *ISA_CAPS))
    capped = f" (kernels capped: {' '.join(caps)})" if caps else ""
    return f"{cpu_name()}; {' '.join(_vector_flags()) or 'no avx flags'}{capped}"


def _vector_flags() -> list[str]:
    """The CPU's vector and matrix instruction sets (its avx* and amx* flags), as /proc/cpuinfo lists them."""
    return [f for f in _cpuinfo("flags").split() if f.startswith(("avx", "amx"))]


def _caps_set(names: tuple[str, ...]) -> list[str]:
    """``NAME=value`` for each of ``names`` set in the environment."""
    return [f"{name}={os.environ[name]}" for name in names if os.environ.get(name)]


def _cpuinfo(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def instruction_sets() -> str:
    """What decides which kernels run, beyond the CPU's name: ATen's vector capability, a digest of
    the CPU's avx*/amx* flags and any cap set on oneDNN's or MKL's instruction sets. Clouds name
    different CPUs alike ("Intel(R) Xeon(R) Processor", "AMD EPYC"), and a cache under a home
    directory shared across a cluster's nodes would otherwise hand an AMX node's bf16 answer to an
    avx2-only node, where bf16 runs up to 19x slower."""
    import torch

    digest = hashlib.sha1(" ".join(sorted(set(_vector_flags()))).encode()).hexdigest()[:8]
    return " ".join([torch.backends.cpu.get_cpu_capability(), "flags", digest, *_caps_set(ISA_CAPS)])


def machine_key(shapes: Shapes) -> str:
    """What a measurement depends on besides noise: CPU and its instruction sets, torch, threads,
    fp32 kernel, shapes."""
    import torch

    from grpo.models import cpu_linear

    kernel = "onednn" if cpu_linear.wanted() and cpu_linear.onednn_works() else "torch"
    if kernel == "onednn" and cpu_linear.stream_available():
        # the streaming layout is timed too, through grpo's own kernels: a change to them (their
        # build's digest) measures again rather than answer from the previous kernels' numbers
        from grpo.models import native_kernels

        kernel += f"+stream {native_kernels.build_digest()[:8]}"
    return (f"{cpu_name()} | {instruction_sets()} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
            f"{kernel} | {shapes.signature()} | probe {PROBE_VERSION}")


def cache_file() -> Path:
    from grpo import models

    return models.cache_dir() / "precision.json"


# the share of this process's cores in use (by anyone) over BUSY_WINDOW_S above which a high load
# average still means "busy": a load average is a minute's memory, and one left behind by a job that
# has just ended (a test suite, a compile) would skip the probe on a machine that is quiet now
BUSY_NOW = 0.5
BUSY_WINDOW_S = 0.25


def machine_busy() -> str | None:
    """Why timing now would measure other processes rather than this machine, or None: the load
    average is at least the number of cores this process may run on, and those cores are still
    mostly in use (``BUSY_NOW``) when looked at now (where the kernel says: Linux's /proc/stat).

    The load average alone kept a run started right after ``make test`` from measuring (load 2.4
    on 2 idle cores): its bf16 sampler packed in the unmeasured fallback, oneDNN's layout, which
    the probe then measured 1.58x slower per decoding step than the streaming one (AMD EPYC)."""
    try:
        load, cpus = os.getloadavg()[0], sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: no load known
        return None
    if load < len(cpus):
        return None
    in_use = cores_in_use(cpus)
    if in_use is not None and in_use < BUSY_NOW:
        return None
    now = f", {in_use:.0%} of them in use now" if in_use is not None else ""
    return f"load {load:.1f} on {len(cpus)} cores{now}"


def cores_in_use(cpus: list[int], window_s: float = BUSY_WINDOW_S) -> float | None:
    """The share of the time of ``cpus`` that went to running anything (this process included; a
    virtual machine's stolen time too) over the next ``window_s``; None where /proc/stat is not there."""
    first = _cpu_times(cpus)
    if first is None:
        return None
    time.sleep(window_s)
    second = _cpu_times(cpus)
    if second is None:
        return None
    busy, total = (b - a for a, b in zip(first, second, strict=True))
    return busy / total if total > 0 else None


def _cpu_times(cpus: list[int], stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(busy, total) clock ticks of ``cpus`` so far, from ``stat``: busy is all but idle and iowait."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    wanted, busy, total, seen = {f"cpu{c}" for c in cpus}, 0, 0, 0
    for line in lines:
        name, *fields = line.split() or [""]
        if name not in wanted:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user and nice]
        ticks = [int(v) for v in fields[:8]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        busy += sum(ticks) - idle
        total += sum(ticks)
        seen += 1
    return (busy, total) if seen == len(wanted) else None


def timings(shapes: Shapes, timer: Timer | None = None, cache: Path | None = None) -> dict[str, Timing] | None:
    """Each role's Timing for ``shapes`` on this machine: from this process, else the cache file,
    else measured (by ``timer``, default ``measure``), cached and printed once. None, printed once
    per process, where the machine is too busy to measure: ``auto`` is fp32 until a run finds it quiet."""
    key = machine_key(shapes)
    cache = cache if cache is not None else cache_file()
    # fp32 per training kernel and each precision per decoding layout, where measured: kept with the entry
    by_variant: dict[str, dict[str, float]] = {}

    def measured() -> dict[str, Timing]:
        seconds = (timer or measure)(shapes)
        by_variant.update({name: dict(seconds[name]) for name in BY_VARIANT if seconds.get(name)})
        if by_variant:
            _by_variant_memo[f"{cache} | {key}"] = dict(by_variant)
        return {role: Timing(*seconds[role]) for role in ROLES}

    def to_json(result: dict[str, Timing]) -> dict:
        return {role: asdict(t) for role, t in result.items()} | by_variant

    return measured_once(
        key, cache, _memo,
        parse=lambda entry: {role: Timing(float(entry[role]["fp32_s"]), float(entry[role]["bf16_s"])) for role in ROLES},
        measure=measured, to_json=to_json, announce=lambda result: summary(result, key), what="auto precision",
        fallback="fp32")


def fp32_training_by_kernel(shapes: Shapes, cache: Path | None = None) -> dict[str, float] | None:
    """Seconds of a fp32 training pass through each float32 kernel, as this probe measured them
    for ``shapes`` on this machine (in this process, or cached); None where it has not. The kernel
    probe (kernel_probe.py) takes its answer from them rather than timing the same ops again."""
    return _measured_variants(BY_KERNEL, shapes, cache)


def sampling_by_layout(precision: str, shapes: Shapes, cache: Path | None = None) -> dict[str, float] | None:
    """Seconds of a decoding step in ``precision`` ("fp32" or "bf16") in each packed layout, as this
    probe measured them (as ``fp32_training_by_kernel``)."""
    return _measured_variants(BY_LAYOUT[precision], shapes, cache)


def _measured_variants(name: str, shapes: Shapes, cache: Path | None) -> dict[str, float] | None:
    key, cache = machine_key(shapes), cache if cache is not None else cache_file()
    found = _by_variant_memo.get(f"{cache} | {key}", {}).get(name)
    if found is None:
        entry = _read(cache).get(key)
        found = entry.get(name) if isinstance(entry, dict) else None
    try:
        return {variant: float(seconds) for variant, seconds in found.items()}
    except (AttributeError, TypeError, ValueError):  # none, or a damaged entry
        return None


def measured_once(key: str, cache: Path, memo: dict[str, Any], parse: Callable[[Any], T], measure: Callable[[], T],
                  to_json: Callable[[T], Any], announce: Callable[[T], str], what: str, fallback: str) -> T | None:
    """A machine's measurement ``key``: from ``memo`` (this process), else the cache file's entry
    (``parse``), else ``measure()``d, stored (``to_json``) and announced once. None, said once per
    process, where the machine is too busy to measure: the caller's ``fallback`` until a run finds
    it quiet. kernel_probe.py caches through it too.

    Run on the process's computing thread (computing.py), wherever it is called from: a probe timed
    on another thread leaves a second OpenMP team in the process, after which every kernel of
    grpo's ran ~1.7x slower (docs/benchmark.md). The whole call goes there, the cached answer's
    lookup too, so that no lock is taken off that thread which the computing thread could wait for."""
    if not computing.on_computing_thread():
        return computing.run(measured_once, key, cache, memo, parse, measure, to_json, announce, what, fallback)
    memo_key = f"{cache} | {key}"
    # Two engines created at once measure once; so do two processes (the jobs of a sweep), which
    # measuring side by side would time each other.
    with _lock, _file_lock(cache):
        if memo_key in memo:
            return memo[memo_key]
        try:
            result = parse(_read(cache).get(key))
        except (KeyError, TypeError, ValueError):  # not measured yet, or a damaged entry: measure again
            busy = machine_busy()
            if busy is not None:  # what would be cached for good would be the other processes' load
                print(f"grpo: {what} not measured, the machine is busy ({busy}): {fallback} for this run, "
                      "measured by a later one", file=sys.stderr, flush=True)
                memo[memo_key] = None
                return None
            result = measure()
            from grpo.models import native_kernels

            # the packed weights it timed are gone: the memory kept for a next pack is no one's
            native_kernels.release_kept_memory()
            stored = _read(cache)  # another process may have added entries meanwhile
            stored[key] = to_json(result)
            _write(cache, stored)
            print(f"grpo: {announce(result)}; cached in {cache}", file=sys.stderr, flush=True)
        memo[memo_key] = result
        return result


@contextlib.contextmanager
def _file_lock(cache: Path) -> Iterator[None]:
    try:
        import fcntl

        cache.parent.mkdir(parents=True, exist_ok=True)
        handle = open(cache.with_name(cache.name + ".lock"), "a")  # noqa: SIM115 (held across the yield)
    except (ImportError, OSError):  # not POSIX, or a read-only cache: unlocked (at worst, measured twice)
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def choose(result: dict[str, Timing]) -> dict[str, str]:
    """Each role's precision: the faster one by ``MARGIN``, with the two roles paired. The probe
    times fp32 sampling as it runs beside an fp32 trainer, with LoRA folded into the weights; beside
    a bf16 trainer the sampler runs its own fp32 copy with LoRA unmerged (sampler_precision.py),
    slower than what was timed. So where bf16 trains faster, sampling is bf16 too unless fp32
    measured ``MARGIN`` faster at it (an fp32 sampler packed in the streaming layout can come within
    the margin of bf16 on an AMX CPU, which must not cost bf16 training); and where fp32 samples
    that much faster, training stays fp32 beside it. ``train_dtype=bf16`` asks for the mixed pair."""
    sample, train = result["sample"], result["train"]
    if train.choice == "bf16" and sample.fp32_s * MARGIN > sample.bf16_s:
        return {"sample": "bf16", "train": "bf16"}
    return {"sample": sample.choice, "train": "fp32" if sample.choice == "fp32" else train.choice}


def summary(result: dict[str, Timing], key: str) -> str:
    """One line: each role's choice and the numbers it was made from."""
    cpu, _, rest = key.partition(" | ")
    chosen, parts = choose(result), []
    for role, what in (("sample", "decoding step"), ("train", "training pass")):
        t = result[role]
        kept = "" if chosen[role] == t.choice else (
            "; fp32 kept beside the fp32 sampler" if role == "train" else "; bf16 beside the bf16 trainer")
        parts.append(f"{role}_dtype {chosen[role]} (per {what}: fp32 {t.fp32_s * 1e3:.1f} ms, "
                     f"bf16 {t.bf16_s * 1e3:.1f} ms, bf16 {_relative(t)}{kept})")
    return f"auto precision on {cpu} ({rest}): " + ", ".join(parts)


def _relative(t: Timing) -> str:
    s = t.bf16_slowdown
    return f"{s:.2f}x slower" if s >= 1 else f"{1 / s:.2f}x faster"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    from grpo.files import atomic_write_text

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as err:  # a read-only cache costs a probe per process, nothing more
        print(f"grpo: could not cache the precision probe in {path}: {err}", file=sys.stderr)


# --------------------------------------------------------------------------- the real timer


def measure(shapes: Shapes, budget_s: float = BUDGET_S) -> dict[str, tuple[float, float]]:
    """Seconds per model step in fp32 and bf16 for each role (see the module docstring)."""
    import torch

    from grpo.models import cpu_linear

    out = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # a decoding step runs right after the previous one, over the same weights: what of
        # them the cache holds then is part of its time, so each run is timed after a first;
        # each precision in each packed layout the sampler could pack in, the faster counting
        precisions = {"fp32": torch.float32, "bf16": torch.bfloat16}
        layouts = {p: sampler_layouts(p) for p in precisions}
        variants = {(p, layout): _decode_ops(shapes, dtype, layout) for p, dtype in precisions.items()
                    for layout in layouts[p]}
        counts = next(iter(variants.values()))[1]
        seconds = dict(zip(variants, _fastest_of([ops for ops, _ in variants.values()], counts, budget_s * 0.4,
                                                 warm_each=True), strict=True))
        by_layout = {p: {layout: seconds[p, layout] for layout in layouts[p]} for p in precisions}
        out["sample"] = (min(by_layout["fp32"].values()), min(by_layout["bf16"].values()))
        out |= {BY_LAYOUT[p]: by_layout[p] for p in precisions if len(layouts[p]) > 1}
        del variants  # a probed decoding step holds the model's weights in each variant
        # fp32 training through each float32 kernel the model could train through, the faster counting
        kernels = cpu_linear.KERNELS if cpu_linear.wanted() and cpu_linear.onednn_works() else ("onednn",)
        variants = [_train_ops(shapes, torch.float32, kernel) for kernel in kernels]
        bf16, counts = _train_ops(shapes, torch.bfloat16)
        *fp32_s, bf16_s = _fastest_of([ops for ops, _ in variants] + [bf16], counts, budget_s * 0.6)
        out["train"] = (min(fp32_s), bf16_s)
        if len(kernels) > 1:
            out[BY_KERNEL] = dict(zip(kernels, fp32_s, strict=True))
    return out


def _fastest_of(variants: list[list[Op]], counts: list[float], budget_s: float,
                warm_each: bool = False) -> tuple[float, ...]:
    """Each variant's seconds per model step: each op's fastest run, the variants alternating op
    by op, summed with its count per model step. Op by op, because on a loaded machine a whole
    model step rarely runs undisturbed while a single matmul often does; alternating, so that the
    load falls on every variant alike. ``warm_each``: every timed run right after an untimed one
    of the same op."""
    for ops in variants:  # warm-up: oneDNN primitive creation, first touch of the weights
        for op in ops:
            op()
    best = [[math.inf] * len(ops) for ops in variants]
    start, reps = time.perf_counter(), 0
    while reps < MAX_REPS and (reps == 0 or (elapsed := time.perf_counter() - start) < budget_s
                               or (reps < 3 and elapsed < 2 * budget_s)):
        for j in range(len(counts)):
            for k, ops in enumerate(variants):
                if warm_each:
                    ops[j]()
                t0 = time.perf_counter()
                ops[j]()
                best[k][j] = min(best[k][j], time.perf_counter() - t0)
        reps += 1
    return tuple(sum(c * t for c, t in zip(counts, b, strict=True)) for b in best)


def _linears(shapes: Shapes, dtype, head_rows: int, kernel: str = "onednn"):
    """One layer's Linears and a ``head_rows``-row slice of the unembedding, in ``dtype``, on the
    kernels the model runs (oneDNN for fp32 on a CPU unless ``kernel`` is "torch": cpu_linear.py)."""
    import torch
    from torch import nn

    from grpo.models.cpu_linear import use_kernel, use_onednn_linears

    h, i, q, kv = shapes.hidden, shapes.intermediate, shapes.q_out, shapes.kv_out
    layer_shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]  # q k v o gate up down

    def linear(fan_in: int, fan_out: int) -> nn.Linear:
        module = nn.Linear(fan_in, fan_out, bias=False, device="meta")
        weight = torch.empty(fan_out, fan_in, dtype=dtype).uniform_(-fan_in ** -0.5, fan_in ** -0.5)
        module.weight = nn.Parameter(weight, requires_grad=False)
        return module

    layer = nn.ModuleList(linear(a, b) for a, b in layer_shapes)
    head = linear(h, head_rows)
    for module in (layer, head):
        use_onednn_linears(module)
        use_kernel(module, kernel)
    return list(layer), head


def _lora(module, dtype, trainable: bool):
    """LoRA's A and B for ``module`` (rank ``LORA_RANK``) as nn.Linears in ``dtype``."""
    import torch
    from torch import nn

    from grpo.models.cpu_linear import use_onednn_linears

    a = nn.Linear(module.in_features, LORA_RANK, bias=False, dtype=dtype)
    b = nn.Linear(LORA_RANK, module.out_features, bias=False, dtype=dtype)
    with torch.no_grad():
        b.weight.normal_(std=0.01)  # peft starts B at zero; not a number a kernel should see
    for p in (*a.parameters(), *b.parameters()):
        p.requires_grad_(trainable)
    use_onednn_linears(a), use_onednn_linears(b)
    return a, b


def sampler_layouts(precision: str) -> tuple[str, ...]:
    """The packed layouts a sampler in ``precision`` ("fp32" or "bf16") could use here: oneDNN's, the
    streaming one where grpo's kernels are loaded, and for bf16 its dot-product kernel where they
    were built with avx512_bf16 (cpu_linear.py)."""
    from grpo.models import cpu_linear

    if not cpu_linear.stream_available():
        return ("onednn",)
    dot = precision == "bf16" and cpu_linear.stream_dot_available()
    return ("onednn", "stream", "stream_dot") if dot else ("onednn", "stream")


def _decode_ops(shapes: Shapes, dtype, layout: str = "onednn") -> tuple[list[Op], list[float]]:
    """One decoding step: ``DECODE_ROWS`` rows through the Linears of the model's layers, one
    layer after the other, built as the sampler builds them, packed in ``layout`` (cpu_linear.pack_weight)
    -- fp32 with LoRA folded into the weights (folded_lora.py), bf16 as the sampler's copy with
    sibling projections stacked and LoRA side paths (sampler_precision.py) -- and a slice of the
    unembedding. As many layers as the
    model has, up to ``DECODE_BYTES``: whether a step's weights stay in the last-level cache (480
    MiB on one Xeon here: bf16 SmolLM2 does, fp32 does not) is part of what decides."""
    import torch

    from grpo.models.cpu_linear import PackedLinear, can_pack
    from grpo.models.fused_projections import FusedProjections
    from grpo.models.lora_linear import LoraSidePath

    h, i, q, kv = shapes.hidden, shapes.intermediate, shapes.q_out, shapes.kv_out
    layer_bytes = 4 * h * (2 * q + 2 * kv + 3 * i)
    copies = max(1, min(shapes.layers, DECODE_BYTES // layer_bytes))
    head_rows = max(1, min(shapes.vocab, HEAD_DECODE_BYTES // (4 * h)))
    inputs = {n: torch.randn(DECODE_ROWS, n, dtype=dtype) for n in {h, q, i}}

    def weight(fan_in: int, fan_out: int) -> torch.Tensor:
        return torch.empty(fan_out, fan_in, dtype=dtype).uniform_(-fan_in ** -0.5, fan_in ** -0.5)

    def lora(fan_in: int, fan_out: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        # peft starts B at zero; not a number a kernel should see
        return torch.randn(LORA_RANK, fan_in) * fan_in ** -0.5, torch.randn(fan_out, LORA_RANK) * 0.01, LORA_SCALING

    def single(fan_in: int, fan_out: int) -> Callable[[torch.Tensor], torch.Tensor]:
        w = weight(fan_in, fan_out)
        linear = (PackedLinear(w, None, layout) if can_pack(w, layout)
                  else functools.partial(torch.nn.functional.linear, weight=w))
        return linear if dtype == torch.float32 else LoraSidePath(linear, *lora(fan_in, fan_out), dtype)

    def siblings(fan_outs: list[int]) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        weights = [weight(h, n) for n in fan_outs]
        if dtype == torch.float32 or not can_pack(weights[0], layout):
            return [single(h, n) for n in fan_outs]
        group = FusedProjections(torch.cat(weights), None, fan_outs, layout)
        group.set_lora([lora(h, n) for n in fan_outs])
        return [lambda x, k=k: group.output(x, k) for k in range(len(fan_outs))]

    layers = [(*siblings([q, kv, kv]), single(q, h), *siblings([i, i]), single(i, h)) for _ in range(copies)]
    fan_ins = (h, h, h, q, h, h, i)  # q k v o gate up down, in the order a layer calls them
    head = single(h, head_rows)

    @torch.no_grad()
    def step() -> None:
        for layer in layers:
            for linear, fan_in in zip(layer, fan_ins, strict=True):
                linear(inputs[fan_in])

    return [step, torch.no_grad()(lambda: head(inputs[h]))], [shapes.layers / copies, shapes.vocab / head_rows]


def _train_ops(shapes: Shapes, dtype, kernel: str = "onednn") -> tuple[list[Op], list[float]]:
    """One training pass's matmuls: ``TRAIN_ROWS`` tokens forward and back through one layer's
    Linears and a slice of the unembedding, as the trainer runs them: the frozen base in ``dtype``
    (input gradient only; fp32 through ``kernel``), fp32 LoRA weights cast to ``dtype`` and added
    inside the matmul (lora_linear.py)."""
    import torch

    from grpo.models.lora_linear import lora_side_path

    head_rows = min(shapes.vocab, HEAD_TRAIN_ROWS)
    linears, head = _linears(shapes, dtype, head_rows, kernel)
    inputs = {n: torch.randn(TRAIN_ROWS, n, dtype=dtype) for n in {shapes.hidden, shapes.q_out, shapes.intermediate}}

    def op(module) -> Op:
        x = inputs[module.in_features].clone().requires_grad_(True)
        grad = torch.ones(TRAIN_ROWS, module.out_features, dtype=dtype)
        a, b = _lora(module, torch.float32, trainable=True)

        def run() -> None:
            lora_side_path(module(x), x, a.weight.to(dtype), b.weight.to(dtype), LORA_SCALING,
                           in_place=True).backward(grad)
            a.weight.grad = b.weight.grad = None

        return run

    return [op(m) for m in linears] + [op(head)], [float(shapes.layers)] * len(linears) + [shapes.vocab / head_rows]


def main(argv: list[str] | None = None) -> None:
    """``python -m grpo.models.dtype_probe [base_model]``: measure now (the cache is neither read nor
    written) and print the line ``auto`` would print."""
    from grpo import models
    args = sys.argv[1:] if argv is None else argv
    name = args[0] if args else "smollm2"
    shapes = Shapes.from_config(models.load_config(name))
    if shapes is None:
        raise SystemExit(f"grpo: the config of {name!r} names no decoder shapes; auto is fp32 for it")
    busy = machine_busy()
    seconds = measure(shapes)  # each role's (fp32, bf16), beside the per-kernel and per-layout variants
    result = {role: Timing(*seconds[role]) for role in ROLES}
    print(summary(result, machine_key(shapes)) + (f" (busy machine: {busy}; auto would not measure now)" if busy else ""))


if __name__ == "__main__":
    main()
