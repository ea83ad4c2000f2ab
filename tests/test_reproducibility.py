"""Same seed, same machine: bit-identical metrics, rollouts and weights, whatever the timing.

Float results depend on how sample requests are batched (padding, matmul shapes), so these runs
delay every sample submission by more than the old batcher's gather window: a batch made up by
timing splits differently and the runs part in the last digits (issue #16). A run interrupted
mid-step and resumed must land on the same bytes too.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest
from toy_adapter import ToyAdapter

from grpo.backends.local import clients
from grpo.record.checkpoint import final_adapter_dir
from grpo.record.runlog import WALL_CLOCK_PREFIXES as TIMING_PREFIXES
from grpo.record.runlog import read_jsonl
from grpo.rl.loop import run_grpo as loop_run_grpo

TINY = {"base_model": "tiny", "batch_size": 2, "group_size": 4, "max_tokens": 8, "report": False,
        "progress": False, "learning_rate": 1e-3, "eval_samples": 2, "seed": 11}
# The command: python -m grpo adapter=math steps=6 batch_size=2 group_size=4 max_tokens=8
PACKAGED = {"base_model": "smollm2", "batch_size": 2, "group_size": 4, "max_tokens": 8, "steps": 6,
            "report": False, "progress": False}


def outcome(run_dir: Path) -> dict:
    """Everything a run leaves that must not depend on timing: metrics minus wall-clock times,
    rollouts, and the final adapter's bytes."""
    def comparable(name: str) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in read_jsonl(run_dir / name)]

    return {"metrics": comparable("metrics.jsonl"), "rollouts": comparable("rollouts.jsonl"),
            "adapter": (final_adapter_dir(run_dir) / "adapter_model.safetensors").read_bytes()}


def slow_submissions(monkeypatch, delay_s: float) -> None:
    """Pause after every sample submission, as a loaded machine might: longer than any gather
    window, so that a batcher that closes batches by time would split every wave."""
    real = clients.SamplingClient.sample

    def sample(self, *args, **kwargs):
        future = real(self, *args, **kwargs)
        time.sleep(delay_s)
        return future

    monkeypatch.setattr(clients.SamplingClient, "sample", sample)


def interrupted_at(adapter, reward_call: int):
    """``adapter`` with Ctrl-C arriving during its ``reward_call``-th reward."""
    calls = 0
    real = adapter.compute_reward

    def compute_reward(response, sample):
        nonlocal calls
        calls += 1
        if calls == reward_call:
            raise KeyboardInterrupt
        return real(response, sample)

    adapter.compute_reward = compute_reward
    return adapter


def check_three_runs_agree(tmp_path: Path, monkeypatch, make_adapter, cfg: dict, interrupt_call: int,
                           precision: dict | None = None) -> None:
    """``precision``: ServiceClient dtype keys (train_dtype, sample_dtype); None: the defaults."""
    def run_grpo(adapter, cfg, run_dir):
        if precision is None:
            return loop_run_grpo(adapter, cfg, run_dir=run_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bf16 on a CPU without bf16 instructions warns
            service = clients.ServiceClient(checkpoint_dir=run_dir / "checkpoints", **precision)
        return loop_run_grpo(adapter, cfg, service_client=service, run_dir=run_dir)

    run_grpo(make_adapter(), cfg, run_dir=tmp_path / "straight")
    want = outcome(tmp_path / "straight")
    assert len({r["step"] for r in want["rollouts"]}) == cfg["steps"]

    with monkeypatch.context() as m:
        slow_submissions(m, delay_s=0.05)
        run_grpo(make_adapter(), cfg, run_dir=tmp_path / "slow")
    got = outcome(tmp_path / "slow")
    assert got["metrics"] == want["metrics"]
    assert got["rollouts"] == want["rollouts"]
    assert got["adapter"] == want["adapter"]

    with pytest.raises(KeyboardInterrupt):
        run_grpo(interrupted_at(make_adapter(), interrupt_call), cfg, run_dir=tmp_path / "resumed")
    assert (tmp_path / "resumed" / "checkpoints.jsonl").exists()
    run_grpo(make_adapter(), cfg, run_dir=tmp_path / "resumed")
    got = outcome(tmp_path / "resumed")
    assert got["metrics"] == want["metrics"]
    assert got["rollouts"] == want["rollouts"]
    assert got["adapter"] == want["adapter"]


def test_tiny_runs_are_bit_identical_however_sampling_is_timed_and_when_resumed(tmp_path, monkeypatch):
    # eval at step 0 scores 3 + 3x2 responses, each step 8: call 30 is inside step 2
    check_three_runs_agree(tmp_path, monkeypatch, ToyAdapter, {**TINY, "steps": 4, "save_every": 0}, interrupt_call=30)


@pytest.mark.slow
@pytest.mark.parametrize("precision", [{"train_dtype": "fp32", "sample_dtype": "bf16"},
                                       {"train_dtype": "bf16", "sample_dtype": "bf16"}], ids=["bf16-sample", "bf16"])
def test_bf16_tiny_runs_are_bit_identical_however_sampling_is_timed_and_when_resumed(tmp_path, monkeypatch, precision):
    """Within a precision: same seed, same machine, same bytes (the bf16 sampler's copy of the
    weights is rebuilt from the same fp32 state after a resume)."""
    check_three_runs_agree(tmp_path, monkeypatch, ToyAdapter, {**TINY, "steps": 4, "save_every": 0}, interrupt_call=30,
                           precision={"device": "cpu", **precision})


@pytest.mark.slow
def test_packaged_model_math_runs_are_bit_identical_and_resume_identically(tmp_path, monkeypatch):
    from adapters.math_rl import MathAdapter

    # the default eval scores 32 greedy + 32x4 sampled answers (160 calls), each step 8: call 190
    # is inside step 3, one of the steps where two runs used to part
    check_three_runs_agree(tmp_path, monkeypatch, MathAdapter, PACKAGED, interrupt_call=190)
