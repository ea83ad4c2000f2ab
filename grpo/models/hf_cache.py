"""Expose the packaged SmolLM2 under its real hub id in the Hugging Face cache.

An exported adapter names its base ``HuggingFaceTB/SmolLM2-135M-Instruct`` (see
``grpo.models.public_id``), so that ``AutoPeftModelForCausalLM.from_pretrained(final)``, vLLM or a
hub upload know what it adapts. On a machine without the hub that id resolves only if the model
is in the local cache; this puts grpo's rebuilt copy there, as the hub would have::

    python -m grpo.hf_cache                        # into $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
    HF_HUB_OFFLINE=1 python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('HuggingFaceTB/SmolLM2-135M-Instruct')"

It is opt-in (a user's cache is theirs to fill) and offline only: the snapshot is grpo's rebuild of
the packaged GGUF (same architecture and tokenizer, weights from the Q4_1 file), under a revision
named for that, never the hub's own revision. Files are hard-linked from grpo's cache where the
filesystem allows (no second 520 MB), else copied.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from grpo import models

# The snapshot's revision name: fixed, and plainly not one of the hub's commits.
REVISION = hashlib.sha1(f"grpo-packaged:{models.SMOLLM2_GGUF_FILE}".encode()).hexdigest()


def hub_cache_dir() -> Path:
    """Where huggingface_hub looks, read from the environment now (its own constant is fixed at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def install(hub_cache: str | Path | None = None, repo_id: str = models.SMOLLM2_HUB_ID) -> Path:
    """Place the packaged model in ``hub_cache`` under ``repo_id``; return the snapshot directory.
    Idempotent: an existing snapshot is left as it is."""
    source = models._ensure_packaged_smollm2()
    repo_dir = Path(hub_cache or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / REVISION
    if not (snapshot / "config.json").exists():
        tmp = snapshot.with_name(snapshot.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for file in sorted(source.iterdir()):
            if file.is_file():
                _link_or_copy(file, tmp / file.name)
        tmp.replace(snapshot)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(REVISION)
    return snapshot


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def main(argv: list[str] | None = None) -> None:
    """``python -m grpo.hf_cache [HUB_CACHE_DIR]`` (or ``grpo.models.hf_cache``)."""
    args = sys.argv[1:] if argv is None else argv
    where = install(args[0] if args else None)
    print(f"{models.SMOLLM2_HUB_ID} -> {where}")


if __name__ == "__main__":
    main()
