"""Advantages and datums against hand computation."""

from __future__ import annotations

import math

import pytest

from grpo.rl.advantages import (
    build_datum,
    build_datums,
    compute_advantages,
    group_advantages,
    is_flat,
    kl_penalised,
    loss_scales,
    select_for_training,
    training_rewards,
)
from grpo.rl.rollouts import Group, Rollout, ScoredGroup


def rollout(tokens, stop="stop", logprobs=None):
    return Rollout(tokens=list(tokens), logprobs=list(logprobs or [-0.5] * len(tokens)), stop_reason=stop, text="x")


def scored(index, prompt, pairs):
    """A ScoredGroup from (rollout, reward) pairs."""
    group = Group(index, None, list(prompt), [r for r, _ in pairs])
    return ScoredGroup(group, [x for _, x in pairs], [{} for _ in pairs], [])


def chosen(groups, norm="center", overlong="keep", skip_flat=True):
    return select_for_training(groups, compute_advantages(groups, norm, overlong), skip_flat, overlong)


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
    r = rollout([7, 8, 9], logprobs=[-1.0, -2.0, -3.0])
    d = build_datum([1, 2, 3, 4], r, [0.5, 0.5, 0.5])
    assert d.model_input.to_ints() == [1, 2, 3, 4, 7, 8]
    ins = {k: v.tolist() for k, v in d.loss_fn_inputs.items()}
    assert ins["target_tokens"] == [2, 3, 4, 7, 8, 9]
    assert ins["weights"] == [0, 0, 0, 1, 1, 1]
    assert ins["advantages"] == [0, 0, 0, 0.5, 0.5, 0.5]
    assert ins["logprobs"] == [0, 0, 0, -1.0, -2.0, -3.0]


def test_flat_groups_are_skipped_and_overlong_rules():
    flat = scored(0, [1, 2], [(rollout([3]), 1.0), (rollout([4]), 1.0)])
    mixed = scored(1, [1, 2], [(rollout([3]), 1.0), (rollout([4, 5], stop="length"), 0.0), (rollout([6]), math.nan)])
    samples = chosen([flat, mixed])
    assert [(s.group.item_index, s.rollout.tokens) for s in samples] == [(1, [3]), (1, [4, 5])]  # NaN left out
    assert [s.advantage for s in samples] == [0.5, -0.5]
    assert len(chosen([flat, mixed], skip_flat=False)) == 4
    assert [s.rollout.tokens for s in chosen([mixed], overlong="drop")] == [[3]]
    # overlong=zero: the truncated rollout trains with reward 0, but the adapter's reward is kept
    g = scored(2, [1], [(rollout([3]), 1.0), (rollout([4], stop="length"), 1.0)])
    assert training_rewards(g, "zero") == [1.0, 0.0]
    assert [s.advantage for s in chosen([g], overlong="zero")] == [0.5, -0.5]
    assert g.rewards == [1.0, 1.0]
    # ... and flatness follows the rewards training sees: flat as the adapter scored it, not once zeroed
    assert is_flat(g.rewards) and not is_flat(training_rewards(g, "zero"))
    assert chosen([g], overlong="keep") == []


def test_build_datums_loss_agg_and_kl_shaping():
    g = scored(0, [1, 2], [(rollout([3, 4], logprobs=[-1.0, -1.0]), 1.0), (rollout([5], logprobs=[-2.0]), 0.0)])
    samples = chosen([g])
    datums, _ = build_datums(samples, "importance_sampling", "token_mean")
    # 3 response tokens in the batch: advantages are scaled by 1/3
    assert datums[0].loss_fn_inputs["advantages"].tolist()[-2:] == pytest.approx([0.5 / 3] * 2)
    assert datums[1].loss_fn_inputs["advantages"].tolist()[-1:] == pytest.approx([-0.5 / 3])
    # dro puts the aggregation into the weights, the advantage stays whole
    datums, _ = build_datums(samples, "dro", "seq_mean")
    assert datums[0].loss_fn_inputs["weights"].tolist()[-2:] == pytest.approx([0.25, 0.25])
    assert datums[0].loss_fn_inputs["advantages"].tolist()[-1] == pytest.approx(0.5)

    # KL shaping: k_t = q_t - ref_t, advantage_t = A - coef * (k_t - mean k)
    refs = [[-1.5, -0.5], [-2.3]]  # k = 0.5, -0.5 and 0.3
    datums, metrics = build_datums(samples, "importance_sampling", "sum", kl_penalty_coef=0.1, ref_logprobs=refs)
    mean_k = (0.5 - 0.5 + 0.3) / 3
    assert metrics["kl/reference"] == pytest.approx(mean_k)
    assert datums[0].loss_fn_inputs["advantages"].tolist()[-2:] == pytest.approx(
        [0.5 - 0.1 * (0.5 - mean_k), 0.5 - 0.1 * (-0.5 - mean_k)], abs=1e-6)
    assert kl_penalised(1.0, [-1.0], [-1.0], 0.5, 0.0) == [1.0]
