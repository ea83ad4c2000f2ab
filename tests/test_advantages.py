"""Advantages and datums against hand computation."""

from __future__ import annotations

import math

import pytest

from grpo.advantages import (
    assign_advantages,
    build_datum,
    build_datums,
    group_advantages,
    kl_penalised,
    loss_scales,
    trainable_responses,
)
from grpo.rollouts import Group, Response


def resp(tokens, reward=0.0, stop="stop", logprobs=None):
    return Response(tokens=list(tokens), logprobs=list(logprobs or [-0.5] * len(tokens)), stop_reason=stop,
                    text="x", reward=reward)


def test_group_advantages_centre_and_std():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    adv = group_advantages([3.0, 1.0], "std")  # mean 2, std 1
    assert adv == pytest.approx([1.0, -1.0], abs=1e-5)
    # a failed (NaN) reward is left out of the mean and gets no advantage
    adv = group_advantages([1.0, math.nan, 0.0])
    assert adv[0] == 0.5 and math.isnan(adv[1]) and adv[2] == -0.5
    assert group_advantages([2.0, 2.0, 2.0], "std") == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="advantage_norm"):
        group_advantages([1.0], "zscore")


def test_loss_scales_fold_aggregation_into_advantages():
    assert loss_scales([2, 3], "sum") == [1.0, 1.0]
    assert loss_scales([2, 3], "token_mean") == pytest.approx([0.2, 0.2])
    assert loss_scales([2, 3], "seq_mean") == pytest.approx([1 / 4, 1 / 6])
    with pytest.raises(ValueError, match="loss_agg"):
        loss_scales([1], "mean")


def test_build_datum_masks_the_prompt():
    r = resp([7, 8, 9], logprobs=[-1.0, -2.0, -3.0])
    d = build_datum([1, 2, 3, 4], r, [0.5, 0.5, 0.5])
    assert d.model_input.to_ints() == [1, 2, 3, 4, 7, 8]
    ins = {k: v.tolist() for k, v in d.loss_fn_inputs.items()}
    assert ins["target_tokens"] == [2, 3, 4, 7, 8, 9]
    assert ins["weights"] == [0, 0, 0, 1, 1, 1]
    assert ins["advantages"] == [0, 0, 0, 0.5, 0.5, 0.5]
    assert ins["logprobs"] == [0, 0, 0, -1.0, -2.0, -3.0]


def test_flat_groups_are_skipped_and_overlong_rules():
    flat = Group(0, None, [1, 2], [resp([3], 1.0), resp([4], 1.0)])
    mixed = Group(1, None, [1, 2], [resp([3], 1.0), resp([4, 5], 0.0, stop="length"), resp([6], math.nan)])
    assign_advantages([flat, mixed], "center", "keep")
    pairs = trainable_responses([flat, mixed], skip_flat_groups=True, overlong="keep")
    assert [(g.item_index, r.tokens) for g, r in pairs] == [(1, [3]), (1, [4, 5])]  # NaN one left out
    assert [r.advantage for _, r in pairs] == [0.5, -0.5]
    assert len(trainable_responses([flat, mixed], skip_flat_groups=False, overlong="keep")) == 4
    assert [r.tokens for _, r in trainable_responses([mixed], True, "drop")] == [[3]]
    # overlong=zero: the truncated response's reward becomes 0 before centring
    g = Group(2, None, [1], [resp([3], 1.0), resp([4], 1.0, stop="length")])
    assign_advantages([g], "center", "zero")
    assert [r.reward for r in g.responses] == [1.0, 0.0]
    assert [r.advantage for r in g.responses] == [0.5, -0.5]


def test_build_datums_loss_agg_and_kl_shaping():
    g = Group(0, None, [1, 2], [resp([3, 4], 1.0, logprobs=[-1.0, -1.0]), resp([5], 0.0, logprobs=[-2.0])])
    assign_advantages([g], "center", "keep")
    pairs = trainable_responses([g], True, "keep")
    datums, _ = build_datums(pairs, "importance_sampling", "token_mean")
    # 3 response tokens in the batch: advantages are scaled by 1/3
    assert datums[0].loss_fn_inputs["advantages"].tolist()[-2:] == pytest.approx([0.5 / 3] * 2)
    assert datums[1].loss_fn_inputs["advantages"].tolist()[-1:] == pytest.approx([-0.5 / 3])
    # dro puts the aggregation into the weights, the advantage stays whole
    datums, _ = build_datums(pairs, "dro", "seq_mean")
    assert datums[0].loss_fn_inputs["weights"].tolist()[-2:] == pytest.approx([0.25, 0.25])
    assert datums[0].loss_fn_inputs["advantages"].tolist()[-1] == pytest.approx(0.5)

    # KL shaping: k_t = q_t - ref_t, advantage_t = A - coef * (k_t - mean k)
    g.responses[0].ref_logprobs = [-1.5, -0.5]  # k = 0.5, -0.5
    g.responses[1].ref_logprobs = [-2.3]  # k = 0.3
    datums, metrics = build_datums(pairs, "importance_sampling", "sum", kl_penalty_coef=0.1)
    mean_k = (0.5 - 0.5 + 0.3) / 3
    assert metrics["kl/reference"] == pytest.approx(mean_k)
    assert datums[0].loss_fn_inputs["advantages"].tolist()[-2:] == pytest.approx(
        [0.5 - 0.1 * (0.5 - mean_k), 0.5 - 0.1 * (-0.5 - mean_k)], abs=1e-6)
    assert kl_penalised(1.0, [-1.0], [-1.0], 0.5, 0.0) == [1.0]
