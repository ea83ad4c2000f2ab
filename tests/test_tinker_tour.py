"""scripts/tinker_tour.py as a user runs it: a subprocess doing `import grpo as tinker`.

The fast test tours the tiny model; the slow one the packaged SmolLM2 (run in CI's slow set).
The tour asserts its own numbers (SFT loss falls, resume matches the original to 1e-5, the
listings and downloads hold what was saved) and exits non-zero when one fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOUR = Path(__file__).resolve().parent.parent / "scripts" / "tinker_tour.py"


def run_tour(tmp_path: Path, *args: str, timeout: int) -> str:
    proc = subprocess.run([sys.executable, str(TOUR), "--checkpoint-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for step in ("supported models:", "SFT loss per step:", "importance_sampling loss:sum", "ppo loss:sum",
                 "cispo loss:sum", "dro loss:sum", "custom loss", "archive holds", "after one more step",
                 "tour complete"):
        assert step in out, f"{step!r} missing from the tour's output:\n{out}"
    return out


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_tour_on_the_tiny_model(tmp_path) -> None:
    run_tour(tmp_path, "--base-model", "tiny", "--max-tokens", "4", timeout=600)


@pytest.mark.slow
def test_tour_on_the_packaged_smollm2(tmp_path) -> None:
    out = run_tour(tmp_path, "--base-model", "smollm2", "--max-tokens", "8", timeout=1200)
    assert "sampler base model: smollm2" in out
