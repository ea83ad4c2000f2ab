"""The precision the sampler and the trainer run the base weights in: ``fp32``, ``bf16`` or ``auto``.

``auto`` is bf16 on a CUDA GPU and fp32 on a CPU. It used to be bf16 on CPUs reporting
``avx512_bf16`` or AMX, chosen from the flags alone, and measurement said otherwise: on an Intel
Xeon with AMX, bf16 sampling ran 1.3-1.7x slower than fp32 and ``make demo`` 30% slower, and on
SmolLM2 the MinT quick-start's sampler/trainer ratios strayed 0.33 from 1 (AMD EPYC Zen 4,
avx512_bf16), where fp32 keeps them within 1e-3. A default that is never slower than fp32 and
on-policy to fp32 rounding is fp32 until ``auto`` is decided by timing the model on the machine
(issue #41). bf16 on a CPU stays one key away (``train_dtype``/``sample_dtype=bf16``). Whatever
the precision of the base weights, LoRA weights and the optimizer state stay fp32 (peft keeps
adapters in fp32, engine.py checks it).

Asking for bf16 on a CPU without bf16 instructions runs (slowly) after a one-line warning naming
the key; an unknown name fails in one line naming the key and the valid values.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

# name -> dtype; "auto" is resolved per device by resolve()
NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
VALID = ("auto", "fp32", "bf16", "float32", "bfloat16")
# /proc/cpuinfo flags of native bf16 arithmetic: AVX512-BF16 (Zen 4, Cooper Lake) and AMX (Sapphire Rapids)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (from ``/proc/cpuinfo``, or the text given); empty where unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: no flags known, so "auto" stays fp32
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@functools.cache
def cpu_has_bf16() -> bool:
    return cpu_supports_bf16(cpu_flags())


def cpu_supports_bf16(flags: set[str]) -> bool:
    return any(f in flags for f in BF16_CPU_FLAGS)


def auto_dtype(device: torch.device) -> torch.dtype:
    """What ``auto`` means on ``device``: bf16 on CUDA, fp32 elsewhere (see the module docstring)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve(key: str, value: str | torch.dtype | None, device: torch.device, cpu_bf16: bool | None = None
            ) -> torch.dtype:
    """The dtype config ``key`` asks for on ``device`` (None and "auto": ``auto_dtype``).

    ``cpu_bf16`` overrides what this CPU reports (for tests)."""
    check(key, value)
    if value is None or value == "auto":
        return auto_dtype(device)
    dtype = value if isinstance(value, torch.dtype) else NAMES[value.lower()]
    native = cpu_has_bf16() if cpu_bf16 is None else cpu_bf16
    if dtype == torch.bfloat16 and device.type == "cpu" and not native:
        warnings.warn(f"{key}=bf16 on a CPU without avx512_bf16/AMX: bf16 matmuls are emulated and run slower "
                      f"than fp32; {key}=auto (fp32 on a CPU) is faster here", stacklevel=2)
    return dtype


def check(key: str, value: str | torch.dtype | None) -> None:
    """Fail fast on a bad name, before any model loads."""
    if not (value is None or isinstance(value, torch.dtype) or value == "auto"
            or (isinstance(value, str) and value.lower() in NAMES)):
        raise ValueError(f"{key}={value!r} is invalid; valid: {', '.join(VALID)}")


def short_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
