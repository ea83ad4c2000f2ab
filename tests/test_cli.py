"""The command line as users type it: python -m grpo ... in a subprocess, on the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo.record.checkpoint import final_adapter_dir
from grpo.record.runlog import WALL_CLOCK_PREFIXES as TIMING_PREFIXES
from grpo.record.runlog import read_jsonl

TESTS = Path(__file__).parent
ROOT = TESTS.parent
TOY = ["adapter=custom", "adapter._target_=toy_adapter.ToyAdapter", "base_model=tiny", "batch_size=2",
       "group_size=4", "max_tokens=8", "report=false", "learning_rate=1e-3", "eval_samples=2"]


def grpo(*args: str, cwd: Path | None = None, extra_env: dict | None = None, pythonpath=(TESTS,),
         timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath), **(extra_env or {})}
    # A shell without job control starts background commands with SIGINT ignored, and Python keeps
    # an ignored SIGINT ignored: the child gets Ctrl-C's default back, as from a terminal.
    return subprocess.run([sys.executable, "-m", "grpo", *args], cwd=cwd or ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics minus wall-clock timings, which legitimately differ between runs."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_sigkill_mid_step_then_resume_matches_an_uninterrupted_run(tmp_path):
    check_sigkill_resume(tmp_path, [])


@pytest.mark.slow
@pytest.mark.parametrize("precision", [["backend.train_dtype=fp32", "backend.sample_dtype=bf16"],
                                       ["backend.train_dtype=bf16", "backend.sample_dtype=bf16"]],
                         ids=["bf16-sample", "bf16"])
def test_sigkill_resume_is_bit_identical_in_bf16_too(tmp_path, precision):
    check_sigkill_resume(tmp_path, precision)


def check_sigkill_resume(tmp_path: Path, extra: list[str]) -> None:
    args = [*TOY, "steps=6", "save_every=2", "seed=3", *extra]
    straight = grpo(*args, f"hydra.run.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]

    # Eval at step 0 scores 3 greedy + 3x2 sampled responses (9 calls), each step 8 more: call 52 is
    # in the middle of scoring step 5, after the checkpoint taken when step 3 finished.
    run_dir = tmp_path / "killed"
    killed = grpo(*args, f"hydra.run.dir={run_dir}", extra_env={"GRPO_TEST_KILL_AT_CALL": "52"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    done = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert done == [0, 1, 2, 3, 4]  # step 4 ran after the last checkpoint and is replayed

    resumed = grpo(*args, f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stdout and "at step 4" in resumed.stdout

    for name in ("metrics.jsonl", "rollouts.jsonl"):
        expected = comparable(read_jsonl(tmp_path / "straight" / name))
        assert comparable(read_jsonl(run_dir / name)) == expected, name
    assert final_adapter(tmp_path / "straight") == final_adapter(run_dir)


def final_adapter(run_dir: Path) -> bytes:
    """The final weights' bytes, found through the tinker:// path the run logged."""
    return (final_adapter_dir(run_dir) / "adapter_model.safetensors").read_bytes()


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_ctrl_c_checkpoints_the_last_whole_step_and_resume_matches(tmp_path):
    args = [*TOY, "steps=4", "save_every=0", "seed=5", "eval_size=0"]
    straight = grpo(*args, f"hydra.run.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]

    run_dir = tmp_path / "interrupted"  # call 19 is in the middle of scoring step 2
    interrupted = grpo(*args, f"hydra.run.dir={run_dir}", extra_env={"GRPO_TEST_INTERRUPT_AT_CALL": "19"})
    assert interrupted.returncode != 0
    assert "interrupted in step 2; checkpoint saved" in interrupted.stdout
    assert [c["step"] for c in read_jsonl(run_dir / "checkpoints.jsonl")] == [2]  # no save_every: Ctrl-C's own

    resumed = grpo(*args, f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        assert comparable(read_jsonl(run_dir / name)) == comparable(read_jsonl(tmp_path / "straight" / name)), name


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_rerunning_a_finished_run_changes_nothing(tmp_path):
    args = [*TOY, "steps=2", f"hydra.run.dir={tmp_path}"]
    assert grpo(*args).returncode == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    again = grpo(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed" in again.stdout
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_a_qwen3_model_trains_end_to_end(tmp_path, tiny_of):
    """The family of MinT's default model (Qwen3: each head of q and k normalised) through the whole
    loop -- sampling through the native step, training, checkpoints -- on a tiny saved one."""
    args = [a for a in TOY if not a.startswith("base_model=")]
    result = grpo(*args, f"base_model={tiny_of('qwen3')}", "steps=2", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r] == [0, 1]
    assert final_adapter(tmp_path)


def test_a_run_ends_by_naming_its_directory_and_its_report(tmp_path):
    """What a user opens next is the last thing printed: the run directory, then report.html."""
    result = grpo(*TOY, "steps=1", "eval_size=0", "report=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-2:]
    assert last == [f"[grpo] run directory: {tmp_path}", f"[grpo] report: {tmp_path / 'report.html'}"]
    assert (tmp_path / "report.html").is_file()


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_sweep_runs_into_separate_directories(tmp_path):
    result = grpo("-m", *TOY, "steps=1", "eval_size=0", "learning_rate=1e-5,2e-5", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(runs) == 2
    import yaml

    lrs = sorted(yaml.safe_load((r / "config.yaml").read_text())["learning_rate"] for r in runs)
    assert lrs == [1e-5, 2e-5]
    for r in runs:
        assert [m["lr"] for m in read_jsonl(r / "metrics.jsonl") if "lr" in m] in ([1e-5], [2e-5])


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_a_users_adapter_from_outside_the_repository(tmp_path):
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text(textwrap.dedent("""
        from grpo import RLAdapter
        from grpo.rl.adapter import chat_prompt_tokens

        class LengthAdapter(RLAdapter):
            def __init__(self, target: int = 10, bonus: float = 0.0):
                self.target, self.bonus = target, bonus

            def build_dataset(self):
                return [f"Write {i} words." for i in range(8)]

            def make_prompt(self, sample, tokenizer):
                return chat_prompt_tokens(tokenizer, [{"role": "user", "content": sample}])

            def compute_reward(self, response, sample):
                return self.bonus - abs(len(response) - self.target)
    """))
    run_dir = tmp_path / "run"
    result = grpo("adapter=custom", "adapter._target_=my_pkg.rewards.LengthAdapter", "+adapter.bonus=100",
                  "base_model=tiny", "steps=1", "batch_size=2", "max_tokens=4", "report=false",
                  f"hydra.run.dir={run_dir}", cwd=tmp_path, pythonpath=(tmp_path,))
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [r["reward"] for r in read_jsonl(run_dir / "rollouts.jsonl")]
    assert len(rewards) == 8 and all(r > 50 for r in rewards)  # the +adapter.bonus override arrived

    typo = grpo("adapter=custom", "adapter._target_=my_pkg.rewards.LengthAdapter", "+adapter.bonsu=1",
                f"hydra.run.dir={run_dir}2", cwd=tmp_path, pythonpath=(tmp_path,))
    assert typo.returncode == 2 and "does not take argument(s) ['bonsu']" in typo.stderr


@pytest.mark.parametrize("override, message", [
    ("batch_size=0", "batch_size=0 is invalid: must be a positive integer"),
    ("group_size=1", "group_size=1 is invalid: must be an integer >= 2"),
    ("loss_fn=grpo", "loss_fn='grpo' is invalid: valid values: cross_entropy, importance_sampling, ppo, cispo, dro"),
    ("learning_rate=-1", "learning_rate=-1"),
    ("max_tokens=0", "max_tokens=0 is invalid"),
    ("temperature=-0.5", "temperature=-0.5 is invalid"),
    ("+grpu_size=3", "unknown config key 'grpu_size'"),
    ("adapter._target_=no_such_pkg.Adapter", "adapter._target_='no_such_pkg.Adapter' does not import"),
    ("loss_fn_config.beta=0.3", "loss_fn_config key 'beta' is not used by loss_fn='importance_sampling'"),
    ("loss_fn=ppo loss_fn_config.clip_low_threshold=1.5", "needs 0 <= clip_low_threshold <= 1"),
    ("backend.name=cloud", "backend.name='cloud' is invalid; valid: local, mint, tinker"),
])
def test_bad_config_fails_before_torch_loads(tmp_path, override, message):
    # A 'torch' that cannot be imported, first on the path: the error must come from validation,
    # before any model (or torch itself) is loaded.
    blocker = tmp_path / "torch"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('torch was imported during config validation')")
    result = grpo(*TOY, *override.split(), f"hydra.run.dir={tmp_path / 'run'}", pythonpath=(tmp_path, TESTS))
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "torch was imported" not in result.stderr


def test_unknown_adapter_group_lists_the_valid_ones():
    result = grpo("adapter=nope")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "grpo: configuration error: adapter='nope' is invalid: valid values: chat, code, custom, math, tools"]


def one_line(result: subprocess.CompletedProcess, *says: str) -> str:
    """The run failed with exit 2 and one ``grpo:`` line on stderr holding every one of ``says``."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("grpo: "), result.stderr[-3000:]
    assert all(s in lines[0] for s in says), lines[0]
    return lines[0]


# Runs ``python -m grpo`` and records, as it exits, which heavy modules it had imported: a bad
# setting must be refused before torch or transformers load (that is what makes it quick; the
# time itself is not asserted, it depends on the machine).
IMPORTS_AT_EXIT = """import atexit, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(" ".join(m for m in ("torch", "transformers") if m in sys.modules)))
runpy.run_module("grpo", run_name="__main__", alter_sys=True)
"""


def test_bad_input_is_one_line_naming_the_key_or_file_before_torch_loads(tmp_path):
    """Issue #33: each was a traceback (or Hydra's 14 lines); none involves the network."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n{broken\n')
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (["adapter=math", "base_model=tiny", "adapter.task=dataset", f"adapter.source={data}",
          f"hydra.run.dir={tmp_path / 'r1'}"], ["adapter.source", "bad.jsonl line 2 is not JSON"]),
        (["adapter=math", f"hydra.run.dir={a_file}"], ["hydra.run.dir=", "is a file"]),
        (["adapter=math", "hydra.run.dir=/proc/grpo-run"], ["hydra.run.dir='/proc/grpo-run'", "cannot write"]),
        (["adapter=math", "-m", "hydra.sweep.dir=/proc/grpo-sweep"], ["hydra.sweep.dir=", "cannot write"]),
        (["adapter=math", "learning_rate=abc", f"hydra.run.dir={tmp_path / 'r2'}"],
         ["learning_rate='abc' is invalid: must be a finite number"]),
        (["adapter=nonexistent"], ["adapter='nonexistent'", "valid values: chat"]),
        (["backend=nope"], ["backend='nope'", "valid values:"]),
        (["adapter=math", "base_model=Qwen/Qwen3-0.6B", f"hydra.run.dir={tmp_path / 'r3'}"],
         ["base_model 'Qwen/Qwen3-0.6B'", "HF_HUB_OFFLINE"]),
    ]
    env = {**os.environ, "PYTHONPATH": str(TESTS), "HF_HUB_OFFLINE": "1"}
    for i, (args, says) in enumerate(cases):
        imported = tmp_path / f"imported_{i}.txt"
        result = subprocess.run([sys.executable, "-c", IMPORTS_AT_EXIT, str(imported), *args], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        one_line(result, *says)
        assert imported.read_text() == "", (args, imported.read_text())


def test_cfg_job_prints_the_resolved_config():
    result = grpo(*TOY, "group_size=8", "loss_fn=ppo", "kl_penalty_coef=0.01", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    import yaml

    cfg = yaml.safe_load(result.stdout)
    assert (cfg["group_size"], cfg["loss_fn"], cfg["kl_penalty_coef"]) == (8, "ppo", 0.01)
    assert cfg["adapter"]["_target_"] == "toy_adapter.ToyAdapter" and cfg["backend"]["name"] == "local"


def test_help_lists_the_config_groups():
    result = grpo("--help")
    assert result.returncode == 0, result.stderr
    groups = dict(line.split(": ", 1) for line in result.stdout.splitlines()
                  if line.startswith(("adapter: ", "backend: ")))
    assert set(groups["adapter"].split(", ")) >= {"math", "chat", "code", "custom"}
    assert set(groups["backend"].split(", ")) >= {"local", "mint", "tinker"}
    assert "python -m grpo -m learning_rate=1e-5,2e-5" in result.stdout


def test_conf_is_found_from_a_non_editable_install(tmp_path):
    """A wheel-style install (no source tree on the path) still ships and finds conf/."""
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = grpo("adapter=math", "--cfg", "job", cwd=elsewhere, pythonpath=(target,))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "_target_: adapters.math_rl.MathAdapter" in result.stdout
    where = subprocess.run([sys.executable, "-c", "import grpo; print(grpo.__file__)"], cwd=elsewhere,
                           env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True)
    assert where.stdout.startswith(str(target))


@pytest.mark.slow  # four runs that load the tiny model, about a minute on 2 cores: CI's slow stage runs it
def test_what_the_user_or_the_disk_breaks_is_one_line_not_a_traceback(tmp_path):
    """Issue #37 F: each of these ended in Hydra's "Error executing job" and a Python traceback."""
    import subprocess as sp

    from test_restart_hygiene import interrupted_run

    cases = [([f"base_model={'a' * 5000}", f"hydra.run.dir={tmp_path / 'long'}"], ["base_model", "5000 characters"])]
    a_file_in_the_way = tmp_path / "checkpoints_is_a_file"  # the run's store cannot be created
    a_file_in_the_way.mkdir()
    (a_file_in_the_way / "checkpoints").write_text("")
    cases.append(([f"hydra.run.dir={a_file_in_the_way}"], ["cannot use", "checkpoints"]))
    a_dir_in_the_way = tmp_path / "metrics_is_a_dir"  # the resumed run's log cannot be rewritten
    (a_dir_in_the_way / "metrics.jsonl").mkdir(parents=True)
    cases.append(([f"hydra.run.dir={a_dir_in_the_way}"], ["cannot use", "metrics.jsonl"]))
    immutable = tmp_path / "immutable"
    immutable.mkdir()
    (immutable / "metrics.jsonl").write_text('{"step": 0}\n')
    chattr = sp.run(["chattr", "+i", str(immutable / "metrics.jsonl")], capture_output=True).returncode == 0
    if chattr:  # where permitted (root in a container may not be): a file even root cannot replace
        cases.append(([f"hydra.run.dir={immutable}"], ["cannot use", "metrics.jsonl"]))
    planted = tmp_path / "planted"
    interrupted_run(planted)
    next(planted.glob("checkpoints/*/weights/step_*/optimizer.pt")).write_bytes(b"not a torch file")
    cases.append(([f"hydra.run.dir={planted}"], ["optimizer.pt", "step_000001", "earlier checkpoint"]))
    try:
        for args, says in cases:
            one_line(grpo(*TOY, "steps=2", "save_every=0", *args), *says)
    finally:
        if chattr:
            sp.run(["chattr", "-i", str(immutable / "metrics.jsonl")], check=True)
