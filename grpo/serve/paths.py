"""``tinker://`` checkpoint paths <-> directories under the server's checkpoint directory.

A path is ``tinker://<training run id>/<weights|sampler_weights>/<name>``, the shape the SDK
parses (``ParsedCheckpointTinkerPath``). The mapping is a pure function of the path, so a
path saved before a server restart resolves to the same directory after it.
"""

from __future__ import annotations

import re
from pathlib import Path

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


def _check(part: str, what: str) -> str:
    if not _SAFE.fullmatch(part) or ".." in part:
        raise ValueError(f"{what} {part!r} is not allowed: use letters, digits, '.', '_', '-' (no '/')")
    return part


def tinker_path(training_run_id: str, kind: str, name: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"checkpoint kind must be one of {KINDS}, got {kind!r}")
    return f"{SCHEME}{_check(training_run_id, 'training run id')}/{kind}/{_check(name, 'checkpoint name')}"


def parse(path: str) -> tuple[str, str, str]:
    """(training run id, kind, name) of a tinker:// path, or a ValueError saying what is wrong."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise ValueError(f"path {path!r} is not a tinker:// path; pass one returned by save_state or "
                         "save_weights_for_sampler")
    parts = path[len(SCHEME):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise ValueError(f"path {path!r} is not of the form tinker://<run id>/<weights|sampler_weights>/<name>")
    run_id, kind, name = parts
    return _check(run_id, "training run id"), kind, _check(name, "checkpoint name")


def local_dir(root: Path, path: str) -> Path:
    run_id, kind, name = parse(path)
    return root / run_id.replace(":", "_") / kind / name
