"""What the process imported before its first engine, set aside from Python's garbage collector.

A full collection (generation 2) walks every object the collector tracks. After the imports of a
training process (torch, transformers, peft, datasets: their functions, tuples, dicts) and the bench's
model there are ~461,000 of them, and a full collection took 196-222 ms, one every 3-6 steps of the
bench's shape: a stall inside whichever sampling or training call it fell in (Intel Xeon avx512, 2
cores, docs/benchmark.md). ``gc.freeze`` moves every object alive at that moment to a permanent
generation that collections skip; done before the first engine loads its model, that is the imports
(~373,000 objects there), and six steps' full collections took 24 ms instead of 205.

Frozen objects are still freed when their last reference goes, but a cycle among them is never
collected; so the freeze comes after a collection (nothing already garbage is kept), once per process,
before any model is loaded: what is alive then lives for the process anyway.
``GRPO_GC_FREEZE=off`` leaves the collector as the program set it; a program that switched the
collector off is left alone too.
"""

from __future__ import annotations

import gc
import threading

from grpo.checks import env_switch

ENV_SWITCH = "GRPO_GC_FREEZE"

_lock = threading.Lock()
_frozen = False


def enabled() -> bool:
    """Whether grpo may freeze what is alive at its first engine (``GRPO_GC_FREEZE``: on, the default, or off)."""
    return env_switch(ENV_SWITCH)


def freeze_once() -> bool:
    """Collect, then freeze every object alive now, the first time it is called in the process
    (and the collector is on and the switch allows); True where it froze."""
    global _frozen
    if not enabled():
        return False
    with _lock:
        if _frozen or not gc.isenabled():
            return False
        gc.collect()
        gc.freeze()
        _frozen = True
        return True
