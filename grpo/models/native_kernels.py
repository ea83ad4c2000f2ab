"""grpo's native CPU kernels (the C++ in native/): built once per machine, loaded once per process.

At the row counts of a decoding step, and at the widths of a small model's training pass, each of
PyTorch's small operators costs more in dispatch and passes over memory than in arithmetic: an
RMSNorm is eight of them forward and more backward, SiLU * up three, a decoding step's attention a
dozen. The kernels in native/ (one file a job; native/ops.h lists them) do each such piece in one
call, rounding to the tensor's dtype wherever the eager operators do. They serve the sampler's
decoding step (native_decode.py) and the trainer's norms, MLP activations (native_layers.py) and
attention over packed sequences (packed_attention.py), and multiply by weights packed in the
streaming layout (cpu_linear.py).

They are C++ built on first use by ``torch.utils.cpp_extension`` into grpo's cache, once per
machine (sources, torch version and instruction sets in the folder's name), ~30-45 s on two
cores (ninja compiles the files side by side). Where they cannot be built -- no C++ compiler,
another platform -- this says so once, and the callers run PyTorch's operators as before.
``GRPO_NATIVE_KERNELS=off`` skips them.
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

from grpo.checks import env_switch

ENV_SWITCH = "GRPO_NATIVE_KERNELS"
SOURCE_DIR = Path(__file__).with_name("native")

_LOCK = "grpo.lock"  # the build folder's flock (_build_lock)
_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "ops" -> torch.ops.grpo_native, or "error" -> why not


def enabled() -> bool:
    """Whether grpo may use its native kernels (``GRPO_NATIVE_KERNELS``: on, the default, or off)."""
    return env_switch(ENV_SWITCH)


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


def build_digest() -> str:
    """A digest of everything this machine's build depends on: the source, torch, the CPU and its
    instruction sets, the compiler's target, Python. A change to any is another build."""
    from grpo.models import dtype_probe

    # torch's own path too: two environments' builds differ in their include paths, and sharing a
    # folder, each would rebuild over the other's
    sources = [f"{path.name}\n{path.read_text()}" for path in _source_files()]
    identity = "\n".join([*sources, torch.__version__, str(Path(torch.__file__).parent), dtype_probe.cpu_name(),
                          dtype_probe.instruction_sets(), " ".join(_arch_flags()), sys.version])
    return hashlib.sha1(identity.encode()).hexdigest()[:16]


def _source_files() -> list[Path]:
    """The kernels' sources and headers, in a fixed order (the digest's)."""
    return sorted(path for path in SOURCE_DIR.iterdir() if path.suffix in (".cpp", ".h"))


def build_directory() -> Path:
    """Where this machine's build lives: named by its ``build_digest``, so that a cache shared
    across machines (a home directory on a cluster) never loads another CPU's code."""
    from grpo import models

    return models.cache_dir() / "kernels" / f"grpo_native_{build_digest()}"


def kernels():
    """``torch.ops.grpo_native``, built or loaded once per process; None where that failed or is
    switched off (said once, on stderr)."""
    if not enabled():
        return None
    with _lock:
        if "ops" not in _loaded and "error" not in _loaded:
            try:
                _loaded["ops"] = _load()
            except Exception as exc:  # a compiler missing or failing: PyTorch's operators, as before
                lines = str(exc).strip().splitlines() or [type(exc).__name__]
                reason = next((line for line in lines if "error" in line.lower() and "Error building" not in line),
                              lines[-1])[:300]
                _loaded["error"] = reason
                print(f"grpo: native kernels unavailable ({type(exc).__name__}: {reason}); sampling and training "
                      f"with PyTorch's operators ({ENV_SWITCH}=off skips them; the build: {build_directory()})",
                      file=sys.stderr)
        return _loaded.get("ops")


def release_kept_memory() -> int:
    """Give back the memory the kernels keep for the next packed weights (``stream_pack`` reuses a
    freed chunk rather than fault in a new one); the bytes returned, 0 where they were never loaded."""
    ops = _loaded.get("ops")
    return int(ops.release_kept_chunks()) if ops is not None else 0


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
                return torch.ops.grpo_native
            except OSError as exc:
                print(f"grpo: the native kernels in {directory} did not load ({exc}); building them again",
                      file=sys.stderr)
        for path in directory.iterdir():  # a clean build: no object file half-written by a killed one
            if path.name != _LOCK:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        print(f"grpo: building the native kernels (once per machine and torch version) in {directory}",
              file=sys.stderr)
        started = time.perf_counter()
        with _ninja_on_path():
            cpp_extension.load(name=name, sources=[str(path) for path in _source_files() if path.suffix == ".cpp"],
                               build_directory=str(directory),
                               is_python_module=False, verbose=False,
                               extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", *_arch_flags()])
        print(f"grpo: built the native kernels in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return torch.ops.grpo_native


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
