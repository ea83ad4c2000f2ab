"""The gate every API request passes before its body is read: the key, then the body's size.

FastAPI reads and parses a body before running a route's dependencies, so a key check there
would let anyone without the key make the server read and parse hundreds of MB. This ASGI
middleware answers 401 from the headers alone, 413 from a Content-Length over the limit, and
stops a body without one (chunked) as soon as it passes the limit.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

KEY_MESSAGE = ("missing or wrong X-API-Key (the key the server printed at start, or $GRPO_SERVE_API_KEY); "
               "set TINKER_API_KEY to it")


class _TooLarge(BaseException):
    """Raised from inside the body read; a BaseException so that no handler on the way (FastAPI
    turns a failed body read into a 400) swallows it before this middleware answers 413."""


class Guard:
    def __init__(self, app: Any, api_key: str, max_body_bytes: int, open_paths: frozenset[str]):
        self.app = app
        self.key = api_key.encode()
        self.max_body = max_body_bytes
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not hmac.compare_digest(headers.get(b"x-api-key", b""), self.key):
            return await _answer(send, 401, KEY_MESSAGE)
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _answer(send, 400, f"Content-Length {declared[:40].decode(errors='replace')!r} is not a number")
            if int(declared) > self.max_body:
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
                await _answer(send, 413, self._too_large(seen))

    def _too_large(self, size: int) -> str:
        return (f"body: {size} bytes is more than this server's limit of {self.max_body} bytes "
                "(set by --max-body-mb); send fewer datums per request")


async def _answer(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
