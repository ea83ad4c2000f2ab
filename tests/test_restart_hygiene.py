"""Resuming is safe and clean: nothing in a run directory is unpickled (a planted pickle never runs),
and a run killed before its first checkpoint restarts with the logs of an uninterrupted run."""

from __future__ import annotations

import json
import pathlib
import pickle
import signal

import pytest
from test_cli import TOY, comparable, grpo
from test_reproducibility import TINY, interrupted_at
from toy_adapter import ToyAdapter

from grpo.record.checkpoint import LEGACY_RNG_STATE, RNG_STATE
from grpo.record.runlog import read_jsonl
from grpo.rl.loop import run_grpo


class Planted:
    """Unpickling this creates ``marker``: proof that code from the file ran."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def interrupted_run(run_dir: pathlib.Path) -> pathlib.Path:
    """A run stopped by Ctrl-C in step 1, which leaves a checkpoint; its loop-state directory."""
    with pytest.raises(KeyboardInterrupt):
        run_grpo(interrupted_at(ToyAdapter(eval_items=0), 12), {**TINY, "steps": 3, "save_every": 0}, run_dir=run_dir)
    row = read_jsonl(run_dir / "checkpoints.jsonl")[-1]
    return pathlib.Path(row["loop_state"]).parent


def test_rng_state_is_json_and_a_planted_pickle_never_runs(tmp_path):
    loop_dir = interrupted_run(tmp_path / "run")
    saved = json.loads((loop_dir / RNG_STATE).read_text())  # data, readable without unpickling
    assert set(saved) == {"python", "numpy", "torch"}

    marker = tmp_path / "pwned"
    (loop_dir / RNG_STATE).write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(ValueError, match=r"rng.json is not a grpo RNG state"):
        run_grpo(ToyAdapter(eval_items=0), {**TINY, "steps": 3, "save_every": 0}, run_dir=tmp_path / "run")
    assert not marker.exists()

    # An older run's pickle (rng.pt) is not unpickled either: the run resumes without it.
    (loop_dir / RNG_STATE).unlink()
    (loop_dir / LEGACY_RNG_STATE).write_bytes(pickle.dumps(Planted(marker)))
    run_grpo(ToyAdapter(eval_items=0), {**TINY, "steps": 3, "save_every": 0}, run_dir=tmp_path / "run")
    assert not marker.exists()
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r] == [0, 1, 2]


@pytest.mark.slow  # kills and restarts a real run, about a minute on 2 cores: CI's slow stage runs it
def test_a_run_killed_before_its_first_checkpoint_restarts_with_clean_logs(tmp_path):
    args = [*TOY, "steps=2", "save_every=0", "seed=5"]
    straight = grpo(*args, f"hydra.run.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    # Eval at step 0 scores 9 responses, each step 8 more: call 21 is inside step 1, before any checkpoint.
    run_dir = tmp_path / "killed"
    killed = grpo(*args, f"hydra.run.dir={run_dir}", extra_env={"GRPO_TEST_KILL_AT_CALL": "21"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert read_jsonl(run_dir / "metrics.jsonl") and not (run_dir / "checkpoints.jsonl").exists()

    rerun = grpo(*args, f"hydra.run.dir={run_dir}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        assert comparable(read_jsonl(run_dir / name)) == comparable(read_jsonl(tmp_path / "straight" / name)), name
