"""RestClient of the Tinker SDK over a grpo.api.checkpoint_store.CheckpointStore.

``ServiceClient().create_rest_client()`` gives one. Every call returns a completed future (an
error is raised by ``.result()``, as the SDK's are), and each has its ``_async`` twin. Downloads
are ``file://`` URLs of this machine: ``get_checkpoint_archive_url_from_tinker_path`` (earlier
SDKs; tinker_cookbook.weights.download calls it) gives one tar archive, ``get_external_weights_urls``
(0.38) one URL per file. Session, billing, audit-log and project calls have no local meaning and
are listed in grpo/api/sdk_parity.py instead.
"""

from __future__ import annotations

import concurrent.futures
import datetime
from collections.abc import Callable
from typing import Any

from grpo.api.checkpoint_store import CheckpointStore, default_root, now
from grpo.api.errors import as_sdk_error
from grpo.types import (
    APIFuture,
    CheckpointArchiveUrlResponse,
    CheckpointsListResponse,
    ExternalWeightsUrlsResponse,
    GetServerCapabilitiesResponse,
    ParsedCheckpointTinkerPath,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoResponse,
    async_twin,
)

# file:// URLs do not expire; the SDK's responses carry an expiry, so a far one is given.
URL_LIFETIME = datetime.timedelta(days=365)


def _future(fn: Callable[[], Any]) -> APIFuture:
    out: concurrent.futures.Future = concurrent.futures.Future()
    try:
        out.set_result(fn())
    except Exception as err:
        out.set_exception(as_sdk_error(err))  # a missing run is the SDK's NotFoundError (a FileNotFoundError)
    return APIFuture(out)


def _none(_: Any) -> None:
    """The SDK's management calls return None; the store returns the updated record."""
    return None


def _path(training_run_id: str, checkpoint_id: str) -> str:
    return f"tinker://{training_run_id}/{checkpoint_id}"


class RestClient:
    """Runs and checkpoints of one checkpoint store, under the SDK's method names."""

    def __init__(self, _holder: Any = None, *, base_url: str | None = None, api_key: str | None = None,
                 store: CheckpointStore | None = None,
                 capabilities: Callable[[], GetServerCapabilitiesResponse] | None = None):
        """``RestClient()`` as the SDK's: the store a default ``ServiceClient()`` writes to
        ($GRPO_CHECKPOINT_DIR, else $GRPO_CACHE/checkpoints). ``store`` (or a CheckpointStore as the first argument) names
        another; ``base_url`` and ``api_key`` are the SDK's connection settings, unused in-process."""
        if isinstance(_holder, CheckpointStore):
            store = _holder
        elif _holder is not None:
            raise TypeError(f"RestClient's first argument is a CheckpointStore or None, got {type(_holder).__name__}")
        if store is None:
            store = CheckpointStore(default_root())
        self.store = store
        self._capabilities = capabilities

    # ------------------------------------------------------------------ server and runs

    def get_server_capabilities(self) -> APIFuture[GetServerCapabilitiesResponse]:
        if self._capabilities is None:
            return _future(lambda: GetServerCapabilitiesResponse(supported_models=[]))
        return _future(self._capabilities)

    def get_training_run(self, training_run_id: str, access_scope: str = "owned") -> APIFuture[TrainingRun]:
        return _future(lambda: self.store.get_run(training_run_id))

    def get_training_run_by_tinker_path(self, tinker_path: str, access_scope: str = "owned"
                                        ) -> APIFuture[TrainingRun]:
        return _future(lambda: self.store.get_run(
            ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id))

    def list_training_runs(self, limit: int = 20, offset: int = 0, access_scope: str = "owned",
                           project_id: str | None = None) -> APIFuture[TrainingRunsResponse]:
        return _future(lambda: self.store.list_runs(limit=limit, offset=offset))

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[WeightsInfoResponse]:
        return _future(lambda: self.store.weights_info(tinker_path))

    # ------------------------------------------------------------------ checkpoints

    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        return _future(lambda: self.store.list_checkpoints(training_run_id))

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[CheckpointsListResponse]:
        return _future(lambda: self.store.list_user_checkpoints(limit=limit, offset=offset))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        return _future(lambda: self.store.delete(_path(training_run_id, checkpoint_id)))

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return _future(lambda: self.store.delete(tinker_path))

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Marks the checkpoint public (its ``public`` field); locally nobody else reads it."""
        return _future(lambda: _none(self.store.set_public(tinker_path, True)))

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return _future(lambda: _none(self.store.set_public(tinker_path, False)))

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None) -> APIFuture[None]:
        """Expire the checkpoint ``ttl_seconds`` from now (None: never). The service asks for at
        least 3600 s; locally any positive TTL is honoured."""
        return _future(lambda: _none(self.store.set_ttl(tinker_path, ttl_seconds)))

    def copy_weights(self, path: str, destination_project_id: str | None = None, *,
                     ttl_seconds: int | None = None, weights_access_token: str | None = None) -> APIFuture[str]:
        """A copy of the checkpoint in a new training run; its tinker:// path. Projects have no
        local meaning, so ``destination_project_id`` is ignored."""
        def copy() -> str:
            import shutil

            parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
            source = self.store.resolve(path)
            info = self.store.weights_info(path)
            run = self.store.create_run(info.base_model, lora_rank=info.lora_rank, train_mlp=bool(info.train_mlp),
                                        train_attn=bool(info.train_attn), train_unembed=bool(info.train_unembed))
            name = parsed.checkpoint_id.split("/", 1)[1]
            return self.store.save(run.training_run_id, parsed.checkpoint_type, name,
                                   lambda staging: shutil.copytree(source, staging, dirs_exist_ok=True),
                                   ttl_seconds=ttl_seconds).tinker_path
        return _future(copy)

    # ------------------------------------------------------------------ downloads

    def get_checkpoint_archive_url_from_tinker_path(self, tinker_path: str
                                                    ) -> APIFuture[CheckpointArchiveUrlResponse]:
        """A ``file://`` URL of an uncompressed tar of the checkpoint's files (earlier SDKs' call)."""
        return _future(lambda: CheckpointArchiveUrlResponse(url=self.store.archive(tinker_path).resolve().as_uri(),
                                                            expires=now() + URL_LIFETIME))

    def get_checkpoint_archive_url(self, training_run_id: str, checkpoint_id: str
                                   ) -> APIFuture[CheckpointArchiveUrlResponse]:
        return self.get_checkpoint_archive_url_from_tinker_path(_path(training_run_id, checkpoint_id))

    def get_external_weights_urls(self, tinker_path: str) -> APIFuture[ExternalWeightsUrlsResponse]:
        """One ``file://`` URL per file, keyed by its path inside the checkpoint (0.38's call).
        Any checkpoint type is served, not only ``external_weights``."""
        return _future(lambda: ExternalWeightsUrlsResponse(
            urls={rel: f.resolve().as_uri() for rel, f in self.store.file_paths(tinker_path).items()},
            expires=now() + URL_LIFETIME))

    def get_telemetry(self) -> None:
        return None

    # ------------------------------------------------------------------ async twins

    get_server_capabilities_async = async_twin("get_server_capabilities", awaited=True)
    get_training_run_async = async_twin("get_training_run", awaited=True)
    get_training_run_by_tinker_path_async = async_twin("get_training_run_by_tinker_path", awaited=True)
    list_training_runs_async = async_twin("list_training_runs", awaited=True)
    get_weights_info_by_tinker_path_async = async_twin("get_weights_info_by_tinker_path", awaited=True)
    list_checkpoints_async = async_twin("list_checkpoints", awaited=True)
    list_user_checkpoints_async = async_twin("list_user_checkpoints", awaited=True)
    delete_checkpoint_async = async_twin("delete_checkpoint", awaited=True)
    delete_checkpoint_from_tinker_path_async = async_twin("delete_checkpoint_from_tinker_path", awaited=True)
    publish_checkpoint_from_tinker_path_async = async_twin("publish_checkpoint_from_tinker_path", awaited=True)
    unpublish_checkpoint_from_tinker_path_async = async_twin("unpublish_checkpoint_from_tinker_path", awaited=True)
    set_checkpoint_ttl_from_tinker_path_async = async_twin("set_checkpoint_ttl_from_tinker_path", awaited=True)
    copy_weights_async = async_twin("copy_weights", awaited=True)
    get_checkpoint_archive_url_from_tinker_path_async = async_twin(
        "get_checkpoint_archive_url_from_tinker_path", awaited=True)
    get_checkpoint_archive_url_async = async_twin("get_checkpoint_archive_url", awaited=True)
    get_external_weights_urls_async = async_twin("get_external_weights_urls", awaited=True)
