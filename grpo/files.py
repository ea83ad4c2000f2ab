"""Replacing files and directories so that a reader, or a run killed mid-write, never sees half
of one: write beside the target, then rename over it (rename is atomic within a filesystem)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Move the finished directory ``src`` to ``dst``, replacing what is there.

    Directories cannot be swapped atomically, so the old copy is renamed aside first and deleted
    only once the new one is in place: a crash in between leaves ``dst`` (old or new) or
    ``<dst>.old``, never neither; the next replace_dir restores a stranded ``.old``.
    """
    src, dst = Path(src), Path(dst)
    old = dst.with_name(dst.name + ".old")
    if not dst.exists() and old.exists():  # a previous replace died between its two renames
        old.replace(dst)
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        dst.replace(old)
    src.replace(dst)
    shutil.rmtree(old, ignore_errors=True)
    return dst
