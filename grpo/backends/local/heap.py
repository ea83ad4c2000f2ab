"""Memory a training or sampling call freed: kept for the next call up to a cap, the rest given
back to the OS.

A call's working set (activations, KV cache slots, logits) is freed when it ends and built again,
at about the same size, by the next call. glibc's malloc returns large blocks to the OS as they
are freed (each tensor over its mmap threshold is an mmap of its own, and the top of a heap is
trimmed once it passes the trim threshold), and ``malloc_trim(0)`` gives back every free page of
every arena; memory given back is faulted in again, page by page, when the next call touches it.
Measured on the bench step (8 prompts x 4 samples x 32 tokens, SmolLM2-135M; Intel Xeon with AMX,
2 cores, docs/benchmark.md) with a trim after every call: 400-450 thousand page faults a step in
bf16, 550-650 thousand in fp32, about 0.7 and 1 s of kernel time. So on a CPU the engine tells
malloc (``keep_for_reuse``) to leave freed blocks in its heaps (blocks up to 32 MiB, the most glibc
lets it, come from the heap; no automatic trim below 2 GiB), and after each call ``release_free_memory``
trims only when the free memory malloc holds passes a cap: twice the engine's memory budget
(memory.py), a training call's working set and a sampling call's, which lie in different places
of the heap. The step took 0.93x the time in bf16 and in fp32. Without a cap a long run's held
memory crept up as tensors of one step's shapes left holes the next step's did not fill (peak RSS
4.5 -> 5.9 GB over ten steps of 8 x 16 x 256, same machine); past the cap it is trimmed as before.
The settings are the process's: a program's own allocations are kept for reuse the same way.

Only the CPU device needs it (a GPU's working set is in torch's own caching allocator), and only
glibc has ``malloc_trim``, ``mallopt`` and ``mallinfo2``; elsewhere (musl, macOS, an allocator such
as jemalloc preloaded in its place) this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

import torch

from grpo.models import native_kernels

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# the largest mmap threshold glibc accepts on 64-bit Linux (HEAP_MAX_SIZE / 2), the ceiling its own
# dynamic threshold rises to
_MMAP_THRESHOLD_MAX = 32 * 2**20
# mallopt takes an int: the top of a heap is trimmed as it is freed only past 2 GiB
_AUTOMATIC_TRIM_ABOVE = 2**31 - 1


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)  # the C library the process already runs on
    try:
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.mallinfo2.argtypes, libc.mallinfo2.restype = [], _MallInfo2
    except AttributeError:  # not glibc, or a glibc before 2.33 (no mallinfo2)
        return None
    return libc


_tuned = threading.Event()


def keep_for_reuse(device: torch.device) -> bool:
    """Have malloc keep freed blocks for the next call instead of returning them to the OS as
    they are freed (once per process, for a CPU engine); whether it was done. Trimming is then
    ``release_free_memory``'s, after each call."""
    libc = _libc() if device.type == "cpu" else None
    if libc is None:
        return False
    if not _tuned.is_set():
        if not (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
                and libc.mallopt(_M_TRIM_THRESHOLD, _AUTOMATIC_TRIM_ABOVE)):
            return False
        _tuned.set()
    return True


def free_bytes() -> int | None:
    """Bytes malloc holds free in its heaps (every arena), or None where that cannot be read."""
    libc = _libc()
    return None if libc is None else int(libc.mallinfo2().fordblks)


def release_free_memory(device: torch.device, keep: int = 0) -> bool:
    """Return the free pages of every malloc arena to the OS when ``device`` is the CPU and malloc
    holds more than ``keep`` bytes free; returns whether it did. The chunks the native kernels keep
    for packed weights (``stream_pack``, grpo/models/native/weight_pool.cpp) are given back whatever ``keep``: a
    sampler's repack frees and reuses them within one call, so those still kept after it are not
    about to be packed into."""
    if device.type == "cpu":
        native_kernels.release_kept_memory()
    free = free_bytes() if device.type == "cpu" else None
    if free is None or (keep and free <= keep):
        return False
    _libc().malloc_trim(0)
    return True
