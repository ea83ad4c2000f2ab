"""The checkpoint store: training runs and their saved weights on disk, addressed by tinker:// paths.

One store serves every way in: the in-process clients (grpo.backends.local) save into it and load
from it, the RestClient lists/publishes/expires/deletes/downloads from it, and the HTTP server
(grpo.serve) can answer the same calls from the same directory.

Layout under ``root`` (one directory per training run; nothing else is kept anywhere)::

    <root>/<run_id>/run.json                     the TrainingRun record (base model, LoRA settings)
    <root>/<run_id>/weights/<name>/              a training state (save_state): weights + optimizer
    <root>/<run_id>/sampler_weights/<name>/      sampler weights (save_weights_for_sampler)
    <root>/<run_id>/<segment>/<name>.meta.json   its Checkpoint record: time, expiry, public, metadata

    tinker://<run_id>/<segment>/<name>  <->  <root>/<run_id>/<segment>/<name>/

API (every path argument takes a ``tinker://`` path; ``resolve`` also takes a plain directory):

    store = CheckpointStore(root)
    run = store.create_run(base_model, lora_rank=..., train_mlp=..., user_metadata=...)  # TrainingRun
    ckpt = store.save(run.training_run_id, "training", name, write_files, ttl_seconds=None,
                      user_metadata=None, overwrite=True)   # write_files(staging_dir) writes the files
    store.resolve(path) -> Path                  # the directory to load; FileNotFoundError if gone
    store.get_checkpoint(path) -> Checkpoint
    store.get_run(run_id) -> TrainingRun;  store.list_runs(limit, offset) -> TrainingRunsResponse
    store.list_checkpoints(run_id) -> CheckpointsListResponse          # newest first
    store.list_user_checkpoints(limit, offset) -> CheckpointsListResponse
    store.set_ttl(path, ttl_seconds | None);  store.set_public(path, bool);  store.delete(path)
    store.weights_info(path) -> WeightsInfoResponse
    store.archive(path) -> Path                  # an uncompressed tar of the files, `tar -xf` opens it
    store.file_paths(path) -> dict[str, Path]    # relative path -> file, for per-file downloads
    store.purge_expired(run_id=None) -> list[str]  # deletes what has expired (of one run, or all);
                                                   # every listing and resolve does it for what it reads

Writes are atomic (files are staged beside the target and renamed in), so a crash mid-save leaves
either the old checkpoint or the new one. Expiry is lazy: an expired checkpoint is deleted the next
time anything lists or resolves it, and never loads.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import tarfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from grpo.api import names
from grpo.files import atomic_write_text, replace_dir, staging_path, sweep_staging
from grpo.types import (
    CHECKPOINT_SEGMENTS,
    Checkpoint,
    CheckpointsListResponse,
    CheckpointType,
    Cursor,
    ParsedCheckpointTinkerPath,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoResponse,
)

RUN_FILE = "run.json"
META_SUFFIX = ".meta.json"
OWNER = "local"
# What cannot be trusted on disk (a run or checkpoint that is a symlink out of the store, a record
# that does not parse) is skipped by every listing and logged once here, never the listing's failure.
log = logging.getLogger(__name__)
# What reading a planted or half-written entry can raise (UnsafeName and JSON errors are ValueErrors;
# AttributeError: JSON that is no object, whose fields cannot be read).
_UNTRUSTED = (ValueError, OSError, KeyError, TypeError, AttributeError)
# Files a loader needs, in the archive and the per-file listing; staging leftovers never are.
_HIDDEN_SUFFIXES = (".tmp", ".old")


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def is_tinker_path(path: Any) -> bool:
    return isinstance(path, str) and path.startswith("tinker://")


def tinker_path(run_id: str, checkpoint_type: CheckpointType, name: str) -> str:
    return f"tinker://{run_id}/{CHECKPOINT_SEGMENTS[checkpoint_type]}/{name}"


class CheckpointStore:
    """Training runs and checkpoints under one directory (see the module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._lock = threading.RLock()
        self._skipped: set[str] = set()
        self.clean_staging()

    def _skip(self, what: str, err: BaseException) -> None:
        """Log once per entry that a listing passes over ``what`` (a path relative to the root)."""
        if what not in self._skipped:
            self._skipped.add(what)
            reason = str(err).replace(str(self.root.resolve()), "<store>").replace(str(self.root), "<store>")
            log.warning("checkpoint store: skipped %s, which cannot be trusted (%s: %s)", what,
                        type(err).__name__, reason)

    def clean_staging(self) -> list[Path]:
        """Remove what saves killed mid-write left (``<name>.<pid>.tmp`` staging directories of
        processes no longer alive, a ``.old`` copy whose replacement is in place; a ``.old``
        without one is restored). Runs when a store is opened, so a server restart or a resumed
        run reclaims the space; returns what was removed."""
        removed = []
        archives = self.root / ".archives"
        if archives.is_dir() and not archives.is_symlink():
            for folder in archives.iterdir():
                removed += sweep_staging(folder)
        for run in self._run_dirs():
            removed += sweep_staging(run)  # run.json's staging file
            for segment in CHECKPOINT_SEGMENTS.values():
                folder = run / segment
                removed += sweep_staging(folder)  # checkpoint directories and their .meta.json files
                if not folder.is_dir() or folder.is_symlink():
                    continue
                for entry in folder.iterdir():
                    if entry.name.endswith(".old") and entry.is_dir():
                        live = entry.with_name(entry.name[:-len(".old")])
                        if live.exists():
                            shutil.rmtree(entry, ignore_errors=True)
                            removed.append(entry)
                        else:
                            entry.replace(live)
        return removed

    # ------------------------------------------------------------------ runs

    def create_run(self, base_model: str, *, lora_rank: int | None = None, train_mlp: bool = True,
                   train_attn: bool = True, train_unembed: bool = True,
                   user_metadata: dict[str, str] | None = None, run_id: str | None = None) -> TrainingRun:
        """Register a new training run (one per training client) and return its record."""
        run_id = run_id or f"run-{uuid.uuid4().hex[:12]}"
        names.check_run_id(run_id, "training_run_id")
        record = {"training_run_id": run_id, "base_model": base_model, "is_lora": lora_rank is not None,
                  "lora_rank": lora_rank, "train_mlp": train_mlp, "train_attn": train_attn,
                  "train_unembed": train_unembed, "user_metadata": _metadata(user_metadata),
                  "created": now().isoformat()}
        run_dir = self.root / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / RUN_FILE, record)
        return self.get_run(run_id)

    def get_run(self, run_id: str) -> TrainingRun:
        record = self._run_record(run_id)
        checkpoints = self.list_checkpoints(run_id).checkpoints
        last = {kind: next((c for c in checkpoints if c.checkpoint_type == kind), None)
                for kind in ("training", "sampler")}
        times = [datetime.datetime.fromisoformat(record["created"])] + [c.time for c in checkpoints]
        return TrainingRun(training_run_id=run_id, base_model=record["base_model"], model_owner=OWNER,
                           is_lora=record["is_lora"], lora_rank=record["lora_rank"],
                           last_request_time=max(times), last_checkpoint=last["training"],
                           last_sampler_checkpoint=last["sampler"], user_metadata=record["user_metadata"])

    def list_runs(self, limit: int = 20, offset: int = 0) -> TrainingRunsResponse:
        """Runs, most recently active first. Every run's last activity is read from its record and
        its checkpoints' metadata (its expired checkpoints swept on the way); the full records, each
        of which sizes every checkpoint's files, are built for the page's runs alone."""
        active = []
        for p in self._run_dirs():
            try:
                active.append((self._last_activity(p.name), p.name))
            except _UNTRUSTED as err:
                self._skip(p.name, err)
        active.sort(key=lambda entry: entry[0], reverse=True)
        page = []
        for _, run_id in active[offset:offset + limit]:
            try:
                page.append(self.get_run(run_id))
            except _UNTRUSTED as err:  # changed since its activity was read
                self._skip(run_id, err)
        return TrainingRunsResponse(training_runs=page,
                                    cursor=Cursor(offset=offset, limit=limit, total_count=len(active)))

    def _last_activity(self, run_id: str) -> datetime.datetime:
        """``get_run(run_id).last_request_time``, from the record and the checkpoints' metadata alone."""
        created = datetime.datetime.fromisoformat(self._run_record(run_id)["created"])
        return max([created] + [time for time, _ in self._live_times(run_id)])

    def _run_record(self, run_id: str) -> dict[str, Any]:
        path = names.under_root(self.root, names.check_run_id(run_id, "training_run_id"), RUN_FILE,
                                field="training_run_id")
        if not path.exists():
            raise FileNotFoundError(f"no training run {run_id!r} in the checkpoint store at {self.root}")
        return json.loads(path.read_text())

    def _run_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        # A run directory must be a name and lie inside the store (a symlink out of it is ignored).
        root = self.root.resolve()
        return sorted(p for p in self.root.iterdir() if names.is_run_id(p.name) and (p / RUN_FILE).exists()
                      and p.resolve().is_relative_to(root))

    # ------------------------------------------------------------------ saving and resolving

    def save(self, run_id: str, checkpoint_type: CheckpointType, name: str, write_files: Callable[[Path], None],
             *, ttl_seconds: int | None = None, user_metadata: dict[str, str] | None = None,
             overwrite: bool = True) -> Checkpoint:
        """Write a checkpoint: ``write_files(staging_dir)`` fills a fresh directory, which then
        replaces ``<run>/<segment>/<name>`` atomically. ``overwrite=False`` refuses an existing name."""
        if checkpoint_type not in CHECKPOINT_SEGMENTS:
            raise ValueError(f"checkpoint_type={checkpoint_type!r} is invalid; valid: {', '.join(CHECKPOINT_SEGMENTS)}")
        names.check_name(name, "name")
        ttl = _check_ttl(ttl_seconds)
        self._run_record(run_id)
        path = tinker_path(run_id, checkpoint_type, name)
        target = self._dir(path)
        with self._lock:
            if target.exists() and not overwrite:
                raise FileExistsError(f"checkpoint {path} exists; pass overwrite=True to replace it")
            # The writer's pid in the name: a later start-up can tell a dead save's leftovers
            # (removed by clean_staging) from a live one's in another process sharing the store.
            staging = staging_path(target)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            try:
                write_files(staging)
                created = now()
                meta = {"time": created.isoformat(), "public": False, "user_metadata": _metadata(user_metadata),
                        "expires_at": None if ttl is None else (created + datetime.timedelta(seconds=ttl)).isoformat()}
                replace_dir(staging, target)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)  # a failed save leaves nothing behind
                raise
            _write_json(self._meta_file(path), meta)
        return self.get_checkpoint(path)

    def resolve(self, path: str | os.PathLike) -> Path:
        """The directory a loader reads: a tinker:// path's checkpoint, or a plain directory as is."""
        if not is_tinker_path(path):
            return Path(path)
        target = self._existing(str(path))
        link = next(iter(_links(target)), None)
        if link is not None:  # the store never writes one: it was planted, and could lead anywhere
            raise names.UnsafeName("path", str(path), f"the checkpoint holds a symlink ({link}), which is never "
                                   "followed")
        return target

    def _existing(self, path: str) -> Path:
        """The checkpoint's directory (its run's expired ones purged first); FileNotFoundError when
        there is none."""
        target = self._dir(path)
        self.purge_expired(names.parse_path(path)[0])
        if not target.is_dir() or not self._meta_file(path).exists():
            raise FileNotFoundError(f"no checkpoint {path} in the checkpoint store at {self.root} "
                                    "(never saved, deleted, or expired)")
        return target

    def get_checkpoint(self, path: str) -> Checkpoint:
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        meta_file = self._meta_file(path)
        if not meta_file.exists():
            raise FileNotFoundError(f"no checkpoint {path} in the checkpoint store at {self.root}")
        meta = json.loads(meta_file.read_text())
        expires = meta.get("expires_at")
        return Checkpoint(checkpoint_id=parsed.checkpoint_id, checkpoint_type=parsed.checkpoint_type,
                          time=datetime.datetime.fromisoformat(meta["time"]), tinker_path=path,
                          size_bytes=sum(f.stat().st_size for f in self.file_paths(path, check=False).values()),
                          public=bool(meta.get("public")), user_metadata=meta.get("user_metadata"),
                          expires_at=None if expires is None else datetime.datetime.fromisoformat(expires))

    # ------------------------------------------------------------------ listing

    def list_checkpoints(self, run_id: str) -> CheckpointsListResponse:
        """A run's checkpoints of every type, newest first."""
        self._run_record(run_id)
        self.purge_expired(run_id)
        found = self._checkpoints(run_id)
        found.sort(key=lambda c: c.time, reverse=True)
        return CheckpointsListResponse(checkpoints=found)

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> CheckpointsListResponse:
        """Every run's checkpoints, newest first, one page of them: ordered by their metadata's
        times (expired ones swept on the way), full records (which size the files) for the page alone."""
        found = [entry for run in self._run_dirs() for entry in self._live_times(run.name)]
        found.sort(key=lambda entry: entry[0], reverse=True)
        page = self._trusted([path for _, path in found[offset:offset + limit]])
        return CheckpointsListResponse(checkpoints=page, cursor=Cursor(offset=offset, limit=limit, total_count=len(found)))

    def _checkpoints(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints that can be trusted; the others are skipped (and logged once)."""
        return self._trusted(self._checkpoint_paths(run_id))

    def _trusted(self, paths: list[str]) -> list[Checkpoint]:
        """The Checkpoints of ``paths`` that can be trusted; the others are skipped (and logged once)."""
        found = []
        for path in paths:
            try:
                found.append(self.get_checkpoint(path))
            except FileNotFoundError:
                continue  # deleted by someone else just now
            except _UNTRUSTED as err:
                self._skip(path.removeprefix("tinker://"), err)
        return found

    def _live_times(self, run_id: str) -> list[tuple[datetime.datetime, str]]:
        """(time, path) of ``run_id``'s live checkpoints, from their metadata (expired ones swept)."""
        out = []
        for meta in self._sweep(run_id, []):
            try:
                out.append((datetime.datetime.fromisoformat(meta["time"]), meta["path"]))
            except _UNTRUSTED as err:
                self._skip(meta["path"].removeprefix("tinker://"), err)
        return out

    def _checkpoint_paths(self, run_id: str) -> list[str]:
        out = []
        for kind, segment in CHECKPOINT_SEGMENTS.items():
            folder = self.root / run_id / segment
            if folder.is_dir():
                out += [tinker_path(run_id, kind, m.name[:-len(META_SUFFIX)])  # type: ignore[arg-type]
                        for m in sorted(folder.glob("*" + META_SUFFIX))]
        return out

    # ------------------------------------------------------------------ management

    def set_ttl(self, path: str, ttl_seconds: int | None) -> Checkpoint:
        """Expire ``ttl_seconds`` from now, or never (None)."""
        ttl = _check_ttl(ttl_seconds)
        self.resolve(path)
        expires = None if ttl is None else (now() + datetime.timedelta(seconds=ttl)).isoformat()
        return self._update_meta(path, expires_at=expires)

    def set_public(self, path: str, public: bool) -> Checkpoint:
        self.resolve(path)
        return self._update_meta(path, public=bool(public))

    def delete(self, path: str) -> None:
        self._existing(path)  # a checkpoint with a planted symlink is deleted too (rmtree never follows one)
        self._remove(path)

    def purge_expired(self, run_id: str | None = None) -> list[str]:
        """Delete every checkpoint whose expiry has passed -- ``run_id``'s alone where given, which
        is all that listing or resolving one run needs -- and return their paths. (Every run's,
        each time one run was listed, made a page of ``list_runs`` read the whole store once per
        run: 90 s for 1,475 runs.)"""
        gone: list[str] = []
        for run in [run_id] if run_id is not None else [r.name for r in self._run_dirs()]:
            self._sweep(run, gone)
        return gone

    def _sweep(self, run_id: str, gone: list[str]) -> list[dict[str, Any]]:
        """The metadata of ``run_id``'s live checkpoints, its expired ones deleted (their paths
        added to ``gone``) on the way; entries that cannot be trusted are skipped (logged once)."""
        live, moment = [], now()
        for path in self._checkpoint_paths(run_id):
            try:
                meta = json.loads(self._meta_file(path).read_text())
                expires = meta.get("expires_at")
                expired = expires is not None and datetime.datetime.fromisoformat(expires) <= moment
            except FileNotFoundError:
                continue  # deleted by someone else just now
            except _UNTRUSTED as err:
                self._skip(path.removeprefix("tinker://"), err)
                continue
            if expired:
                self._remove(path)
                gone.append(path)
            else:
                live.append({**meta, "path": path})
        return live

    def _update_meta(self, path: str, **changes: Any) -> Checkpoint:
        with self._lock:
            meta_file = self._meta_file(path)
            _write_json(meta_file, {**json.loads(meta_file.read_text()), **changes})
        return self.get_checkpoint(path)

    def _remove(self, path: str) -> None:
        with self._lock:
            self._meta_file(path).unlink(missing_ok=True)  # first: a half-removed checkpoint is invisible
            shutil.rmtree(self._dir(path), ignore_errors=True)

    # ------------------------------------------------------------------ reading the weights

    def weights_info(self, path: str) -> WeightsInfoResponse:
        """What a loader needs to know before loading: base model and LoRA settings."""
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        self.resolve(path)
        run = self._run_record(parsed.training_run_id)
        return WeightsInfoResponse(base_model=run["base_model"], is_lora=run["is_lora"], lora_rank=run["lora_rank"],
                                   train_unembed=run["train_unembed"], train_mlp=run["train_mlp"],
                                   train_attn=run["train_attn"])

    def file_paths(self, path: str, check: bool = True) -> dict[str, Path]:
        """The checkpoint's files, keyed by their path inside the checkpoint directory."""
        folder = self.resolve(path) if check else self._dir(path)
        if not folder.is_dir():
            return {}
        found = {}
        for here, _dirs, files in os.walk(folder):  # symlinked directories are listed, never entered
            for name in files:
                f = Path(here) / name
                if not f.is_symlink() and f.is_file() and not name.endswith(_HIDDEN_SUFFIXES):
                    found[f.relative_to(folder).as_posix()] = f
        return dict(sorted(found.items()))

    def archive(self, path: str) -> Path:
        """An uncompressed tar of the checkpoint's files (at the archive's top level, as the
        service's archives are), written once under ``<root>/.archives`` and reused."""
        files = self.file_paths(path)
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        stamp = self.get_checkpoint(path).time.strftime("%Y%m%dT%H%M%S%f")
        out = self.root / ".archives" / parsed.training_run_id / f"{parsed.checkpoint_id.replace('/', '__')}-{stamp}.tar"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + f".{uuid.uuid4().hex[:6]}.{os.getpid()}.tmp")  # pid: see clean_staging
            with tarfile.open(tmp, "w") as tar:
                for rel, file in files.items():
                    tar.add(file, arcname=rel)
            tmp.replace(out)
        return out

    # ------------------------------------------------------------------ paths

    def _dir(self, path: str) -> Path:
        run_id, segment, name = names.parse_path(path)
        return names.under_root(self.root, run_id, segment, name)

    def _meta_file(self, path: str) -> Path:
        run_id, segment, name = names.parse_path(path)
        self._dir(path)
        return names.under_root(self.root, run_id, segment, name + META_SUFFIX)


def _links(folder: Path) -> list[str]:
    """Symlinks anywhere inside ``folder`` (relative paths), without following any."""
    return [(Path(here) / name).relative_to(folder).as_posix() for here, dirs, files in os.walk(folder)
            for name in dirs + files if (Path(here) / name).is_symlink()]


def _check_ttl(ttl_seconds: Any) -> int | None:
    # The service asks for at least an hour; locally any positive TTL is honoured (tests use seconds).
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int | float) or ttl_seconds <= 0:
        raise ValueError(f"ttl_seconds must be a positive number of seconds or None (never expires), "
                         f"got {ttl_seconds!r}")
    return ttl_seconds


def _metadata(user_metadata: dict[str, str] | None) -> dict[str, str] | None:
    if user_metadata is None:
        return None
    if not isinstance(user_metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in user_metadata.items()):
        raise ValueError(f"user_metadata must map strings to strings, got {user_metadata!r}")
    return dict(user_metadata)


def _write_json(path: Path, value: Any) -> None:
    atomic_write_text(path, json.dumps(value, indent=1, default=str))


def checkpoint_dict(checkpoint: Checkpoint) -> dict[str, Any]:
    """A Checkpoint as JSON-ready data (datetimes as ISO strings), e.g. for an HTTP response."""
    return json.loads(json.dumps(asdict(checkpoint), default=str))


def default_root() -> Path:
    """Where a ``ServiceClient()`` / ``RestClient()`` made without a directory keeps checkpoints:
    $GRPO_CHECKPOINT_DIR, else $GRPO_CACHE/checkpoints. A program written for the SDK (the cookbook)
    names no directory, so the variable is how its checkpoints are placed."""
    explicit = os.environ.get("GRPO_CHECKPOINT_DIR")
    if explicit:
        return Path(explicit)
    from grpo import models  # lazily: the store itself needs no model code

    return models.cache_dir() / "checkpoints"
