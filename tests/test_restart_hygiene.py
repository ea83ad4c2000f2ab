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
    return (run_dir / row["loop_state"]).parent  # relative to the run directory


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


class RecordingClient:
    """Stands in for the training client on resume: records which checkpoint it was told to load."""

    def __init__(self):
        self.loaded: list[str] = []

    def load_state_with_optimizer(self, path):
        self.loaded.append(path)
        return type("Done", (), {"result": lambda self: None})()


def test_a_moved_or_copied_run_directory_resumes_as_itself(tmp_path):
    """Issue #37 D: checkpoints.jsonl held absolute paths, so a moved run resumed nothing (logs cut
    to step 0, every step retrained) and a copied run loaded the original's loop state."""
    from grpo.record import checkpoint
    from grpo.record.runlog import RunLog

    interrupted_run(tmp_path / "run")
    row = read_jsonl(tmp_path / "run" / "checkpoints.jsonl")[-1]
    assert not pathlib.Path(row["loop_state"]).is_absolute(), row  # recorded relative to the run dir
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert metrics

    (tmp_path / "run").rename(tmp_path / "moved")
    client = RecordingClient()
    state = checkpoint.resume(tmp_path / "moved", client, RunLog(tmp_path / "moved", {}, 3, progress=False))
    assert state is not None and state.step == 1 and client.loaded == [row["path"]]
    assert read_jsonl(tmp_path / "moved" / "metrics.jsonl") == [r for r in metrics if r["step"] < 1]

    import shutil
    shutil.copytree(tmp_path / "moved", tmp_path / "copy")
    loop_file = tmp_path / "moved" / row["loop_state"]
    loop_file.write_text(json.dumps({**json.loads(loop_file.read_text()), "cursor": 999}))  # the original moves on
    state = checkpoint.resume(tmp_path / "copy", RecordingClient(), RunLog(tmp_path / "copy", {}, 3, progress=False))
    assert state is not None and state.cursor != 999


def test_an_older_record_with_absolute_paths_still_resumes(tmp_path):
    """Runs written before the paths became relative: an absolute loop_state inside the run dir is
    used as it is; one that no longer points inside it (the run was moved or copied since) is
    found under the run's own checkpoints/<name>/."""
    from grpo.record import checkpoint
    from grpo.record.runlog import RunLog

    run = tmp_path / "run"
    loop_dir = run / "checkpoints" / "step_000002"
    loop_dir.mkdir(parents=True)
    (loop_dir / checkpoint.LOOP_STATE).write_text(json.dumps({"step": 2, "cursor": 4}))
    old_row = {"step": 2, "name": "step_000002", "path": "tinker://run-x/weights/step_000002", "kind": "state",
               "loop_state": str(loop_dir / checkpoint.LOOP_STATE)}
    (run / "checkpoints.jsonl").write_text(json.dumps(old_row) + "\n")
    for where in (run, tmp_path / "elsewhere"):
        if where != run:
            run.rename(where)
        client = RecordingClient()
        state = checkpoint.resume(where, client, RunLog(where, {}, 3, progress=False))
        assert state is not None and (state.step, state.cursor) == (2, 4) and client.loaded == [old_row["path"]]


def dead_pid() -> str:
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_failed_write_leaves_no_staging_file(tmp_path):
    """Issue #37 G: grpo/files.py left its <name>.tmp<pid> behind whenever the write or the rename failed."""
    from grpo.files import atomic_write_text

    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(tmp_path / "metrics.jsonl", "\ud800")  # fails after the staging file is opened
    (tmp_path / "run.json").mkdir()
    (tmp_path / "run.json" / "x").write_text("a directory is in the way")
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "run.json", "{}")  # the rename fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_staging_files_of_killed_writes_are_swept_on_restart(tmp_path):
    """Issue #37 G: the restart sweep matched only names ending .tmp, so <name>.tmp<pid> files
    (run.json, .meta.json, metrics.jsonl) of a killed writer stayed for ever."""
    from grpo.api.checkpoint_store import CheckpointStore
    from grpo.record import checkpoint
    from grpo.record.runlog import RunLog

    dead = dead_pid()
    run_dir = tmp_path / "run"
    store = CheckpointStore(run_dir / "checkpoints")
    run = store.create_run("tiny", lora_rank=2)
    ckpt = store.save(run.training_run_id, "training", "step_000001", lambda d: (d / "f").write_text("x"))
    weights = store.root / run.training_run_id / "weights"
    loop_dir = run_dir / "checkpoints" / "step_000001"
    loop_dir.mkdir()
    leftovers = [store.root / run.training_run_id / f"run.json.tmp{dead}", weights / f"step_000001.meta.json.tmp{dead}",
                 weights / f"step_000002.meta.json.{dead}.tmp", run_dir / f"metrics.jsonl.tmp{dead}",
                 run_dir / f"rollouts.jsonl.{dead}.tmp", loop_dir / f"loop_state.json.tmp{dead}"]
    live = [run_dir / f"metrics.jsonl.tmp{__import__('os').getpid()}"]  # a live writer's: kept
    for f in leftovers + live:
        f.write_text("half")
    CheckpointStore(run_dir / "checkpoints")  # a server restart, or a resumed run's backend
    checkpoint.resume(run_dir, RecordingClient(), RunLog(run_dir, {}, 3, progress=False))
    assert [f for f in leftovers if f.exists()] == [] and all(f.exists() for f in live)
    assert store.resolve(ckpt.tinker_path).is_dir()
