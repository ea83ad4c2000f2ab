"""The code adapter: problems, code extraction, rewards from real sandbox runs, config, and GRPO
end to end on the tiny model (and on the packaged SmolLM2 under -m slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.code_problems import BUILTIN, load_humaneval, split_check
from adapters.code_rl import CodeAdapter, build_program, extract_code
from grpo.api.checkpoint_store import CheckpointStore
from grpo.record.runlog import read_jsonl

FENCE = "```"


def block(code: str, lang: str = "python") -> str:
    return f"Here you go:\n{FENCE}{lang}\n{code}{FENCE}\nDone."


@pytest.fixture(scope="module")
def adapter():
    a = CodeAdapter(problems="builtin", workers=2, timeout_s=3.0, test_timeout_s=1.0)
    yield a
    a.sandbox.close()


@pytest.fixture(scope="module")
def humaneval():
    return load_humaneval()


# ---------------------------------------------------------------------- problems and programs


def test_humaneval_loads_offline_and_splits_check_per_assert(humaneval):
    assert len(humaneval) == 164
    assert len({p.task_id for p in humaneval}) == 164
    first = humaneval[0]
    assert first.task_id == "HumanEval/0" and first.entry_point == "has_close_elements"
    assert len(first.tests) == 7  # the 7 asserts of its check()
    assert first.tests[0].startswith("assert candidate(")
    assert first.setup.strip().endswith("candidate = has_close_elements")
    assert all(p.tests for p in humaneval)


def test_split_check_groups_statements_and_skips_assert_true():
    source = ("X = 1\n\ndef check(candidate):\n    import math\n    y = 2\n    assert candidate(y) == 4\n"
              "    assert True, 'debug'\n    for i in range(3):\n        assert candidate(i) >= 0\n    z = 0\n")
    setup, tests = split_check(source, "f")
    assert setup == "X = 1\ncandidate = f\n"
    assert tests == ("import math\ny = 2\nassert candidate(y) == 4",
                     "for i in range(3):\n    assert candidate(i) >= 0\nz = 0")


def test_extract_code_variants():
    assert extract_code(block("x = 1\n")) == "x = 1\n"
    assert extract_code(block("x = 1\n", lang="")) == "x = 1\n"
    assert extract_code(f"{FENCE}py\ndef f():\n    return 1") == "def f():\n    return 1"  # cut by max_tokens
    assert extract_code("def f(): return 1") is None
    two = f"{FENCE}python\nprint(1)\n{FENCE} and {FENCE}python\ndef f():\n    pass\n{FENCE}"
    assert extract_code(two, "f") == "def f():\n    pass\n"
    assert extract_code(two) == "print(1)\n"


def test_build_program_keeps_prompt_helpers(humaneval):
    poly = humaneval[32]  # find_zero: its tests call poly(), defined only in the prompt
    full = build_program("def find_zero(xs):\n    return 0.0\n", poly)
    assert "def poly(" in full and full.rstrip().endswith("return 0.0")
    body = build_program("    return 0.0\n", poly)
    assert body == poly.prompt + "    return 0.0\n"


# ---------------------------------------------------------------------- rewards


def test_builtin_solutions_pass_and_wrong_answers_do_not(adapter):
    assert len(BUILTIN) >= 20
    results = adapter.sandbox.run_many([
        job for p in BUILTIN for job in (
            _job(p, p.solution), _job(p, f"def {p.entry_point}(*args):\n    return None\n"))])
    for i, p in enumerate(BUILTIN):
        good, bad = results[2 * i], results[2 * i + 1]
        assert good.all_passed, (p.task_id, good.statuses, good.details)
        assert not bad.all_passed, p.task_id


def _job(problem, code):
    from adapters.sandbox import Job

    return Job(build_program(code, problem), problem.tests, problem.setup)


def test_reward_is_fraction_or_all_or_nothing(adapter):
    add = next(p for p in BUILTIN if p.entry_point == "add")
    # add(2,3)=-1 F, add(-1,1)=-2 F, add(0,0)=0 P, add(10,-4)=14 F  -> 1 of 4
    wrong = block("def add(a, b):\n    return a - b\n")
    right = block("def add(a, b):\n    return a + b\n")
    rewards = adapter.compute_group_rewards([wrong, right, "no code here", block("def add(:\n")], add)
    assert rewards == [0.25, 1.0, 0.0, 0.0]
    strict = CodeAdapter(problems="builtin", reward="all_or_nothing", workers=1)
    assert strict.compute_reward(wrong, add) == 0.0 and strict.compute_reward(right, add) == 1.0
    assert adapter.is_correct(1.0, add) and not adapter.is_correct(0.25, add)
    metrics = adapter.sample_metrics(wrong, add)
    assert metrics == {"has_code": 1.0, "tests_passed": 0.25, "tests_fail": 0.75, "tests_timeout": 0.0,
                       "tests_crash": 0.0}
    assert adapter.sample_metrics("no code here", add) == {"has_code": 0.0}


def test_humaneval_canonical_solutions_score_one(humaneval):
    a = CodeAdapter(problems="humaneval", workers=2)
    sample = humaneval[:6]
    for p in sample:
        full, body = p.solution, p.solution[len(p.prompt):]
        assert a.compute_group_rewards([block(full), block(body), block(f"def {p.entry_point}(*a):\n    pass\n")],
                                       p) [:2] == [1.0, 1.0], p.task_id
    a.sandbox.close()


def test_hostile_response_scores_zero_and_never_raises(adapter):
    add = next(p for p in BUILTIN if p.entry_point == "add")
    bombs = [block("import os\nwhile True:\n    os.fork()\n"), block("def add(a, b):\n    while True:\n        pass\n"),
             block("import os\nos._exit(0)\n"), block("raise SystemExit(0)\n")]
    assert adapter.compute_group_rewards(bombs, add) == [0.0, 0.0, 0.0, 0.0]


def test_bad_options_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="adapter.reward='best'"):
        CodeAdapter(reward="best")
    with pytest.raises(ValueError, match="adapter.problems='mbpp'"):
        CodeAdapter(problems="mbpp")
    with pytest.raises(ValueError, match="eval_fraction"):
        CodeAdapter(eval_fraction=1.5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "x", "prompt": "def f():\n"}) + "\n")
    with pytest.raises(ValueError, match="entry_point"):
        CodeAdapter(problems=str(bad))


def test_problems_from_a_jsonl_file_and_split(tmp_path, humaneval):
    rows = [{k: getattr(p, k) for k in ("task_id", "prompt", "entry_point")} for p in humaneval[:4]]
    raw = {json.loads(line)["task_id"]: json.loads(line) for line in _humaneval_lines()[:4]}
    for row in rows:
        row["test"] = raw[row["task_id"]]["test"]
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = CodeAdapter(problems=str(path), eval_fraction=0.5, workers=1)
    train, held = a.build_dataset(), a.build_eval_dataset()
    assert len(train) == 2 and len(held) == 2
    assert {p.task_id for p in train + held} == {r["task_id"] for r in rows}
    assert CodeAdapter(problems="builtin", eval_fraction=0.25).build_eval_dataset().__len__() == len(BUILTIN) // 4


def _humaneval_lines() -> list[str]:
    import gzip

    from adapters.code_problems import humaneval_path

    with gzip.open(humaneval_path(), "rt") as f:
        return [line for line in f if line.strip()]


def test_prompt_uses_chat_template(adapter, tokenizer):
    problem = BUILTIN[0]
    tokens = adapter.make_prompt(problem, tokenizer)
    text = tokenizer.decode(tokens)
    assert "def add(a: int, b: int) -> int:" in text and "```python" in text
    assert text.rstrip().endswith("assistant")


def test_hydra_group_builds_the_adapter():
    from hydra import compose, initialize_config_dir

    from grpo.__main__ import build_adapter
    from grpo.rl.config_docs import config_dir

    conf = config_dir()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["adapter=code", "adapter.problems=humaneval",
                                                       "adapter.reward=all_or_nothing", "adapter.workers=1"])
    a = build_adapter(cfg.adapter, {"problems", "reward", "workers"})
    assert isinstance(a, CodeAdapter) and a.reward == "all_or_nothing"
    assert len(a.build_dataset()) + len(a.build_eval_dataset()) == 164
    a.sandbox.close()


# ---------------------------------------------------------------------- end to end


def _check_run(run_dir: Path, adapter: CodeAdapter, steps: int) -> list[dict]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train_rows = [m for m in metrics if "reward/mean" in m]
    assert [m["step"] for m in train_rows] == list(range(steps))
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    assert rollouts
    by_name = {p.entry_point: p for p in BUILTIN}
    for row in rollouts:  # every logged reward is what the sandbox gives that response again
        problem = next(p for name, p in by_name.items() if f"def {name}(" in row["prompt"])
        assert row["reward"] == adapter.compute_reward(row["response"], problem)
    return train_rows


def test_grpo_runs_end_to_end_on_tiny_model(tmp_path):
    from grpo.rl.loop import run_grpo

    a = CodeAdapter(problems="builtin", workers=2, timeout_s=5.0)
    final = run_grpo(a, {"base_model": "tiny", "steps": 2, "batch_size": 2, "group_size": 2, "max_tokens": 24,
                         "eval_size": 2, "eval_samples": 2, "progress": False, "report": False,
                         "save_every": 0}, run_dir=tmp_path)
    assert (CheckpointStore(tmp_path / "checkpoints").resolve(final) / "adapter_config.json").exists()
    rows = _check_run(tmp_path, a, 2)
    assert all("adapter/has_code" in m for m in rows)
    a.sandbox.close()


@pytest.mark.slow
def test_grpo_on_smollm2_writes_scored_code(tmp_path):
    from grpo.rl.loop import run_grpo

    a = CodeAdapter(problems="builtin", workers=2)
    run_grpo(a, {"base_model": "smollm2", "steps": 2, "batch_size": 2, "group_size": 4, "max_tokens": 96,
                 "eval_size": 4, "eval_samples": 2, "temperature": 0.8, "progress": False, "report": False, "save_every": 0}, run_dir=tmp_path)
    rows = _check_run(tmp_path, a, 2)
    # the instruct model does answer in code blocks: the sandbox really ran its programs
    assert sum(m["adapter/has_code"] for m in rows) / len(rows) > 0.5
    a.sandbox.close()


@pytest.mark.slow
def test_every_humaneval_canonical_solution_scores_one(humaneval):
    a = CodeAdapter(problems="humaneval", workers=2, timeout_s=20.0, test_timeout_s=10.0)
    for p in humaneval:
        assert a.compute_reward(block(p.solution), p) == 1.0, p.task_id
    a.sandbox.close()
