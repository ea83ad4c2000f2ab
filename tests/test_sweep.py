"""Sweeps: the objective a run returns, one GPU per parallel job, run directory names, resuming,
the ranked sweep report, and real sweeps with Hydra's joblib and submitit launchers and its Optuna
sweeper on the tiny model (python -m grpo -m ... in a subprocess, as users type it)."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from grpo.record import report, sweep
from grpo.record.runlog import read_jsonl
from grpo.rl.config import ConfigError, GRPOConfig

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from test_cli import TOY, grpo  # noqa: E402  (the CLI helper and the tiny toy run's arguments)

CLOCK = [a if not a.startswith("adapter._target_=") else "adapter._target_=sweep_adapter.ClockAdapter"
         for a in TOY]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def last_eval(run_dir: Path, key: str) -> float:
    return [r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if key in r][-1]


def run_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if (p / "metrics.jsonl").is_file()),
                  key=lambda p: int(p.name.split("_")[0]))


# --------------------------------------------------------------------------- the objective


def test_objective_is_the_last_logged_value_of_its_key(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", [
        {"step": 0, "eval/accuracy": 0.25, "eval/pass@4": 0.5},
        {"step": 0, "reward/mean": 0.1},
        {"step": 1, "reward/mean": None},  # NaN is logged as null
        {"step": 2, "eval/accuracy": 0.75, "eval/pass@4": 1.0},
    ])
    assert sweep.read_objective(tmp_path, "eval/accuracy") == 0.75
    assert sweep.read_objective(tmp_path, "eval/pass@4") == 1.0
    assert math.isnan(sweep.read_objective(tmp_path, "reward/mean"))
    assert sweep.read_objective(tmp_path, "eval/pass@8") is None
    assert sweep.read_objective(tmp_path / "nope", "eval/accuracy") is None


@pytest.mark.parametrize(("overrides", "message"), [
    ({"objective": ""}, "objective='' is invalid"),
    ({"eval_size": 0}, "eval_size=0"),
    ({"objective": "eval/pass@4", "eval_samples": 2}, "eval_samples=4"),
])
def test_an_objective_the_run_cannot_log_is_refused_up_front(overrides, message):
    with pytest.raises(ConfigError, match=message):
        sweep.check_objective(GRPOConfig(**overrides))
    sweep.check_objective(GRPOConfig(objective="eval/pass@2", eval_samples=2))
    sweep.check_objective(GRPOConfig(objective="reward/mean", eval_size=0))
    # Nobody asked for the default objective (a plain run, a grid sweep): eval_size=0 stays valid.
    sweep.check_objective(GRPOConfig(eval_size=0), required=False)
    with pytest.raises(ConfigError, match="objective=None is invalid"):
        sweep.check_objective(GRPOConfig(objective=None), required=False)


def test_cli_names_a_bad_objective_before_loading_anything(tmp_path):
    done = grpo(*TOY, "objective=eval/pass@4", f"hydra.run.dir={tmp_path}", timeout=120)
    assert done.returncode == 2
    assert "objective=eval/pass@4" in done.stderr and "eval_samples=4" in done.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- one run per GPU


def test_parallel_jobs_claim_different_gpus_and_queue_when_all_are_busy(tmp_path):
    locks = tmp_path / "locks"
    with sweep.claimed_gpu(0, 2, locks) as a, sweep.claimed_gpu(1, 2, locks) as b:
        assert (a, b) == ("cuda:0", "cuda:1")  # job n starts at GPU n % count
    with sweep.claimed_gpu(2, 2, locks) as a, sweep.claimed_gpu(4, 2, locks) as b:
        assert (a, b) == ("cuda:0", "cuda:1")  # job 4 wanted GPU 0 too: it takes the free one

    # Both GPUs busy: job 5 waits until one is released, then takes that one.
    got, waits = [], []
    with sweep.claimed_gpu(0, 2, locks):
        release = threading.Event()

        def hold_gpu1() -> None:
            with sweep.claimed_gpu(1, 2, locks):
                release.wait(10)

        holder = threading.Thread(target=hold_gpu1)
        holder.start()
        time.sleep(0.2)

        def job5() -> None:
            with sweep.claimed_gpu(5, 2, locks, poll_s=0.05, log=waits.append) as device:
                got.append((device, time.monotonic()))

        waiter = threading.Thread(target=job5)
        waiter.start()
        time.sleep(0.5)
        assert got == [] and len(waits) == 1 and "all 2 GPUs are busy" in waits[0]
        released_at = time.monotonic()
        release.set()
        holder.join(5)
        waiter.join(5)
    assert got[0][0] == "cuda:1" and got[0][1] >= released_at


def test_a_gpu_held_by_another_process_is_skipped_and_freed_when_it_dies(tmp_path):
    locks = tmp_path / "locks"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from grpo.record import sweep\n"
         f"with sweep.claimed_gpu(0, 2, Path({str(locks)!r})) as d:\n"
         "    print(d, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "cuda:0"
        with sweep.claimed_gpu(0, 2, locks) as device:
            assert device == "cuda:1"
    finally:
        holder.kill()
        holder.wait()
    with sweep.claimed_gpu(0, 2, locks) as device:  # the kernel dropped the dead process's lock
        assert device == "cuda:0"


def test_gpu_locks_name_physical_gpus_and_one_gpu_needs_no_choice(tmp_path):
    locks = tmp_path / "locks"
    # Two sweeps on one machine whose processes see the same physical GPU under different indices.
    with sweep.claimed_gpu(0, 2, locks, visible="3,5") as device:
        assert device == "cuda:0" and (locks / "gpu-3.lock").exists()
        with sweep.claimed_gpu(1, 2, locks, visible="5,3") as other:
            # Job 1 prefers its cuda:1, which is physical GPU 3 here and taken: it gets GPU 5.
            assert other == "cuda:0" and (locks / "gpu-5.lock").exists()
    for n in (0, 1):
        with sweep.claimed_gpu(7, n, locks) as device:
            assert device is None  # the backend's own device: auto stands


# --------------------------------------------------------------------------- names, resume, ranking


def test_run_directories_are_named_by_the_swept_keys_only():
    keys = sweep.swept_keys(["base_model=tiny", "learning_rate=1e-5,2e-5", "+adapter.x=range(2)",
                             "kl_penalty_coef=interval(0,0.1)"], {"group_size": "4,8"})
    assert keys == ["learning_rate", "adapter.x", "kl_penalty_coef", "group_size"]
    job = ["base_model=/models/a", "learning_rate=2e-5", "+adapter.x=1", "group_size=8", "objective=x/y"]
    assert sweep.job_dirname(3, job, keys) == "3_+adapter.x=1,group_size=8,learning_rate=2e-5"
    assert sweep.job_dirname(0, job, None, exclude=["objective"]) == \
        "0_+adapter.x=1,base_model=_models_a,group_size=8,learning_rate=2e-5"  # '/' stays in one level
    assert sweep.job_dirname(2, ["steps=3"], []) == "2"


def test_a_run_is_finished_only_with_its_final_adapter_and_the_same_config(tmp_path):
    config = {"steps": 3, "learning_rate": 2e-5, "betas": [0.9, 0.999]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    write_jsonl(tmp_path / "checkpoints.jsonl", [{"step": 3, "kind": "state"}])
    assert not sweep.finished(tmp_path, 3, config)  # killed after its last checkpoint
    write_jsonl(tmp_path / "checkpoints.jsonl", [{"step": 3, "kind": "state"}, {"step": 3, "kind": "final"}])
    assert sweep.finished(tmp_path, 3, {**config, "betas": (0.9, 0.999)})
    assert not sweep.finished(tmp_path, 5, {**config, "steps": 5})  # more steps asked: resume it
    assert not sweep.finished(tmp_path, 3, {**config, "learning_rate": 1e-5})


def test_sweep_report_ranks_runs_by_each_runs_objective(tmp_path):
    def run(name: str, values: list, objective: str = "eval/accuracy") -> Path:
        d = tmp_path / "sweep" / name
        write_jsonl(d / "metrics.jsonl", [{"step": i, objective: v} for i, v in enumerate(values)])
        (d / "config.yaml").write_text(yaml.safe_dump({"objective": objective, "steps": 1}))
        return d

    run("0_lr=1", [0.9, 0.2])  # its last value counts, not its best
    run("1_lr=2", [0.1, 0.6])
    run("2_lr=3", [0.5], objective="eval/pass@2")
    run("3_lr=4", [None])  # NaN: ranked last
    out = report.build_report([tmp_path / "sweep"], tmp_path / "sweep" / "report.html")
    import json
    import re

    data = json.loads(re.search(r'id="report-data">(.*?)</script>', out.read_text(), re.S).group(1))
    assert [r["name"] for r in data["runs"]] == ["1_lr=2", "2_lr=3", "0_lr=1", "3_lr=4"]
    assert [r["label"].split()[0] for r in data["runs"]] == ["#1", "#2", "#3", "#4"]
    assert [(r["summary"]["objective"], r["summary"]["objective_value"]) for r in data["runs"]] == [
        ("eval/accuracy", 0.6), ("eval/pass@2", 0.5), ("eval/accuracy", 0.2), ("eval/accuracy", None)]


def test_report_labels_say_what_a_sweep_job_varies_once(tmp_path):
    def job(name: str, overrides: list[str]) -> report.Run:
        d = tmp_path / name
        write_jsonl(d / "metrics.jsonl", [{"step": 0, "reward/mean": 0.5}])
        (d / ".hydra").mkdir()
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        return report.load_run(d)

    runs = [job("0_learning_rate=0.001", ["base_model=tiny", "learning_rate=0.001", "seed=1"]),
            job("1_learning_rate=0.002", ["base_model=tiny", "learning_rate=0.002", "seed=2"])]
    report.label_runs(runs)
    # base_model is shared, learning_rate is in the name already: only seed is left to say.
    assert [r.label for r in runs] == ["0_learning_rate=0.001 (seed=1)", "1_learning_rate=0.002 (seed=2)"]


# --------------------------------------------------------------------------- real sweeps


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_joblib_sweep_runs_two_jobs_at_once_each_with_its_run_dir_and_report(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *CLOCK, "steps=2", "eval_size=2",
            "report=true", "progress=false", f"+adapter.rendezvous={tmp_path / 'rendezvous'}",
            "+adapter.parties=2", "learning_rate=1e-3,2e-3", f"hydra.sweep.dir={sweep_dir}"]
    done = grpo(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = run_dirs(sweep_dir)
    assert [r.name for r in runs] == ["0_learning_rate=0.001", "1_learning_rate=0.002"]
    spans = []
    for r in runs:
        walls = [m["adapter/wall"] for m in read_jsonl(r / "metrics.jsonl") if "adapter/wall" in m]
        assert len(walls) == 2, r
        spans.append((walls[0], walls[-1]))
        assert (r / "report.html").is_file()
        assert any(c["kind"] == "final" for c in read_jsonl(r / "checkpoints.jsonl"))
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1, f"the two runs trained one after the other: {spans}"
    # The sweep's own report overlays both, ranked by the objective each run returned.
    text = (sweep_dir / "report.html").read_text()
    assert "0_learning_rate=0.001" in text and "1_learning_rate=0.002" in text
    assert "runs ranked by their objective" in done.stdout


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_rerunning_a_sweep_skips_finished_runs_and_resumes_the_others(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", *TOY, "steps=2", "save_every=1", "eval_size=0", "objective=reward/mean", "progress=false",
            "seed=1,2", f"hydra.sweep.dir={sweep_dir}"]
    done = grpo(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    finished, killed = run_dirs(sweep_dir)
    # As if job 1 was killed during its last step: its log ends at the step-1 checkpoint.
    write_jsonl(killed / "checkpoints.jsonl", [c for c in read_jsonl(killed / "checkpoints.jsonl")
                                               if c["step"] < 2])
    write_jsonl(killed / "metrics.jsonl", [m for m in read_jsonl(killed / "metrics.jsonl") if m["step"] < 1])
    before = (finished / "metrics.jsonl").read_text()
    again = grpo(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already finished; skipped") == 1 and f"{finished} already finished" in again.stdout
    assert (finished / "metrics.jsonl").read_text() == before  # not even its final eval was redone
    assert f"resumed {killed} at step 1" in again.stdout
    assert [m["step"] for m in read_jsonl(killed / "metrics.jsonl")] == [0, 1]
    assert any(c["kind"] == "final" for c in read_jsonl(killed / "checkpoints.jsonl"))


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # optuna 2.x's SQLAlchemy 1.4 idioms
def test_optuna_sweep_returns_each_runs_objective_and_names_the_best(tmp_path):
    import optuna

    sweep_dir, db = tmp_path / "sweep", tmp_path / "study.db"
    done = grpo("-m", "+sweep=optuna", "hydra.sweeper.n_trials=4", f"hydra.sweeper.storage=sqlite:///{db}",
                "learning_rate=tag(log, interval(0.03, 1.0))",  # command-line search space; big: 1 step shows
                *(a for a in TOY if not a.startswith("learning_rate=")), "steps=1", "eval_size=3",
                "objective=eval/reward", "progress=false",
                f"hydra.sweep.dir={sweep_dir}", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = optuna.load_study(study_name="grpo", storage=f"sqlite:///{db}").trials
    assert len(trials) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    runs = run_dirs(sweep_dir)
    assert len(runs) == 4
    for trial, run in zip(trials, runs, strict=True):
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["learning_rate"] == pytest.approx(trial.params["learning_rate"])
        assert config["kl_penalty_coef"] == pytest.approx(trial.params["kl_penalty_coef"])
        assert trial.value == last_eval(run, "eval/reward")  # what the task function returned
        assert f"learning_rate={trial.params['learning_rate']}" in run.name
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = max(trials, key=lambda t: t.value)
    assert results["best_value"] == best.value
    assert results["best_params"] == pytest.approx(best.params)
    assert len({t.value for t in trials}) > 1  # the search saw different outcomes to choose from


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_rerunning_a_seeded_optuna_sweep_trains_only_its_unfinished_trials(tmp_path):
    args = ["-m", "+sweep=optuna", "hydra.sweeper.n_trials=2", *TOY, "steps=1", "eval_size=2", "progress=false",
            "report=false", f"hydra.sweep.dir={tmp_path}"]
    done = grpo(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    finished, killed = run_dirs(tmp_path)
    write_jsonl(killed / "checkpoints.jsonl", [c for c in read_jsonl(killed / "checkpoints.jsonl")
                                               if c["kind"] != "final"])
    again = grpo(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    # The seeded sampler asks for the same points, and the finished trial's value is read back.
    assert run_dirs(tmp_path) == [finished, killed]
    assert again.stdout.count("already finished; skipped") == 1 and f"{finished} already finished" in again.stdout
    assert f"resumed {killed}" in again.stdout


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_optuna_job_without_its_objective_fails_naming_the_keys_it_logged(tmp_path):
    # An adapter with no held-out data: the run trains, but never logs eval/accuracy.
    done = grpo("-m", "+sweep=optuna", "hydra.sweeper.n_trials=1", *TOY, "+adapter.eval_items=0", "steps=1",
                "progress=false", f"hydra.sweep.dir={tmp_path}")
    assert done.returncode != 0
    assert "objective=eval/accuracy is missing in" in done.stderr
    assert "logged keys: accuracy, " in done.stderr and "reward/mean" in done.stderr


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_submitit_local_runs_a_two_job_sweep_to_completion(tmp_path):
    sweep_dir = tmp_path / "sweep"
    done = grpo("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", *TOY, "steps=1",
                "eval_size=2", "progress=false", "seed=1,2", f"hydra.sweep.dir={sweep_dir}", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = run_dirs(sweep_dir)
    assert [r.name for r in runs] == ["0_seed=1", "1_seed=2"]
    for r in runs:
        assert any(c["kind"] == "final" for c in read_jsonl(r / "checkpoints.jsonl"))
        assert yaml.safe_load((r / "config.yaml").read_text())["seed"] == int(r.name[-1])
    assert list((sweep_dir / ".submitit").iterdir())  # submitit's own job folders: its code path ran
