"""Rows from wherever a user keeps data: a hub name, local jsonl/json/parquet/csv, or a list.

Every adapter reads its optional ``datasets`` source through ``load_rows`` so the three accept the
same spellings and fail with the same clear message when a source cannot be had (the hub is not
reachable on every machine).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo.checks import ConfigError

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataSourceError(ConfigError):
    """A data source that cannot be read; a ConfigError, so the CLI prints it as one line."""


def load_rows(source: str | Sequence[Mapping[str, Any]], *, split: str = "train", name: str | None = None,
              limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of ``source`` as plain dicts.

    ``source`` is a list of mappings (used as is), a local file or directory of jsonl / json /
    parquet / csv files, or a Hugging Face hub dataset id (``openai/gsm8k`` with ``name="main"``).
    """
    if not isinstance(source, str):
        rows = [dict(r) for r in source]
        return rows[:limit] if limit is not None else rows
    from datasets import load_dataset

    path = Path(source).expanduser()
    if path.exists():
        files = sorted(p for p in path.iterdir() if p.suffix in LOCAL_FORMATS) if path.is_dir() else [path]
        if not files or files[0].suffix not in LOCAL_FORMATS:
            raise DataSourceError(f"data source {source!r} holds no {', '.join(LOCAL_FORMATS)} file")
        try:
            with _quiet_datasets():  # its own ERROR log line and progress bar would precede our one line
                dataset = load_dataset(LOCAL_FORMATS[files[0].suffix], data_files=[str(f) for f in files],
                                       split="train")
        except Exception as err:  # datasets wraps a bad line in DatasetGenerationError; its cause says which
            root = err
            while root.__cause__ is not None or root.__context__ is not None:
                root = root.__cause__ or root.__context__
            where = _first_bad_json_line(files) or f"{type(root).__name__}: {' '.join(str(root).split())[:300]}"
            raise DataSourceError(f"data source {source!r} could not be read as "
                                  f"{LOCAL_FORMATS[files[0].suffix]}: {where}") from err
    elif source.startswith((".", "/", "~")) or Path(source).suffix in LOCAL_FORMATS:
        raise DataSourceError(f"data source {source!r} looks like a local file but {path} does not exist")
    else:
        try:
            dataset = load_dataset(source, name, split=split)
        except Exception as err:  # network, auth, unknown name, unknown split: one clear message
            raise DataSourceError(
                f"could not load dataset {source!r} (config {name!r}, split {split!r}) from the Hugging Face hub: "
                f"{type(err).__name__}: {err}. The hub may be unreachable from this machine; use a local "
                "jsonl/parquet file or the adapter's built-in generator instead."
            ) from err
    rows = [dict(r) for r in (dataset.select(range(min(limit, len(dataset)))) if limit is not None else dataset)]
    if not rows:
        raise DataSourceError(f"data source {source!r} has no rows")
    return rows


def _first_bad_json_line(files: list[Path]) -> str | None:
    """Where a jsonl file stops being JSON lines (read only once loading has failed)."""
    import json

    for file in files:
        if file.suffix != ".jsonl":
            continue
        with open(file, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                try:
                    if line.strip():
                        json.loads(line)
                except json.JSONDecodeError as err:
                    return f"{file.name} line {number} is not JSON ({err.msg})"
    return None


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    import datasets

    logger = logging.getLogger("datasets")
    level, bars = logger.level, datasets.utils.are_progress_bars_disabled()
    logger.setLevel(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if not bars:
            datasets.enable_progress_bars()


def require_columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], source: Any) -> None:
    """Raise a clear error when the rows lack a configured column, naming the ones they have."""
    if not rows:
        return
    missing = [c for c in columns if c not in rows[0]]
    if missing:
        raise DataSourceError(
            f"data source {source if isinstance(source, str) else '<rows>'} has no column(s) {missing}; "
            f"its columns are {sorted(rows[0])}. Set the adapter's *_column options to match."
        )
