"""The chat adapter: prompts, rewards through the judge and the rules, and short GRPO runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters.chat_prompts import PROMPTS, REFERENCE_ANSWERS
from adapters.chat_rl import ChatAdapter
from adapters.data import DataSourceError
from adapters.judge import rule_score
from grpo.api.checkpoint_store import CheckpointStore
from grpo.record.runlog import read_jsonl
from grpo.rl.adapter import chat_prompt_tokens

CHAT_YAML = Path(__file__).resolve().parents[1] / "conf" / "adapter" / "chat.yaml"




def test_builtin_prompts_and_eval_hold_out():
    assert 40 <= len(PROMPTS) <= 80 and len(set(PROMPTS)) == len(PROMPTS)
    adapter = ChatAdapter(scorer="rules", eval_size=5)
    train, held_out = adapter.build_dataset(), adapter.build_eval_dataset()
    assert len(train) + len(held_out) == len(PROMPTS) and len(held_out) == 5
    assert {i["instruction"] for i in train}.isdisjoint(i["instruction"] for i in held_out)
    assert {i["instruction"] for i in train + held_out} == set(PROMPTS)
    assert ChatAdapter(scorer="rules", limit=7, eval_size=0).build_dataset().__len__() == 7


def test_prompt_tokens_use_the_chat_template(tokenizer):
    adapter = ChatAdapter(scorer="rules", system_prompt="Be brief.")
    item = adapter.build_dataset()[0]
    assert item["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": item["instruction"]}]
    tokens = adapter.make_prompt(item, tokenizer)
    assert tokens == chat_prompt_tokens(tokenizer, item["messages"])
    assert tokenizer.decode(tokens).endswith("<|im_start|>assistant\n")


def test_prompts_from_a_jsonl_source_with_a_configured_column(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"instruction": "Say hi.", "id": 1},
            {"instruction": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Name a color."}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    items = ChatAdapter(prompts=str(path), prompt_column="instruction", scorer="rules", eval_size=0).build_dataset()
    assert sorted(i["instruction"] for i in items) == ["Name a color.", "Say hi."]
    chat = next(i for i in items if i["instruction"] == "Name a color.")
    assert chat["messages"][0] == {"role": "system", "content": "Be kind."}
    with pytest.raises(DataSourceError, match=r"no column\(s\) \['prompt'\].*'instruction'"):
        ChatAdapter(prompts=str(path), scorer="rules").build_dataset()
    with pytest.raises(DataSourceError, match="row 0.*non-empty instruction"):
        ChatAdapter(prompts=[{"prompt": ""}], scorer="rules").build_dataset()


def test_bad_options_fail_before_any_model_loads():
    with pytest.raises(ValueError, match="scorer='llm'.*judge, rules, judge\\+rules"):
        ChatAdapter(scorer="llm")
    with pytest.raises(ValueError, match="rules_weight"):
        ChatAdapter(scorer="judge+rules", rules_weight=1.5)
    with pytest.raises(DataSourceError, match="eval_size=3"):
        ChatAdapter(prompts=[{"prompt": "a"}, {"prompt": "b"}], scorer="rules", eval_size=3).build_dataset()
    adapter = ChatAdapter(judge_model="no-such-model")  # loads lazily: the name is checked on first use
    assert adapter.judge is not None and adapter.judge._model is None


def test_rewards_rules_and_the_judge_rules_mix():
    item = {"messages": [{"role": "user", "content": "What do bees make?"}], "instruction": "What do bees make?"}
    responses = [REFERENCE_ANSWERS["What do bees make?"], "", "bees bees bees bees bees bees", "Bees make"]
    rules = ChatAdapter(scorer="rules")
    expected_rules = [rule_score(r, "What do bees make?") for r in responses]
    assert rules.compute_group_rewards(responses, item) == expected_rules
    assert rules.compute_reward(responses[0], item) == expected_rules[0]
    assert expected_rules[0] > max(expected_rules[1:]) and expected_rules[1] == 0.0

    mixed = ChatAdapter(scorer="judge+rules", judge_model="tiny", rules_weight=0.25)
    wins = mixed.judge.win_rates("What do bees make?", responses)
    got = mixed.compute_group_rewards(responses, item)
    assert got == pytest.approx([0.75 * w + 0.25 * r for w, r in zip(wins, expected_rules, strict=True)], abs=1e-9)
    judge_only = ChatAdapter(scorer="judge", judge_model="tiny")
    assert judge_only.compute_group_rewards(responses, item) == pytest.approx(wins, abs=1e-6)
    with pytest.raises(ValueError, match="compute_group_rewards"):
        judge_only.compute_reward("x", item)


def test_held_out_comparison_uses_the_training_measure():
    item = {"instruction": "What do bees make?"}
    good, bad = REFERENCE_ANSWERS["What do bees make?"], "bees bees bees bees bees bees"
    rules = ChatAdapter(scorer="rules")
    assert rules.compare_responses([item] * 3, [good, bad, good], [bad, good, good]) == [1.0, 0.0, 0.5]
    judge = ChatAdapter(scorer="judge", judge_model="tiny")
    got = judge.compare_responses([item] * 3, [good, bad, good], [bad, good, good])
    p = judge.judge.compare("What do bees make?", good, bad)
    assert got[0] == pytest.approx(p.p_i_over_j, abs=1e-6)
    assert got[0] + got[1] == pytest.approx(1.0, abs=1e-6)  # both orders: complementary
    assert got[2] == pytest.approx(0.5, abs=1e-7)  # the same answer: a tie
    mixed = ChatAdapter(scorer="judge+rules", judge_model="tiny", rules_weight=0.25)
    assert mixed.compare_responses([item], [good], [bad]) == pytest.approx([0.75 * got[0] + 0.25], abs=1e-6)


def test_training_metric_against_a_fixed_reference_answer():
    rows = [{"prompt": "What do bees make?", "reference": REFERENCE_ANSWERS["What do bees make?"]},
            {"prompt": "Name a colour.", "reference": ""}]
    adapter = ChatAdapter(prompts=rows, judge_model="tiny", eval_size=0)
    with_ref, without = sorted(adapter.build_dataset(), key=lambda i: i["reference"] is None)
    responses = ["Honey.", "", "Bees make honey and wax.", "bees bees bees"]
    adapter.compute_group_rewards(responses, with_ref)
    expected = adapter.judge.p_better([with_ref["instruction"]] * 4, responses, [with_ref["reference"]] * 4)
    found = [adapter.sample_metrics(r, with_ref)["judge_vs_reference"] for r in responses]
    assert found == pytest.approx(expected, abs=1e-9)
    assert max(found) - min(found) > 1e-6  # an absolute score (tiny, random judge: small margins)
    adapter.compute_group_rewards(responses, without)  # no reference: no metric
    assert "judge_vs_reference" not in adapter.sample_metrics(responses[0], without)
    builtin = ChatAdapter(scorer="rules").build_dataset() + ChatAdapter(scorer="rules").build_eval_dataset()
    assert sum(i["reference"] is not None for i in builtin) == len(REFERENCE_ANSWERS)


def test_hydra_group_file_instantiates_with_overrides():
    from hydra import compose, initialize_config_dir

    from grpo.__main__ import build_adapter

    overrides = ["adapter=chat", "adapter.judge_model=tiny", "adapter.scorer=judge+rules", "adapter.limit=5",
                 "adapter.eval_size=0"]  # the group's 12 held-out prompts would not fit in 5
    with initialize_config_dir(config_dir=str(CHAT_YAML.parent.parent), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    assert cfg.max_tokens == 64  # the group's own default for the loop
    adapter = build_adapter(cfg.adapter, cli_keys={"judge_model", "scorer", "limit", "eval_size"})
    assert isinstance(adapter, ChatAdapter)
    assert adapter.scorer == "judge+rules" and adapter.judge.model_name == "tiny"
    assert len(adapter.build_dataset()) == 5


def _check_run(run_dir: Path, adapter: ChatAdapter, steps: int, group_size: int) -> None:
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in m]
    assert [m["step"] for m in metrics] == list(range(steps))
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    assert not read_jsonl(run_dir / "failures.jsonl")
    for step in range(steps):
        for group in {r["group"] for r in rollouts if r["step"] == step}:
            rewards = [r["reward"] for r in rollouts if r["step"] == step and r["group"] == group]
            assert len(rewards) == group_size and all(0.0 <= x <= 1.0 for x in rewards)
            # Win rates of a group add up to group_size / 2: every pair hands out exactly one win.
            assert sum(rewards) == pytest.approx(group_size / 2, abs=1e-6)
            advantages = [r["advantage"] for r in rollouts if r["step"] == step and r["group"] == group]
            mean = sum(rewards) / len(rewards)
            assert advantages == pytest.approx([x - mean for x in rewards], abs=1e-6)


def test_end_to_end_tiny_policy_tiny_judge(tmp_path):
    from grpo.rl.loop import run_grpo

    adapter = ChatAdapter(judge_model="tiny", limit=6, eval_size=0)
    judge_weights = {k: v.clone() for k, v in adapter.judge.model.state_dict().items()}
    final = run_grpo(adapter, {"base_model": "tiny", "steps": 2, "batch_size": 2, "group_size": 4,
                               "max_tokens": 8, "learning_rate": 1e-3, "save_every": 0, "progress": False,
                               "report": False}, run_dir=tmp_path)
    assert (CheckpointStore(tmp_path / "checkpoints").resolve(final) / "adapter_config.json").exists()
    _check_run(tmp_path, adapter, steps=2, group_size=4)
    # The judge stayed frozen and outside the policy: not a weight moved.
    after = adapter.judge.model.state_dict()
    assert all(torch.equal(judge_weights[k], after[k]) for k in judge_weights)
    assert not any(p.requires_grad for p in adapter.judge.model.parameters())


def test_held_out_win_rate_against_the_base_model(tmp_path, capsys):
    from grpo.record.report import PANELS, build_payload, load_run, panel_keys
    from grpo.rl.loop import run_grpo

    adapter = ChatAdapter(judge_model="tiny", limit=10, eval_size=4)
    run_grpo(adapter, {"base_model": "tiny", "steps": 2, "batch_size": 2, "group_size": 4, "max_tokens": 8,
                       "learning_rate": 5e-2, "save_every": 0, "progress": False, "report": False},
             run_dir=tmp_path)
    evals = {m["step"]: m for m in read_jsonl(tmp_path / "metrics.jsonl") if "eval/win_rate" in m}
    assert sorted(evals) == [0, 2] and all(m["eval/items"] == 4 for m in evals.values())
    # Step 0: the policy is the base model, so its greedy answers are the base's and every
    # comparison is a tie, exactly.
    assert evals[0]["eval/same_as_base"] == 1.0
    assert evals[0]["eval/win_rate"] == pytest.approx(0.5, abs=1e-6) and evals[0]["eval/wins"] == 0.0
    # A large learning rate on a random model changes the answers: the win rate moves off 0.5.
    # (The tiny judge is random, its margins ~1e-5: the real judge's numbers are in the README.)
    assert evals[2]["eval/same_as_base"] < 1.0 and abs(evals[2]["eval/win_rate"] - 0.5) > 1e-6
    assert evals[2]["eval/failures"] == 0.0
    assert "held-out win rate vs the base model 0.500 (step 0) ->" in capsys.readouterr().out
    eval_panel = next(p for p in PANELS if p.id == "eval")
    run = load_run(tmp_path)
    assert "eval/win_rate" in panel_keys(eval_panel, set(run.metrics))  # drawn in the report
    assert build_payload([run], "t")


@pytest.mark.slow
def test_end_to_end_smollm2_policy_and_judge(tmp_path):
    from grpo.rl.loop import run_grpo

    adapter = ChatAdapter(judge_model="smollm2", scorer="judge", limit=8, eval_size=0)
    run_grpo(adapter, {"base_model": "smollm2", "steps": 2, "batch_size": 2, "group_size": 4, "max_tokens": 32,
                       "learning_rate": 1e-4, "save_every": 0, "progress": False, "report": False}, run_dir=tmp_path)
    _check_run(tmp_path, adapter, steps=2, group_size=4)
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    # The real judge separates responses: rewards are not all tied at 0.5.
    assert max(abs(r["reward"] - 0.5) for r in rollouts) > 1e-3
