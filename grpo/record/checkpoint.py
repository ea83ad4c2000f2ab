"""Save and resume: backend state (adapter + optimizer) plus the loop's own state and RNGs.

A checkpoint is complete only once its loop_state.json exists and its line is in
checkpoints.jsonl; resuming takes the newest complete one, so a kill at any moment (even in the
middle of writing a checkpoint) resumes from a consistent point.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from grpo.api import names
from grpo.api.protocols import TrainingClient
from grpo.files import atomic_write_text, sweep_staging
from grpo.record.runlog import RunLog, read_jsonl

LOOP_STATE = "loop_state.json"
RNG_STATE = "rng.json"  # data, never a pickle: a file planted here must not run code on resume
LEGACY_RNG_STATE = "rng.pt"  # older runs' pickle: never unpickled


class ResumeError(ValueError):
    """A checkpoint of the run directory that cannot be loaded (a file planted, cut or garbled):
    one line naming it and how to resume from an earlier one."""


@dataclass(frozen=True)
class LoopState:
    """Where the loop stands between steps. Frozen: the loop builds the next one each step
    rather than writing into the one resume() read."""

    step: int = 0  # the next step to run
    cursor: int = 0  # position in the training item stream
    wandb_id: str | None = None
    solve_history: dict = field(default_factory=dict)  # saturation.SolveHistory.to_json()


def _loop_dir(run_dir: Path, name: str) -> Path:
    return run_dir / "checkpoints" / name


def save(training_client: TrainingClient, run_dir: Path, log: RunLog, state: LoopState) -> str:
    name = f"step_{state.step:06d}"
    path = training_client.save_state(name, overwrite=True).result().path  # Ctrl-C re-saves a step
    loop_dir = _loop_dir(run_dir, name)
    loop_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(loop_dir / RNG_STATE, json.dumps(rng_state()))
    atomic_write_text(loop_dir / LOOP_STATE, json.dumps(asdict(state)))
    # Relative to the run directory, so a run that is moved or copied resumes as itself.
    log.log_checkpoint({"step": state.step, "name": name, "path": str(path), "kind": "state",
                        "loop_state": (loop_dir / LOOP_STATE).relative_to(run_dir).as_posix()})
    return str(path)


def final_adapter_dir(run_dir: str | Path) -> Path:
    """The directory of a finished run's final PEFT adapter (``PeftModel.from_pretrained`` loads
    it), found through the ``tinker://`` path the run logged in checkpoints.jsonl."""
    from grpo.api.checkpoint_store import CheckpointStore

    run_dir = Path(run_dir)
    finals = [row for row in read_jsonl(run_dir / "checkpoints.jsonl") if row.get("kind") == "final"]
    if not finals:
        raise FileNotFoundError(f"{run_dir} has no final adapter in checkpoints.jsonl (the run has not finished)")
    return CheckpointStore(run_dir / "checkpoints").resolve(finals[-1]["path"])


def resume(run_dir: Path, training_client: TrainingClient, log: RunLog) -> LoopState | None:
    """Restore the newest complete checkpoint of ``run_dir``; None when there is none."""
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        for loop_dir in checkpoints.iterdir():  # loop_state.json / rng.json staged by a killed save
            sweep_staging(loop_dir)
    for row in reversed(read_jsonl(run_dir / "checkpoints.jsonl")):
        loop_file = _loop_file(run_dir, row) if row.get("kind") == "state" else None
        if loop_file is None or not loop_file.is_file():
            continue
        fix = (f"delete {loop_file.parent} (and the checkpoint it names, {row.get('path')}) to resume from an "
               "earlier checkpoint")
        try:
            state = LoopState(**json.loads(loop_file.read_text()))
        except (ValueError, TypeError) as err:
            raise ResumeError(f"{loop_file} is not a grpo loop state ({type(err).__name__}: {err}); {fix}") from err
        try:
            training_client.load_state_with_optimizer(row["path"]).result()
        except (ValueError, OSError) as err:  # what the local backend raises for a file it cannot read
            raise ResumeError(f"cannot resume from {row.get('path')}: {' '.join(str(err).split())}; {fix}") from err
        rng_file = loop_file.parent / RNG_STATE
        if rng_file.exists():
            set_rng_state(rng_file)
        elif (loop_file.parent / LEGACY_RNG_STATE).exists():
            log.print(f"{loop_file.parent / LEGACY_RNG_STATE} is a pickle (older grpo) and is not loaded, as a "
                      "pickle can run code: resuming with fresh random state")
        log.truncate_after(state.step)
        return state
    # Nothing to resume from (a fresh run, or one killed before its first checkpoint): what an
    # earlier attempt logged would be replayed, so its rows go.
    log.truncate_after(0)
    return None


def _loop_file(run_dir: Path, row: dict) -> Path | None:
    """Where a checkpoints.jsonl row's loop state lies in *this* run directory: its path relative
    to the run dir; in records written before that (absolute paths), the path itself while it still
    points inside the run dir, else the same place under this run's checkpoints/ (the run was moved
    or copied since). Never a file outside the run directory."""
    recorded = row.get("loop_state")
    if not isinstance(recorded, str) or not recorded:
        return None
    inside = run_dir.resolve()
    candidate = Path(recorded) if Path(recorded).is_absolute() else run_dir / recorded
    if candidate.resolve().is_relative_to(inside):
        return candidate
    name = row.get("name")
    if Path(recorded).is_absolute() and isinstance(name, str) and names.is_name(name):
        return _loop_dir(run_dir, name) / LOOP_STATE
    return None


def rng_state() -> dict:
    """Python's, numpy's and torch's RNG states as JSON-ready data."""
    import torch

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def set_rng_state(path: Path) -> None:
    """Restore what rng_state saved; a file that is not that shape is one clear error."""
    import torch

    try:
        rng = json.loads(path.read_text())
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        raw = np.frombuffer(base64.b64decode(rng["torch"]), dtype=np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(raw))
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise ResumeError(f"{path} is not a grpo RNG state ({type(err).__name__}: {err}); delete the "
                         "checkpoint directory it is in to resume from an earlier one") from err
