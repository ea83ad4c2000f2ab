"""tinker-cookbook's rl_loop recipe, unmodified, training against `python -m grpo.serve` on CPU.

The cookbook lives in its own venv ($GRPO_COOKBOOK_PYTHON, else built once under
$GRPO_CACHE/venvs/). 0.5.8 is the newest release that installs from the registry: 0.6.1 needs
tml-renderers >= 0.4.1, which the registry does not have.

rl_loop reaches the Hugging Face hub in three places; each is met by configuration only:
- tokenizer: ``get_tokenizer(model_name)`` loads a local directory when ``model_name`` is one;
- renderer: picked from a table of hub names, so the directory is *named* like a listed model
  (``meta-llama/Llama-3.2-1B``, role_colon renderer) and holds the packaged SmolLM2;
- data: ``load_dataset("openai/gsm8k", "main")`` reads a local directory of that name when one
  exists, so a few GSM8K-style rows are written there with the hub repo's config layout.
The server runs in the same directory, so the same name is its base model (a local directory).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from serve_helpers import API_KEY, Server, sdk_venv

pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow

COOKBOOK = ["torch==2.13.0", "tinker-cookbook==0.5.8", "pylatexenc"]
MODEL_NAME = "meta-llama/Llama-3.2-1B"
GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
---
"""


def write_workdir(root: Path, rows: int) -> None:
    from grpo import models

    (root / MODEL_NAME).parent.mkdir(parents=True)
    (root / MODEL_NAME).symlink_to(models._ensure_packaged_smollm2(), target_is_directory=True)
    data = root / "openai" / "gsm8k"
    (data / "main").mkdir(parents=True)
    (data / "README.md").write_text(GSM8K_README)
    # The recipe's one-shot example counts the r's in "strawberry" (\boxed{3}); asking it again
    # gives a 135M model its best chance of a right answer, so that rewards can vary in a group
    # and the loop takes a gradient step (when all of a group's rewards are equal it skips it).
    words = ["strawberry", "strawberry", "raspberry", "strawberry"]
    with open(data / "main" / "train.jsonl", "w") as f:
        for i in range(rows):
            word = words[i % len(words)]
            f.write(json.dumps({"question": f"How many r's are in {word}?",
                                "answer": f"{word} has {word.count('r')} r's.\n#### {word.count('r')}"}) + "\n")


def test_cookbook_rl_loop_trains_against_the_server(tmp_path):
    python = sdk_venv("tinker-cookbook-0.5.8", COOKBOOK, "GRPO_COOKBOOK_PYTHON")
    write_workdir(tmp_path, rows=8)
    server = Server(tmp_path / "checkpoints", cwd=tmp_path)
    try:
        log_path = tmp_path / "rl-loop"
        env = {**server.client_env(), "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
        env.pop("TINKER_BASE_URL")  # the recipe's own base_url option says where the server is
        done = subprocess.run(
            [python, "-m", "tinker_cookbook.recipes.rl_loop", f"base_url={server.url}", f"model_name={MODEL_NAME}",
             "batch_size=2", "group_size=4", "max_tokens=48", "max_steps=2", "lora_rank=8", "save_every=0",
             f"log_path={log_path}"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, f"{done.stderr[-5000:]}\nserver:\n{server.log.read_text()[-3000:]}"
    finally:
        server.stop()
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    print("rl_loop metrics:", metrics)
    assert [m["progress/batch"] for m in metrics] == [0, 1]
    for m in metrics:
        assert 0.0 <= m["reward/total"] <= 1.0
        if "grad_norm" in m:  # optim_step ran (the batch had a reward spread to train on): it moved
            assert m["grad_norm"] > 0
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    final = checkpoints[-1]
    assert final["name"] == "final"
    assert final["state_path"].startswith("tinker://") and final["sampler_path"].startswith("tinker://")
    assert os.environ.get("TINKER_API_KEY") != API_KEY  # the key reached the recipe only through its env
