"""Replacing files and directories so that a reader, or a run killed mid-write, never sees half
of one: write beside the target, then rename over it (rename is atomic within a filesystem).

What is written beside the target is named ``<name>.<pid>.tmp`` (the writer's pid), so that a
later start-up can tell a dead writer's leftovers from a live one's: ``sweep_staging`` removes the
former. A write that fails removes its own staging file at once.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

# <name>.<pid>.tmp, and <name>.tmp<pid> as grpo before #37 named staging files.
_STAGING = re.compile(r".+\.(?:(?P<pid>\d+)\.tmp|tmp(?P<legacy_pid>\d+))")


def staging_path(path: str | os.PathLike) -> Path:
    """Where a write of ``path`` by this process is staged."""
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory."""
    path = Path(path)
    tmp = staging_path(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a disk that refused the write or the rename keeps no half file
        raise
    return path


def staging_pid(name: str) -> str | None:
    """The pid in a staging name (``<name>.<pid>.tmp``, or the older ``<name>.tmp<pid>``); None when
    ``name`` is not one."""
    match = _STAGING.fullmatch(name)
    return None if match is None else match["pid"] or match["legacy_pid"]


def alive(pid: str) -> bool:
    """Whether the process ``pid`` still runs (ours counts as alive: another thread of this process
    may be mid-write into the same directory)."""
    if not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    except OverflowError:
        return False
    return True


def sweep_staging(folder: str | os.PathLike) -> list[Path]:
    """Remove what writers that are no longer alive staged in ``folder`` (files or directories
    named ``<name>.<pid>.tmp``, never following a symlink); returns what was removed."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return []
    removed = []
    for entry in folder.iterdir():
        pid = staging_pid(entry.name)
        if pid is None or alive(pid):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


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
