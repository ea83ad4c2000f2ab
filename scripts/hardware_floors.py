"""What the hardware allows a GRPO step, to hold grpo's measured step against (scripts/bench.py).

Two numbers of the machine, measured in the same run as the step: the matmul peak (GFLOP/s of a
plain ``torch.mm`` at the model's MLP shape over 1,024 rows, in the precision the step ran in) and
the copy bandwidth (GB/s of a 256 MiB ``copy_``, read plus write). From them:

- a decoding step cannot take less than the larger of streaming every weight once
  (``weight bytes / bandwidth``) and its rows' matmuls (``2 x matmul parameters x rows / peak``);
- training cannot take less than its matmuls: forward and the backward through the inputs (LoRA
  has no base-weight gradient), ``4 x decoder matmul parameters x processed tokens``, plus the
  unembedding's ``4 x its parameters`` for every counted (sampled) token;
- prefill: ``2 x decoder matmul parameters x prompt tokens``.

Attention's own FLOPs are left out (at 32-token answers after ~45-token prompts they are <2% of
the matmuls on SmolLM2), so the floors are a little low, never high.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Machine:
    peak_gflops: float
    bandwidth_gbs: float
    dtype: str


def measure(hidden: int, intermediate: int, dtype: str = "fp32", seconds: float = 1.0) -> Machine:
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    x = torch.randn(1024, hidden, dtype=torch_dtype)
    w = torch.randn(hidden, intermediate, dtype=torch_dtype)
    best = 0.0
    for _ in range(3):  # the best of three windows: a floor is what the machine can do
        torch.mm(x, w)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            torch.mm(x, w)
            n += 1
        best = max(best, 2 * 1024 * hidden * intermediate * n / (time.perf_counter() - t0) / 1e9)
    src = torch.ones(64 * 2**20)  # 256 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return Machine(best, 2 * src.numel() * 4 / copy_s / 1e9, dtype)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass(frozen=True)
class ModelSize:
    decoder_matmul_params: int  # every Linear of the decoder layers
    head_params: int  # the unembedding
    weight_bytes: int  # what a decoding step reads: the decoder's Linears and the unembedding

    @classmethod
    def of(cls, model) -> ModelSize:
        from torch import nn

        head = model.get_output_embeddings()
        decoder = model.get_decoder()
        linears = [m for m in decoder.modules() if isinstance(m, nn.Linear)]
        decoder_params = sum(m.weight.numel() for m in linears)
        head_params = head.weight.numel()
        size = head.weight.element_size()
        return cls(decoder_params, head_params, (decoder_params + head_params) * size)


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
