"""The gate every API request passes before its body is read: the key, then the body's size.

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
from typing import Any

KEY_MESSAGE = ("missing or wrong X-API-Key (the key the server printed at start, or $GRPO_SERVE_API_KEY); "
               "set TINKER_API_KEY to it")


# How much of a refused body is discarded before answering: a keyed client that sent too much
# gets its 413 for anything it can send in the time; a caller without the key only when its
# declared body is small (a client with a stale key, not someone streaming at the server).
DISCARD_SECONDS = 30.0
DISCARD_BYTES_WITHOUT_KEY = 2**20


class _TooLarge(BaseException):
    """Raised from inside the body read; a BaseException so that no handler on the way (FastAPI
    turns a failed body read into a 400) swallows it before this middleware answers 413."""


class Guard:
    def __init__(self, app: Any, api_key: str, max_body_bytes: int, open_paths: frozenset[str],
                 open_prefixes: tuple[str, ...] = ()):
        self.app = app
        self.key = api_key.encode()
        self.max_body = max_body_bytes
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes  # routes that check a credential of their own (signed URLs)

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

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise _TooLarge
            return message

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await _discard_body(receive, seconds=DISCARD_SECONDS)
                await _answer(send, 413, self._too_large(seen))

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
