"""MinT's RL demos with ``from grpo import RLAdapter, RLConfig, run_grpo``: RLConfig's fields,
defaults and ``from_env`` as in mint-quickstart's ``demos/rl/rl_core.py``, the backend rule, the
one-line errors, and demo-shaped scripts (tests/mint_demos/) run as subprocesses."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo import RLConfig
from grpo.mint_run import ENV_VARS, load_env_file
from grpo.record.checkpoint import final_adapter_dir
from grpo.record.runlog import read_jsonl
from grpo.rl.config import ConfigError

DEMOS = Path(__file__).parent / "mint_demos"
REPO = Path(__file__).resolve().parents[1]

# rl_core.RLConfig, field by field (mint-quickstart demos/rl/rl_core.py).
RL_CORE_DEFAULTS = {"model": "Qwen/Qwen3-0.6B", "rank": 16, "steps": 5, "batch": 8, "group": 4, "lr": 1e-4,
                    "max_tokens": 16, "temperature": 1.0}
RL_CORE_VARS = {"model": "MINT_BASE_MODEL", "rank": "MINT_LORA_RANK", "steps": "MINT_RL_STEPS",
                "batch": "MINT_RL_BATCH", "group": "MINT_RL_GROUP", "lr": "MINT_RL_LR",
                "max_tokens": "MINT_RL_MAX_TOKENS", "temperature": "MINT_RL_TEMPERATURE"}


@pytest.fixture
def mint_env(monkeypatch, tmp_path):
    """No MINT_* variable from the outside, and a clean current directory for .env."""
    for var in [*RL_CORE_VARS.values(), "MINT_API_KEY", "MINT_BASE_URL"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def test_rlconfig_has_rl_cores_fields_defaults_and_variables(mint_env) -> None:
    assert dataclasses.asdict(RLConfig()) == RL_CORE_DEFAULTS
    assert {name: var for name, (var, _) in ENV_VARS.items()} == RL_CORE_VARS
    assert dataclasses.asdict(RLConfig.from_env()) == RL_CORE_DEFAULTS  # nothing set: the defaults


def test_from_env_reads_every_variable(mint_env) -> None:
    values = {"MINT_BASE_MODEL": "smollm2", "MINT_LORA_RANK": "8", "MINT_RL_STEPS": "3", "MINT_RL_BATCH": "6",
              "MINT_RL_GROUP": "5", "MINT_RL_LR": "3e-5", "MINT_RL_MAX_TOKENS": "12", "MINT_RL_TEMPERATURE": "0.7"}
    for var, value in values.items():
        mint_env.setenv(var, value)
    cfg = RLConfig.from_env()
    assert dataclasses.asdict(cfg) == {"model": "smollm2", "rank": 8, "steps": 3, "batch": 6, "group": 5,
                                       "lr": 3e-5, "max_tokens": 12, "temperature": 0.7}
    assert isinstance(cfg.rank, int) and isinstance(cfg.lr, float)


def test_dotenv_fills_only_unset_variables(mint_env, tmp_path) -> None:
    (tmp_path / ".env").write_text(
        "# MinT settings\n\nexport MINT_RL_STEPS=7\nMINT_RL_BATCH = '3'\nMINT_BASE_MODEL=\"tiny\"\n"
        "MINT_RL_LR=0.5\nnot a setting\n", encoding="utf-8")
    mint_env.setenv("MINT_RL_LR", "2e-4")  # set in the environment: .env must not override it
    cfg = RLConfig.from_env()
    assert (cfg.steps, cfg.batch, cfg.model, cfg.lr) == (7, 3, "tiny", 2e-4)
    assert os.environ["MINT_RL_STEPS"] == "7" and os.environ["MINT_RL_LR"] == "2e-4"
    assert load_env_file(tmp_path / ".env") == {}  # everything is set now: a second load adds nothing
    assert load_env_file(tmp_path / "missing.env") == {}


def test_a_bad_variable_is_named(mint_env) -> None:
    mint_env.setenv("MINT_RL_STEPS", "five")
    with pytest.raises(ConfigError, match=r"MINT_RL_STEPS='five' is invalid: must be an integer"):
        RLConfig.from_env()


def test_rlconfig_becomes_the_same_grpo_run() -> None:
    cfg = RLConfig(model="tiny", rank=4, steps=2, batch=3, group=5, lr=3e-5, max_tokens=9, temperature=0.6)
    loop = cfg.to_grpo_config()
    assert (loop.base_model, loop.rank, loop.steps, loop.batch_size, loop.group_size, loop.learning_rate,
            loop.max_tokens, loop.temperature) == ("tiny", 4, 2, 3, 5, 3e-5, 9, 0.6)
    with pytest.raises(ConfigError, match=r"group_size=1 is invalid.*MINT_RL_GROUP"):
        RLConfig(group=1).to_grpo_config()


def test_demo_prompts_get_token_ids_from_apply_chat_template(tokenizer) -> None:
    # transformers v5 returns a mapping for tokenize=True; list() of it would be its keys.
    from grpo.mint_run import _V4ChatTemplate

    messages = [{"role": "user", "content": "Why is the sea salty?"}]
    view = _V4ChatTemplate(tokenizer)
    ids = list(view.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False) and all(isinstance(i, int) for i in ids)
    assert view.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert view.eos_token_id == tokenizer.eos_token_id and len(view) == len(tokenizer)
    assert view("hi")["input_ids"] == tokenizer("hi")["input_ids"]


# --------------------------------------------------------------------------- the demos as scripts


def run_demo(name: str, cwd: Path, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MINT_")}
    base.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
                PYTHONPATH=str(REPO) + os.pathsep + base.get("PYTHONPATH", ""))
    base.update(env)
    return subprocess.run([sys.executable, str(DEMOS / f"{name}.py")], cwd=cwd, env=base, capture_output=True,
                          text=True, timeout=timeout)


def only_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_a_model_not_on_this_machine_is_one_line_naming_mint_base_model(tmp_path) -> None:
    # MinT's default model, with no MINT_API_KEY: local, where the hub cannot be reached.
    done = run_demo("verifiable_math", tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    line = only_line(done.stderr)
    assert line.startswith("grpo: MINT_BASE_MODEL='Qwen/Qwen3-0.6B' is not available on this machine")
    assert "MINT_BASE_MODEL=smollm2" in line and "MINT_API_KEY" in line
    assert not (tmp_path / "outputs").exists()  # failed before a run directory was made


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mint_api_key_in_dotenv_sends_the_run_to_the_mint_service(tmp_path) -> None:
    # The key only in .env (as the quickstart tells users to write it): the run goes to
    # MINT_BASE_URL, which here refuses the connection, and says so in one line.
    pytest.importorskip("mint")  # the MinT SDK (mindlab-toolkit, in the dev extra)
    url = f"http://127.0.0.1:{closed_port()}"
    (tmp_path / ".env").write_text(f"MINT_API_KEY=sk-mint-test\nMINT_BASE_URL={url}\n", encoding="utf-8")
    done = run_demo("verifiable_math", tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    line = only_line(done.stderr)
    assert line.startswith("grpo: cannot reach the MinT service (MINT_API_KEY is set")
    assert url in line and "MINT_BASE_URL" in line


def check_demo_run(done: subprocess.CompletedProcess, cwd: Path, steps: int, expect: dict) -> None:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for step in range(steps):  # the adapter's own evaluate() printed every step
        assert f"Step {step}: " in done.stdout
    (run_dir,) = (cwd / "outputs").iterdir()
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert {k: config[k] for k in expect} == expect
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == list(range(steps))
    final = final_adapter_dir(run_dir)
    assert (final / "adapter_config.json").exists()
    logged = [r for r in read_jsonl(run_dir / "checkpoints.jsonl") if r["kind"] == "final"][-1]["path"]
    assert f"final adapter: {logged}" in done.stdout


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_chat_shaped_demo_runs_as_written_on_the_tiny_model(tmp_path) -> None:
    # The chat demo's list(apply_chat_template(tokenize=True)) is the transformers-v4 idiom.
    done = run_demo("preference_chat", tmp_path, MINT_BASE_MODEL="tiny", MINT_RL_STEPS="2", MINT_RL_BATCH="2",
                    MINT_RL_GROUP="2", MINT_RL_MAX_TOKENS="6")
    check_demo_run(done, tmp_path, 2, {"base_model": "tiny", "batch_size": 2, "group_size": 2, "max_tokens": 6,
                                       "learning_rate": 1e-4, "temperature": 1.0, "rank": 16})


@pytest.mark.slow
@pytest.mark.parametrize("demo", ["verifiable_math", "preference_chat", "environment_tooluse"])
def test_mint_demos_run_as_written_on_the_packaged_model(demo: str, tmp_path) -> None:
    done = run_demo(demo, tmp_path, MINT_BASE_MODEL="smollm2", MINT_RL_STEPS="2", MINT_RL_BATCH="2",
                    MINT_RL_GROUP="3", MINT_RL_MAX_TOKENS="8", MINT_LORA_RANK="8")
    check_demo_run(done, tmp_path, 2, {"base_model": "smollm2", "batch_size": 2, "group_size": 3, "max_tokens": 8,
                                       "rank": 8, "learning_rate": 1e-4})
