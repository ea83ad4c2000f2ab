"""The gate every API request passes before its body is read: the key, then the body's size and,
for a JSON body, its nesting depth and item count (JsonScan, while it arrives).

FastAPI reads and parses a body before running a route's dependencies, so a key check there
would let anyone without the key make the server read and parse hundreds of MB. This ASGI
middleware answers 401 from the headers alone, 413 from a Content-Length over the limit, and
stops a body without one (chunked) as soon as it passes the limit.

A refused body is still read off the socket, and thrown away, before the answer goes out (the
"lingering close" of nginx): the server closes a connection after an error answer (urllib and
others send Connection: close), and closing while the client is still writing resets the
connection, so the client sees a broken pipe instead of the 401/413 that says what to fix. The
discarding is bounded in bytes and seconds, and a caller without the key gets only a little of it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

KEY_MESSAGE = ("missing or wrong X-API-Key (the key the server printed at start, or $GRPO_SERVE_API_KEY); "
               "set TINKER_API_KEY to it")


# How much of a refused body is discarded before answering: a keyed client that sent too much
# gets its 413 for anything it can send in the time; a caller without the key only when its
# declared body is small (a client with a stale key, not someone streaming at the server).
DISCARD_SECONDS = 30.0
DISCARD_BYTES_WITHOUT_KEY = 2**20


class _Refused(BaseException):
    """Raised from inside the body read; a BaseException so that no handler on the way (FastAPI
    turns a failed body read into a 400) swallows it before this middleware answers."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


class JsonScan:
    """The nesting depth and the number of items (array elements, object members) of a JSON text
    fed in pieces as it arrives, strings skipped, vectorised over each piece: a body too deep or
    with too many numbers is refused before any parser builds a Python object of it."""

    def __init__(self) -> None:
        self.depth = 0
        self.max_depth = 0
        self.items = 0
        self._in_string = False
        self._backslashes = 0  # the run of backslashes the last piece ended with

    def feed(self, piece: bytes) -> None:
        if not piece:
            return
        b = np.frombuffer(piece, dtype=np.uint8)
        if self._backslashes or b"\\" in piece:
            self._scan(b, np.arange(b.size), escapes=True)
        else:  # the usual piece: no escapes, so only the quotes, brackets and commas matter
            where = np.flatnonzero(_STRUCTURE[b])
            self._scan(b[where], where, escapes=False)
        trailing = len(piece) - len(piece.rstrip(b"\\"))
        self._backslashes = trailing + (self._backslashes if trailing == len(piece) else 0)

    def _scan(self, b: np.ndarray, index: np.ndarray, escapes: bool) -> None:
        """``b``: the piece's bytes at positions ``index`` (all of them, or its structural ones)."""
        if not b.size:
            return
        quotes = np.flatnonzero(b == 34)
        if escapes:
            # The last position up to each byte that is not a backslash (before the piece: the
            # start of the run carried over): each quote knows the run of backslashes before it.
            last_other = np.maximum.accumulate(np.where(b == 92, -1 - self._backslashes, index))
            before = np.where(quotes > 0, last_other[np.maximum(quotes - 1, 0)], -1 - self._backslashes)
            quotes = quotes[(quotes - 1 - before) % 2 == 0]  # an odd run escapes the quote
        toggles = np.zeros(b.size, dtype=np.int32)
        toggles[quotes] = 1
        inside = (np.cumsum(toggles) % 2).astype(bool) ^ self._in_string  # a quote's own state is the one after it
        outside = ~inside
        opens = ((b == 91) | (b == 123)) & outside
        closes = ((b == 93) | (b == 125)) & outside
        depth = self.depth + np.cumsum(opens.astype(np.int32) - closes.astype(np.int32))
        self.max_depth = max(self.max_depth, int(depth.max()))
        self.depth = int(depth[-1])
        self.items += int(np.count_nonzero(opens)) + int(np.count_nonzero((b == 44) & outside))
        self._in_string = bool(inside[-1])


_STRUCTURE = np.zeros(256, dtype=bool)
_STRUCTURE[[34, 44, 91, 93, 123, 125]] = True  # " , [ ] { }


class Guard:
    def __init__(self, app: Any, api_key: str, max_body_bytes: int, open_paths: frozenset[str],
                 open_prefixes: tuple[str, ...] = (),
                 max_json_depth: int | None = None, json_items: Callable[[str], tuple[int, str]] | None = None):
        self.app = app
        self.key = api_key.encode()
        self.max_body = max_body_bytes
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes  # routes that check a credential of their own (signed URLs)
        self.max_json_depth = max_json_depth
        self.json_items = json_items  # path -> (most items a JSON body to it may hold, the flags that set it)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["path"].startswith(self.open_prefixes):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if not hmac.compare_digest(headers.get(b"x-api-key", b""), self.key):
            if (declared is not None and declared.isdigit() and int(declared) <= DISCARD_BYTES_WITHOUT_KEY
                    and not _expects_continue(headers)):
                await _discard_body(receive, seconds=5.0)
            return await _answer(send, 401, KEY_MESSAGE)
        if declared is not None:
            if not declared.isdigit():
                return await _answer(send, 400, f"Content-Length {declared[:40].decode(errors='replace')!r} is not a number")
            if int(declared) > self.max_body:
                if not _expects_continue(headers):
                    await _discard_body(receive, seconds=DISCARD_SECONDS)
                return await _answer(send, 413, self._too_large(int(declared)))
        seen = 0
        started = False
        scan = None if headers.get(b"content-type", b"").startswith(b"application/x-protobuf") else JsonScan()
        max_items, items_flags = self.json_items(scope["path"]) if self.json_items else (None, "")

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            piece = message.get("body", b"")
            seen += len(piece)
            if seen > self.max_body:
                raise _Refused(413, self._too_large(seen))
            if scan is not None and piece:
                scan.feed(piece)
                if self.max_json_depth is not None and scan.max_depth > self.max_json_depth:
                    raise _Refused(422, f"body: JSON nested {scan.max_depth} deep is more than this server's "
                                        f"limit of {self.max_json_depth} (set by --max-json-depth)")
                if max_items is not None and scan.items > max_items:
                    raise _Refused(422, f"body: more than {max_items} JSON items (array elements and object "
                                        f"members), the most a request to {scope['path']} may hold (set by "
                                        f"{items_flags})")
            return message

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _Refused as refusal:
            if not started:
                await _discard_body(receive, seconds=DISCARD_SECONDS)
                await _answer(send, refusal.status, refusal.detail)

    def _too_large(self, size: int) -> str:
        return (f"body: {size} bytes is more than this server's limit of {self.max_body} bytes "
                "(set by --max-body-mb); send fewer datums per request")


def _expects_continue(headers: dict) -> bool:
    """A client that sent Expect: 100-continue waits for the answer before sending its body."""
    return headers.get(b"expect", b"").lower() == b"100-continue"


async def _discard_body(receive: Any, seconds: float, idle_seconds: float = 2.0) -> None:
    """Read the rest of the request body and drop it, until it ends, ``seconds`` have passed, or
    nothing has come for ``idle_seconds``; nothing is kept, so memory stays flat."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = await asyncio.wait_for(receive(), timeout=min(left, idle_seconds))
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return  # the body ended, or the client went away (http.disconnect)


async def _answer(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
