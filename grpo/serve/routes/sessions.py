"""The client config and session routes: what the SDK asks before anything else, and the
sessions it opens, heartbeats and finishes.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import APIRouter

from grpo.serve import bodies
from grpo.serve.limits import Limits
from grpo.serve.state import ServerState


def build(state: ServerState, fwdbwd_chunk_len: int | None, limits: Limits) -> APIRouter:
    """The routes; ``fwdbwd_chunk_len``: datums per forward_backward request the SDK may send;
    ``limits.session_timeout_s``: how long a silent session lives."""
    router = APIRouter()

    @router.post("/client/config")
    async def client_config() -> dict[str, Any]:
        # use_pyqwest_transport: tinker >= 0.3x talks HTTP through pyqwest (a Rust/tokio client)
        # unless the server says otherwise. A response that lands while the client's interpreter
        # finalizes (a heartbeat, a futures long-poll) makes a tokio thread take the GIL, and
        # CPython < 3.14 ends such a thread with pthread_exit, which aborts a Rust thread: the
        # user's program dies with SIGABRT after its last line, roughly once in ten runs of the
        # docs' minimal loop here (core dump: pyqwest's ContentGenerator -> sock_send ->
        # take_gil -> PyThread_exit_thread -> abort). httpx's transport has no foreign threads,
        # and the flag exists so a server can choose it.
        config: dict[str, Any] = {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False,
                                  "use_pyqwest_transport": False}
        if fwdbwd_chunk_len:
            config["fwdbwd_max_chunk_len"] = fwdbwd_chunk_len
        return config

    @router.post("/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return {}

    @router.get("/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        names = ["tiny", "smollm2", *sorted({m.base_model for m in state.models.values()})]
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True}
                                     for n in dict.fromkeys(names)]}

    @router.post("/create_session")
    async def create_session(body: bodies.CreateSession) -> dict[str, Any]:
        state.finish_silent(limits.session_timeout_s)  # what clients long gone left loaded
        session_id = f"sess-{secrets.token_hex(4)}"
        state.sessions[session_id] = {"created": time.time(), "sdk_version": body.sdk_version,
                                      "user_metadata": body.user_metadata or {}, "heartbeat": time.time()}
        return {"type": "create_session", "session_id": session_id}

    @router.post("/session_heartbeat")
    async def session_heartbeat(body: bodies.SessionRef) -> dict[str, Any]:
        state.session(body.session_id)["heartbeat"] = time.time()
        return {"type": "session_heartbeat"}

    @router.post("/sessions/{session_id}/finish")
    async def finish_session(session_id: bodies.RefInPath) -> dict[str, Any]:
        # its queued work is dropped; its models and samplers leave memory (saved checkpoints stay)
        state.finish(session_id, "closed by its client")
        return {"type": "finish_session"}

    @router.post("/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}  # accepted and dropped: nothing leaves this machine

    return router
