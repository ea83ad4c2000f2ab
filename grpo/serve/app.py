"""The Tinker HTTP API over grpo's in-process local backend: create_app assembles it.

Every handler validates its request, hands the work to the local ServiceClient / TrainingClient
/ SamplingClient (which queue training per base model and batch sampling), and answers with a
future id; results are fetched through ``/retrieve_future`` (see futures.py). Nothing here
trains: it translates. The routes live in grpo/serve/routes/, one module per section, each
handed the server's state (grpo/serve/state.py) and what else it needs by create_app, the one
place the middleware, the error handler and the routers are put together.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from grpo.backends.local.clients import ServiceClient
from grpo.serve import file_urls
from grpo.serve.guard import Guard
from grpo.serve.limits import Limits
from grpo.serve.routes import checkpoints, futures, rest, sampling, sessions, training
from grpo.serve.state import API_PREFIX, ServerState

TESTED_SDKS = ("0.22.0", "0.38.0")  # tinker SDK versions tests/test_serve*.py run against this server


def _grpo_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("grpo")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def create_app(api_key: str, service: ServiceClient | None = None, long_poll_s: float = 30.0,
               fwdbwd_chunk_len: int | None = None, limits: Limits | None = None) -> FastAPI:
    """The app; ``service`` (default: a ServiceClient on $GRPO_CACHE/checkpoints) holds the
    base models and the checkpoint store. ``fwdbwd_chunk_len``: datums per forward_backward
    request the SDK may send (its default 1024); smaller batches arrive as parallel chunks."""
    if not api_key.startswith("tml-"):
        raise ValueError("the API key must start with 'tml-' (the Tinker SDK refuses any other)")
    state = ServerState(service or ServiceClient(), long_poll_s)
    state.service.directory_saves = False  # a client names checkpoints of the store, never a directory here
    limits = limits or Limits()

    # No /docs or /openapi.json: nothing is served without the key but liveness. The key and the
    # body size are checked by Guard from the headers, before any body is read or parsed.
    app = FastAPI(title="grpo Tinker-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    data_paths = frozenset({API_PREFIX + "/forward", API_PREFIX + "/forward_backward"})
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes,
                       open_paths=frozenset({API_PREFIX + "/healthz"}),
                       open_prefixes=(API_PREFIX + file_urls.FILES_ROUTE + "/",),  # signed URLs, see file_urls
                       max_json_depth=limits.max_json_depth,
                       json_items=lambda path: limits.json_items(path in data_paths))
    app.state.grpo = state
    app.state.limits = limits

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 without echoing the input back: a NaN there cannot be encoded (a 500),
        and a refused 20 MB list need not travel back."""
        return JSONResponse({"detail": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
                                        for e in exc.errors()]}, status_code=422)

    @app.get(API_PREFIX + "/healthz")
    async def healthz() -> dict[str, Any]:
        """Open without the key: liveness, and which server this is, for clients' start-up check."""
        return {"status": "ok", "server": "grpo serve", "version": _grpo_version(), "tested_sdks": list(TESTED_SDKS)}

    # The sections in the order they were declared in: a route's {checkpoint_id:path} must come
    # after the more specific routes it would swallow (rest.py keeps its own in that order).
    api = APIRouter(prefix=API_PREFIX)
    api.include_router(sessions.build(state, fwdbwd_chunk_len, limits))
    api.include_router(training.build(state, limits))
    api.include_router(checkpoints.build(state))
    api.include_router(rest.build(state, file_urls.FileSigner()))
    api.include_router(sampling.build(state, limits))
    api.include_router(futures.build(state, limits))
    app.include_router(api)
    return app
