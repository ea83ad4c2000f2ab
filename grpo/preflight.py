"""Checks on the command line that must run before Hydra does, because Hydra fails on them with a
traceback or a multi-line message of its own: a config group option that does not exist
(``adapter=nonexistent``) and a run directory that cannot be one (a file, a read-only place).
Each is one ``grpo: ...`` line and exit status 2 (see grpo/__main__.py). Cheap: no torch, no model.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from grpo.checks import ConfigError


def check_argv(argv: list[str], conf_dir: Path) -> None:
    """Raise ConfigError for the first problem in ``argv`` (the Hydra overrides) found here."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    runs_a_job = not any(a.split("=")[0] in ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i",
                                              "--shell-completion", "-sc") for a in argv)
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        # Hydra's sweep functions (choice(...), glob(...), range(...)) and lists are Hydra's to expand.
        if (conf_dir / key).is_dir() and "/" not in key and not any(c in value for c in "${}()[]"):
            _check_group(key, value, conf_dir / key, multirun)
        elif (runs_a_job and key == ("hydra.sweep.dir" if multirun else "hydra.run.dir") and value
              and "${" not in value):  # only a job creates it: --cfg / --help must not
            check_run_dir(key, Path(value))


def _check_group(group: str, value: str, folder: Path, multirun: bool) -> None:
    options = sorted(p.stem for p in folder.glob("*.yaml"))
    for choice in value.split(",") if multirun else [value]:
        if choice not in options and choice != "null":
            raise ConfigError(f"{group}={choice!r} is invalid: valid values: {', '.join(options)}")


def check_run_dir(key: str, path: Path) -> None:
    """``path`` is (or can be made) a directory this process can write in."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={str(path)!r} is invalid: it is a file, not a directory; give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".grpo-write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise ConfigError(f"{key}={str(path)!r} is invalid: cannot write there ({reason}); give a writable "
                          "directory") from None
