"""The tinker-cookbook's own programs through ``python -m grpo.serve`` with the unmodified tinker SDK
0.38, unchanged but for config values (TINKER_BASE_URL / TINKER_API_KEY name the server).

The SDK and the cookbook are overlays on the dev venv's python (serve_helpers.sdk_overlay,
cookbook_helpers.cookbook_overlay), so the project's venv keeps its own tinker. The server gets the
cookbook overlay too, for pyrage: weights.download exports a training checkpoint age-encrypted.
Slow: CI runs it in `make test-ci-slow`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cookbook_helpers import MODEL, PROGRAMS, RENDERER, cookbook_overlay, env, hf_cache, metrics
from serve_helpers import API_KEY, Server, sdk_overlay

pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow
SDK = "0.38.0"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    overlay = cookbook_overlay()
    hub = hf_cache(tmp_path_factory.mktemp("hub"))
    root = tmp_path_factory.mktemp("serve-cookbook")
    server = Server(root / "checkpoints", env=env(overlay, hub_cache=hub))
    client_env = env(sdk_overlay(SDK), overlay, hub_cache=hub, TINKER_BASE_URL=server.url, TINKER_API_KEY=API_KEY)
    yield server, client_env, root
    server.stop()


def run(server: Server, args: list[str], client_env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], env=client_env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{out.stderr[-3000:]}\nserver log:\n{server.log.read_text()[-3000:]}"
    return out


def test_the_sdk_is_the_newest_and_tinker_is_not_grpo(setup) -> None:
    server, client_env, _ = setup
    out = run(server, ["-c", "import tinker; print(tinker.__version__, tinker.__file__)"], client_env)
    version, path = out.stdout.split()
    assert version == SDK and "grpo" not in path.split("/")[-2]


def test_supervised_train_through_the_server_and_its_checkpoint_downloads(setup, tmp_path) -> None:
    server, client_env, root = setup
    run(server, [str(PROGRAMS / "sl_conversations.py"), str(tmp_path / "sl"), MODEL, "4"], client_env)
    nll = [m["train_mean_nll"] for m in metrics(tmp_path / "sl") if "train_mean_nll" in m]
    print("supervised.train nll per step (server):", [round(x, 3) for x in nll])
    assert len(nll) == 4 and min(nll[1:]) < nll[0]

    final = [json.loads(line) for line in (tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()][-1]
    run_id = final["state_path"].removeprefix("tinker://").split("/")[0]
    assert ":train:" in run_id  # the model id the SDK holds is the run id of its checkpoints
    out = run(server, [str(PROGRAMS / "download.py"), final["state_path"], str(tmp_path / "dl"), MODEL], client_env)
    files = json.loads(out.stdout.strip().splitlines()[-1])
    assert files["peft"] == ["adapter_config.json", "adapter_model.safetensors"]
    from safetensors.torch import load_file

    saved = load_file(str(root / "checkpoints" / run_id / "weights" / "final" / "adapter_model.safetensors"))
    peft = load_file(str(tmp_path / "dl" / "peft" / "adapter_model.safetensors"))
    assert saved.keys() == peft.keys() and all(saved[k].equal(peft[k]) for k in saved)


def test_math_rl_arithmetic_through_the_server(setup, tmp_path) -> None:
    server, client_env, _ = setup
    steps = 3
    run(server, ["-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={MODEL}", f"renderer_name={RENDERER}",
                 "env=arithmetic", "group_size=4", "groups_per_batch=4", "learning_rate=1e-3", "max_tokens=5",
                 "lora_rank=8", f"log_path={tmp_path / 'rl'}", f"max_steps={steps}", "eval_every=0", "save_every=0",
                 "behavior_if_log_dir_exists=delete"], client_env, timeout=900)
    rows = [m for m in metrics(tmp_path / "rl") if "env/all/reward/total" in m]
    print("math_rl reward per step (server):", [round(m["env/all/reward/total"], 3) for m in rows])
    assert len(rows) == steps
    assert all(m["env/all/ac_tokens_per_turn"] > 0 for m in rows if "env/all/ac_tokens_per_turn" in m)
