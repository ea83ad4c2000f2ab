"""The tinker-cookbook's own programs in-process on grpo (``python -m grpo.tinker_run``: `import
tinker` gives grpo), unchanged but for config values, on the packaged SmolLM2 and offline.

The cookbook (pinned 0.5.8) lives in an overlay outside the project's venv (cookbook_helpers.py).
Slow: each program is a subprocess that loads the model and trains.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cookbook_helpers import MODEL, PROGRAMS, RENDERER, cookbook_overlay, env, hf_cache, metrics

pytestmark = pytest.mark.slow

# A module may fail to import only for want of an optional extra the cookbook does not require,
# or because its body is an example script that reaches the Hugging Face hub at import.
OPTIONAL = {"modal", "inspect_ai", "litellm"}
HUB_AT_IMPORT = {"tinker_cookbook.eval.custom_evaluators"}  # builds a Qwen sampler at module level


@pytest.fixture(scope="module")
def run_env(tmp_path_factory):
    overlay = cookbook_overlay()
    return env(overlay, hub_cache=hf_cache(tmp_path_factory.mktemp("hub")))


def tinker_run(args: list[str], run_env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "grpo.tinker_run", *args], env=run_env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_every_cookbook_module_imports_in_process(run_env) -> None:
    lines = [json.loads(line) for line in tinker_run([str(PROGRAMS / "import_all.py")], run_env).stdout.splitlines()
             if line.startswith("{")]
    summary, failures = lines[-1], lines[:-1]
    assert summary["modules"] > 100
    unexpected = [f for f in failures if f["module"] not in HUB_AT_IMPORT
                  and not ((f["missing"] or "").split(".")[0] in OPTIONAL
                           or any(f"{name} is required" in f["message"] for name in OPTIONAL))]
    assert unexpected == [], unexpected


def test_supervised_train_on_the_example_conversations_loss_falls(run_env, tmp_path) -> None:
    tinker_run([str(PROGRAMS / "sl_conversations.py"), str(tmp_path / "sl"), MODEL, "6"], run_env)
    nll = [m["train_mean_nll"] for m in metrics(tmp_path / "sl") if "train_mean_nll" in m]
    assert len(nll) == 6
    assert sum(nll[-3:]) / 3 < 0.75 * sum(nll[:2]) / 2, nll
    checkpoints = (tmp_path / "sl" / "checkpoints.jsonl").read_text()
    assert "tinker://" in checkpoints and "sampler_weights/final" in checkpoints


def test_math_rl_arithmetic_reward_rises(run_env, tmp_path) -> None:
    steps = 12
    tinker_run(["tinker_cookbook.recipes.math_rl.train", f"model_name={MODEL}", f"renderer_name={RENDERER}",
                "env=arithmetic", "group_size=4", "groups_per_batch=8", "learning_rate=1e-4", "max_tokens=5",
                "lora_rank=8", f"log_path={tmp_path / 'rl'}", f"max_steps={steps}", "eval_every=0", "save_every=0",
                "behavior_if_log_dir_exists=delete"], run_env, timeout=900)
    reward = [m["env/all/reward/total"] for m in metrics(tmp_path / "rl") if "env/all/reward/total" in m]
    print("math_rl reward per step:", [round(r, 3) for r in reward])
    assert len(reward) == steps
    assert sum(reward[-4:]) / 4 > sum(reward[:4]) / 4 + 0.1, reward
