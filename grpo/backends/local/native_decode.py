"""The CPU decoding step with its non-matmul work in native kernels (decode_kernels.cpp).

A bf16 decoding step of SmolLM2-135M at ~24 rows took ~54 ms on a 2-core Xeon where its Linears
alone take ~21 ms: the rest was ~60 small PyTorch operators per layer (RMSNorms, the rotary
embedding, KV-cache writes, grouped-query attention, SiLU), each costing more in dispatch and
passes over memory than in arithmetic (docs/benchmark.md). ``NativeDecoder`` runs a Llama layer
as its Linears (the modules themselves, LoRA side paths included) plus four native calls: the
residual add with the next RMSNorm, rotary + cache write + attention, SiLU * up, and the next
add + RMSNorm. They round to the model's dtype wherever the eager operators do, so they compute
what the model's own forward computes up to the order of float sums (tests/test_native_decode.py).

The kernels are C++ built on first use by ``torch.utils.cpp_extension`` into grpo's cache, once
per machine (source, torch version and instruction sets in the folder's name), ~10-15 s on two
cores. Where they cannot be built -- no C++ compiler, another platform -- the sampler says so once
and decodes with PyTorch's operators (``LeanDecoder``), as before. ``GRPO_NATIVE_KERNELS=off``
skips them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from grpo.backends.local.kv_cache import SlotCache
from grpo.backends.local.lean_decode import LeanDecoder

ENV_SWITCH = "GRPO_NATIVE_KERNELS"
SOURCE = Path(__file__).with_name("decode_kernels.cpp")
DTYPES = (torch.float32, torch.bfloat16)

_LOCK = "grpo.lock"  # the build folder's flock (_build_lock)
_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "ops" -> torch.ops.grpo_decode, or "error" -> why not


def enabled() -> bool:
    """Whether the sampler may use the native kernels (``GRPO_NATIVE_KERNELS``: on, the default, or off)."""
    value = os.environ.get(ENV_SWITCH, "on").strip().lower() or "on"
    if value not in ("on", "off"):
        raise ValueError(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r} is invalid; valid: on, off")
    return value == "on"


def _arch_flags() -> list[str]:
    """Code for this CPU's vector width, within any cap set on ATen's (ATEN_CPU_CAPABILITY): a run
    emulating an avx2-only CPU gets avx2 code."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return ["-march=native"]
    if capability == "AVX2":
        return ["-march=haswell", "-mtune=native"]
    return []


def build_directory() -> Path:
    """Where this machine's build lives: named by what the binary depends on, so that a cache
    shared across machines (a home directory on a cluster) never loads another CPU's code."""
    from grpo import models
    from grpo.models import dtype_probe

    # torch's own path too: two environments' builds differ in their include paths, and sharing a
    # folder, each would rebuild over the other's
    identity = "\n".join([SOURCE.read_text(), torch.__version__, str(Path(torch.__file__).parent),
                          dtype_probe.cpu_name(), dtype_probe.instruction_sets(), " ".join(_arch_flags()), sys.version])
    return models.cache_dir() / "kernels" / f"grpo_decode_{hashlib.sha1(identity.encode()).hexdigest()[:16]}"


def kernels():
    """``torch.ops.grpo_decode``, built or loaded once per process; None where that failed or is
    switched off (said once, on stderr)."""
    if not enabled():
        return None
    with _lock:
        if "ops" not in _loaded and "error" not in _loaded:
            try:
                _loaded["ops"] = _load()
            except Exception as exc:  # a compiler missing or failing: decode with PyTorch's operators
                lines = str(exc).strip().splitlines() or [type(exc).__name__]
                reason = next((line for line in lines if "error" in line.lower() and "Error building" not in line),
                              lines[-1])[:300]
                _loaded["error"] = reason
                print(f"grpo: native decoding kernels unavailable ({type(exc).__name__}: {reason}); decoding with "
                      f"PyTorch's operators ({ENV_SWITCH}=off skips them; the build: {build_directory()})",
                      file=sys.stderr)
        return _loaded.get("ops")


def _load():
    """Load this machine's build, or build it (and load it). The folder's name is a digest of
    everything the library depends on, so a library found there is the right one; one that does
    not load (a build killed while linking, a truncated copy) is built again from scratch."""
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    name = directory.name
    library = directory / f"{name}.so"
    with _build_lock(directory):
        if library.exists():
            try:
                torch.ops.load_library(str(library))
                return torch.ops.grpo_decode
            except OSError as exc:
                print(f"grpo: the native decoding kernels in {directory} did not load ({exc}); building them again",
                      file=sys.stderr)
        for path in directory.iterdir():  # a clean build: no object file half-written by a killed one
            if path.name != _LOCK:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        print(f"grpo: building the native decoding kernels (once per machine and torch version) in {directory}",
              file=sys.stderr)
        started = time.perf_counter()
        with _ninja_on_path():
            cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(directory),
                               is_python_module=False, verbose=False,
                               extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", *_arch_flags()])
        print(f"grpo: built the native decoding kernels in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return torch.ops.grpo_decode


@contextlib.contextmanager
def _ninja_on_path():
    """cpp_extension runs ``ninja`` from PATH; the ninja package (a dependency) has it in the
    environment's bin folder, which is not on PATH where the environment is not activated
    (``.venv/bin/python -m grpo``)."""
    if shutil.which("ninja") is not None:
        yield
        return
    import ninja

    before = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One process builds at a time (xdist workers, several runs starting together). An flock is
    let go when its process dies, whereas cpp_extension's own lock file outlives a build that was
    killed and makes every later one wait for ever: under ours, such a file is stale and removed."""
    with open(directory / _LOCK, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class NativeDecoder(LeanDecoder):
    """``LeanDecoder``'s step with each layer's non-matmul work in four native calls."""

    def __init__(self, causal_lm, ops):
        super().__init__(causal_lm)
        self.ops = ops
        self.heads = int(causal_lm.config.num_attention_heads)

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: SlotCache) -> torch.Tensor:
        ops, decoder, layers = self.ops, self.decoder, self.decoder.layers
        hidden = decoder.embed_tokens.forward(input_ids)  # [rows, 1, hidden]
        cos, sin = decoder.rotary_emb(hidden, positions)
        cos, sin = cos[:, 0], sin[:, 0]
        lengths = cache.step.lengths_tensor  # each row's new column: its position
        norm = layers[0].input_layernorm
        hidden, x = ops.add_rms_norm(hidden[:, 0], None, norm.weight, norm.variance_epsilon)
        for index, (layer, (qkv, gate_up)) in enumerate(zip(layers, self.groups, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = qkv.full(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            slot = cache.layers[index]
            out = ops.rope_attend(q, k, v, cos, sin, slot._keys, slot._values, lengths, self.heads, attn.scaling)
            norm = layer.post_attention_layernorm
            hidden, x = ops.add_rms_norm(hidden, attn.o_proj(out), norm.weight, norm.variance_epsilon)
            gate, up = gate_up.full(x) if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
            norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else decoder.norm
            hidden, x = ops.add_rms_norm(hidden, mlp.down_proj(ops.silu_mul(gate, up)), norm.weight,
                                         norm.variance_epsilon)
        return self.causal_lm.lm_head(x).float()


def native_decoder(lean: LeanDecoder | None, device: torch.device) -> LeanDecoder | None:
    """``lean``'s step through the native kernels where they apply (a CPU, float32 or bf16 weights,
    kernels built), else ``lean`` itself."""
    if lean is None or device.type != "cpu" or type(lean) is not LeanDecoder:
        return lean
    dtype = lean.decoder.embed_tokens.weight.dtype
    norms = [lean.decoder.norm] + [n for layer in lean.decoder.layers
                                   for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if dtype not in DTYPES or any(n.weight.dtype != dtype for n in norms):
        return lean  # (a model keeping its norms in float32 beside bf16 weights: the eager step)
    ops = kernels()  # None where switched off or not built
    return lean if ops is None else NativeDecoder(lean.causal_lm, ops)
