"""The tinker-cookbook for tests, kept out of the project's venv.

``cookbook_overlay()`` is a directory holding tinker-cookbook 0.5.8 (``pip --no-deps --target``) and
the few packages it imports that the dev venv lacks (chz, tml-renderers, blobfile, aiohttp, pyrage
and their own small dependencies), built once under $GRPO_CACHE/cookbook-overlays/. Put on
PYTHONPATH it adds the cookbook to the dev venv's python for one subprocess; the venv's torch and
transformers are used (the cookbook's own pins are not installed), and ``tinker`` is either grpo
(``python -m grpo.tinker_run``) or the SDK overlay of serve_helpers.sdk_overlay.

``hf_cache(dir)`` puts the packaged SmolLM2 under its hub id in a Hugging Face cache, so the
cookbook's own ``AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")`` works offline.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

COOKBOOK = "tinker-cookbook==0.5.8"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RENDERER = "qwen3_instruct"  # SmolLM2's chat format: ChatML without think tokens
# Imported by the cookbook's core modules; the rest (modal, inspect_ai, litellm...) are optional extras.
IMPORTED = ["chz", "tml-renderers", "blobfile", "aiohttp", "pyrage", "pylatexenc"]
# Provided otherwise: grpo or the SDK overlay stands for tinker; the venv's torch/transformers serve.
NOT_INSTALLED = {"tinker", "torch", "transformers"}
REPO = Path(__file__).resolve().parent.parent
PROGRAMS = REPO / "tests" / "cookbook"


def cookbook_overlay() -> Path:
    from grpo import models

    target = models.cache_dir() / "cookbook-overlays" / COOKBOOK.replace("==", "-")
    if (target / ".installed").exists():
        return target
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging)]
    subprocess.run([*pip, COOKBOOK, *IMPORTED], check=True, timeout=900)
    for _ in range(5):  # the dependencies' own dependencies, until none is missing
        missing = _missing(staging)
        if not missing:
            break
        subprocess.run([*pip, *missing], check=True, timeout=900)
    (staging / ".installed").touch()
    shutil.rmtree(target, ignore_errors=True)
    staging.replace(target)
    return target


def _missing(staging: Path) -> list[str]:
    have = {p.name.split("-")[0].lower().replace("_", "-") for p in staging.glob("*.dist-info")}
    out = set()
    for meta in staging.glob("*.dist-info/METADATA"):
        for line in Parser().parsestr(meta.read_text()).get_all("Requires-Dist") or []:
            req = Requirement(line)
            name = req.name.lower().replace("_", "-")
            if name in NOT_INSTALLED or name in have or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            try:
                importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                out.add(req.name)
    return sorted(out)


def hf_cache(root: Path) -> Path:
    from grpo.models import hf_cache as cache

    cache.install(str(root))
    return root


def env(*pythonpath: Path, hub_cache: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath)), "HF_HUB_CACHE": str(hub_cache),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TINKER_TELEMETRY": "0", "WANDB_MODE": "disabled", **extra}


def metrics(log_path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
