"""Backends behind the Tinker client API: ``local`` (this process) or a remote service."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

BACKENDS = ("local", "mint", "tinker")


def create_service_client(backend: Mapping[str, Any], run_dir: Path) -> Any:
    """A ServiceClient for the ``backend`` config group (conf/backend/*.yaml)."""
    options = dict(backend)
    name = options.pop("name", "local")
    if name not in BACKENDS:
        raise ValueError(f"backend.name={name!r} is invalid; valid: {', '.join(BACKENDS)}")
    if name == "local":
        from grpo.backends.local import ServiceClient

        # precision.json: what auto resolved to when the run began, kept for its resumes
        return ServiceClient(checkpoint_dir=Path(run_dir) / "checkpoints",
                             precision_record=Path(run_dir) / "precision.json", **options)
    from grpo.backends.remote import RemoteServiceClient

    return RemoteServiceClient(sdk=name, **options)
