"""Which float32 kernel trains faster on this CPU: oneDNN's Linear or PyTorch's own (MKL's sgemm);
and which packed layout samples faster: oneDNN's or grpo's streaming one.

cpu_linear.py sends float32 Linears to oneDNN because MKL ran them 2.2x slower on the AMD EPYC
where that was measured. On an Intel Xeon with AMX the order turns round for training: the input
gradients of SmolLM2's layers and of its unembedding ran 8% and 1.6x faster through MKL, and a
bench step's fp32 training took 0.83-0.89x the time through MKL (docs/benchmark.md). Which library
wins is a property of the CPU and the shapes, not of its flags, so the first fp32 training model
of a shape on a machine times one training pass's matmuls (dtype_probe's ``train`` ops: one
layer's Linears and a slice of the unembedding, forward and back, with LoRA) through both, op by
op alternating, each op's fastest run counting; PyTorch's kernel is taken only when it measured
``MARGIN`` faster (oneDNN, the one chosen so far, keeps ties). Sampling keeps oneDNN's packed
weights either way: a sampling call measured the same through both here and 1.4x faster through
oneDNN on the EPYC.

Where ``auto`` was resolved for the same shapes on the machine, the precision probe has timed these
very ops through both kernels already (it weighs bf16 against the faster): its numbers, kept in its
cache entry, give the answer without timing them again.

The sampler's float32 weights are packed the same way: in oneDNN's blocked layout, or in grpo's
streaming layout (cpu_linear.py, native_kernels.cpp's ``stream_linear``), which reads each weight
once for all of a decoding step's rows and measured 1.1-1.4x faster than oneDNN's for 1-48 rows on
an Intel Xeon (avx512) and 0.75-0.95x its speed for 128-512 rows (a prefill; docs/benchmark.md).
``decoding_layout`` times dtype_probe's fp32 decoding step (the model's layers' Linears at a
decoding step's rows, LoRA folded) packed each way and takes the streaming layout where it
measured ``MARGIN`` faster; as for training, the precision probe's own numbers answer where it
timed both.

The results are cached beside the precision probe's (``$GRPO_CACHE/precision.json``) under the same
machine key (CPU and its instruction sets, torch, threads, shapes, probe version), printed once
when measured. As with the precision probe, ``GRPO_PRECISION_PROBE=off`` skips it (oneDNN), and a machine whose load average
is at least its core count is not measured (oneDNN for that run, measured by a later one).
``GRPO_CPU_LINEAR=torch`` sends every Linear to PyTorch's kernels without measuring.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo.models import dtype_probe
from grpo.models.cpu_linear import KERNELS
from grpo.models.dtype_probe import Shapes

MARGIN = 1.05  # PyTorch's kernel must be this many times faster: noise keeps the kernel in use so far
BUDGET_S = 1.0
KEY_PREFIX = "fp32 training kernel | "
LAYOUT_KEY_PREFIX = "fp32 decoding layout | "

# (shapes) -> (oneDNN seconds, PyTorch seconds) per training pass; tests pass a fake one
Timer = Callable[[Shapes], tuple[float, float]]

_memo: dict[str, KernelTiming | None] = {}
_layout_memo: dict[str, LayoutTiming | None] = {}


@dataclass(frozen=True)
class KernelTiming:
    """Seconds of one probed training pass through each kernel."""

    onednn_s: float
    torch_s: float

    @property
    def choice(self) -> str:
        return "torch" if self.torch_s * MARGIN <= self.onednn_s else "onednn"


@dataclass(frozen=True)
class LayoutTiming:
    """Seconds of one probed fp32 decoding step with the weights packed in each layout."""

    onednn_s: float
    stream_s: float

    @property
    def choice(self) -> str:
        return "stream" if self.stream_s * MARGIN <= self.onednn_s else "onednn"


def training_kernel(shapes: Shapes | None, timer: Timer | None = None, cache: Path | None = None) -> str:
    """The float32 training kernel for a model of ``shapes`` on this machine, "onednn" or "torch":
    oneDNN without measuring where there is nothing to measure (no shapes, the probe off, oneDNN
    not in use) or the machine is too busy to."""
    from grpo.models import cpu_linear

    if shapes is None or not dtype_probe.enabled() or not (cpu_linear.wanted() and cpu_linear.onednn_works()):
        return "onednn"
    timing = timings(shapes, timer, cache)
    return "onednn" if timing is None else timing.choice


def timings(shapes: Shapes, timer: Timer | None = None, cache: Path | None = None) -> KernelTiming | None:
    """The KernelTiming of ``shapes``: from this process, the cache file, or measured (and cached
    and printed once); None, printed once, where the machine is too busy to measure."""
    cache = cache if cache is not None else dtype_probe.cache_file()
    borrowed = []  # whether the answer came from the precision probe's numbers

    def measured() -> KernelTiming:
        # ``auto`` resolving to fp32 has just timed these very ops through both kernels
        # (dtype_probe's training role): its numbers answer, rather than timing them again (0.3 s on an AMX Xeon)
        timed = dtype_probe.fp32_training_by_kernel(shapes, cache) or {}
        if timed.keys() >= set(KERNELS):
            borrowed.append(True)
            return KernelTiming(timed["onednn"], timed["torch"])
        return KernelTiming(*(timer or measure)(shapes))

    return dtype_probe.measured_once(
        KEY_PREFIX + dtype_probe.machine_key(shapes), cache, _memo,
        parse=lambda entry: KernelTiming(float(entry["onednn_s"]), float(entry["torch_s"])),
        measure=measured, to_json=asdict, announce=lambda result: summary(result, shapes, bool(borrowed)),
        what="fp32 training kernel", fallback="oneDNN")


def summary(result: KernelTiming, shapes: Shapes, from_precision_probe: bool = False) -> str:
    ratio = result.onednn_s / result.torch_s
    return (f"fp32 training kernel on {dtype_probe.cpu_name()} ({shapes.signature()}): "
            f"{'PyTorch (MKL)' if result.choice == 'torch' else 'oneDNN'} (per training pass: oneDNN "
            f"{result.onednn_s * 1e3:.1f} ms, PyTorch {result.torch_s * 1e3:.1f} ms, PyTorch "
            f"{f'{ratio:.2f}x faster' if ratio >= 1 else f'{1 / ratio:.2f}x slower'}"
            f"{', as the precision probe timed them' if from_precision_probe else ''})")


def measure(shapes: Shapes, budget_s: float = BUDGET_S) -> tuple[float, float]:
    """Seconds per training pass through oneDNN and through PyTorch's kernel (dtype_probe's
    training ops, scaled to the whole model)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        (onednn, counts), (plain, _) = (dtype_probe._train_ops(shapes, torch.float32, kernel) for kernel in KERNELS)
        onednn_s, torch_s = dtype_probe._fastest_of([onednn, plain], counts, budget_s)
        return onednn_s, torch_s


def decoding_layout(shapes: Shapes | None, timer: Callable[[Shapes], tuple[float, float]] | None = None,
                    cache: Path | None = None) -> str:
    """The packed layout for a float32 sampler of ``shapes`` on this machine, "onednn" or "stream":
    oneDNN's without measuring where there is nothing to measure (no shapes, the probe off, oneDNN
    or grpo's kernels not in use) or the machine is too busy to."""
    from grpo.models import cpu_linear

    if (shapes is None or not dtype_probe.enabled() or not (cpu_linear.wanted() and cpu_linear.onednn_works())
            or not cpu_linear.stream_available()):
        return "onednn"
    timing = layout_timings(shapes, timer, cache)
    return "onednn" if timing is None else timing.choice


def layout_timings(shapes: Shapes, timer: Callable[[Shapes], tuple[float, float]] | None = None,
                   cache: Path | None = None) -> LayoutTiming | None:
    """The LayoutTiming of ``shapes``, as ``timings`` finds a KernelTiming."""
    cache = cache if cache is not None else dtype_probe.cache_file()
    borrowed = []

    def measured() -> LayoutTiming:
        timed = dtype_probe.fp32_sampling_by_layout(shapes, cache) or {}
        if timed.keys() >= {"onednn", "stream"}:
            borrowed.append(True)
            return LayoutTiming(timed["onednn"], timed["stream"])
        return LayoutTiming(*(timer or measure_layouts)(shapes))

    return dtype_probe.measured_once(
        LAYOUT_KEY_PREFIX + dtype_probe.machine_key(shapes), cache, _layout_memo,
        parse=lambda entry: LayoutTiming(float(entry["onednn_s"]), float(entry["stream_s"])),
        measure=measured, to_json=asdict, announce=lambda result: layout_summary(result, shapes, bool(borrowed)),
        what="fp32 decoding layout", fallback="oneDNN's")


def layout_summary(result: LayoutTiming, shapes: Shapes, from_precision_probe: bool = False) -> str:
    ratio = result.onednn_s / result.stream_s
    return (f"fp32 decoding layout on {dtype_probe.cpu_name()} ({shapes.signature()}): "
            f"{'streaming' if result.choice == 'stream' else 'oneDNN'} (per decoding step: oneDNN "
            f"{result.onednn_s * 1e3:.1f} ms, streaming {result.stream_s * 1e3:.1f} ms, streaming "
            f"{f'{ratio:.2f}x faster' if ratio >= 1 else f'{1 / ratio:.2f}x slower'}"
            f"{', as the precision probe timed them' if from_precision_probe else ''})")


def measure_layouts(shapes: Shapes, budget_s: float = BUDGET_S) -> tuple[float, float]:
    """Seconds per fp32 decoding step packed in oneDNN's layout and in the streaming one (dtype_probe's
    decoding ops, scaled to the whole model)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        (onednn, counts), (stream, _) = (dtype_probe._decode_ops(shapes, torch.float32, layout)
                                         for layout in ("onednn", "stream"))
        onednn_s, stream_s = dtype_probe._fastest_of([onednn, stream], counts, budget_s, warm_each=True)
        return onednn_s, stream_s


def main(argv: list[str] | None = None) -> None:
    """``python -m grpo.models.kernel_probe [base_model]``: measure now (the cache is neither read
    nor written) and print the lines a first fp32 run would print."""
    from grpo import models
    from grpo.models import cpu_linear

    args = sys.argv[1:] if argv is None else argv
    name = args[0] if args else "smollm2"
    shapes = Shapes.from_config(models.load_config(name))
    if shapes is None:
        raise SystemExit(f"grpo: the config of {name!r} names no decoder shapes; nothing to time")
    print(summary(KernelTiming(*measure(shapes)), shapes))
    if cpu_linear.stream_available():
        print(layout_summary(LayoutTiming(*measure_layouts(shapes)), shapes))
    else:
        print("fp32 decoding layout: oneDNN's (grpo's native kernels are not built here: nothing to weigh it against)")


if __name__ == "__main__":
    main()
