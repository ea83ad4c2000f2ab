"""What the hardware allows a GRPO step, to hold grpo's measured step against (scripts/bench.py).

Two numbers of the machine, measured in the same run as the step: the matmul peak (GFLOP/s of the
fastest dense kernel this torch has -- ``torch.mm`` or oneDNN's linear, cpu_linear.dense_products --
at the model's MLP shape over 1,024 rows, in the precision the step ran in) and the copy bandwidth
(GB/s of a 256 MiB ``copy_``, read plus write). The fastest, because one kernel's rate is not the
machine's: on an AMD EPYC Zen 5 a float32 ``torch.mm`` (MKL) ran 220 GFLOP/s and oneDNN's 490, and
a peak read from ``torch.mm`` alone had grpo's training at 113% of it. From them:

- a decoding step cannot take less than the larger of streaming every weight once
  (``weight bytes / bandwidth``) and its rows' matmuls (``2 x matmul parameters x rows / peak``);
- training cannot take less than its matmuls: forward and the backward through the inputs (LoRA
  has no base-weight gradient), ``4 x decoder matmul parameters x processed tokens``, plus the
  unembedding's ``4 x its parameters`` for every counted (sampled) token;
- prefill: ``2 x decoder matmul parameters x prompt tokens``.

Attention's own FLOPs are left out (at 32-token answers after ~45-token prompts they are <2% of
the matmuls on SmolLM2), so the floors are a little low, never high.

And what the kernels alone allow (``kernels_alone``): the step's own matmuls at its own shapes,
everything else free -- a decoding step's Linears at its mean rows through the sampler's kernel
(oneDNN's packed layout where it packs, grpo/models/cpu_linear.py), and a training pass's forward
and input-gradient products through each dense kernel (the faster pass counting, as for the
peak), every Linear's weight distinct as in the model. Where these alone miss a goal, the goal is out of reach
of the kernel library on this machine, whatever grpo does around them; the distance between them
and grpo's step is grpo's own.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

BYTES = {"fp32": 4, "bf16": 2}  # per weight, by precision


@dataclass(frozen=True)
class Machine:
    peak_gflops: float
    bandwidth_gbs: float
    dtype: str
    kernel: str = "torch"  # the dense kernel the peak was measured through (cpu_linear.KERNELS)


def measure(hidden: int, intermediate: int, dtype: str = "fp32", seconds: float = 1.0) -> Machine:
    """The peak through each dense kernel for ``seconds`` (the fastest counting) and the copy bandwidth."""
    import torch

    from grpo.models import cpu_linear

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    x = torch.randn(1024, hidden, dtype=torch_dtype)
    w = torch.randn(intermediate, hidden, dtype=torch_dtype)
    flops = 2 * 1024 * hidden * intermediate
    rates = {}
    for kernel, product in cpu_linear.dense_products(torch_dtype).items():
        rates[kernel] = 0.0
        for _ in range(3):  # the best of three windows: a floor is what the machine can do
            product(x, w)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 3:
                product(x, w)
                n += 1
            rates[kernel] = max(rates[kernel], flops * n / (time.perf_counter() - t0) / 1e9)
    kernel = max(rates, key=rates.get)
    src = torch.ones(64 * 2**20)  # 256 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return Machine(rates[kernel], 2 * src.numel() * 4 / copy_s / 1e9, dtype, kernel)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass(frozen=True)
class ModelSize:
    decoder_matmul_params: int  # every Linear of the decoder layers
    head_params: int  # the unembedding
    weight_bytes: int  # what a decoding step reads: the decoder's Linears and the unembedding
    # every decoder Linear's (out, in) in order, then the unembedding's: what kernels_alone multiplies
    linear_shapes: tuple[tuple[int, int], ...] = ()
    # the same as the sampler multiplies them: sibling projections stacked (q/k/v, gate/up), one
    # product each (fused_projections.py); empty: as linear_shapes
    sampler_shapes: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, model, sample_dtype: str | None = None) -> ModelSize:
        """``model``'s Linears; ``weight_bytes`` at ``sample_dtype`` ("fp32", "bf16": the sampler's
        precision, where it differs from the model's), else at the model's own."""
        from torch import nn

        from grpo.models.fused_projections import sibling_sets

        head = model.get_output_embeddings()
        decoder = model.get_decoder()
        # the model's own Linears: peft's LoRA A and B (Linears inside the adapted layers) are
        # overhead above the floors, not part of them
        # (paths without peft's ".base_layer": the module paths the sampler's siblings are found by)
        named = [(name.removesuffix(".base_layer"), m) for name, m in decoder.named_modules()
                 if isinstance(m, nn.Linear) and ".lora_" not in f".{name}"]
        linears = [m for _, m in named]
        decoder_params = sum(m.weight.numel() for m in linears)
        head_params = head.weight.numel()
        size = BYTES[sample_dtype] if sample_dtype else head.weight.element_size()
        shapes = tuple((m.out_features, m.in_features) for m in linears) + (tuple(head.weight.shape),)
        return cls(decoder_params, head_params, (decoder_params + head_params) * size, shapes,
                   _stacked(named, sibling_sets(decoder)) + (tuple(head.weight.shape),))

    @classmethod
    def from_dict(cls, data: dict) -> ModelSize:
        return cls(**{**data, **{key: tuple(tuple(s) for s in data.get(key, ()))
                                 for key in ("linear_shapes", "sampler_shapes")}})


def _stacked(named: list, sets: list[list[str]]) -> tuple[tuple[int, int], ...]:
    """The (out, in) of the decoder's Linears ``named`` (path, module) in order, each set of
    siblings in ``sets`` (fused_projections.sibling_sets) one product of their stacked outputs, at
    its last member, as the sampler packs them."""
    modules = dict(named)
    last = {paths[-1]: paths for paths in sets}
    members = {path for paths in sets for path in paths}
    shapes = []
    for path, m in named:
        if path in last:
            shapes.append((sum(modules[p].out_features for p in last[path]), m.in_features))
        elif path not in members:
            shapes.append((m.out_features, m.in_features))
    return tuple(shapes)


def decode_step_floor_s(size: ModelSize, machine: Machine, rows: float) -> dict[str, float]:
    stream = size.weight_bytes / (machine.bandwidth_gbs * 1e9)
    compute = 2 * (size.decoder_matmul_params + size.head_params) * rows / (machine.peak_gflops * 1e9)
    return {"stream_s": stream, "compute_s": compute, "floor_s": max(stream, compute)}


def train_flops(size: ModelSize, processed_tokens: int, counted_tokens: int) -> float:
    return 4 * size.decoder_matmul_params * processed_tokens + 4 * size.head_params * counted_tokens


def step_floor_s(size: ModelSize, machine: Machine, decode_steps: int, rows_decoded: int, prompt_tokens: int,
                 processed_tokens: int, counted_tokens: int) -> dict[str, float]:
    """The step's floor, sampling (prefill + decoding) and training apart."""
    rows = rows_decoded / max(decode_steps, 1)
    decode = decode_steps * decode_step_floor_s(size, machine, rows)["floor_s"]
    prefill = 2 * size.decoder_matmul_params * prompt_tokens / (machine.peak_gflops * 1e9)
    train = train_flops(size, processed_tokens, counted_tokens) / (machine.peak_gflops * 1e9)
    return {"sample_s": decode + prefill, "train_s": train, "step_s": decode + prefill + train}


def as_dict(machine: Machine, size: ModelSize) -> dict:
    return {"machine": asdict(machine), "model": asdict(size)}


def kernels_alone(size: ModelSize, dtype: str, rows: float, processed_tokens: int, counted_tokens: int,
                  reps: int = 5, sample_dtype: str | None = None, layout: str = "onednn") -> dict[str, float]:
    """Seconds of the step's matmuls alone, the fastest of ``reps`` (see the module docstring):
    ``decode_linears_s``, one decoding step's Linears and unembedding at ``rows`` rows, in
    ``sample_dtype`` (default ``dtype``), stacked (``sampler_shapes``: q/k/v and gate/up one product
    each: the separate Linears, each call with its own fixed costs, took 34.0 ms against the
    stacked products' 15.7 ms for a bf16 step on an AMD EPYC, docs/benchmark.md) and
    packed in ``layout`` as the sampler packs them (the engine's
    ``sample_layout``; cpu_linear.pack_weight); ``train_matmuls_s``, one training pass's forward and
    input-gradient products in ``dtype`` (the decoder's for ``processed_tokens``, the unembedding's
    for ``counted_tokens``). Weights are random: a kernel's rate does not depend on the values.
    Call it on the thread that runs grpo's kernels (grpo/models/computing.py): another thread's
    OpenMP team slows them."""
    import torch

    from grpo.models import cpu_linear

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    train_dtype, decode_dtype = dtypes[dtype], dtypes[sample_dtype or dtype]
    *decoder, _ = size.linear_shapes  # the unembedding last
    weights = [torch.empty(shape, dtype=train_dtype).uniform_(-0.05, 0.05) for shape in size.linear_shapes]
    decode_rows = max(1, round(rows))
    fans = {fan_in for _, fan_in in size.linear_shapes} | {fan_out for fan_out, _ in size.linear_shapes}
    inputs = {n: torch.randn(processed_tokens, n, dtype=train_dtype) for n in fans}
    decode_shapes = size.sampler_shapes or size.linear_shapes  # (stacking keeps the inputs' widths)
    decode_inputs = {n: torch.randn(decode_rows, n, dtype=decode_dtype) for n in fans}

    def sampler_linear(w: torch.Tensor):
        w = w.to(decode_dtype)
        return (cpu_linear.PackedLinear(w, None, layout) if cpu_linear.can_pack(w, layout)
                else (lambda x: torch.nn.functional.linear(x, w)))

    sampler = [sampler_linear(torch.empty(shape).uniform_(-0.05, 0.05)) for shape in decode_shapes]

    def decode_step() -> None:
        for linear, (_, fan_in) in zip(sampler, decode_shapes, strict=True):
            linear(decode_inputs[fan_in])

    def train_pass(product) -> None:
        for w, (fan_out, fan_in), tokens in zip(weights, size.linear_shapes, [processed_tokens] * len(decoder)
                                                 + [counted_tokens], strict=True):
            product(inputs[fan_in][:tokens], w)  # forward
            product(inputs[fan_out][:tokens], w.t())  # the input's gradient (the frozen base has none of its own)

    with torch.inference_mode():
        return {"decode_linears_s": min(_timed(decode_step) for _ in range(reps + 1)),
                "train_matmuls_s": min(_timed(lambda p=product: train_pass(p)) for product in
                                       cpu_linear.dense_products(train_dtype).values() for _ in range(reps + 1))}
