"""scripts/scaling.py runs end to end (one row on the tiny model) and its numbers add up, so the
benchmark that docs/benchmark.md's scaling table comes from cannot silently rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_smoke_row_measures_a_whole_step(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "scripts/scaling.py", "--rows", "smoke", "--steps", "3", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [row] = json.loads(out.read_text())
    assert (row["model"], row["prompts"], row["group"], row["max_tokens"]) == ("tiny", 2, 2, 4)
    assert 2 * 2 <= row["sampled"] <= 2 * 2 * 4
    assert row["processed"] == row["prompt_tokens"] + row["sampled"]
    # each sampled token was chosen in exactly one sampling step, as one of that step's rows
    assert row["decode_rows"] == row["sampled"]
    assert 1 <= row["decode_steps"] <= 4
    assert row["sample_s"] > 0 and row["train_s"] > 0 and row["peak_rss_mb"] > 0
    assert "| tiny [fp32] | 2 x 2 x 4 |" in proc.stdout
    # three steps, each with its own peak (a window of /proc's VmHWM), none above the run's peak
    assert row["steps"] == 3 and len(row["step_peaks_mb"]) == 3
    assert all(0 < p <= row["peak_rss_mb"] for p in row["step_peaks_mb"])
    assert "Peak RSS by step, tiny 2 x 2 x 4:" in proc.stdout


@pytest.mark.slow  # three smoke rows end to end: CI's slow stage runs it
def test_rows_run_once_per_precision(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "scripts/scaling.py", "--rows", "smoke", "--precision", "fp32,bf16-sample,bf16",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["precision"] for r in rows] == ["fp32", "bf16-sample", "bf16"]
    assert all(r["sampled"] >= 4 and r["train_s"] > 0 for r in rows)
    # efficiency is against the matmul peak of the training precision
    assert "fp32 GFLOP/s" in proc.stdout and "bf16 GFLOP/s" in proc.stdout
    bad = subprocess.run([sys.executable, "scripts/scaling.py", "--rows", "smoke", "--precision", "fp8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--precision fp8 is invalid; valid: fp32, bf16, bf16-sample" in bad.stderr


@pytest.mark.slow  # end to end (the sampler of a real model): CI's slow stage runs it
def test_decode_step_cost_prints_every_batch_size_against_the_floors():
    proc = subprocess.run([sys.executable, "scripts/decode_step_cost.py", "--model", "tiny", "--rows", "1,2,4",
                           "--steps", "4", "--precision", "fp32"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sampler fp32" in proc.stdout and "# CPU: " in proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")][2:]  # past header and rule
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table]
    assert [int(r[0]) for r in rows] == [1, 2, 4]
    for _, step, stream, compute, over_larger, over_sum in rows:
        assert float(step) > 0 and float(stream) > 0 and float(compute) >= 0
        # a step against the larger floor is at least the step against both floors' sum
        assert float(over_larger.rstrip("x")) >= float(over_sum.rstrip("x")) > 0
    # every step streams the same weights; the rows' arithmetic grows with them
    assert len({r[2] for r in rows}) == 1 and float(rows[-1][3]) >= float(rows[0][3])
