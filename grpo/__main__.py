"""Command line: ``python -m grpo adapter=math group_size=8 loss_fn=ppo``.

Hydra composes conf/ (the checkout's top-level conf/, or the copy shipped inside the installed
package): adapter, backend and every hyperparameter. A sweep is
``python -m grpo -m learning_rate=1e-5,2e-5``. Rerunning a command with the same
``hydra.run.dir=...`` resumes that run (``hydra.sweep.dir=...`` for a sweep: finished runs are
skipped). The task function returns the run's objective, so Hydra sweepers (Optuna) can tune it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from grpo import preflight
from grpo.record import sweep
from grpo.rl.config import ConfigError, GRPOConfig
from grpo.rl.config_docs import config_dir

NON_LOOP_KEYS = ("adapter", "backend")


def build_adapter(adapter_cfg: DictConfig, cli_keys: set[str]) -> Any:
    """Instantiate ``adapter._target_`` with the group's arguments.

    When ``_target_`` is swapped for a user's class, the group file's own arguments (meant for
    the built-in adapter) are passed only where the new constructor accepts them; arguments
    given on the command line are always passed, so a typo there is an error, not ignored.
    """
    options = OmegaConf.to_container(adapter_cfg, resolve=True)
    target = options.pop("_target_", None)
    if not target or target == "???":
        raise ConfigError("adapter._target_ is not set: choose adapter=math|chat|code or set "
                          "adapter._target_=your_pkg.YourAdapter")
    module_name, _, class_name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"adapter._target_={target!r} does not import ({type(err).__name__}: {err}); "
                          "give a dotted path to an RLAdapter subclass importable from here") from err
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in options.items() if takes_any or k in params or k in cli_keys}
    unknown = [k for k in kwargs if not takes_any and k not in params]
    if unknown:
        raise ConfigError(f"adapter {target} does not take argument(s) {unknown}; it takes: "
                          f"{', '.join(n for n in params if n != 'self') or 'none'}")
    return cls(**kwargs)


def _cli_adapter_keys() -> set[str]:
    from hydra.core.hydra_config import HydraConfig

    keys = set()
    for override in HydraConfig.get().overrides.task:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("adapter."):
            keys.add(key.split(".", 1)[1])
    return keys


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def main(composed: DictConfig) -> float | None:
    """Train one run; return its objective (the last logged value of ``objective``; None when
    never logged) so that any Hydra sweeper can optimise it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    resolved = OmegaConf.to_container(composed, resolve=True)
    try:
        # Validate everything cheap before anything heavy (torch, models) is imported.
        loop_cfg = GRPOConfig.from_any({k: v for k, v in composed.items() if k not in NON_LOOP_KEYS})
        required = _objective_required(hydra_cfg, in_sweep)
        sweep.check_objective(loop_cfg, required=required)
        backend_cfg = OmegaConf.to_container(composed.backend, resolve=True)
        adapter = build_adapter(composed.adapter, _cli_adapter_keys())
        if backend_cfg.get("name", "local") == "local":  # a service resolves its own model names
            from grpo.models import check_available

            check_available(loop_cfg.base_model)  # a missing directory, a malformed name, an unreachable hub id
    except (ConfigError, ValueError, TypeError) as err:
        print(f"grpo: configuration error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:
        _disk_error(err)
    if in_sweep and sweep.finished(run_dir, loop_cfg.steps, resolved):
        print(f"[grpo] {run_dir} already finished; skipped (its objective is read from metrics.jsonl)")
        return _objective(run_dir, loop_cfg.objective, in_sweep, required)

    with _sweep_gpu(backend_cfg, hydra_cfg.job.num if in_sweep else None) as device:
        if device is not None:
            import torch

            torch.cuda.set_device(device)  # also where anything without an explicit device goes
            backend_cfg["device"] = device
            print(f"[grpo] sweep job {hydra_cfg.job.num} trains on {device}")
        try:
            from grpo.backends import create_service_client

            service_client = create_service_client(backend_cfg, run_dir)
        except (ConfigError, ValueError, TypeError) as err:
            print(f"grpo: configuration error: {err}", file=sys.stderr)
            sys.exit(2)
        except (ConnectionError, TimeoutError) as err:  # a remote backend that cannot be reached
            print(f"grpo: cannot reach the backend: {err}", file=sys.stderr)
            sys.exit(3)
        except OSError as err:
            _disk_error(err)
        from grpo.backends.remote.resilience import RemoteRequestError
        from grpo.models import ModelNotFoundError
        from grpo.record.checkpoint import ResumeError
        from grpo.rl.loop import run_grpo

        try:
            run_grpo(adapter, loop_cfg, service_client=service_client, run_dir=run_dir, resolved_config=resolved)
        except ConfigError as err:  # found once the run started: the adapter's data file, a config it reads
            print(f"grpo: {' '.join(str(err).split())}", file=sys.stderr)
            sys.exit(2)
        except RemoteRequestError as err:  # the service refused a value: one line naming it, no traceback
            print(f"grpo: {err}", file=sys.stderr)
            sys.exit(2)
        except ModelNotFoundError as err:  # a hub id that is neither cached nor reachable, a broken dir
            print(f"grpo: {' '.join(str(err).split())}", file=sys.stderr)
            sys.exit(2)
        except ResumeError as err:  # a checkpoint of the run planted, cut or garbled
            print(f"grpo: {' '.join(str(err).split())}", file=sys.stderr)
            sys.exit(2)
        except OSError as err:
            _disk_error(err)
    print_where_to_look(run_dir)
    return _objective(run_dir, loop_cfg.objective, in_sweep, required)


def print_where_to_look(run_dir: Path) -> None:
    """The run's last lines: what a user opens next (the run directory, and its report)."""
    from grpo.record.report import REPORT_NAME

    print(f"[grpo] run directory: {run_dir}")
    report = run_dir / REPORT_NAME
    print(f"[grpo] report: {report}" if report.is_file()
          else f"[grpo] report: none (report=false); python -m grpo.record.report {run_dir} writes it", flush=True)


def _disk_error(err: OSError) -> None:
    """A file of the run the disk refuses (read-only, immutable, full, a file where a directory
    belongs): one line naming it and exit 2. An OSError naming no file is not the disk's answer
    about one of the run's files, so it keeps its traceback (a bug shows where it is)."""
    if err.filename is None:
        raise err
    where = f"{err.filename}" + (f" -> {err.filename2}" if err.filename2 else "")
    print(f"grpo: cannot use {where}: {err.strerror or type(err).__name__} "
          "(the run directory must be writable by this user; fix it or pick another hydra.run.dir)",
          file=sys.stderr)
    sys.exit(2)


def _searching_sweeper(hydra_cfg: Any) -> bool:
    """A sweeper that ranks runs by the returned value (Optuna, Ax, ...), not Hydra's grid."""
    return not str(hydra_cfg.sweeper.get("_target_", "")).endswith(".BasicSweeper")


def _objective_required(hydra_cfg: Any, in_sweep: bool) -> bool:
    named = any(o.split("=", 1)[0].lstrip("+~") == "objective" for o in hydra_cfg.overrides.task)
    return named or (in_sweep and _searching_sweeper(hydra_cfg))


def _sweep_gpu(backend_cfg: dict, job_num: int | None) -> Any:
    """A GPU of its own for a sweep job on the local backend with ``device: auto`` when this
    machine has several; otherwise nothing to choose (the backend's setting stands)."""
    if job_num is None or backend_cfg.get("name") != "local" or backend_cfg.get("device") != "auto":
        return contextlib.nullcontext(None)
    import torch

    return sweep.claimed_gpu(int(job_num), torch.cuda.device_count())


def _objective(run_dir: Path, objective: str, in_sweep: bool, required: bool) -> float | None:
    """The run's objective. Missing (or NaN) it fails the job when a searching sweeper (Optuna...)
    would have to rank it; a grid sweep that names it says so; otherwise it is None, quietly."""
    value = sweep.read_objective(run_dir, objective)
    if value is not None and not math.isnan(value):
        return value
    if not (in_sweep and required):
        return None
    from hydra.core.hydra_config import HydraConfig

    problem = (f"objective={objective} is {'NaN' if value is not None else 'missing'} in "
               f"{run_dir / 'metrics.jsonl'} (logged keys: "
               f"{', '.join(sweep.logged_metric_keys(run_dir)) or 'none'})")
    if not _searching_sweeper(HydraConfig.get()):
        print(f"[grpo] {problem}", file=sys.stderr)
        return None
    raise sweep.ObjectiveError(f"{problem}: the sweeper has no number to rank this run by; "
                               "set objective= to one of the logged keys")


def cli() -> None:
    """``python -m grpo ...``: the checks Hydra itself would fail on with a traceback, then Hydra."""
    try:
        preflight.check_argv(sys.argv[1:], config_dir())
    except ConfigError as err:
        print(f"grpo: configuration error: {err}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
