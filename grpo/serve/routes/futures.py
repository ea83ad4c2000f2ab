"""The futures route: /retrieve_future long-polls a request's result (grpo/serve/futures.py
holds them), renders it as JSON or protobuf, and drops the sessions of clients that stopped polling.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from grpo.serve import bodies
from grpo.serve.futures import cancelled_result, error_result
from grpo.serve.limits import Limits
from grpo.serve.state import PROTOBUF, ServerState, fail


def build(state: ServerState, limits: Limits) -> APIRouter:
    """The route; ``limits.client_timeout_s``: how long a silent client's queued work is kept,
    ``limits.session_timeout_s`` how long its session."""
    router = APIRouter()

    def drop_silent_sessions() -> None:
        """A client that stopped polling is gone (killed, disconnected): its queued sampling would
        only keep the others waiting. Checked on every poll, so no timer thread is needed."""
        cutoff = time.time() - limits.client_timeout_s
        for session_id, info in list(state.sessions.items()):
            # once per silence: a later request of its own moves the heartbeat on
            if info["heartbeat"] < cutoff and info.get("dropped_at") != info["heartbeat"]:
                state.futures.drop_session(session_id)
                info["dropped_at"] = info["heartbeat"]
        state.finish_silent(limits.session_timeout_s)  # and silent for far longer: finished

    def public_error(err: BaseException) -> dict[str, Any]:
        result = error_result(err)
        return {**result, "error": state.public(result["error"])}

    @router.post("/retrieve_future")
    async def retrieve_future(body: bodies.RetrieveFuture, request: Request) -> Response:
        pending = state.futures.get(body.request_id)
        if pending is not None:
            state.seen(pending.session)
        drop_silent_sessions()
        if pending is None:
            raise fail(404, "request_id", f"unknown request_id {body.request_id!r} (results are kept "
                       "10 minutes, and not across a server restart)")
        if pending.future.cancelled():
            return JSONResponse(cancelled_result())
        if not await state.futures.wait(pending):
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        err = pending.future.exception()
        if err is not None:
            return JSONResponse(public_error(err))
        accept = request.headers.get("accept", "")
        want_proto = PROTOBUF in accept and "application/json" not in accept
        try:
            rendered = pending.render(pending.future.result(), want_proto)
            if isinstance(rendered, bytes):
                return Response(rendered, media_type=PROTOBUF)
            return JSONResponse(rendered)  # raises ValueError on a non-finite number
        except Exception as render_err:  # never a 5xx: the SDK would retry it forever
            return JSONResponse(public_error(render_err))

    return router
