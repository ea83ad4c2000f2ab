"""MathAdapter: data and held-out splits, prompts, rewards, config errors, Hydra, and short runs."""

from __future__ import annotations

import inspect
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from adapters.math_rl import MathAdapter, MathConfigError
from grpo.record.runlog import read_jsonl
from grpo.rl.loop import run_grpo

CONF = Path(__file__).resolve().parent.parent / "conf" / "adapter" / "math.yaml"


def _sum_of(question: str) -> int:
    a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", question).groups())
    return a + b


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- data


def test_addition_is_seeded_correct_and_held_out_disjoint():
    ad = MathAdapter(task="addition", digits=1, num_eval=20)
    train, held = ad.build_dataset(), ad.build_eval_dataset()
    assert len(held) == 20 and len(train) == 80  # 100 one-digit sums in all
    assert {i["question"] for i in train}.isdisjoint(i["question"] for i in held)
    assert all(int(i["answer"]) == _sum_of(i["question"]) for i in train + held)
    assert MathAdapter(num_eval=20).build_eval_dataset() == held  # same seed, same split
    assert MathAdapter(num_eval=20, seed=1).build_eval_dataset() != held
    # a small space holds out at most half of itself
    assert len(MathAdapter(num_eval=64).build_eval_dataset()) == 50

    two = MathAdapter(digits=2, num_train=300, num_eval=40)
    questions = [i["question"] for i in two.build_dataset() + two.build_eval_dataset()]
    assert len(questions) == len(set(questions)) == 340
    assert all(10 <= int(n) <= 99 for q in questions for n in re.findall(r"\d+", q))


@pytest.mark.parametrize("task", ["arithmetic", "gsm8k"])
def test_reasoning_gym_tasks_have_a_disjoint_held_out_split(task):
    ad = MathAdapter(task=task, num_train=60, num_eval=20, digits=2)
    train, held = ad.build_dataset(), ad.build_eval_dataset()
    assert len(train) == 60 and len(held) == 20
    assert {i["question"] for i in train}.isdisjoint(i["question"] for i in held)
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", i["answer"]) for i in train + held)
    if task == "arithmetic":  # the gold answer is the expression's value
        item = train[0]
        expr = item["question"].removeprefix("Calculate ").rstrip(".")
        assert float(item["answer"]) == pytest.approx(eval(expr))  # noqa: S307 (generated digits only)


def test_dataset_source_with_custom_columns_and_gsm8k_answers(tmp_path):
    rows = [{"problem": f"Tom has {n} apples and buys 2. How many now?",
             "solution": f"{n} + 2 = {n + 2}\n#### {n + 2:,}"} for n in range(995, 1015)]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    ad = MathAdapter(task="dataset", source=str(path), question_column="problem",
                     answer_column="solution", num_eval=5)
    train, held = ad.build_dataset(), ad.build_eval_dataset()
    assert len(train) == 15 and len(held) == 5
    assert {i["question"] for i in train}.isdisjoint(i["question"] for i in held)
    by_q = {r["problem"]: r["solution"].rsplit("#### ", 1)[1] for r in rows}
    assert all(i["answer"] == by_q[i["question"]] for i in train + held)
    item = next(i for i in train if "1000 apples" in i["question"])
    assert item["answer"] == "1,002" and ad.compute_reward("so 1002 apples", item) == 1.0

    # a separate held-out file: its questions are removed from training
    eval_path = _write_jsonl(tmp_path / "test.jsonl", rows[:3])
    ad = MathAdapter(task="gsm8k", source=str(path), eval_source=str(eval_path),
                     question_column="problem", answer_column="solution", num_eval=10)
    assert len(ad.build_eval_dataset()) == 3 and len(ad.build_dataset()) == 17

    # in-memory rows work too
    ad = MathAdapter(task="dataset", source=[{"question": "1+1?", "answer": 2}] * 3
                     + [{"question": "2+2?", "answer": 4}], num_eval=1, seed=3)
    assert len(ad.build_eval_dataset()) == 1


# --------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("kwargs,pattern", [
    ({"task": "algebra"}, r"adapter\.task='algebra' is invalid: valid values: addition, arithmetic, gsm8k, dataset"),
    ({"prompt_style": "cot"}, r"adapter\.prompt_style='cot' is invalid: valid values: chat, fewshot"),
    ({"extraction": "first_number"}, r"adapter\.extraction='first_number'.*last_number, boxed, answer_line, auto"),
    ({"digits": 0}, r"adapter\.digits=0 is invalid"),
    ({"format_reward": 1.0}, r"adapter\.format_reward=1\.0 is invalid: must be a number in \[0, 1\)"),
    ({"grade_timeout_s": 0}, r"adapter\.grade_timeout_s=0"),
    ({"task": "dataset"}, r"task='dataset' needs adapter\.source"),
    ({"task": "addition", "source": "x.jsonl"}, r"only read by task='gsm8k' or task='dataset'"),
])
def test_bad_config_names_the_key_and_valid_values(kwargs, pattern):
    with pytest.raises(MathConfigError, match=pattern):
        MathAdapter(**kwargs)


def test_missing_columns_and_missing_files_fail_in_the_constructor(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?", "target": "2"}])
    with pytest.raises(MathConfigError, match=r"no column\(s\) \['question', 'answer'\].*\['prompt', 'target'\]"):
        MathAdapter(task="dataset", source=str(path))
    with pytest.raises(MathConfigError, match="does not exist"):
        MathAdapter(task="dataset", source=str(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------- prompts and rewards


def test_chat_prompt_carries_question_and_instruction(tokenizer):
    ad = MathAdapter(num_eval=4, instruction="Box it.", system_prompt="Be brief.")
    item = {"question": "What is 2 + 3?", "answer": "5"}
    text = tokenizer.decode(ad.make_prompt(item, tokenizer))
    assert text.index("Be brief.") < text.index("What is 2 + 3?\nBox it.")
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert ad.stop_sequences(tokenizer) == [tokenizer.eos_token_id]


def test_fewshot_prompt_is_plain_q_a(tokenizer):
    ad = MathAdapter(prompt_style="fewshot", extraction="boxed", num_shots=2, num_eval=4)
    item = {"question": "What is 2 + 3?", "answer": "5"}
    s1, s2 = ad.shots
    expected = (f"Q: {s1['question']}\nA: \\boxed{{{s1['answer']}}}\n\n"
                f"Q: {s2['question']}\nA: \\boxed{{{s2['answer']}}}\n\nQ: What is 2 + 3?\nA:")
    assert ad.fewshot_text(item) == expected
    assert tokenizer.decode(ad.make_prompt(item, tokenizer)) == expected
    assert {"\nQ:", "\n\n"} <= set(ad.stop_sequences(tokenizer))
    assert not {s["question"] for s in ad.shots} & {i["question"] for i in ad.build_eval_dataset()}


def test_rewards_partial_credit_and_correctness():
    item = {"question": "What is 2 + 3?", "answer": "5"}
    plain = MathAdapter(num_eval=4)
    assert plain.compute_reward("2 + 3 = 5", item) == 1.0
    assert plain.compute_reward("2 + 3 = 6", item) == 0.0
    assert plain.compute_reward("five", item) == 0.0

    boxed = MathAdapter(num_eval=4, extraction="boxed", format_reward=0.1)
    assert boxed.compute_reward("so \\boxed{5}", item) == 1.0
    assert boxed.compute_reward("so \\boxed{6}", item) == 0.1  # right format, wrong answer
    assert boxed.compute_reward("so 5", item) == 0.0  # no box: no credit at all
    assert boxed.is_correct(1.0, item) and not boxed.is_correct(0.1, item)
    assert boxed.sample_metrics("so \\boxed{6}", item) == {"answer_found": 1.0, "chars": 12.0}
    assert boxed.sample_metrics("so 5", item)["answer_found"] == 0.0


# --------------------------------------------------------------------------- Hydra


def test_math_yaml_matches_the_constructor_and_cli_overrides_apply():
    from hydra import compose, initialize_config_dir

    from grpo.__main__ import build_adapter

    conf = yaml.safe_load(CONF.read_text())["adapter"]
    defaults = {k: p.default for k, p in inspect.signature(MathAdapter).parameters.items()}
    # every knob is in the group file with the constructor's default, and no stray one
    assert {k: v for k, v in conf.items() if k != "_target_"} == defaults

    overrides = ["adapter=math", "adapter.task=gsm8k", "adapter.prompt_style=fewshot",
                 "adapter.num_train=30", "adapter.num_eval=5"]
    with initialize_config_dir(config_dir=str(CONF.parent.parent), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    ad = build_adapter(cfg.adapter, {"task", "prompt_style", "num_train", "num_eval"})
    assert isinstance(ad, MathAdapter)
    assert (ad.task, ad.prompt_style, len(ad.build_dataset()), len(ad.build_eval_dataset())) == \
        ("gsm8k", "fewshot", 30, 5)


# --------------------------------------------------------------------------- end to end


def test_two_steps_on_the_tiny_model(tmp_path):
    ad = MathAdapter(num_eval=4)
    cfg = {"base_model": "tiny", "steps": 2, "batch_size": 2, "group_size": 4, "max_tokens": 8,
           "eval_size": 4, "eval_samples": 2, "report": False, "progress": False}
    run_grpo(ad, cfg, run_dir=tmp_path)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward/mean" in r] == [0, 1]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2]
    assert all(r["failures/count"] == 0 for r in rows if "reward/mean" in r)
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert len(rollouts) == 16
    for r in rollouts:  # every logged reward is what the adapter gives that response
        question = re.search(r"What is \d+ \+ \d+\?", r["prompt"]).group(0)
        assert r["reward"] == ad.compute_reward(r["response"], {"answer": str(_sum_of(question))})
    ad.close()


@pytest.mark.slow
def test_smollm2_defaults_give_mixed_groups(tmp_path):
    """On the packaged SmolLM2 the default task is neither solved nor hopeless: held-out greedy
    accuracy is well above zero and below one, and groups are mixed (GRPO has signal)."""
    ad = MathAdapter()
    cfg = {"base_model": "smollm2", "steps": 3, "batch_size": 4, "group_size": 4, "max_tokens": 16,
           "learning_rate": 2e-5, "eval_size": 16, "eval_samples": 2, "report": False,
           "progress": False}
    run_grpo(ad, cfg, run_dir=tmp_path)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train] == [0, 1, 2]
    first_eval = next(r for r in rows if "eval/accuracy" in r)
    assert 0.2 <= first_eval["eval/accuracy"] <= 0.95
    assert sum(r["groups/mixed"] for r in train) / len(train) >= 0.25
    assert all(math.isfinite(r["loss"]) for r in train if r["datums"] > 0)
    ad.close()
