"""Named sections of the backend's work, timed when someone asks (scripts/profile_step.py).

The sampler and the trainer mark their phases (``grpo.sample.decode_forward``,
``grpo.train.optimizer``, ...) with ``section(name)``. Each is a ``torch.profiler`` range, so a
Chrome trace shows them, and while ``recording()`` is active its wall time is also summed per
name. The summing is what the step profile reads: torch.profiler records only the thread that
started it, and the backend's work runs on the engine's worker threads, never the caller's.
Wall time is what a section costs on a CPU; on a GPU it would need a synchronisation, which
nothing here does. Switched off -- no profiler on the calling thread, not recording -- a section
costs an attribute read and one call: a profiler range is two operator calls, and on a CPU a
decoding step's weight stream evicts the interpreter and the dispatcher from the caches, after
which each of the sampler's two ranges a step cost ~0.1 ms of a one-row bf16 step of ~12 ms (AMD EPYC).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

from torch.profiler import record_function

try:  # whether a profiler records on this thread (private: where it is gone, always a range)
    from torch._C._autograd import _profiler_enabled
except ImportError:  # pragma: no cover
    def _profiler_enabled() -> bool:
        return True


class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)


_RECORDER = _Recorder()


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """Mark the enclosed work as ``name`` (a profiler range; timed while recording)."""
    if not _RECORDER.active:
        if _profiler_enabled():
            with record_function(name):
                yield
        else:
            yield
        return
    start = time.perf_counter()
    try:
        with record_function(name):
            yield
    finally:
        elapsed = time.perf_counter() - start
        with _RECORDER.lock:
            _RECORDER.seconds[name] += elapsed
            _RECORDER.calls[name] += 1


@contextlib.contextmanager
def recording() -> Iterator[tuple[dict[str, float], dict[str, int]]]:
    """Sum every section's wall seconds and calls, from every thread, while the block runs."""
    with _RECORDER.lock:
        _RECORDER.seconds.clear()
        _RECORDER.calls.clear()
        _RECORDER.active = True
    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}
    try:
        yield seconds, calls
    finally:
        with _RECORDER.lock:
            _RECORDER.active = False
            seconds.update(_RECORDER.seconds)
            calls.update(_RECORDER.calls)
