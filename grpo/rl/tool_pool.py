"""A bounded pool of threads for environment calls (tools, ``observe``), with a time limit per call.

Python cannot stop a thread, so a tool that never returns keeps its thread until it does. Giving
each call its own thread (as episodes once did) leaks one thread per call of a hanging tool; this
pool bounds them instead: at most ``workers`` threads ever run environment calls, whatever the
tools do. A call waits for a free worker, then has ``timeout_s`` from when it starts; past that the
episode gets a "timed out" observation and the worker stays busy until the call returns (counted
by ``stuck()``: the leak, bounded by ``workers``). When every worker is stuck, a waiting call is
answered "tool unavailable" at once: never a hang, never a crash, and the pool recovers as soon as
a stuck call returns.

Chosen over a subprocess per blocking call because tools are plain Python functions that may
close over the adapter (a sandbox, a database handle, the sample) and return any value: a process
would need all of that picklable and would cost a fork per call. A tool that must be killable
(untrusted code) runs its work in a process itself, as the python tool does in adapters/sandbox.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo.rl.agent import ToolError

POLL_S = 0.05  # how often a waiting caller re-checks whether every worker is stuck


@dataclass(eq=False)
class ToolCall:
    """One environment call: queued, then running on a worker, then done."""

    fn: Callable[[], Any]
    value: Any = None
    error: str | None = None
    started: float | None = None  # when a worker picked it up
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            self.value = self.fn()
        except ToolError as err:
            self.error = str(err) or "tool error"
        except BaseException as err:  # noqa: BLE001 - anything a tool does becomes an observation
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self.seconds = time.perf_counter() - (self.started or time.perf_counter())
            self.done.set()


class ToolPool:
    """At most ``workers`` daemon threads run the calls; each call may run ``timeout_s``."""

    def __init__(self, workers: int, timeout_s: float):
        self.workers, self.timeout_s = workers, timeout_s
        self._cond = threading.Condition()
        self._queue: deque[ToolCall] = deque()
        self._running: set[ToolCall] = set()
        self._threads = 0  # alive worker threads (running a call, or about to take one or exit)

    def submit(self, fn: Callable[[], Any]) -> ToolCall:
        call = ToolCall(fn)
        with self._cond:
            self._queue.append(call)
            idle = self._threads - len(self._running)
            if self._threads < self.workers and idle < len(self._queue):
                self._threads += 1
                threading.Thread(target=self._work, name="grpo-tool", daemon=True).start()
        return call

    def wait(self, call: ToolCall) -> str | None:
        """Block until ``call`` finished (None), ran past ``timeout_s`` ("timeout"), or cannot start
        because every worker is stuck on a call past its time limit ("unavailable")."""
        with self._cond:
            while not call.done.is_set():
                now = time.perf_counter()
                if call.started is not None:
                    left = call.started + self.timeout_s - now
                    if left <= 0:
                        return "timeout"
                elif self._stuck(now) >= self.workers:
                    self._queue.remove(call)
                    return "unavailable"
                else:
                    left = POLL_S
                self._cond.wait(min(left, POLL_S))
        return None

    def stuck(self) -> int:
        """Calls still running past their time limit: threads held by tools that did not return."""
        with self._cond:
            return self._stuck(time.perf_counter())

    def threads(self) -> int:
        with self._cond:
            return self._threads

    def _stuck(self, now: float) -> int:
        return sum(c.started is not None and now - c.started >= self.timeout_s for c in self._running)

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue:  # no idle threads linger: the next submit starts one again
                    self._threads -= 1
                    return
                call = self._queue.popleft()
                call.started = time.perf_counter()
                self._running.add(call)
            call.run()
            with self._cond:
                self._running.discard(call)
                self._cond.notify_all()


def pool_for(adapter: Any) -> ToolPool:
    """The adapter's pool (one per adapter, kept across steps and evaluation, so a tool stuck in
    one step still holds its worker in the next); a new one if its limits changed."""
    pool = getattr(adapter, "_grpo_tool_pool", None)
    if pool is None or (pool.workers, pool.timeout_s) != (adapter.tool_workers, adapter.tool_timeout_s):
        pool = ToolPool(adapter.tool_workers, adapter.tool_timeout_s)
        adapter._grpo_tool_pool = pool
    return pool
