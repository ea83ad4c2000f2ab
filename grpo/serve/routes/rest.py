"""The RestClient's routes: listing runs and checkpoints, TTL, publishing, deleting, all
answered by the checkpoint store; and a checkpoint's files by URLs this server signed.
"""

from __future__ import annotations

import datetime
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, Response

from grpo import types as g
from grpo.serve import bodies, file_urls
from grpo.serve.state import API_PREFIX, ServerState, record


def build(state: ServerState, signer: file_urls.FileSigner) -> APIRouter:
    """The routes; ``signer`` signs and checks the checkpoint file URLs (no API key: the URL is it)."""
    router = APIRouter()

    def store_call(fn, *args: Any) -> Any:
        try:
            return fn(*args)
        except FileNotFoundError as err:
            raise HTTPException(404, detail=state.public(err)) from err
        except ValueError as err:
            raise HTTPException(422, detail=state.public(err)) from err
        except OSError as err:  # the disk refused (read-only, immutable, full, something in the way):
            # a 4xx, as a 5xx (and 409) would have the SDK retry what will fail again
            raise HTTPException(403, detail="the checkpoint store's disk refused this: " + state.public(err)) from err

    def ckpt_path(run_id: str, checkpoint_id: str) -> str:
        return f"tinker://{run_id}/{checkpoint_id}"

    @router.get("/training_runs")
    async def list_training_runs(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return record(store_call(state.store.list_runs, limit, offset))

    @router.get("/training_runs/{run_id}")
    async def get_training_run(run_id: bodies.RunIdInPath) -> dict[str, Any]:
        return record(store_call(state.store.get_run, run_id))

    @router.get("/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: bodies.RunIdInPath) -> dict[str, Any]:
        return record(store_call(state.store.list_checkpoints, run_id))

    @router.get("/checkpoints")
    async def list_user_checkpoints(limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return record(store_call(state.store.list_user_checkpoints, limit, offset))

    @router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(run_id: bodies.RunIdInPath, checkpoint_id: bodies.CheckpointIdInPath,
                                    request: Request) -> dict[str, Any]:
        # Not the in-process file:// URLs, which would show where the store lies on this disk:
        # signed URLs of this server (file_urls), which urllib fetches as the SDK's storage URLs.
        path = ckpt_path(run_id, checkpoint_id)
        files = store_call(state.store.file_paths, path)
        expires = file_urls.expiry()
        base = str(request.base_url).rstrip("/") + API_PREFIX
        return record(g.ExternalWeightsUrlsResponse(
            urls={rel: signer.url(base, path, rel, expires) for rel in files},
            expires=datetime.datetime.fromtimestamp(expires, datetime.UTC)))

    @router.get(file_urls.FILES_ROUTE + "/{run_id}/{segment}/{name}/{rel:path}")
    async def checkpoint_file(run_id: bodies.RunIdInPath, segment: bodies.Segment, name: bodies.NameInPath,
                              rel: bodies.RefInPath, expires: bodies.TextInQuery = "",
                              sig: bodies.TextInQuery = "") -> Response:
        """A file of a checkpoint by a URL external_weights_urls signed (no API key: the URL is it)."""
        path = f"tinker://{run_id}/{segment}/{name}"
        if not signer.valid(path, rel, expires, sig):
            raise HTTPException(403, detail="this checkpoint file URL is not one the server signed, or it has "
                                "expired: ask external_weights_urls for a fresh one")
        file = store_call(state.store.file_paths, path).get(rel)
        if file is None:
            raise HTTPException(404, detail=f"{path} has no file {rel!r} (deleted or replaced since)")
        return FileResponse(file, media_type="application/octet-stream")

    @router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    async def publish_checkpoint(run_id: bodies.RunIdInPath,
                                 checkpoint_id: bodies.CheckpointIdInPath) -> Response:
        store_call(state.store.set_public, ckpt_path(run_id, checkpoint_id), True)
        return Response(status_code=204)

    @router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    async def unpublish_checkpoint(run_id: bodies.RunIdInPath,
                                   checkpoint_id: bodies.CheckpointIdInPath) -> Response:
        store_call(state.store.set_public, ckpt_path(run_id, checkpoint_id), False)
        return Response(status_code=204)

    @router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_checkpoint_ttl(run_id: bodies.RunIdInPath, checkpoint_id: bodies.CheckpointIdInPath,
                                 body: bodies.SetTtl) -> Response:
        store_call(state.store.set_ttl, ckpt_path(run_id, checkpoint_id), body.ttl_seconds)
        return Response(status_code=204)

    # Registered after the /publish and /ttl routes, which its {checkpoint_id:path} would swallow.
    @router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: bodies.RunIdInPath,
                                checkpoint_id: bodies.CheckpointIdInPath) -> Response:
        store_call(state.store.delete, ckpt_path(run_id, checkpoint_id))
        return Response(status_code=204)

    return router
