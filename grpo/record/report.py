"""One self-contained HTML report of a run (or of several runs overlaid), and PNG plots.

    python -m grpo.record.report RUN_DIR                      # writes RUN_DIR/report.html
    python -m grpo.record.report RUN_A RUN_B -o sweep.html    # runs overlaid in one page
    python -m grpo.record.report multirun/2025-01-01/12-00-00 # every run under a sweep's directory
    python -m grpo.record.report RUN_DIR --png                # also RUN_DIR/report_plots/overview.png

The page opens offline: no CDN, the data is embedded as JSON and drawn by the small script in
report_assets/report.js. It shows the training curves and a rollout browser (pick a step, read
each group's prompt, responses, rewards and advantages, filter by reward).

The loop calls ``write_report(run_dir)`` at every checkpoint and at the end, so the report is
kept quick: rollouts are capped per step and in number of steps, and long texts are cut.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from grpo.files import atomic_write_text
from grpo.record.runlog import read_jsonl

REPORT_NAME = "report.html"
MAX_ROLLOUTS_PER_STEP = 64
MAX_ROLLOUT_STEPS = 200
MAX_TEXT_CHARS = 4000
MAX_FAILURES = 50
MAX_TURNS = 40  # turns of one episode embedded in the page
MAX_TURN_CHARS = 1500
MAX_LABEL_KEYS = 4
# Config keys that differ between runs for reasons that say nothing about the experiment.
_UNINTERESTING_KEYS = ("run_dir", "output_dir", "hydra", "wandb.name", "wandb.id")


class ReportError(ValueError):
    """A user error: a path that is not a run, or no run found under it."""


@dataclass(frozen=True)
class Panel:
    """One plot: the metric keys it draws (exact names, or ``prefix/*``)."""

    id: str
    title: str
    patterns: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    band: dict[str, str] = field(default_factory=dict)  # key -> key of its std, drawn as ±band
    empty: str = "no data in this run"


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward (mean ± std over samples)", ("reward/mean",), band={"reward/mean": "reward/std"}),
    Panel("accuracy", "Accuracy on training samples", ("accuracy", "groups/mixed")),
    Panel("eval", "Held-out evaluation", ("eval/accuracy", "eval/win_rate", "eval/*"), exclude=("eval/items", "eval/failures"),
          empty="no held-out evaluation (the adapter has no eval dataset)"),
    Panel("kl", "KL", ("kl/*",), exclude=("kl/sample_train",)),
    Panel("mismatch", "Sampler vs trainer on sampled tokens: KL, worst |Δ logprob|, share capped by tis_cap",
          ("kl/sample_train", "mismatch/kl_k3", "logprob/max_abs_diff", "mismatch/*")),
    Panel("entropy", "Entropy (nats / token)", ("entropy",)),
    Panel("length", "Response length (tokens)", ("response/mean_length",)),
    Panel("truncation", "Truncation rate", ("response/truncation_rate",)),
    Panel("time", "Time per phase (s)", ("time/sample", "time/score", "time/train", "time/*")),
    Panel("episode", "Episodes: turns, tool calls, environment replies, tool error rate",
          ("episode/turns", "episode/tool_calls", "episode/observations", "episode/tool_error_rate"),
          empty="single-turn run (no episodes)"),
    Panel("prefix", "Sampler: share of prompt tokens read from the prefix cache",
          ("sampler/prefix_hit_rate",), empty="no prefix-cache metrics in this run"),
    Panel("loss", "Loss", ("loss",)),
    Panel("grad_norm", "Gradient norm", ("grad_norm",)),
)


# --------------------------------------------------------------------------- reading a run


# The metric a run reports to a sweeper unless its config names another: declared here, where runs
# recorded before the key existed need it, and GRPOConfig.objective's default is this.
DEFAULT_OBJECTIVE = "eval/accuracy"


@dataclass
class Run:
    path: Path
    name: str
    config: dict[str, Any]
    overrides: list[str]
    metrics: dict[str, list[tuple[int, float | None]]]
    rollouts: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    label: str = ""

    @property
    def objective(self) -> tuple[str, float | None]:
        """(key, last value) of the metric the run reports to a sweeper: its config's ``objective``
        (eval/accuracy by default), as python -m grpo returns it; None if never logged or NaN."""
        key = self.config.get("objective") or DEFAULT_OBJECTIVE  # runs from before the key: default
        series = self.metrics.get(str(key), [])
        return str(key), (series[-1][1] if series else None)


def _number(value: Any) -> float | None:
    """A finite float, or None for anything else (NaN, inf, None, strings, booleans)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _step(row: dict[str, Any]) -> int | None:
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return int(step)


def metric_series(rows: Iterable[dict[str, Any]]) -> dict[str, list[tuple[int, float | None]]]:
    """{key: [(step, value), ...]} sorted by step. Train and eval lines of one step carry
    different keys, so both land in their own series; a repeated (key, step) keeps the last."""
    by_key: dict[str, dict[int, float | None]] = {}
    for row in rows:
        step = _step(row)
        if step is None:
            continue
        for key, value in row.items():
            # None/NaN/inf are gaps in a series; strings, booleans, lists are not metrics at all.
            if key == "step" or not (value is None or isinstance(value, (int, float))) or isinstance(value, bool):
                continue
            by_key.setdefault(key, {})[step] = _number(value)
    return {k: sorted(v.items()) for k, v in sorted(by_key.items())}


def _read_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    try:
        import yaml

        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception:  # a broken config must not cost the whole report
        return {}
    return config if isinstance(config, dict) else {}


def _read_overrides(run_dir: Path) -> list[str]:
    """Hydra's command-line overrides of a multirun job: the best label a sweep member has."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    try:
        import yaml

        overrides = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception:
        return []
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def load_run(run_dir: Path) -> Run:
    run_dir = Path(run_dir)
    return Run(
        path=run_dir,
        name=run_dir.resolve().name or str(run_dir),
        config=_read_config(run_dir),
        overrides=_read_overrides(run_dir),
        metrics=metric_series(read_jsonl(run_dir / "metrics.jsonl")),
        rollouts=read_jsonl(run_dir / "rollouts.jsonl"),
        failures=read_jsonl(run_dir / "failures.jsonl"),
        checkpoints=read_jsonl(run_dir / "checkpoints.jsonl"),
    )


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories named by ``paths``: each is a run (it holds metrics.jsonl) or a parent
    whose subdirectories hold runs (a Hydra multirun / sweep directory)."""
    if not paths:
        raise ReportError("no run directory given: pass RUN_DIR (holding metrics.jsonl) or a sweep directory")
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ReportError(f"{path} does not exist: pass a run directory (holding metrics.jsonl) "
                              "or a sweep directory with runs below it")
        if not path.is_dir():
            raise ReportError(f"{path} is not a directory: pass a run directory (holding metrics.jsonl), "
                              "not a file")
        if (path / "metrics.jsonl").is_file():
            found.append(path)
            continue
        below = sorted({m.parent for m in path.rglob("metrics.jsonl") if "checkpoints" not in m.parts},
                       key=_natural_key)
        if not below:
            raise ReportError(f"no run found under {path}: a run directory holds metrics.jsonl "
                              "(written by the training loop), and a sweep directory has runs below it")
        found.extend(below)
    unique: list[Path] = []
    for p in found:  # the same run named twice is drawn once
        if p.resolve() not in {u.resolve() for u in unique}:
            unique.append(p)
    return unique


def _natural_key(path: Path) -> list[Any]:
    """Sort sweep jobs 0, 1, 2, ..., 10 rather than 0, 1, 10, 2."""
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def rank_runs(runs: list[Run]) -> list[Run]:
    """Runs best first by their objective (highest value first); runs without one keep their
    order after the others. Unchanged when no run has an objective value."""
    if not any(r.objective[1] is not None for r in runs):
        return list(runs)
    return sorted(runs, key=lambda r: (r.objective[1] is None, -(r.objective[1] or 0.0)))


# --------------------------------------------------------------------------- labels


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = json.dumps(value, default=str) if not isinstance(value, str) else value
    return flat


def label_runs(runs: list[Run]) -> None:
    """Name each run by what sets it apart: its Hydra overrides that not every run shares, else the config keys whose values
    differ between the runs (``lr=1e-5, group_size=8``), after its directory name."""
    names = [r.name for r in runs]
    if len(set(names)) < len(names):  # e.g. several sweeps' job "0": use the path below the common parent
        try:
            common = Path(os.path.commonpath([str(r.path.resolve()) for r in runs]))
            names = [str(r.path.resolve().relative_to(common)) or r.name for r in runs]
        except ValueError:
            names = [str(r.path) for r in runs]
    flats = [_flatten(r.config) for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    differing = [k for k in keys if len({f.get(k) for f in flats}) > 1
                 and not any(k == u or k.startswith(u + ".") for u in _UNINTERESTING_KEYS)]
    shared = set.intersection(*(set(r.overrides) for r in runs)) if runs else set()
    for run, name, flat in zip(runs, names, flats, strict=True):
        # What this sweep job varies, unless its directory name already says it (grpo names them so).
        own = [o for o in run.overrides if o not in shared and o.replace("/", "_") not in name]
        if len(runs) > 1 and own:
            detail = ", ".join(own[:MAX_LABEL_KEYS])
        elif len(runs) > 1 and differing:
            detail = ", ".join(f"{k}={flat.get(k, '-')}" for k in differing[:MAX_LABEL_KEYS])
        else:
            detail = ""
        run.label = f"{name} ({detail})" if detail else name


# --------------------------------------------------------------------------- the embedded data


def panel_keys(panel: Panel, keys: Iterable[str]) -> list[str]:
    """The keys a panel draws, in the order its patterns name them."""
    keys = sorted(keys)
    chosen: list[str] = []
    for pattern in panel.patterns:
        if pattern.endswith("*"):
            matches = [k for k in keys if k.startswith(pattern[:-1])]
        else:
            matches = [pattern] if pattern in keys else []
        chosen.extend(m for m in matches if m not in chosen and m not in panel.exclude)
    return chosen


def _cut(text: Any, limit: int = MAX_TEXT_CHARS) -> str:
    text = "" if text is None else str(text)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n… [{len(text) - limit} more characters not shown]"


def rollouts_by_step(rows: list[dict[str, Any]], per_step: int = MAX_ROLLOUTS_PER_STEP,
                     max_steps: int = MAX_ROLLOUT_STEPS) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """{step: [group, ...]} with each group's prompt stored once and its samples below it.

    At most ``per_step`` responses a step and ``max_steps`` steps (evenly spaced, always the first
    and the last) are kept. Returns the groups and how many responses were kept.
    """
    steps: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        step = _step(row)
        if step is not None:
            steps.setdefault(step, []).append(row)
    chosen = sorted(steps)
    if len(chosen) > max_steps:
        picks = {round(i * (len(chosen) - 1) / (max_steps - 1)) for i in range(max_steps)}
        chosen = [chosen[i] for i in sorted(picks)]
    out: dict[str, list[dict[str, Any]]] = {}
    kept = 0
    for step in chosen:
        groups: dict[Any, dict[str, Any]] = {}
        for row in steps[step][:per_step]:
            key = row.get("group")
            key = key if isinstance(key, (int, str)) and not isinstance(key, bool) else "?"
            group = groups.setdefault(key, {"group": key, "prompt": _cut(row.get("prompt")), "samples": []})
            group["samples"].append({
                "sample": row.get("sample") if isinstance(row.get("sample"), int) else len(group["samples"]),
                "response": _cut(row.get("response")),
                "reward": _number(row.get("reward")),
                "advantage": _number(row.get("advantage")),
                "truncated": bool(row.get("truncated")),
                "num_tokens": _number(row.get("num_tokens")),
                **_episode(row),
            })
            kept += 1
        out[str(step)] = list(groups.values())
    return out, kept


def _episode(row: dict[str, Any]) -> dict[str, Any]:
    """A multi-turn rollout's trace (grpo.rl.episodes): each turn's role, text, tool call and error."""
    turns = row.get("turns")
    if not isinstance(turns, list):
        return {}
    kept = []
    for turn in turns[:MAX_TURNS]:
        if not isinstance(turn, dict):
            continue
        kept.append({"role": "model" if turn.get("role") == "model" else "observation",
                     "text": _cut(turn.get("text"), MAX_TURN_CHARS),
                     **{k: _cut(turn[k], 500) for k in ("tool", "tool_input", "error") if turn.get(k) is not None}})
    return {"turns": kept, "end_reason": _cut(row.get("end_reason"), 40),
            "turns_cut": max(0, len(turns) - MAX_TURNS)}


def _summary(run: Run) -> dict[str, Any]:
    def last(key: str) -> float | None:
        values = [v for _, v in run.metrics.get(key, []) if v is not None]
        return values[-1] if values else None

    def first(key: str) -> float | None:
        values = [v for _, v in run.metrics.get(key, []) if v is not None]
        return values[0] if values else None

    train_steps = [s for s, v in run.metrics.get("reward/mean", []) + run.metrics.get("time/step", [])]
    step_times = [v for _, v in run.metrics.get("time/step", []) if v is not None]
    cfg = run.config
    return {
        "steps_done": (max(train_steps) + 1) if train_steps else 0,
        "steps_planned": cfg.get("steps"),
        "base_model": cfg.get("base_model"),
        "loss_fn": cfg.get("loss_fn"),
        "reward_first": first("reward/mean"),
        "reward_last": last("reward/mean"),
        "accuracy_last": last("accuracy"),
        "eval_accuracy_first": first("eval/accuracy"),
        "eval_accuracy_last": last("eval/accuracy"),
        "objective": run.objective[0],
        "objective_value": run.objective[1],
        "seconds_per_step": sum(step_times) / len(step_times) if step_times else None,
        "failures": len(run.failures),
        "checkpoints": len(run.checkpoints),
    }


def build_payload(runs: list[Run], title: str) -> dict[str, Any]:
    all_keys = set().union(*(r.metrics for r in runs)) if runs else set()
    panels = [{"id": p.id, "title": p.title, "keys": panel_keys(p, all_keys),
               "band": {k: v for k, v in p.band.items() if k in all_keys}, "empty": p.empty}
              for p in PANELS]
    run_data = []
    for run in runs:
        rollouts, kept = rollouts_by_step(run.rollouts)
        run_data.append({
            "name": run.name,
            "label": run.label or run.name,
            "path": str(run.path),
            "config": _flatten(run.config),
            "summary": _summary(run),
            "metrics": {k: [[s, v] for s, v in series] for k, series in run.metrics.items()},
            "rollouts": rollouts,
            "rollouts_total": len(run.rollouts),
            "rollouts_shown": kept,
            "failures": [{"step": _step(f), "group": f.get("group"), "sample": f.get("sample"),
                          "error": _cut(f.get("error"), 500)} for f in run.failures[-MAX_FAILURES:]],
        })
    return {"title": title, "generated": time.strftime("%Y-%m-%d %H:%M:%S"), "panels": panels,
            "metric_keys": sorted(all_keys), "runs": run_data}


def embed_json(data: Any) -> str:
    """JSON safe inside <script>: '<', '>' and '&' are written as \\u escapes, so no string in the
    data ("</script>", "<!--") can end or confuse the script element; JSON.parse reads them back."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _asset(name: str) -> str:
    return resources.files("grpo.record").joinpath("report_assets", name).read_text(encoding="utf-8")


def render_html(payload: dict[str, Any]) -> str:
    page = _asset("report.html")
    # Plain replacement (not str.format): the CSS and JS are full of braces.
    return (page.replace("%%TITLE%%", html.escape(payload["title"]))
                .replace("%%CSS%%", _asset("report.css"))
                .replace("%%JS%%", _asset("report.js"))
                .replace("%%DATA%%", embed_json(payload)))


# --------------------------------------------------------------------------- writing


def build_report(run_dirs: Sequence[str | Path], output: str | Path, *, png: bool = False,
                 title: str | None = None) -> Path:
    """Write one HTML report of ``run_dirs`` (runs or sweep directories) to ``output``."""
    paths = find_runs(run_dirs)
    runs = [load_run(p) for p in paths]
    label_runs(runs)
    if len(runs) > 1 and any(r.objective[1] is not None for r in runs):
        runs = rank_runs(runs)  # a sweep's runs, best first: the card order is the ranking
        for i, run in enumerate(runs, 1):
            run.label = f"#{i} {run.label}"
    if title is None:
        title = f"grpo run: {runs[0].label}" if len(runs) == 1 else f"grpo: {len(runs)} runs"
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    text = render_html(build_payload(runs, title))
    atomic_write_text(output, text)  # a browser reloading mid-run never sees half a page
    if png:
        write_pngs(runs, output.with_name(output.stem + "_plots"))  # .../report_plots/overview.png
    return output


def write_report(run_dir: Path, png: bool = False) -> Path:
    """RUN_DIR/report.html (and RUN_DIR/report_plots/overview.png with ``png``); called by the loop."""
    run_dir = Path(run_dir)
    return build_report([run_dir], run_dir / REPORT_NAME, png=png)


def write_pngs(runs: list[Run], out_dir: Path) -> Path:
    """out_dir/overview.png: every panel in one grid, via matplotlib's Agg canvas (no pyplot:
    no global state, no display). One figure with a fixed layout: text layout dominates
    matplotlib's time, so a figure per panel or constrained layout costs seconds."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ReportError("--png needs matplotlib, which is not installed: pip install -e '.[plots]' in your "
                          "grpo checkout (or pip install matplotlib); the HTML report needs nothing") from err

    out_dir.mkdir(parents=True, exist_ok=True)
    all_keys = set().union(*(r.metrics for r in runs))
    cols = 3
    rows = math.ceil(len(PANELS) / cols)
    fig = Figure(figsize=(5 * cols, 3.3 * rows), dpi=90)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.05, right=0.985, top=0.95, bottom=0.05, hspace=0.42, wspace=0.22)
    title = runs[0].label if len(runs) == 1 else f"{len(runs)} runs"
    fig.suptitle(f"grpo: {title}", fontsize=12)
    for i, panel in enumerate(PANELS):
        _draw_panel(fig.add_subplot(rows, cols, i + 1), panel, panel_keys(panel, all_keys), runs)
    path = out_dir / "overview.png"
    fig.savefig(path)
    return path


def _draw_panel(ax: Any, panel: Panel, keys: list[str], runs: list[Run]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(panel.title, fontsize=10, pad=12)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if not any(r.metrics.get(k) for r in runs for k in keys):
        ax.text(0.5, 0.5, panel.empty, ha="center", va="center", transform=ax.transAxes, fontsize=8, color="gray")
        return
    multi = len(runs) > 1
    for ri, run in enumerate(runs):
        for ki, key in enumerate(keys):
            points = [(s, v) for s, v in run.metrics.get(key, []) if v is not None]
            if not points:
                continue
            # one run: a colour per metric; several: a colour per run, a line style per metric
            color = f"C{(ri if multi else ki) % 10}"
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, ("-", "--", ":", "-.")[ki % 4] if multi else "-", color=color,
                    label=f"{run.label}: {key}" if multi else key, linewidth=1.4,
                    marker="o" if len(xs) <= 40 else None, markersize=3)
            std = dict(run.metrics.get(panel.band.get(key, ""), []))
            band = [(s, v, std[s]) for s, v in points if std.get(s) is not None]
            if band:
                bs, bv, bd = zip(*band, strict=True)
                ax.fill_between(bs, [v - d for v, d in zip(bv, bd, strict=True)],
                                [v + d for v, d in zip(bv, bd, strict=True)], color=color, alpha=0.15)
    ax.legend(fontsize=7, loc="upper left")


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo.record.report",
        description="Write a self-contained HTML report (plots + rollout browser) of one or more runs.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories (holding metrics.jsonl) or sweep directories with runs below")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help=f"HTML file to write (default: RUN_DIR/{REPORT_NAME} for one run or one sweep "
                             f"directory, ./{REPORT_NAME} for several)")
    parser.add_argument("--png", action="store_true", help="also write the plots as one PNG (for READMEs, or without a browser)")
    parser.add_argument("--title", default=None, help="page title")
    args = parser.parse_args(argv)
    output = args.output
    if output is None:
        output = Path(args.runs[0]) / REPORT_NAME if len(args.runs) == 1 else Path(REPORT_NAME)
    try:
        t0 = time.perf_counter()
        path = build_report(args.runs, output, png=args.png, title=args.title)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path} in {time.perf_counter() - t0:.2f} s")
    if args.png:
        print(f"PNG plots in {path.with_name(path.stem + '_plots') / 'overview.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
