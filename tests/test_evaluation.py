"""Held-out evaluation: reward failures are recorded like training's, not dropped."""

from __future__ import annotations

from toy_adapter import ToyAdapter

from grpo.record.runlog import read_jsonl
from grpo.rl.loop import run_grpo


def test_reward_failures_during_evaluation_are_recorded(tmp_path) -> None:
    # 3 eval items: 3 greedy + 3 x 2 sampled rewards per evaluation, at steps 0 and 1; every
    # 4th reward call raises, in training and in evaluation alike.
    adapter = ToyAdapter(fail_every=4, eval_items=3)
    run_grpo(adapter, {"base_model": "tiny", "steps": 1, "batch_size": 2, "group_size": 2, "max_tokens": 6,
                       "eval_samples": 2, "max_failure_rate": 1.0, "save_every": 0, "progress": False,
                       "report": False}, run_dir=tmp_path)
    failures = read_jsonl(tmp_path / "failures.jsonl")
    evals = {m["step"]: m for m in read_jsonl(tmp_path / "metrics.jsonl") if "eval/accuracy" in m}
    # Call order: eval at step 0 (calls 1-9), training step 0 (10-13), eval at step 1 (14-22).
    eval_calls = {0: range(1, 10), 1: range(14, 23)}
    for step, calls in eval_calls.items():
        rows = [f for f in failures if f.get("phase") == "eval" and f["step"] == step]
        expected = [c for c in calls if c % 4 == 0]
        assert sorted(int(f["error"].rsplit(" ", 1)[1]) for f in rows) == expected
        assert all("RuntimeError: reward blew up" in f["error"] and "Traceback" in f["traceback"] for f in rows)
        assert evals[step]["eval/failures"] == len(expected)
    train_rows = [f for f in failures if "phase" not in f]
    assert [int(f["error"].rsplit(" ", 1)[1]) for f in train_rows] == [12]
