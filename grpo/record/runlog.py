"""The run directory: jsonl logs, wandb and the live progress display.

Layout of RUN_DIR:
  config.yaml          the resolved configuration
  metrics.jsonl        one line per step (and eval lines with eval/ keys)
  rollouts.jsonl       prompt, response, reward, advantage of sampled responses
  failures.jsonl       rewards that raised or were not finite, with tracebacks
  checkpoints.jsonl    every checkpoint written
  checkpoints/         adapter + optimizer + loop state per checkpoint, and final/
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from grpo.files import atomic_write_text, sweep_staging

LOG_FILES = ("metrics.jsonl", "rollouts.jsonl", "failures.jsonl")
# Metrics measured in wall-clock time: the only ones that may differ between two runs of one seed.
WALL_CLOCK_PREFIXES = ("time/", "throughput/")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl file (none if it does not exist). A line that does not parse, a
    last line cut by a kill or one edited by hand, is skipped rather than hiding what follows."""
    if not path.is_file():
        return []
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLog:
    def __init__(self, run_dir: Path, config: Mapping[str, Any], total_steps: int, progress: bool = True,
                 wandb_cfg: Any = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sweep_staging(self.run_dir)  # metrics.jsonl.<pid>.tmp and the like of a run killed mid-write
        self.config = dict(config)
        self._progress = _Progress(total_steps) if progress else None
        self._wandb = None
        self._wandb_cfg = wandb_cfg

    # ------------------------------------------------------------------ files

    def write_config(self, resolved: Mapping[str, Any]) -> None:
        import yaml

        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(dict(resolved), sort_keys=False))

    def truncate_after(self, step: int) -> None:
        """Drop log lines of steps >= ``step``: a resumed run replays them exactly."""
        for name in LOG_FILES:
            path = self.run_dir / name
            rows = [r for r in read_jsonl(path) if r.get("step", -1) < step]
            _write_lines(path, rows)

    def _append(self, name: str, rows: Iterable[Mapping[str, Any]]) -> None:
        with open(self.run_dir / name, "a") as f:
            for row in rows:
                f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
            f.flush()

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._append("metrics.jsonl", [{"step": step, **metrics}])
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if v is not None}, step=step)
        if self._progress is not None:
            self._progress.update(step, metrics)

    def log_rollouts(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self._append("rollouts.jsonl", rows)

    def log_failures(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self._append("failures.jsonl", rows)

    def log_checkpoint(self, row: Mapping[str, Any]) -> None:
        self._append("checkpoints.jsonl", [row])

    # ------------------------------------------------------------------ wandb

    def start_wandb(self, run_id: str | None) -> str | None:
        cfg = self._wandb_cfg
        if cfg is None or not cfg.enabled:
            return None
        import wandb

        self._wandb = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name, tags=list(cfg.tags),
                                 mode=cfg.mode, dir=str(self.run_dir), config=self.config, id=run_id,
                                 resume="allow")
        return self._wandb.id

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def show_sample(self, step: int, row: Mapping[str, Any]) -> None:
        """One sampled prompt, response and reward on the console, to read what the policy does."""
        prompt = str(row["prompt"])[-300:]
        self.print(f"--- step {step} sample (reward {row['reward']}, advantage {row['advantage']:+.3f})\n"
                   f"[prompt] ...{prompt}\n[response] {row['response']}")

    def print(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.print(message)
        else:
            print(message, flush=True)


def _write_lines(path: Path, rows: list[dict[str, Any]]) -> None:
    if not path.exists() and not rows:
        return
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


class _Progress:
    """A rich progress bar with the step's reward and accuracy; one plain line per step when
    the output is not a terminal (logs, CI), so nothing is lost in a file."""

    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        # soft_wrap: a path or a metrics line stays one line in log files, whatever their width
        self.console = Console(stderr=False, soft_wrap=True)
        self.live = sys.stdout.isatty()
        self.progress = Progress(TextColumn("[bold]grpo"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                 console=self.console, disable=not self.live)
        self.task = self.progress.add_task("steps", total=total, status="")
        self.progress.start()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        parts = []
        for key, label in (("reward/mean", "reward"), ("accuracy", "acc"), ("eval/accuracy", "eval acc"),
                           ("eval/win_rate", "eval win rate vs base"), ("time/step", "s/step")):
            value = metrics.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                parts.append(f"{label} {value:.3f}")
        status = "  ".join(parts)
        if any(key.startswith("eval/") for key in metrics):
            self.console.print(f"step {step:>4}  {status}")
            return
        self.progress.update(self.task, completed=step + 1, status=status)
        if not self.live:
            self.console.print(f"step {step + 1:>4}/{self.progress.tasks[0].total}  {status}")

    def close(self) -> None:
        self.progress.stop()
