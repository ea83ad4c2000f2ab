"""What a sweep needs from a run: its objective, its own GPU, a skip when it already finished, and
one ranked report of the whole sweep.

The CLI's task function returns the run's objective (the last value of ``cfg.objective`` in
metrics.jsonl), so any Hydra sweeper (Optuna, Ax, Nevergrad, a grid) can optimise it; launchers
(joblib, submitit) run jobs in parallel, and each local job on a multi-GPU machine claims a GPU
of its own through a lock file, never piling onto cuda:0.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from grpo.checks import ConfigError
from grpo.record.runlog import read_jsonl

GPU_LOCK_DIR = Path(tempfile.gettempdir()) / "grpo-gpu-locks"
_PASS_AT = re.compile(r"eval/pass@(\d+)")


# --------------------------------------------------------------------------- the objective


class ObjectiveError(RuntimeError):
    """A sweep job finished without the number its sweeper optimises."""


class ObjectiveSettings(Protocol):
    """What of a run's config decides which metrics it logs (a GRPOConfig has these keys; the
    record sits below the loop, so it names them rather than importing the loop's config)."""

    objective: str
    eval_size: int
    eval_samples: int


def check_objective(cfg: ObjectiveSettings, required: bool = True) -> None:
    """Fail before any model loads when the objective cannot appear in this run's metrics.
    ``required=False`` (nobody asked for it: the default key outside a searching sweep) checks
    only that it is a name, so ``eval_size=0`` runs keep working with the default objective."""
    objective = cfg.objective
    if not isinstance(objective, str) or not objective.strip():
        raise ConfigError(f"objective={objective!r} is invalid: name a metric of metrics.jsonl, "
                          "e.g. eval/accuracy, eval/pass@4, reward/mean")
    if not required:
        return
    if objective.startswith("eval/") and cfg.eval_size == 0:
        raise ConfigError(f"objective={objective} needs held-out evaluation, but eval_size=0: set "
                          "eval_size > 0 or choose a training metric such as reward/mean")
    match = _PASS_AT.fullmatch(objective)
    if match and int(match.group(1)) != cfg.eval_samples:
        raise ConfigError(f"objective={objective} is logged only with eval_samples={match.group(1)} "
                          f"(this run has eval_samples={cfg.eval_samples}, so it logs "
                          f"eval/pass@{cfg.eval_samples})")


def read_objective(run_dir: str | Path, objective: str) -> float | None:
    """The last logged value of ``objective`` in RUN_DIR/metrics.jsonl (the final evaluation for an
    ``eval/*`` key); None when the run never logged it, NaN when its last value was (logged as
    null); the CLI treats both as "no objective" rather than rank a made-up number."""
    value = None
    for row in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        if objective in row:
            raw = row[objective]
            value = math.nan if raw is None else float(raw)
    return value


def logged_metric_keys(run_dir: str | Path) -> list[str]:
    keys: set[str] = set()
    for row in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        keys.update(k for k in row if k != "step")
    return sorted(keys)


# --------------------------------------------------------------------------- resuming a sweep


def finished(run_dir: str | Path, steps: int, resolved_config: dict[str, Any]) -> bool:
    """True when RUN_DIR holds a completed run of exactly this configuration: its final adapter is
    logged at step ``steps`` and its config.yaml matches. A resumed sweep skips such a job instead
    of loading the model only to find nothing left to do."""
    run_dir = Path(run_dir)
    done = any(row.get("kind") == "final" and row.get("step") == steps
               for row in read_jsonl(run_dir / "checkpoints.jsonl"))
    if not done or not (run_dir / "config.yaml").is_file():
        return False
    import yaml

    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return False
    # Through YAML both ways, so 2e-5 vs 2.0e-05 or a tuple vs a list do not count as changes.
    return saved == yaml.safe_load(yaml.safe_dump(resolved_config, sort_keys=False))


# --------------------------------------------------------------------------- one run per GPU


def gpu_ids(n_gpus: int, visible: str | None = None) -> list[str]:
    """Names of the visible GPUs that are the same in every process on this machine: the entries
    of CUDA_VISIBLE_DEVICES when it is set (cuda:0 of a process may be physical GPU 3)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    names = [v.strip() for v in (visible or "").split(",") if v.strip()]
    return names[:n_gpus] if len(names) >= n_gpus else [str(i) for i in range(n_gpus)]


@contextlib.contextmanager
def claimed_gpu(job_num: int, n_gpus: int, lock_dir: Path = GPU_LOCK_DIR, *, visible: str | None = None,
                poll_s: float = 1.0, log: Any = print) -> Iterator[str | None]:
    """Hold one GPU of this machine for the ``with`` block and yield its device (``cuda:i``).

    Job ``n`` tries GPU ``n % n_gpus`` first, then the next ones, taking the first whose lock file
    no other process holds (an flock, released when the block ends or the process dies). When every
    GPU is busy it waits for one to free up: more parallel jobs than GPUs queue instead of sharing a
    GPU. With one GPU or none there is nothing to choose and it yields None (the backend's own
    ``device: auto`` stands).
    """
    if n_gpus <= 1:
        yield None
        return
    import fcntl  # POSIX; imported here so that grpo.__main__ itself imports anywhere

    lock_dir.mkdir(parents=True, exist_ok=True)
    names = gpu_ids(n_gpus, visible)
    order = [(job_num + i) % n_gpus for i in range(n_gpus)]
    held: IO[str] | None = None
    device = None
    waited = False
    while held is None:
        for index in order:
            f = open(lock_dir / f"gpu-{names[index]}.lock", "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            held, device = f, f"cuda:{index}"
            break
        if held is None:
            if not waited:
                log(f"[grpo] job {job_num}: all {n_gpus} GPUs are busy with other runs; waiting for one")
                waited = True
            time.sleep(poll_s)
    try:
        held.seek(0)
        held.truncate()
        held.write(f"{os.getpid()}\n")  # who holds it, for a human looking at the lock dir
        held.flush()
        yield device
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
        held.close()


# --------------------------------------------------------------------------- run directory names

SWEPT_KEYS_FILE = ".swept_keys.json"  # in the sweep dir, written when the sweep starts


def _override_key(override: Any) -> str:
    return override.key_or_group if override.package is None else f"{override.key_or_group}@{override.package}"


def swept_keys(task_overrides: Sequence[str], sweeper_params: Any = None) -> list[str]:
    """The keys a sweep varies: command-line overrides with sweep syntax (``a=1,2``, ``range()``,
    ``interval()`` for Optuna) and the keys of ``hydra.sweeper.params``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    keys = [_override_key(o) for o in parsed if o.is_sweep_override()]
    keys += [str(k) for k in (sweeper_params or {}) if str(k) not in keys]
    return keys


def job_dirname(job_num: int, job_overrides: Sequence[str], keys: Sequence[str] | None,
                exclude: Sequence[str] = ()) -> str:
    """``<num>_<k=v,...>`` with only the swept keys (every override when they are unknown), sorted,
    and '/' made '_' so a value such as a model path stays one directory level."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(job_overrides))
    chosen = [o.input_line for o in parsed
              if _override_key(o) not in exclude and (keys is None or _override_key(o) in keys)]
    name = ",".join(sorted(chosen)).replace("/", "_")
    return f"{job_num}_{name}" if name else str(job_num)


def _resolve_job_dirname(*, _root_: Any) -> str:
    """Resolver ``${grpo.job_dirname:}`` for ``hydra.sweep.subdir``, evaluated in each job."""
    hydra_cfg = _root_.hydra
    keys = None
    try:
        keys = json.loads((Path(str(hydra_cfg.sweep.dir)) / SWEPT_KEYS_FILE).read_text())
    except (OSError, ValueError):
        pass  # launched without grpo's callback: name the run by all its overrides
    exclude = list(hydra_cfg.job.config.override_dirname.exclude_keys or [])
    return job_dirname(int(hydra_cfg.job.num), list(hydra_cfg.overrides.task), keys, exclude)


if not OmegaConf.has_resolver("grpo.job_dirname"):
    OmegaConf.register_new_resolver("grpo.job_dirname", _resolve_job_dirname)


# --------------------------------------------------------------------------- the sweep's report


class SweepReport(Callback):
    """Hydra callback (set in conf/config.yaml). When a sweep starts it records which keys the sweep
    varies (run directories are named by those alone); when it ends it writes SWEEP_DIR/report.html
    with every run overlaid and ranked by its objective, and prints the ranking."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        params = OmegaConf.select(config, "hydra.sweeper.params")
        keys = swept_keys(list(config.hydra.overrides.task), params)
        (sweep_dir / SWEPT_KEYS_FILE).write_text(json.dumps(keys))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from grpo.record.report import ReportError, build_report, find_runs, load_run, rank_runs

        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            runs = rank_runs([load_run(p) for p in find_runs([sweep_dir])])
            path = build_report([sweep_dir], sweep_dir / "report.html")
        except ReportError as err:  # every job failed before logging anything
            print(f"[grpo] no sweep report: {err}")
            return
        except Exception as err:  # a report must never turn a finished sweep into a failure
            print(f"[grpo] sweep report not written: {type(err).__name__}: {err}")
            return
        if all(run.objective[1] is None for run in runs):  # nothing to rank by (say, eval_size=0)
            print(f"[grpo] sweep report: {path}")
            return
        print(f"[grpo] {len(runs)} runs ranked by their objective (best first), report: {path}")
        for rank, run in enumerate(runs, 1):
            key, value = run.objective
            shown = "-" if value is None else f"{value:.4g}"
            print(f"  #{rank}  {key}={shown}  {run.path.name}")
