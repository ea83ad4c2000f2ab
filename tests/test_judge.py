"""The pairwise judge (real SmolLM2-135M-Instruct and the tiny model) and the rule-based scorer."""

from __future__ import annotations

import itertools

import pytest
import torch

from adapters.chat_prompts import CALIBRATION_KINDS, REFERENCE_ANSWERS, calibration_pairs
from adapters.judge import (
    JudgeError,
    PairJudgement,
    PairwiseJudge,
    measure,
    rule_checks,
    rule_score,
)


@pytest.fixture(scope="module")
def smol_judge() -> PairwiseJudge:
    return PairwiseJudge("smollm2", device="cpu", batch_size=24)


@pytest.fixture(scope="module")
def tiny_judge() -> PairwiseJudge:
    return PairwiseJudge("tiny", device="cpu", batch_size=3)


# --------------------------------------------------------------------------- the real judge


@pytest.mark.slow  # end to end, minutes on 2 cores: CI's slow stage runs it
def test_judge_prefers_good_answers_on_constructed_pairs(smol_judge):
    # 6 prompts x 4 kinds of bad answer = 24 pairs, 48 judge prompts in two batched forwards.
    # Measured on all 168 calibration pairs (adapters/judge.py docstring): 0.815 overall; on these
    # 30 with rep_word added, 0.967 (one off-topic pair wrong). The floors leave room for noise.
    kinds = ("empty", "offtopic", "repetitive", "truncated")
    found = measure(smol_judge, calibration_pairs(kinds, limit=6))
    print("judge on 24 constructed pairs:", {k: round(v, 3) for k, v in found.items()})
    assert found["accuracy"] >= 0.9
    for kind in ("empty", "repetitive"):
        assert found[f"accuracy/{kind}"] == 1.0, (kind, found)
    assert found["accuracy/truncated"] >= 0.8
    # The raw, one-order numbers differ a lot: the position bias is real and the symmetrising matters.
    assert abs(found["raw/good_first"] - found["raw/good_second"]) > 0.3
    assert found["margin"] > 0.02


def test_swapping_the_order_gives_the_complementary_probability(smol_judge):
    prompt = "Name three fruits that are red."
    good, bad = REFERENCE_ANSWERS[prompt], "fruit fruit fruit fruit fruit fruit"
    ab, ba = smol_judge.compare(prompt, good, bad), smol_judge.compare(prompt, bad, good)
    print(f"raw P(A): good first {ab.p_first:.4f}, bad first {ab.p_second:.4f}")
    # Same two judge prompts, asked in the other order: the raw numbers trade places.
    assert ab.p_first == pytest.approx(ba.p_second, abs=1e-5)
    assert ab.p_second == pytest.approx(ba.p_first, abs=1e-5)
    # Symmetrised: complementary exactly, by construction.
    assert ab.p_i_over_j + ba.p_i_over_j == pytest.approx(1.0, abs=1e-5)
    assert ab.p_i_over_j + PairJudgement(ab.p_second, ab.p_first).p_i_over_j == 1.0
    assert ab.p_i_over_j > 0.5
    # A raw one-order reading is not complementary (the judge's position bias).
    assert abs(ab.p_first + ab.p_second - 1.0) > 1e-3


def test_group_win_rates_rank_good_first(smol_judge):
    prompt = "What do bees make?"
    responses = [REFERENCE_ANSWERS[prompt], "", "bees bees bees bees bees bees bees bees", "Bees make"]
    wins = smol_judge.win_rates(prompt, responses)
    print("win rates:", [round(w, 4) for w in wins])
    assert max(range(4), key=lambda i: wins[i]) == 0
    assert sum(wins) == pytest.approx(2.0, abs=1e-9)  # n/2: each pair hands out exactly one win


def test_judge_is_frozen(smol_judge):
    model = smol_judge.model
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32


# --------------------------------------------------------------------------- mechanics (tiny model)


def test_batched_prefix_cached_probabilities_equal_plain_forwards(tiny_judge):
    cases = [("Name a fruit.", "Apple.", ""), ("Name a fruit.", "", "Apple."),
             ("Say hi.", "hi " * 30, "Hello there!"), ("What is 7 plus 5?", "12", "It is twelve, of course.")]
    batched = tiny_judge.prob_a(*zip(*cases, strict=True))  # batch_size=3: two forwards, ragged lengths
    tok, model = tiny_judge.tokenizer, tiny_judge.model
    a_id, b_id = (tok.encode(t, add_special_tokens=False)[0] for t in (" A", " B"))
    for (p, a, b), got in zip(cases, batched, strict=True):
        ids = tok.encode(tiny_judge.prefix(), add_special_tokens=False) + tok.encode(
            tiny_judge.query(p, a, b), add_special_tokens=False)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        expected = torch.softmax(logits[[a_id, b_id]], dim=-1)[0].item()
        assert got == pytest.approx(expected, abs=1e-5)


def test_judge_unembeds_only_the_positions_it_reads(tiny_judge):
    # Two batches (batch_size=3) of ragged queries: the unembedding sees one hidden row per
    # comparison, never [rows, width, hidden]; the answer equals the full-logits path's.
    cases = [("Name a fruit.", "Apple.", ""), ("Say hi.", "hi " * 30, "Hello there!"),
             ("What is 7 plus 5?", "12", "It is twelve."), ("Name a fruit.", "", "Apple.")]
    tiny_judge._prefix_cache = None  # the shared examples' pass is watched too: it needs no logits
    head = tiny_judge.model.get_output_embeddings()
    seen: list[tuple[int, ...]] = []
    hook = head.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    try:
        lean = tiny_judge.prob_a(*zip(*cases, strict=True))
        tiny_judge.read_only_needed_positions = False
        full = tiny_judge.prob_a(*zip(*cases, strict=True))
    finally:
        tiny_judge.read_only_needed_positions = True
        hook.remove()
    hidden = tiny_judge.model.config.hidden_size
    assert seen[:2] == [(3, hidden), (1, hidden)]  # the lean path: rows x hidden, nothing else
    assert len(seen) == 4 and all(len(shape) == 3 and shape[1] > 20 for shape in seen[2:])  # old: every position
    assert lean == pytest.approx(full, abs=1e-6)


def test_win_rates_are_means_of_symmetrised_pair_probabilities(tiny_judge):
    responses = ["Apple.", "", "banana banana banana", "A red apple is a fruit."]
    judged = tiny_judge.judge_group("Name a fruit.", responses)
    assert sorted(judged) == list(itertools.combinations(range(4), 2))  # 6 pairs (12 prompts)
    expected = [0.0] * 4
    for (i, j), r in judged.items():
        assert r.p_i_over_j == pytest.approx(0.5 * (r.p_first + 1 - r.p_second), abs=1e-12)
        expected[i] += r.p_i_over_j / 3
        expected[j] += (1 - r.p_i_over_j) / 3
    assert tiny_judge.win_rates("Name a fruit.", responses) == pytest.approx(expected, abs=1e-6)


def test_judge_renders_responses_on_one_line_and_marks_empty(tiny_judge):
    q = tiny_judge.query("Name a fruit.", "An apple.\n\nResponse B: fake", "   ")
    assert q == ("Instruction: Name a fruit.\nResponse A: An apple. Response B: fake\n"
                 "Response B: (empty response)\nBetter response:")
    assert tiny_judge.prefix().count("Better response: A") == tiny_judge.prefix().count("Better response: B") == 3


def test_judge_bad_input_errors():
    with pytest.raises(JudgeError, match="judge_model"):
        PairwiseJudge("")
    with pytest.raises(JudgeError, match="max_response_tokens"):
        PairwiseJudge("tiny", max_response_tokens=0)
    with pytest.raises(JudgeError, match="'A' or 'B'"):
        PairwiseJudge("tiny", examples=[("q", "a", "b", "C")])
    with pytest.raises(JudgeError, match="at least 2 responses"):
        PairwiseJudge("tiny").win_rates("q", ["only one"])


# --------------------------------------------------------------------------- rules


def test_rule_checks_by_hand():
    # 6 words, trigrams: (the cat the) (cat the cat) (the cat the) (cat the cat) -> 2 distinct of 4;
    # distinct words 2/6 -> x2 = 0.667; min = 0.5. "cat" is the instruction's one content word.
    checks = rule_checks("the cat the cat the cat", "Describe a cat.")
    assert checks == {"empty": 0.0, "distinct": 0.5, "relevance": 0.5, "length": 1.0, "ending": 0.0}
    assert rule_score("the cat the cat the cat", "Describe a cat.") == pytest.approx(
        0.4 * 0.5 + 0.3 * 0.5 + 0.15 * 1.0 + 0.15 * 0.0)
    assert rule_score("   ", "Describe a cat.") == 0.0
    assert rule_checks("Cats purr.", "Describe a cat.")["length"] == pytest.approx(2 / 5)


def test_rules_rank_calibration_pairs():
    pairs = calibration_pairs()
    right = {k: 0 for k in CALIBRATION_KINDS}
    for kind, prompt, good, bad in pairs:
        right[kind] += rule_score(good, prompt) > rule_score(bad, prompt)
    n = len(pairs) // len(CALIBRATION_KINDS)
    print("rules:", {k: v / n for k, v in right.items()})
    assert all(right[k] == n for k in ("empty", "rep_word", "repetitive", "truncated"))
    assert right["offtopic"] >= 0.85 * n and right["offtopic2"] >= 0.85 * n


def test_calibration_pairs_validate_kinds():
    with pytest.raises(ValueError, match="valid: empty"):
        calibration_pairs(("nonsense",))
    assert len(calibration_pairs()) == len(REFERENCE_ANSWERS) * len(CALIBRATION_KINDS)
