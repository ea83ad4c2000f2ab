"""Which float32 kernel trains faster on this CPU: oneDNN's Linear or PyTorch's own (MKL's sgemm);
which packed layout samples faster: oneDNN's or grpo's streaming one; and whether the bf16 training
attention's products run faster by avx512_bf16's dot product than by float32's multiply-adds.

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

The sampler's weights are packed the same way: in oneDNN's blocked layout, or in grpo's streaming
layout (cpu_linear.py, native/stream_linear.cpp), which reads each weight once for
all of a decoding step's rows. In fp32 it measured 1.1-1.4x faster than oneDNN's for 1-48 rows on
an Intel Xeon (avx512) and 0.75-0.95x its speed for 128-512 rows (a prefill); in bf16, on the same
Xeon without AMX, 1.3-1.8x faster at every row count (docs/benchmark.md), where on an AMX Xeon
oneDNN's bf16 product runs on the tiles. ``decoding_layout`` times dtype_probe's decoding step in
the sampler's precision (the model's layers' Linears at a decoding step's rows, fp32 with LoRA
folded, bf16 with LoRA's side paths) packed each way and takes the streaming layout where it
measured ``MARGIN`` faster; as for training, the precision probe's own numbers answer where it
timed both.

A bf16 weight streams in one of two kernels (cpu_linear.py): widened to float32 for float32's
multiply-adds, or in pairs for avx512_bf16's dot product, twice the multiply-adds an instruction.
On an AMD EPYC (Zen 4) the dot products ran a step's products 1.96x faster, on an Intel Xeon
without AMX the instruction ran at half float32's rate of multiply-adds (docs/benchmark.md): where
the kernels were built with it, ``bf16_stream_kernel`` asks which is faster, and the bf16 layout
question weighs oneDNN's layout against the streaming one in that kernel.

The trainer's bf16 attention (native/packed_attention.cpp) takes its seven products -- the scores,
the weighted sums, the key and value gradients -- by float32's multiply-adds (bf16 widened, the
softmax's weights float32) or, where the kernels are built with avx512_bf16 and the head dimension is
a multiple of 32, by that instruction: the scores over pairs of dims, the rest over pairs of keys or
queries with the weights rounded to bf16 (as PyTorch's CPU flash attention does). On an AMD EPYC
(Zen 4) the kernel ran ~1.5x faster that way (docs/benchmark.md); where the instruction runs at half
float32's rate it would be slower. ``training_attention`` times the kernel both ways on a GRPO
micro-batch of the model's heads.

These are the same question -- which of two ways of computing the same thing runs faster here --
asked by a ``Question``: its answer is cached beside the precision probe's (``$GRPO_CACHE/precision.json``) under the same
machine key (CPU and its instruction sets, torch, threads, shapes, probe version), printed once
when measured. As with the precision probe, ``GRPO_PRECISION_PROBE=off`` skips it (oneDNN), and a machine whose load average
is at least its core count is not measured (oneDNN for that run, measured by a later one).
``GRPO_CPU_LINEAR=torch`` sends every Linear to PyTorch's kernels without measuring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpo import models
from grpo.models import dtype_probe
from grpo.models.dtype_probe import Shapes

MARGIN = 1.05  # the second option must be this many times faster: noise keeps the one in use so far
BUDGET_S = 1.0

# (shapes) -> (seconds through the first option, through the second) per pass; tests pass a fake one
Timer = Callable[[Shapes], tuple[float, float]]

_memo: dict[str, Timing | None] = {}  # both questions' answers in this process, by cache key


@dataclass(frozen=True)
class Question:
    """Which of two ways of computing the same thing runs faster on this machine: ``options[0]``
    (the one used so far) unless ``options[1]`` measured ``MARGIN`` faster."""

    what: str  # names the cache entry and the printed line
    per: str  # what one timing is of
    options: tuple[str, str]
    names: tuple[str, str]  # how the printed line names each option
    chosen_names: tuple[str, str]  # ... and the chosen one
    # the precision probe's numbers for the two options, where it timed both (dtype_probe.py)
    borrowed: Callable[[Shapes, Path], dict[str, float] | None]
    measure: str  # this module's function that times both: looked up when called (tests replace it)

    @property
    def key_prefix(self) -> str:
        return f"{self.what} | "

    def answer(self, shapes: Shapes, timer: Timer | None = None, cache: Path | None = None) -> str:
        """The faster option for ``shapes``; the first where the machine is too busy to measure."""
        timing = self.timings(shapes, timer, cache)
        return self.options[0] if timing is None else timing.choice

    def timings(self, shapes: Shapes, timer: Timer | None = None, cache: Path | None = None) -> Timing | None:
        """The Timing of ``shapes``: from this process, the cache file, or measured (and cached and
        printed once); None, printed once, where the machine is too busy to measure."""
        cache = cache if cache is not None else dtype_probe.cache_file()
        borrowed = []  # whether the answer came from the precision probe's numbers

        def measured() -> Timing:
            # ``auto`` resolving to fp32 has just timed these very ops both ways (dtype_probe.py):
            # its numbers answer, rather than timing them again
            timed = self.borrowed(shapes, cache) or {}
            if timed.keys() >= set(self.options):
                borrowed.append(True)
                return Timing(self, *(timed[option] for option in self.options))
            return Timing(self, *(timer or globals()[self.measure])(shapes))

        return dtype_probe.measured_once(
            self.key_prefix + dtype_probe.machine_key(shapes), cache, _memo,
            parse=lambda entry: Timing(self, *(float(entry[f"{option}_s"]) for option in self.options)),
            measure=measured, to_json=Timing.to_json, announce=lambda result: result.summary(shapes, bool(borrowed)),
            what=self.what, fallback=self.chosen_names[0])


@dataclass(frozen=True)
class Timing:
    """Seconds of one probed pass through each of a question's options."""

    question: Question
    first_s: float
    second_s: float

    @property
    def choice(self) -> str:
        return self.question.options[1 if self.second_s * MARGIN <= self.first_s else 0]

    def to_json(self) -> dict[str, float]:
        first, second = self.question.options
        return {f"{first}_s": self.first_s, f"{second}_s": self.second_s}

    def summary(self, shapes: Shapes, from_precision_probe: bool = False) -> str:
        q, ratio = self.question, self.first_s / self.second_s
        first, second = q.names
        return (f"{q.what} on {dtype_probe.cpu_name()} ({shapes.signature()}): "
                f"{q.chosen_names[q.options.index(self.choice)]} (per {q.per}: {first} {self.first_s * 1e3:.1f} ms, "
                f"{second} {self.second_s * 1e3:.1f} ms, {second} "
                f"{f'{ratio:.2f}x faster' if ratio >= 1 else f'{1 / ratio:.2f}x slower'}"
                f"{', as the precision probe timed them' if from_precision_probe else ''})")


TRAINING_KERNEL = Question("fp32 training kernel", "training pass", ("onednn", "torch"), ("oneDNN", "PyTorch"),
                           ("oneDNN", "PyTorch (MKL)"), dtype_probe.fp32_training_by_kernel, "measure")
# the sampler's packed layout, per precision
DECODING_LAYOUT = {
    precision: Question(f"{precision} decoding layout", "decoding step", ("onednn", "stream"), ("oneDNN", "streaming"),
                        ("oneDNN", "streaming"), functools.partial(dtype_probe.sampling_by_layout, precision),
                        measure)
    for precision, measure in (("fp32", "measure_layouts"), ("bf16", "measure_bf16_layouts"))}
KEY_PREFIX, LAYOUT_KEY_PREFIX = TRAINING_KERNEL.key_prefix, DECODING_LAYOUT["fp32"].key_prefix


def _bf16_layouts_timed(shapes: Shapes, cache: Path) -> dict[str, float] | None:
    return _as_two_layouts(dtype_probe.sampling_by_layout("bf16", shapes, cache))


def _as_two_layouts(timed: dict[str, float] | None) -> dict[str, float] | None:
    """bf16 decoding times per layout as the layout question's two options: oneDNN's, and the
    streaming layout in the kernel that the same numbers choose (BF16_STREAM_KERNEL's rule)."""
    if timed and {"stream", "stream_dot"} <= timed.keys():
        kernel = Timing(BF16_STREAM_KERNEL, timed["stream"], timed["stream_dot"]).choice
        timed = {"onednn": timed.get("onednn"), "stream": timed[kernel]}
    return timed if timed and None not in timed.values() else None


# the bf16 streaming layout's kernel, where the dot product is built: its weights widened for
# float32's multiply-adds (the one used so far), or in pairs for avx512_bf16's dot product
BF16_STREAM_KERNEL = Question("bf16 streaming kernel", "decoding step", ("stream", "stream_dot"),
                              ("float32 multiply-adds", "bf16 dot products"),
                              ("float32 multiply-adds (bf16 widened)", "avx512_bf16 dot products"),
                              functools.partial(dtype_probe.sampling_by_layout, "bf16"),
                              "measure_bf16_stream_kernels")
DECODING_LAYOUT["bf16"] = dataclasses.replace(DECODING_LAYOUT["bf16"], borrowed=_bf16_layouts_timed)


@dataclass(frozen=True)
class AttentionShapes:
    """A decoder's attention heads: what the training attention question times."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> AttentionShapes | None:
        """The heads of a transformers config; None where it does not name them."""
        config = models.text_config(config)
        try:
            heads = int(config.num_attention_heads)
            kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            return None
        return cls(heads, kv_heads, head_dim)

    def signature(self) -> str:
        return f"attention-h{self.heads}-kv{self.kv_heads}-d{self.head_dim}"


# the trainer's bf16 attention's products: float32 multiply-adds (the one used so far) or, where built,
# avx512_bf16's dot product
TRAINING_ATTENTION = Question("bf16 training attention", "micro-batch's attention", ("fma", "dot"),
                              ("float32 multiply-adds", "bf16 dot products"),
                              ("float32 multiply-adds (bf16 widened)", "avx512_bf16 dot products"),
                              lambda shapes, cache: None, "measure_attention_kernels")


def _probed(shapes: Shapes | None) -> bool:
    """Whether there is anything to measure: shapes, the probe on, oneDNN's Linears in use."""
    from grpo.models import cpu_linear

    return shapes is not None and dtype_probe.enabled() and cpu_linear.wanted() and cpu_linear.onednn_works()


def training_kernel(shapes: Shapes | None, timer: Timer | None = None, cache: Path | None = None) -> str:
    """The float32 training kernel for a model of ``shapes`` on this machine, "onednn" or "torch":
    oneDNN without measuring where there is nothing to measure (no shapes, the probe off, oneDNN
    not in use) or the machine is too busy to."""
    return TRAINING_KERNEL.answer(shapes, timer, cache) if _probed(shapes) else "onednn"


def timings(shapes: Shapes, timer: Timer | None = None, cache: Path | None = None) -> Timing | None:
    """The training kernel's Timing of ``shapes`` (``Question.timings``)."""
    return TRAINING_KERNEL.timings(shapes, timer, cache)


def decoding_layout(shapes: Shapes | None, dtype=None, timer: Timer | None = None, cache: Path | None = None) -> str:
    """The packed layout for a sampler of ``shapes`` in ``dtype`` (float32, the default, or bf16) on
    this machine, "onednn" or "stream" (bf16: or "stream_dot", ``bf16_stream_kernel``): oneDNN's
    without measuring where there is nothing to measure (no shapes, the probe off, oneDNN or grpo's
    kernels not in use) or the machine is too busy to."""
    import torch

    from grpo.models import cpu_linear

    if not (_probed(shapes) and cpu_linear.stream_available()):
        return "onednn"
    if dtype != torch.bfloat16:
        return DECODING_LAYOUT["fp32"].answer(shapes, timer, cache)
    layout = DECODING_LAYOUT["bf16"].answer(shapes, timer, cache)
    return bf16_stream_kernel(shapes, cache=cache) if layout == "stream" else layout


def bf16_stream_kernel(shapes: Shapes, timer: Timer | None = None, cache: Path | None = None) -> str:
    """The streaming layout a bf16 sampler of ``shapes`` packs in: "stream_dot" (avx512_bf16's dot
    product) where built and measured ``MARGIN`` faster than "stream" (float32 multiply-adds)."""
    from grpo.models import cpu_linear

    if not (_probed(shapes) and cpu_linear.stream_dot_available()):
        return "stream"
    return BF16_STREAM_KERNEL.answer(shapes, timer, cache)


def training_attention(shapes: AttentionShapes | None, timer: Timer | None = None, cache: Path | None = None) -> str:
    """How the trainer's bf16 attention of ``shapes`` takes its products on this machine: "dot"
    (avx512_bf16's dot product) where grpo's kernels are built with it, the head dimension is a
    multiple of 32 and it measured ``MARGIN`` faster; else "fma" (float32 multiply-adds), without
    measuring where there is nothing to measure or the machine is too busy to."""
    from grpo.models import cpu_linear

    if shapes is None or shapes.head_dim % 32 or not (dtype_probe.enabled() and cpu_linear.stream_dot_available()):
        return "fma"
    return TRAINING_ATTENTION.answer(shapes, timer, cache)


def measure(shapes: Shapes, budget_s: float = BUDGET_S) -> tuple[float, float]:
    """Seconds per training pass through oneDNN and through PyTorch's kernel (dtype_probe's
    training ops, scaled to the whole model)."""
    import torch

    from grpo.models.cpu_linear import KERNELS

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        (onednn, counts), (plain, _) = (dtype_probe._train_ops(shapes, torch.float32, kernel) for kernel in KERNELS)
        onednn_s, torch_s = dtype_probe._fastest_of([onednn, plain], counts, budget_s)
        return onednn_s, torch_s


def measure_layouts(shapes: Shapes, budget_s: float = BUDGET_S) -> tuple[float, float]:
    """Seconds per float32 decoding step packed in oneDNN's layout and in the streaming one
    (dtype_probe's decoding ops, scaled to the whole model)."""
    import torch

    return _time_layouts(shapes, torch.float32, ("onednn", "stream"), budget_s)


def measure_bf16_layouts(shapes: Shapes, budget_s: float = BUDGET_S) -> tuple[float, float]:
    """``measure_layouts`` in bf16, the streaming layout in whichever of its kernels measured
    faster here (timed alongside, not asked of ``bf16_stream_kernel``: each question measures
    under the probe's lock, which is not taken twice)."""
    import torch

    layouts = dtype_probe.sampler_layouts("bf16")
    timed = _as_two_layouts(dict(zip(layouts, _time_layouts(shapes, torch.bfloat16, layouts, budget_s), strict=True)))
    return timed["onednn"], timed["stream"]


def measure_bf16_stream_kernels(shapes: Shapes, budget_s: float = BUDGET_S) -> tuple[float, float]:
    """Seconds per bf16 decoding step streamed through float32 multiply-adds and through
    avx512_bf16's dot products (dtype_probe's decoding ops, scaled to the whole model)."""
    import torch

    return _time_layouts(shapes, torch.bfloat16, ("stream", "stream_dot"), budget_s)


def measure_attention_kernels(shapes: AttentionShapes, budget_s: float = BUDGET_S) -> tuple[float, float]:
    """Seconds of the native attention's forward and backward over a GRPO micro-batch of
    ``shapes``' heads (two prompts of 64 tokens, each continued by four answers of 128), bf16, its
    products by float32 multiply-adds and by the dot product, alternating."""
    import torch

    from grpo.models import native_kernels

    ops = native_kernels.kernels()
    # the plan PackedPass.native_plan makes for these sequences (built here: models/ sits below the
    # backends in the package's layers, tests/test_layout.py)
    seqs, key_rows, rows = [], [], 0
    for _ in range(2):
        prompt = list(range(rows, rows + 64))
        seqs.append((rows, 64, 0, len(key_rows)))
        key_rows += prompt
        rows += 64
        for _ in range(4):
            seqs.append((rows, 128, 64, len(key_rows)))
            key_rows += prompt + list(range(rows, rows + 128))
            rows += 128
    plan = torch.tensor(seqs, dtype=torch.long), torch.tensor(key_rows, dtype=torch.long)
    heads, kv_heads, dim = shapes.heads, shapes.kv_heads, shapes.head_dim
    with _seeded_rng():
        q, grad = (torch.randn(rows, heads * dim).to(torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(rows, kv_heads * dim).to(torch.bfloat16) for _ in range(2))

    def attention(dot: bool):
        def step():
            out, lse = ops.packed_attention(q, k, v, *plan, heads, kv_heads, dim ** -0.5, dot)
            ops.packed_attention_backward(grad, q, k, v, out, lse, *plan, heads, kv_heads, dim ** -0.5, dot)
        return [step]

    return tuple(dtype_probe._fastest_of([attention(False), attention(True)], [1.0], budget_s))


def _time_layouts(shapes: Shapes, dtype, layouts: tuple[str, ...], budget_s: float) -> tuple[float, ...]:
    """Seconds of dtype_probe's decoding step packed in each of ``layouts``, alternating."""
    with _seeded_rng():
        ops = [dtype_probe._decode_ops(shapes, dtype, layout) for layout in layouts]
        return tuple(dtype_probe._fastest_of([step for step, _ in ops], ops[0][1], budget_s, warm_each=True))


@contextlib.contextmanager
def _seeded_rng():
    """Timed on weights drawn from seed 0, leaving the caller's random state as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


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
    print(Timing(TRAINING_KERNEL, *measure(shapes)).summary(shapes))
    for precision, question in DECODING_LAYOUT.items():
        if cpu_linear.stream_available():
            print(Timing(question, *globals()[question.measure](shapes)).summary(shapes))
            if precision == "bf16" and cpu_linear.stream_dot_available():
                print(Timing(BF16_STREAM_KERNEL, *measure_bf16_stream_kernels(shapes)).summary(shapes))
        else:
            print(f"{precision} decoding layout: oneDNN's (grpo's native kernels are not built here: nothing to weigh "
                  f"it against)")
    attention = AttentionShapes.from_config(models.load_config(name))
    if attention is not None and attention.head_dim % 32 == 0 and cpu_linear.stream_dot_available():
        print(Timing(TRAINING_ATTENTION, *measure_attention_kernels(attention)).summary(attention))
    else:
        print("bf16 training attention: float32 multiply-adds (no avx512_bf16 build of grpo's kernels, or a head "
              "dimension not a multiple of 32: nothing to weigh them against)")


if __name__ == "__main__":
    main()
