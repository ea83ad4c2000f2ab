"""The first engine of a process sets the imports aside from Python's full collections
(grpo/backends/local/long_lived.py): once, after a collection, switchable off, and what is made
afterwards is still collected."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import gc, sys
from grpo.backends.local.engine import Engine
before = gc.get_freeze_count()
Engine("tiny", device="cpu", dtype="fp32")
first = gc.get_freeze_count()
Engine("tiny", device="cpu", dtype="fp32")
second = gc.get_freeze_count()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle, garbage once the names go
del a, b
print(before, first, second, gc.collect())
"""


def _run(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRPO_GC_FREEZE"}
    if value is not None:
        env["GRPO_GC_FREEZE"] = value
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_first_engine_freezes_the_imports_once_and_later_garbage_is_collected() -> None:
    done = _run(None)
    assert done.returncode == 0, done.stderr
    before, first, second, collected = (int(v) for v in done.stdout.split()[-4:])
    assert before == 0
    assert first > 10_000  # torch, transformers, grpo: their functions, tuples, dicts
    assert second == first  # once a process: the first engine's model is not frozen by the second
    assert collected >= 2  # the cycle made after the freeze


def test_the_switch_off_leaves_the_collector_alone_and_a_bad_value_is_named() -> None:
    done = _run("off")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-4:-1] == ["0", "0", "0"]
    bad = _run("sometimes")
    assert bad.returncode != 0
    assert "GRPO_GC_FREEZE='sometimes' is invalid; valid: on, off" in bad.stderr
