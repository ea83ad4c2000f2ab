"""The one thread of this process that computes with PyTorch on a CPU.

PyTorch's CPU kernels run on an OpenMP team per thread that calls them. Once the teams' threads
outnumber the cores, GNU OpenMP (PyTorch's CPU wheels ship it) lets an idle team thread spin only
briefly (its "throttled" spin) before it sleeps, so each of the thousand parallel regions of a
decoding step waits for wake-ups. Measured on a 2-core Xeon (docs/benchmark.md): with the model
loaded on the caller's thread, training on one thread and sampling on another, the cores were
busy 55% of a bf16 sampling call (4.6-5.0 s); with every kernel on one thread, 2.7-3.0 s.

So on a CPU every engine of the process (every base model a ServiceClient loads) and the chat
adapter's judge compute here (the precision and kernel probes measure here too), one call after
another, which on a CPU costs nothing: they would share the same cores anyway. A program's own
PyTorch work on another thread (a reward model of its own) can go through ``run`` for the same
reason. What runs on it must not wait for a sampling result (a custom loss that samples, say):
generations run on this same thread.

The one team's idle threads spin about 3 ms after each parallel region before they sleep (GNU
OpenMP's default), which is what keeps a decoding step's cores busy; several grpo processes on the
same cores (parallel sweep jobs, the test suite) take CPU from each other that way, and should run
with ``OMP_WAIT_POLICY=PASSIVE`` (tests/conftest.py sets it; docs/sweeps.md).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_ident: int | None = None  # the computing thread's, once it runs


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's computing thread, started on first use and kept for the process's life."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="grpo-compute", initializer=_remember_thread)
        return _executor


def _remember_thread() -> None:
    global _ident
    _ident = threading.get_ident()


def on_computing_thread() -> bool:
    return threading.get_ident() == _ident


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the computing thread, waited for (called directly when already
    on it, so that computing code may call it without waiting on itself)."""
    if on_computing_thread():
        return fn(*args, **kwargs)
    return executor().submit(fn, *args, **kwargs).result()
