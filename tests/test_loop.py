"""run_grpo end to end on the tiny model: run directory, metrics, faults, KL, wandb, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from toy_adapter import ToyAdapter

from grpo.api.checkpoint_store import CheckpointStore
from grpo.record.runlog import read_jsonl
from grpo.rl.config import GRPOConfig
from grpo.rl.loop import RewardFailureError, run_grpo

BASE = {"base_model": "tiny", "batch_size": 2, "group_size": 4, "max_tokens": 8, "report": False,
        "progress": False, "learning_rate": 1e-3, "eval_samples": 2}

STEP_KEYS = {
    "reward/mean", "reward/std", "accuracy", "groups/all_correct", "groups/all_wrong", "groups/mixed",
    "datums", "tokens/sampled", "response/mean_length", "response/truncation_rate", "entropy",
    "kl/sample_train", "loss", "grad_norm", "lr", "time/sample", "time/score", "time/train",
    "throughput/tokens_per_s", "adapter/chars", "sampler/prompt_tokens", "sampler/prefilled_tokens",
    "sampler/prefix_hit_rate",
}


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def test_run_writes_everything_a_user_reads(tmp_path):
    adapter = ToyAdapter()
    final = run_grpo(adapter, {**BASE, "steps": 3, "save_every": 2}, run_dir=tmp_path)

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train = train_rows(tmp_path)
    assert [r["step"] for r in train] == [0, 1, 2]
    for row in train:
        assert STEP_KEYS <= set(row), STEP_KEYS - set(row)
        assert row["datums"] == 8 and row["tokens/sampled"] == 64
        # on-policy: the trainer's logprobs match the sampler's
        assert abs(row["kl/sample_train"]) < 1e-4 and row["logprob/max_abs_diff"] < 1e-4
        assert row["grad_norm"] > 0 and math.isfinite(row["loss"])
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]  # before training and after the last step
    assert {"eval/pass@2", "eval/sampled_accuracy", "eval/reward"} <= set(evals[0])

    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert len(rollouts) == 3 * 8
    assert {"prompt", "response", "reward", "advantage", "step"} <= set(rollouts[0])
    for step in range(3):  # advantages are centred inside each group
        for group in range(2):
            advs = [r["advantage"] for r in rollouts if r["step"] == step and r["group"] == group]
            assert sum(advs) == pytest.approx(0.0, abs=1e-9)

    assert (tmp_path / "config.yaml").exists()
    kinds = [c["kind"] for c in read_jsonl(tmp_path / "checkpoints.jsonl")]
    assert kinds == ["state", "state", "final"]
    # The final weights are a tinker:// path into the run's checkpoint store.
    final_dir = CheckpointStore(tmp_path / "checkpoints").resolve(final)
    assert final.endswith("/sampler_weights/final") and final_dir.name == "final"
    assert (final_dir / "adapter_config.json").exists()
    assert adapter.evaluated == [(0, 8, 8), (1, 8, 8), (2, 8, 8)]


def test_sampling_requests_are_all_in_flight_before_any_is_awaited(tmp_path):
    """The loop issues a whole wave of sample() calls before waiting on the first result."""
    from grpo.backends.local import ServiceClient

    events: list[str] = []

    class RecordingSampler:
        def __init__(self, inner):
            self.inner = inner

        def sample(self, **kwargs):
            events.append("sample")
            future = self.inner.sample(**kwargs)
            result = future.result

            def recorded_result(*a, **k):
                events.append("result")
                return result(*a, **k)

            future.result = recorded_result
            return future

        def __getattr__(self, name):
            return getattr(self.inner, name)

    service = ServiceClient(checkpoint_dir=tmp_path / "ck")
    original = service.create_lora_training_client

    def create(*args, **kwargs):
        client = original(*args, **kwargs)
        make = client.save_weights_and_get_sampling_client
        client.save_weights_and_get_sampling_client = lambda *a, **k: RecordingSampler(make(*a, **k))
        return client

    service.create_lora_training_client = create
    run_grpo(ToyAdapter(eval_items=0), {**BASE, "steps": 1, "batch_size": 3}, service_client=service,
             run_dir=tmp_path / "run")
    assert events == ["sample"] * 3 + ["result"] * 3


def test_failing_rewards_are_recorded_and_training_goes_on(tmp_path):
    adapter = ToyAdapter(fail_every=5, nan_every=7, eval_items=0)
    run_grpo(adapter, {**BASE, "steps": 2}, run_dir=tmp_path)
    failures = read_jsonl(tmp_path / "failures.jsonl")
    raised = [f for f in failures if "blew up" in f["error"]]
    nans = [f for f in failures if "not a finite number" in f["error"]]
    assert len(raised) == 3 and len(nans) == 2  # calls 5, 10, 15 raise; 7, 14 are NaN
    assert all("Traceback" in f["traceback"] and "compute_reward" in f["traceback"] for f in raised)
    train = train_rows(tmp_path)
    assert [r["step"] for r in train] == [0, 1]
    assert sum(r["failures/count"] for r in train) == 5
    assert sum(r["datums"] for r in train) == 16 - 5  # failed responses are left out of training


def test_too_many_failures_stop_with_a_checkpoint_then_resume(tmp_path):
    with pytest.raises(RewardFailureError, match=r"max_failure_rate=0.2.*failures.jsonl.*rerun"):
        run_grpo(ToyAdapter(fail_every=2, eval_items=0), {**BASE, "steps": 3, "max_failure_rate": 0.2},
                 run_dir=tmp_path)
    checkpoints = read_jsonl(tmp_path / "checkpoints.jsonl")
    assert [c["step"] for c in checkpoints] == [0]
    # the reward is fixed: the same run directory resumes and finishes
    run_grpo(ToyAdapter(eval_items=0), {**BASE, "steps": 3, "max_failure_rate": 0.2}, run_dir=tmp_path)
    assert [r["step"] for r in train_rows(tmp_path)] == [0, 1, 2]


def test_kl_penalty_uses_the_base_model_as_reference(tmp_path):
    run_grpo(ToyAdapter(eval_items=0), {**BASE, "steps": 3, "kl_penalty_coef": 0.1, "learning_rate": 5e-3},
             run_dir=tmp_path)
    kl = [r["kl/reference"] for r in train_rows(tmp_path)]
    # LoRA starts as the identity (B = 0): the policy equals the reference at step 0, then drifts
    assert abs(kl[0]) < 1e-4
    assert abs(kl[2]) > 1e-3


def test_wandb_writes_offline_files(tmp_path):
    run_grpo(ToyAdapter(eval_items=0), {**BASE, "steps": 1, "wandb": {"enabled": True, "mode": "offline"}},
             run_dir=tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "no wandb event file written"


def test_dynamic_sampling_replaces_flat_groups(tmp_path):
    class HalfFlat(ToyAdapter):
        def compute_reward(self, response, sample):  # even items: always 1, a flat group
            return 1.0 if sample["id"] % 2 == 0 else super().compute_reward(response, sample)

    run_grpo(HalfFlat(eval_items=0), {**BASE, "steps": 2, "batch_size": 4, "dynamic_sampling_waves": 3},
             run_dir=tmp_path)
    for row in train_rows(tmp_path):
        assert row["dynamic/waves"] > 1
        assert row["groups/flat"] > 0  # measured on the first wave
        assert row["datums"] > 8  # more than the first wave's two mixed groups of 4


def test_lr_schedule_and_config_aliases():
    cfg = GRPOConfig.from_any({"steps": 11, "learning_rate": 1.0, "warmup_steps": 2, "lr_schedule": "linear",
                               "min_lr_ratio": 0.1})
    assert [cfg.lr_at(s) for s in (0, 1)] == [0.5, 1.0]
    assert cfg.lr_at(2) == pytest.approx(1.0) and cfg.lr_at(10) == pytest.approx(0.1)
    cos = GRPOConfig.from_any({"steps": 11, "learning_rate": 1.0, "lr_schedule": "cosine"})
    assert cos.lr_at(5) == pytest.approx(0.5)
    assert GRPOConfig.from_any({"groups_per_batch": 3, "lr": 1e-4}).batch_size == 3
    with pytest.raises(ValueError, match="did you mean 'group_size'"):
        GRPOConfig.from_any({"group_sise": 4})
    with pytest.raises(ValueError, match="group_size=1 is invalid"):
        GRPOConfig.from_any({"group_size": 1})


def test_resolved_config_is_saved(tmp_path):
    run_grpo(ToyAdapter(eval_items=0), {**BASE, "steps": 1, "seed": 7}, run_dir=tmp_path)
    import yaml

    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["seed"] == 7 and saved["base_model"] == "tiny"
    json.dumps(saved)


def test_the_item_stream_passes_over_what_each_call_names_and_the_loop_state_is_rebuilt_not_edited():
    """The stream holds no caller's set: what take() skips is its argument, so a set changed after
    the call changes nothing the stream did. LoopState is frozen: the loop builds the next one."""
    import dataclasses

    from grpo.record.checkpoint import LoopState
    from grpo.rl.loop import ItemStream

    order = [i for i, _ in ItemStream(range(6), seed=3).take(6)]
    stream, retired = ItemStream(range(6), seed=3), {order[0], order[2]}
    assert [i for i, _ in stream.take(3, retired)] == [order[1], order[3], order[4]]
    assert stream.cursor == 5 and stream.live(retired) == 4
    retired.add(order[5])  # the caller's record moves on; the stream is told on the next call
    assert [i for i, _ in stream.take(1, frozenset())] == [order[5]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoopState().step = 1  # type: ignore[misc]


# --------------------------------------------------------------------------- #16: the RL guide's checklist


class EvenItemsAlwaysRight(ToyAdapter):
    def compute_reward(self, response, sample):  # even items: every sample correct (saturated)
        return 1.0 if sample["id"] % 2 == 0 else 0.0 if sample["id"] % 3 == 0 else super().compute_reward(response, sample)


def test_saturated_items_are_counted_and_retired_and_the_history_survives_resume(tmp_path):
    cfg = {**BASE, "steps": 4, "batch_size": 3, "retire_solved_after": 1, "retire_unsolved_after": 2,
           "save_every": 2, "seed": 5}
    adapter = EvenItemsAlwaysRight(num_items=12, eval_items=0)
    seen: list[int] = []
    original_take = __import__("grpo.rl.loop", fromlist=["ItemStream"]).ItemStream.take

    def spy(self, n, skip):
        out = original_take(self, n, skip)
        seen.extend(i for i, _ in out)
        return out

    import grpo.rl.loop

    grpo.rl.loop.ItemStream.take = spy
    try:
        run_grpo(adapter, cfg, run_dir=tmp_path / "a")
    finally:
        grpo.rl.loop.ItemStream.take = original_take
    rows = train_rows(tmp_path / "a")
    # an even item is all-correct on its first group and retired: it is never drawn again
    evens = [i for i in seen if i % 2 == 0]
    assert evens and len(evens) == len(set(evens))
    assert rows[-1]["items/retired"] >= len(set(evens))
    # saturated: last group all correct (every even item, and odd ones the random model got right by chance)
    assert rows[0]["items/seen"] == 3
    assert rows[0]["items/saturated"] * 3 >= sum(i % 2 == 0 for i in seen[:3])
    assert all(0 <= r["items/never_solved"] <= 1 for r in rows)
    state = json.loads(sorted((tmp_path / "a" / "checkpoints").glob("step_*/loop_state.json"))[-1].read_text())
    assert set(state["solve_history"]["retired"]) >= set(evens)

    # resumed from the step-2 checkpoint, the run retires and draws exactly the same items
    import shutil

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    b = tmp_path / "b"
    for row in read_jsonl(b / "checkpoints.jsonl"):
        if row.get("name") != "step_000002":
            shutil.rmtree(Path(row["path"].replace(str(tmp_path / "a"), str(b))), ignore_errors=True)
    (b / "checkpoints.jsonl").write_text("".join(
        json.dumps({k: (v.replace(str(tmp_path / "a"), str(b)) if isinstance(v, str) else v) for k, v in r.items()})
        + "\n" for r in read_jsonl(tmp_path / "a" / "checkpoints.jsonl") if r.get("name") == "step_000002"))
    run_grpo(EvenItemsAlwaysRight(num_items=12, eval_items=0), cfg, run_dir=b)
    assert [r["items/retired"] for r in train_rows(b)] == [r["items/retired"] for r in rows]


def test_a_sample_is_shown_every_n_steps(tmp_path, capsys):
    run_grpo(ToyAdapter(eval_items=0), {**BASE, "steps": 3, "show_sample_every": 2}, run_dir=tmp_path)
    out = capsys.readouterr().out
    assert out.count("[response]") == 2 and "--- step 0 sample (reward" in out and "--- step 2 sample" in out


def test_mismatch_metrics_against_their_formulas():
    from grpo.rl.loop import mismatch_metrics

    diffs = [0.1, -0.2, 0.0]  # q - p per sampled token
    got = mismatch_metrics(diffs, tis_cap=1.1)
    ratios = [math.exp(-d) for d in diffs]  # p / q: 0.905, 1.221, 1
    assert got["kl/sample_train"] == pytest.approx(-0.1 / 3)
    assert got["mismatch/kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 3)
    assert got["logprob/max_abs_diff"] == pytest.approx(0.2)
    assert got["mismatch/tis_capped"] == pytest.approx(1 / 3)
    assert "mismatch/tis_capped" not in mismatch_metrics(diffs, tis_cap=None)


def test_bf16_sampling_mismatch_is_measured_and_corrected(tmp_path):
    """fp32 trainer, bf16 sampler: the per-step gap is visible (above fp32's ~1e-6, within bf16
    rounding) and the run trains with the truncated importance weight on."""
    import warnings

    from grpo.backends.local import ServiceClient

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on a CPU without bf16 instructions warns
        svc = ServiceClient(checkpoint_dir=tmp_path / "checkpoints", device="cpu", train_dtype="fp32",
                            sample_dtype="bf16")
    run_grpo(ToyAdapter(), {**BASE, "steps": 2, "save_every": 0, "eval_size": 0,
                            "loss_fn_config": {"tis_cap": 2.0}}, service_client=svc, run_dir=tmp_path)
    for row in train_rows(tmp_path):
        assert 1e-4 < row["logprob/max_abs_diff"] < 0.1
        assert row["mismatch/kl_k3"] >= 0 and abs(row["kl/sample_train"]) < 0.01
        assert 0 <= row["mismatch/tis_capped"] <= 1 and row["grad_norm"] > 0
