"""The precision the sampler and the trainer run the base weights in: ``fp32``, ``bf16`` or ``auto``.

``auto`` is decided by measurement, separately for sampling (``sample_dtype``) and training
(``train_dtype``):

- on a CUDA GPU, bf16 (tensor cores; no probe);
- on a CPU, whichever of fp32 and bf16 ran the model's own shapes faster on this machine, bf16 only
  when at least 25% faster (dtype_probe.py: timed once per CPU model, torch version and model shape,
  cached under ``$GRPO_CACHE``, printed once when measured; bf16 training only beside bf16 sampling,
  since an fp32 sampler beside a bf16 trainer cannot fold LoRA). CPU flags decide nothing: on an Intel
  Xeon with AMX bf16 sampling ran 1.3-1.7x slower than fp32, and on an AMD EPYC with avx512_bf16
  the bf16 sampler ran 1.8x slower (its LoRA unmerged) while a bf16 forward pass ran 2.5x faster
  (docs/benchmark.md). ``GRPO_PRECISION_PROBE=off`` skips
  the probe, and ``auto`` is then fp32 on a CPU, as it is for a model whose config names no shapes.

Sampling in bf16 beside an fp32 trainer moves the sampler's logprobs off the trainer's by bf16
rounding (sampler_precision.py; the loop logs ``kl/sample_train`` and ``loss_fn_config.tis_cap``
corrects it). Whatever the precision of the base weights, LoRA weights and the optimizer state stay
fp32 (peft keeps adapters in fp32, engine.py checks it).

Asking for bf16 on a CPU where it measured slower runs, after one line saying how much slower; an
unknown name fails in one line naming the key and the valid values. The server (``python -m
grpo.serve --train-dtype/--sample-dtype``) and the backend config go through the same functions.

Torch is imported only where a dtype is made, so checking a name costs nothing.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from grpo.models import dtype_probe

if TYPE_CHECKING:
    import torch

# name -> short name; "auto" is resolved per device and role by resolve()
NAMES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
VALID = ("auto", "fp32", "bf16", "float32", "bfloat16")
KEYS = {"train_dtype": "train", "sample_dtype": "sample"}  # config key -> dtype_probe role


def check(key: str, value: Any) -> None:
    """Fail fast on a bad name, before any model loads."""
    if not (value is None or _is_dtype(value) or value == "auto"
            or (isinstance(value, str) and value.lower() in NAMES)):
        raise ValueError(f"{key}={value!r} is invalid; valid: {', '.join(VALID)}")


def auto_dtype(device: torch.device, key: str, shapes: dtype_probe.Shapes | None) -> torch.dtype:
    """What ``auto`` means for ``key`` (train_dtype or sample_dtype) on ``device`` for a model of
    ``shapes`` (see the module docstring)."""
    import torch

    if device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu" or shapes is None or not dtype_probe.enabled():
        return torch.float32
    measured = dtype_probe.timings(shapes)
    return torch.bfloat16 if measured is not None and dtype_probe.choose(measured)[KEYS[key]] == "bf16" else torch.float32


def resolve(key: str, value: Any, device: torch.device, shapes: dtype_probe.Shapes | None = None) -> torch.dtype:
    """The dtype config ``key`` asks for on ``device`` (None and "auto": ``auto_dtype``); ``shapes``:
    the model's, for measuring (None: auto is fp32 on a CPU, and a forced bf16 is not timed)."""
    import torch

    check(key, value)
    if value is None or value == "auto":
        return auto_dtype(device, key, shapes)
    dtype = value if _is_dtype(value) else {"fp32": torch.float32, "bf16": torch.bfloat16}[NAMES[value.lower()]]
    if dtype == torch.bfloat16 and device.type == "cpu" and shapes is not None and dtype_probe.enabled():
        measured = dtype_probe.timings(shapes)
        timing = measured[KEYS[key]] if measured is not None else None
        if timing is not None and timing.bf16_slowdown > 1:
            what = "a decoding step" if KEYS[key] == "sample" else "a training pass"
            warnings.warn(f"{key}=bf16 measured {timing.bf16_slowdown:.2f}x slower than fp32 on this CPU "
                          f"({dtype_probe.cpu_name()}) for {what} of this model ({timing.bf16_s * 1e3:.1f} ms "
                          f"vs {timing.fp32_s * 1e3:.1f} ms); {key}=auto would run fp32 here", stacklevel=2)
    return dtype


def _is_dtype(value: Any) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"
