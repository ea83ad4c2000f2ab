"""The tinker-cookbook's multi-turn recipe ``recipes.multiplayer_rl.guess_number`` one step, in-process
(``python -m grpo.tinker_run``) and through ``python -m grpo.serve`` with the unmodified SDK 0.38,
unchanged but for config values, on the packaged SmolLM2 and offline (overlays as in
test_cookbook_inprocess.py and test_cookbook_serve.py).

Slow, and in CI's slow set (the issue asks for the recipe there): one step of 2 episodes of up to 10
turns takes minutes on 2 cores, most of it training (the cookbook re-renders the conversation each
turn, so each turn becomes its own datum over the whole conversation so far).

``twenty_questions`` is not run: its answerer is a second model named by the dataset builder
(Qwen/Qwen3.5-9B, not a command-line option), whose renderer the cookbook takes from its own
registry (tinker_cookbook.model_info: Qwen, Llama, DeepSeek and a few others) -- none of those models
is available offline, and with SmolLM2 as the answerer the recipe stops in get_model_attributes.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from cookbook_helpers import MODEL, RENDERER, cookbook_overlay, env, hf_cache, metrics
from serve_helpers import API_KEY, Server, sdk_overlay

pytestmark = pytest.mark.slow
SDK = "0.38.0"
EPISODES = 2
GUESS_NUMBER = ["tinker_cookbook.recipes.multiplayer_rl.guess_number.train", f"model_name={MODEL}",
                f"renderer_name={RENDERER}", "group_size=2", "batch_size=1", "max_tokens=8", "learning_rate=1e-4",
                "max_steps=1", "eval_every=0", "save_every=0", "behavior_if_log_dir_exists=delete"]


def check_step(log_path) -> dict:
    """One step of the recipe: every episode ran (at most 10 guesses, the environment answering
    each), each turn's observation is the whole re-rendered conversation, rewards are the recipe's
    (-1 per unparsable turn, 0 per wrong guess, +1 once right), and the trainer saw the sampler's
    tokens. Returns the step's metrics."""
    rows = [m for m in metrics(log_path) if "env/all/total_episodes" in m]
    assert len(rows) == 1
    row = rows[0]
    assert row["env/all/total_episodes"] == EPISODES
    assert 1 <= row["env/all/turns_per_episode"] <= 10
    assert row["env/all/total_turns"] == EPISODES * row["env/all/turns_per_episode"]
    assert 0 < row["env/all/ac_tokens_per_turn"] <= 8  # max_tokens=8
    # turn k's observation holds the k-1 turns before it: far longer than one action
    assert row["env/all/ob_tokens_per_turn"] > 5 * row["env/all/ac_tokens_per_turn"]
    assert -10 <= row["env/all/reward/total"] <= 1
    assert abs(row["optim/kl_sample_train_v1"]) < 1e-3  # an estimate of a KL near 0: may be < 0
    assert math.isfinite(row["grad_norm"])
    return row


@pytest.fixture(scope="module")
def overlay_env(tmp_path_factory):
    overlay = cookbook_overlay()
    return overlay, hf_cache(tmp_path_factory.mktemp("hub"))


def test_guess_number_one_step_in_process(overlay_env, tmp_path) -> None:
    overlay, hub = overlay_env
    out = subprocess.run([sys.executable, "-m", "grpo.tinker_run", *GUESS_NUMBER, f"log_path={tmp_path / 'rl'}"],
                         env=env(overlay, hub_cache=hub, GRPO_CHECKPOINT_DIR=str(tmp_path / "ckpt")),
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    check_step(tmp_path / "rl")


def test_guess_number_one_step_through_the_server(overlay_env, tmp_path) -> None:
    """Every turn is an asample on the step's sampling session; afterwards the base model's
    sampler shows that later turns read most of their prompt from the prefix cache."""
    overlay, hub = overlay_env
    server = Server(tmp_path / "checkpoints", env=env(overlay, hub_cache=hub))
    try:
        stats_path = sampler_stats_route(server)
        before = server.call("GET", stats_path)[1]
        client_env = env(sdk_overlay(SDK), overlay, hub_cache=hub, TINKER_BASE_URL=server.url, TINKER_API_KEY=API_KEY)
        out = subprocess.run([sys.executable, "-m", *GUESS_NUMBER, f"log_path={tmp_path / 'rl'}"], env=client_env,
                             capture_output=True, text=True, timeout=1500)
        assert out.returncode == 0, f"{out.stderr[-3000:]}\nserver log:\n{server.log.read_text()[-3000:]}"
        row = check_step(tmp_path / "rl")
        after = server.call("GET", stats_path)[1]
    finally:
        server.stop()
    stats = {k: after[k] - before[k] for k in ("prefix_hits", "prefix_hit_tokens", "prompt_tokens")}
    # every turn after an episode's first finds its conversation so far in the cache
    assert stats["prefix_hits"] >= row["env/all/total_turns"] - EPISODES, stats
    assert stats["prefix_hit_tokens"] > 0.5 * stats["prompt_tokens"], stats


def sampler_stats_route(server: Server) -> str:
    """The stats route of a sampling session of MODEL: its counters are those of the base model's
    one sampler, which every session of that model (the recipe's too) goes through."""
    session = server.call("POST", "/api/v1/create_session", {})[1]["session_id"]
    status, body = server.call("POST", "/api/v1/create_sampling_session", {"session_id": session, "base_model": MODEL,
                                                                            "sampling_session_seq_id": 0})
    assert status == 200, body
    return f"/api/v1/samplers/{body['sampling_session_id']}/stats"
