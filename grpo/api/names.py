"""The one rule for names and paths a client or user gives: checkpoint names, training run ids,
``tinker://`` paths.

A *name* is one path component of safe characters: 1-128 of ``A-Z a-z 0-9 . _ -``, starting with
a letter or digit (so never ``.``, ``..``, a hidden file, a blank or a separator), and not ending
in a suffix the store keeps for itself (staging ``.tmp``, stranded ``.old``, ``.meta.json``).
A *training run id* is a name that may also hold ``:`` (the service's ids read
``<session>:train:<n>``, and a model id is its run id). A *path* is
``tinker://<run>/<kind>/<name>`` with ``<run>`` a run id, ``<name>`` a name and ``<kind>`` a
checkpoint segment; on disk it must resolve (symlinks followed) under the store root.

In-process, a save may also name a plain *directory* of the caller's machine (absolute, or holding a
path separator): the caller owns that machine. A server's clients never may (``save_target``
with ``directories=False``): what a remote client names lands in the store or nowhere.

Everything that turns a client's string into a file-system location goes through here, so one
place decides what can ever be written or read. A violation is an ``UnsafeName`` (a ValueError)
naming the field and the rule: the server answers it with a 4xx, in-process callers see one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from grpo.types import CHECKPOINT_SEGMENTS

MAX_NAME = 128
RESERVED_SUFFIXES = (".tmp", ".old", ".meta.json")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
NAME_RULE = (f"a name is 1-{MAX_NAME} characters of A-Z a-z 0-9 . _ - starting with a letter or digit, "
             f"not ending in {', '.join(RESERVED_SUFFIXES)}")
RUN_ID_RULE = NAME_RULE.replace("a name is", "a training run id is").replace(". _ -", ". _ - :")
PATH_RULE = (f"expected tinker://<training_run_id>/<{'|'.join(CHECKPOINT_SEGMENTS.values())}>/<name>, "
             f"where {RUN_ID_RULE} and {NAME_RULE}")


class UnsafeName(ValueError):
    """A name or path outside the rule; ``field`` names the request field or argument."""

    def __init__(self, field: str, value: Any, rule: str):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        super().__init__(f"{field}={shown} is invalid: {rule}")
        self.field = field


def _fits(value: Any, pattern: re.Pattern[str]) -> bool:
    return (isinstance(value, str) and len(value) <= MAX_NAME and pattern.fullmatch(value) is not None
            and not value.endswith(RESERVED_SUFFIXES))


def is_name(value: Any) -> bool:
    return _fits(value, _NAME)


def is_run_id(value: Any) -> bool:
    return _fits(value, _RUN_ID)


def check_run_id(value: Any, field: str = "training_run_id") -> str:
    """``value`` if it is a training run id (a name that may hold ``:``), else UnsafeName."""
    if not is_run_id(value):
        raise UnsafeName(field, value, RUN_ID_RULE)
    return value


def check_name(value: Any, field: str = "name") -> str:
    """``value`` if it is a name (see the module docstring), else UnsafeName naming ``field``."""
    if not is_name(value):
        raise UnsafeName(field, value, NAME_RULE)
    return value


def parse_path(value: Any, field: str = "path") -> tuple[str, str, str]:
    """(run_id, segment, name) of a ``tinker://`` path, each part checked."""
    if not isinstance(value, str) or not value.startswith("tinker://"):
        raise UnsafeName(field, value, PATH_RULE)
    parts = value[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in CHECKPOINT_SEGMENTS.values() or not (is_run_id(parts[0]) and is_name(parts[2])):
        raise UnsafeName(field, value, PATH_RULE)
    return parts[0], parts[1], parts[2]


def check_checkpoint_id(value: Any, field: str = "checkpoint_id") -> str:
    """``value`` if it is ``<segment>/<name>``, the tail of a tinker:// path (the RestClient's routes)."""
    segment, _, name = value.partition("/") if isinstance(value, str) else ("", "", "")
    if segment not in CHECKPOINT_SEGMENTS.values() or not is_name(name):
        raise UnsafeName(field, value, f"expected <{'|'.join(CHECKPOINT_SEGMENTS.values())}>/<name>, where {NAME_RULE}")
    return value


def names_a_directory(value: Any) -> bool:
    """A save target that is a plain directory rather than a checkpoint name of the store."""
    return (isinstance(value, str) and "://" not in value
            and (Path(value).is_absolute() or any(sep in value for sep in (os.sep, os.altsep) if sep)))


def save_target(value: Any, field: str = "name", directories: bool = True) -> str | Path:
    """Where a save goes: a checked name of the store (str), or, only where ``directories`` is
    allowed (in-process), a plain directory (Path). A server's clients pass ``directories=False``."""
    if directories and names_a_directory(value):
        return Path(value)
    return check_name(value, field)


def under_root(root: str | os.PathLike, *parts: str, field: str = "path") -> Path:
    """``root/parts...`` after checking that, with every symlink followed, it stays under ``root``:
    a run directory or checkpoint that is a link out of the store is refused, not followed."""
    target = Path(root).joinpath(*parts)
    if not target.resolve().is_relative_to(Path(root).resolve()):
        raise UnsafeName(field, "/".join(parts), "it resolves outside the checkpoint store (a symlink out of it?)")
    return target
