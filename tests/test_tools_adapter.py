"""adapter=tools: the calculator, the python tool in the sandbox, data, prompts and rewards."""

from __future__ import annotations

import pytest

from adapters.tools_rl import ToolsAdapter, calculate
from grpo.rl.agent import AgentConfigError, Episode, ToolError, Turn


@pytest.mark.parametrize(("expression", "value"), [
    ("37*48", "1776"), ("37 * 48", "1776"), ("(12+30)*2 - 4", "80"), ("7/2", "3.5"), ("1/3", "0.333333"),
    ("-5 + 2", "-3"), ("17 // 5", "3"), ("17 % 5", "2"), ("3 × 4", "12"), ("0.1 + 0.2", "0.3"),
])
def test_calculator_is_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(("expression", "message"), [
    ("__import__('os').system('id')", "unsupported"), ("2 ** 10", "unsupported"), ("x + 1", "unsupported"),
    ("1 / 0", "division by zero"), ("37 *", "cannot parse"), ("9" * 300, "longer than"),
    ("10000000000000000 * 10000000000000000", "too large"), ("True + 1", "unsupported"),
])
def test_calculator_refuses_anything_else_with_a_readable_error(expression, message):
    with pytest.raises(ToolError, match=message):
        calculate(expression)


def episode(*turns: tuple[str, str]) -> Episode:
    return Episode(tuple(Turn(role, text, 1, 0.0, tool="calc" if role == "observation" else None)
                         for role, text in turns), "done", 10, 20)


def test_environment_answers_a_calc_call_and_ends_on_an_answer():
    adapter = ToolsAdapter(num_train=10, num_eval=4)
    item = {"question": "What is 37 * 48?", "answer": "1776"}
    assert adapter.observe("<calc>37*48</calc>", item, episode()) == "1776"
    assert adapter.observe("The answer is 1776.", item, episode()) is None
    assert adapter.format_observation("1776", error=False) == " <result>1776</result>"  # after a space, as the examples
    assert "</calc>" in adapter.stop_sequences(type("Tok", (), {"eos_token_id": 2})())
    # reward: the final answer, minus the cost of each call
    solved = episode(("model", "<calc>37*48</calc>"), ("observation", "<result>1776</result>"), ("model", " 1776"))
    assert adapter.episode_reward(solved, item) == pytest.approx(1 - 0.02)
    guessed = episode(("model", "It is 1700."))
    assert adapter.episode_reward(guessed, item) == 0.0
    assert adapter.is_correct(1 - 0.04, item) and not adapter.is_correct(0.0, item)


def test_problems_are_two_digit_and_held_out_items_never_train():
    adapter = ToolsAdapter(ops="+*", num_train=500, num_eval=32, seed=3)
    train, held = adapter.build_dataset(), adapter.build_eval_dataset()
    assert len(train) == 500 and len(held) == 32
    assert not {x["question"] for x in train} & {x["question"] for x in held}
    for x in train + held:
        a, op, b = x["question"].removeprefix("What is ").removesuffix("?").split()
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and op in "+*"
        assert int(x["answer"]) == (int(a) + int(b) if op == "+" else int(a) * int(b))
    assert ToolsAdapter(seed=3, num_train=500, num_eval=32).build_eval_dataset() == held  # seeded


def test_the_baseline_prompt_has_no_tool_and_the_same_items(tokenizer):
    with_tool, without = ToolsAdapter(num_train=10, num_eval=4), ToolsAdapter(tool="none", num_train=10, num_eval=4)
    assert with_tool.build_eval_dataset() == without.build_eval_dataset()
    item = with_tool.build_eval_dataset()[0]
    assert "<calc>" in tokenizer.decode(with_tool.make_prompt(item, tokenizer))
    plain = tokenizer.decode(without.make_prompt(item, tokenizer))
    assert "<calc>" not in plain and item["question"] in plain
    assert without.tools() == {} and without.observe("<calc>1+1</calc>", item, episode()) is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tool": "abacus"}, "adapter.tool='abacus' is invalid"), ({"ops": "+/"}, "adapter.ops='\\+/' is invalid"),
    ({"max_turns": 0}, "adapter.max_turns=0 is invalid"), ({"tool_timeout_s": 0}, "adapter.tool_timeout_s=0"),
    ({"observation_style": "xml"}, "adapter.observation_style='xml'"),
])
def test_bad_settings_name_the_key(kwargs, message):
    with pytest.raises(AgentConfigError, match=message):
        ToolsAdapter(num_train=10, num_eval=2, **kwargs)


def test_python_tool_runs_code_in_the_sandbox():
    adapter = ToolsAdapter(tool="python", num_train=4, num_eval=2, python_timeout_s=3.0)
    try:
        item = adapter.build_eval_dataset()[0]
        assert "question" in item and "answer" in item
        assert adapter.observe("<python>print(3 * 12 - 5)</python>", item, episode()) == "31"
        crashed = adapter.observe("<python>1/0</python>", item, episode())
        assert "ZeroDivisionError" in crashed
        with pytest.raises(ToolError, match="stopped"):
            adapter.observe("<python>while True: pass</python>", item, episode())
    finally:
        if adapter._sandbox is not None:
            adapter._sandbox.close()


@pytest.mark.slow
def test_grpo_on_smollm2_calls_the_calculator(tmp_path):
    """Two steps of `adapter=tools` on the packaged model: it does call the tool, the calls are
    answered, and the traces reach rollouts.jsonl and the report."""
    from grpo.record.runlog import read_jsonl
    from grpo.rl.loop import run_grpo

    adapter = ToolsAdapter(num_train=64, num_eval=8)
    run_grpo(adapter, {"base_model": "smollm2", "steps": 2, "batch_size": 4, "group_size": 4, "max_tokens": 24,
                       "eval_size": 8, "eval_samples": 1, "learning_rate": 3e-4, "progress": False,
                       "save_every": 0}, run_dir=tmp_path)
    steps = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    assert len(steps) == 2 and all(r["datums"] > 0 for r in steps)
    assert sum(r["episode/tool_calls"] for r in steps) > 0
    calls = [t for r in read_jsonl(tmp_path / "rollouts.jsonl") for t in r["turns"] if t["role"] == "observation"]
    answered = [t for t in calls if not t.get("error")]
    assert answered and all(t["text"] == f" <result>{calculate(t['tool_input'])}</result>" for t in answered)
    assert '"turns":[{"role":"model"' in (tmp_path / "report.html").read_text()  # traces embedded in the page
