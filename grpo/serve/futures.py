"""The Tinker futures protocol: every slow call answers ``{request_id}`` at once, and the client
polls ``/retrieve_future`` until the work is done.

The SDK re-polls a ``try_again`` answer immediately, so a poll is held open (long-polled) for
up to ``long_poll_s`` before it is answered with one. A failed call's answer is an ``error``
result (the SDK raises it once), never a 5xx, which the SDK would retry without end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# How long a finished result stays retrievable: long enough for a client whose connection
# dropped to poll again, short enough that a long-running server does not hoard results.
KEEP_RESULTS_S = 600.0

# Exceptions that mean the request itself was wrong (category "user"); anything else is ours.
USER_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, LookupError)


@dataclass
class Pending:
    future: concurrent.futures.Future
    # (result, wants_protobuf) -> JSON-able dict, or bytes sent as application/x-protobuf
    render: Callable[[Any, bool], dict[str, Any] | bytes]
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None
    session: str | None = None  # whose work it is: dropped when that client is gone


class FutureStore:
    def __init__(self, long_poll_s: float = 30.0):
        self.long_poll_s = long_poll_s
        self._items: dict[str, Pending] = {}
        self._prefix = secrets.token_hex(3)  # ids from an earlier server process never match
        self._ids = itertools.count(1)

    def add(self, future: concurrent.futures.Future,
            render: Callable[[Any, bool], dict[str, Any] | bytes] | None = None, session: str | None = None) -> str:
        self._purge()
        request_id = f"req-{self._prefix}-{next(self._ids)}"
        pending = Pending(future, render or (lambda value, _proto: value), session=session)
        future.add_done_callback(lambda _f: setattr(pending, "finished", time.monotonic()))
        self._items[request_id] = pending
        return request_id

    def _purge(self) -> None:
        now = time.monotonic()
        stale = [k for k, p in self._items.items() if p.finished is not None and now - p.finished > KEEP_RESULTS_S]
        for key in stale:
            del self._items[key]

    def drop_session(self, session: str) -> int:
        """Cancel the session's work that has not started (a started batch runs to its end);
        returns how many were dropped. The sampler skips cancelled requests when it gathers."""
        return sum(p.future.cancel() for p in list(self._items.values()) if p.session == session and not p.future.done())

    def get(self, request_id: str) -> Pending | None:
        return self._items.get(request_id)

    async def wait(self, pending: Pending) -> bool:
        """Wait up to the long-poll time; True when the work is done.

        ``asyncio.wait`` rather than ``wait_for``: a timeout (or a client hanging up) must not
        cancel the underlying future, which would drop queued work.
        """
        if pending.future.done():
            return True
        waiter = asyncio.wrap_future(pending.future)
        done, _ = await asyncio.wait({waiter}, timeout=self.long_poll_s)
        return bool(done)


def cancelled_result() -> dict[str, Any]:
    return {"error": "CancelledError: this request was dropped before it ran: its client stopped polling "
                     "(or finished its session) for longer than the server's --client-timeout", "category": "user"}


def error_result(err: BaseException) -> dict[str, Any]:
    category = "user" if isinstance(err, USER_ERRORS) else "server"
    return {"error": f"{type(err).__name__}: {err}", "category": category}
