"""Each loss against its formula written out by hand, value and gradient, on small tensors.

The reference implementations below loop over positions in plain Python floats so they share
no code (and no masking trick) with grpo.api.losses; gradients are checked against the analytic
derivative of each formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.api import losses

LP = [-1.2, -0.3, -2.5, -0.7, -4.0, -0.05]
Q = [-1.0, -0.9, -2.0, -0.7, -1.0, -0.5]
ADV = [0.5, -1.5, 2.0, 0.0, 3.0, -0.25]
W = [1.0, 0.5, 0.0, 2.0, 1.0, 0.0]
LO, HI, BETA = 0.8, 1.2, 0.3


def counted(i: int, with_weights: bool) -> bool:
    return W[i] > 0 if with_weights else ADV[i] != 0


def clip(x: float) -> float:
    return min(max(x, LO), HI)


def reference(loss_fn: str, with_weights: bool, tis_cap: float | None = None) -> tuple[float, list[float]]:
    """Loss value and d loss / d lp_i from the formulas of the issue, position by position.

    With ``tis_cap`` each position's term and its derivative are scaled by the truncated
    importance weight min(exp(lp - q), C), a constant (no derivative of its own)."""
    value, grad = 0.0, []
    for i, (lp, q, a, w) in enumerate(zip(LP, Q, ADV, W, strict=True)):
        if not counted(i, with_weights):
            grad.append(0.0)
            continue
        if tis_cap is not None:
            tis = min(math.exp(lp - q), tis_cap)
            term, slope = reference_at(loss_fn, with_weights, lp, q, a, w)
            value += tis * term
            grad.append(tis * slope)
            continue
        r = math.exp(lp - q)
        w_scale = w if with_weights else 1.0
        if loss_fn == "cross_entropy":
            value += -w_scale * lp
            grad.append(-w_scale)
        elif loss_fn == "importance_sampling":
            value += -r * a
            grad.append(-r * a)
        elif loss_fn == "ppo":
            unclipped, clipped = r * a, clip(r) * a
            value += -min(unclipped, clipped)
            # d/dlp: the unclipped branch moves with r; the clipped one only inside [lo, hi].
            if unclipped <= clipped or LO < r < HI:
                grad.append(-r * a)
            else:
                grad.append(0.0)
        elif loss_fn == "cispo":
            value += -clip(r) * lp * a
            grad.append(-clip(r) * a)
        elif loss_fn == "dro":
            value += -w_scale * (lp * a - 0.5 * BETA * (lp - q) ** 2)
            grad.append(-w_scale * (a - BETA * (lp - q)))
    return value, grad


def reference_at(loss_fn: str, with_weights: bool, lp: float, q: float, a: float, w: float) -> tuple[float, float]:
    """One counted position's term and derivative, from reference() on a one-token problem."""
    global LP, Q, ADV, W
    saved = LP, Q, ADV, W
    LP, Q, ADV, W = [lp], [q], [a], [w]
    try:
        value, grad = reference(loss_fn, with_weights)
    finally:
        LP, Q, ADV, W = saved
    return value, grad[0]


CONFIGS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": LO, "clip_high_threshold": HI},
    "cispo": {"clip_low_threshold": LO, "clip_high_threshold": HI},
    "dro": {"beta": BETA},
}


@pytest.mark.parametrize("with_weights", [True, False], ids=["weights", "no-weights"])
@pytest.mark.parametrize("loss_fn", list(CONFIGS))
def test_loss_matches_formula_value_and_gradient(loss_fn: str, with_weights: bool) -> None:
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    inputs = {"logprobs": torch.tensor(Q, dtype=torch.float64), "advantages": torch.tensor(ADV, dtype=torch.float64)}
    if with_weights:
        inputs["weights"] = torch.tensor(W, dtype=torch.float64)
    loss = losses.compute_loss(loss_fn, lp, inputs, CONFIGS[loss_fn])
    loss.backward()
    want_value, want_grad = reference(loss_fn, with_weights)
    assert loss.item() == pytest.approx(want_value, rel=1e-6, abs=1e-6)
    assert lp.grad.tolist() == pytest.approx(want_grad, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("with_weights", [True, False], ids=["weights", "no-weights"])
@pytest.mark.parametrize("loss_fn", list(CONFIGS))
def test_truncated_importance_weight_matches_formula(loss_fn: str, with_weights: bool) -> None:
    """tis_cap=C scales every loss's per-token term by sg(min(exp(lp - q), C)). C=1.5 caps two of
    the six ratios here (1.82 and 1.57) and leaves the others (0.82, 0.61, 1, 0.05)."""
    cap = 1.5
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    inputs = {"logprobs": torch.tensor(Q, dtype=torch.float64), "advantages": torch.tensor(ADV, dtype=torch.float64)}
    if with_weights:
        inputs["weights"] = torch.tensor(W, dtype=torch.float64)
    loss = losses.compute_loss(loss_fn, lp, inputs, {**CONFIGS[loss_fn], "tis_cap": cap})
    loss.backward()
    want_value, want_grad = reference(loss_fn, with_weights, tis_cap=cap)
    assert want_value != pytest.approx(reference(loss_fn, with_weights)[0])  # the weight changes something
    assert loss.item() == pytest.approx(want_value, rel=1e-6, abs=1e-6)
    assert lp.grad.tolist() == pytest.approx(want_grad, rel=1e-6, abs=1e-6)


def test_truncated_importance_gradient_against_autograd_of_a_reference() -> None:
    """importance_sampling with TIS written as plain torch (its own code): the gradient autograd
    gives it equals the trainer loss's."""
    cap = 1.5
    q, adv = torch.tensor(Q, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64)
    lp_ref = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    ratio = torch.exp(lp_ref - q)
    weight = torch.minimum(ratio.detach(), torch.tensor(cap, dtype=torch.float64))
    (-(ratio * adv * weight)[adv != 0]).sum().backward()
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    losses.compute_loss("importance_sampling", lp, {"logprobs": q, "advantages": adv}, {"tis_cap": cap}).backward()
    assert lp.grad.tolist() == pytest.approx(lp_ref.grad.tolist(), rel=1e-9, abs=1e-12)


def test_tis_cap_is_every_loss_key_and_checked() -> None:
    assert losses.resolve_config("ppo", {"tis_cap": 2}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2,
                                                            "tis_cap": 2.0}
    assert losses.resolve_config("dro", {"tis_cap": None}) == {"beta": 0.05}  # null: off
    with pytest.raises(ValueError, match=r"tis_cap must be a finite number >= 1.*got 0.5"):
        losses.resolve_config("importance_sampling", {"tis_cap": 0.5})
    with pytest.raises(ValueError, match="tis_cap needs the sampler's logprobs"):
        losses.compute_loss("cross_entropy", torch.zeros(2), {"weights": torch.ones(2)}, {"tis_cap": 2.0})
    # cross_entropy with the sampler's logprobs and no weights: every position is weighted
    lp = torch.tensor([-1.0, -2.0])
    got = losses.compute_loss("cross_entropy", lp, {"logprobs": torch.tensor([-1.5, -1.0])}, {"tis_cap": 1.2})
    assert float(got) == pytest.approx(1.2 * 1.0 + math.exp(-1.0) * 2.0)


def test_ppo_clips_both_directions() -> None:
    # One token far above the clip range with A>0 (clipped: no gradient), one far below with
    # A<0 (clipped: no gradient), one inside (gradient r*A).
    lp = torch.tensor([0.0, -3.0, -1.0], requires_grad=True)
    q = torch.tensor([-1.0, -1.0, -1.0])
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss = losses.compute_loss("ppo", lp, {"logprobs": q, "advantages": adv})
    loss.backward()
    want = -(1.2 * 1.0) - (0.8 * -1.0) - (1.0 * 2.0)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -2.0], abs=1e-6)


def test_cispo_gradient_does_not_flow_through_ratio() -> None:
    lp = torch.tensor([-0.5], requires_grad=True)
    q = torch.tensor([-1.0])  # r = e^0.5 = 1.65, clipped to 1.2
    losses.compute_loss("cispo", lp, {"logprobs": q, "advantages": torch.tensor([2.0])}).backward()
    assert lp.grad.item() == pytest.approx(-1.2 * 2.0)


def test_masked_positions_cannot_poison_the_loss_with_overflow() -> None:
    # A prompt position with weight 0 whose "sampler logprob" is absurd would overflow exp();
    # it must neither change the loss nor put NaN into the gradient.
    lp = torch.tensor([-1.0, -0.5], requires_grad=True)
    inputs = {
        "logprobs": torch.tensor([-500.0, -0.5]),
        "advantages": torch.tensor([1e30, 1.0]),
        "weights": torch.tensor([0.0, 1.0]),
    }
    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro"):
        lp.grad = None
        loss = losses.compute_loss(loss_fn, lp, inputs)
        loss.backward()
        assert torch.isfinite(loss), loss_fn
        assert lp.grad[0].item() == 0.0, loss_fn
        assert torch.isfinite(lp.grad).all(), loss_fn


def test_negative_weights_do_not_count() -> None:
    lp = torch.tensor([-1.0, -2.0])
    inputs = {"weights": torch.tensor([-1.0, 1.0])}
    assert float(losses.compute_loss("cross_entropy", lp, inputs)) == pytest.approx(2.0)


def test_cross_entropy_without_weights_counts_every_position() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5])
    assert float(losses.compute_loss("cross_entropy", lp, {})) == pytest.approx(3.5)


def test_unknown_loss_fn_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown loss_fn 'grpo'.*cross_entropy.*importance_sampling.*ppo"):
        losses.compute_loss("grpo", torch.zeros(1), {})


def test_loss_config_rejects_unknown_keys_and_bad_clip_range() -> None:
    with pytest.raises(ValueError, match=r"'beta' is not used by loss_fn='ppo'.*clip_low_threshold"):
        losses.resolve_config("ppo", {"beta": 0.1})
    with pytest.raises(ValueError, match="clip_low_threshold <= 1 <= clip_high_threshold"):
        losses.resolve_config("cispo", {"clip_low_threshold": 1.5})
    assert losses.resolve_config("dro", {"beta": 0.2}) == {"beta": 0.2}
    assert losses.resolve_config("dro", {"beta": 0}) == {"beta": 0.0}  # the linear surrogate's
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="beta must be a finite number >= 0"):
            losses.resolve_config("dro", {"beta": bad})


@pytest.mark.parametrize("loss_fn", list(CONFIGS))
def test_every_loss_is_a_sum_of_per_position_terms(loss_fn: str) -> None:
    """The trainer backpropagates the unembedding a chunk of positions at a time, each chunk with
    only its own positions' inputs (trainer.unembed_counted). That is exact only while a loss is
    a sum of terms that each depend on one position; a loss that normalises over the sequence
    inside would break it, and this test."""
    gen = torch.Generator().manual_seed(0)
    n = 40
    lp = (torch.randn(n, generator=gen) - 2).requires_grad_()
    inputs = {"logprobs": torch.randn(n, generator=gen) - 2, "advantages": torch.randn(n, generator=gen),
              "weights": (torch.rand(n, generator=gen) > 0.3).float() * torch.rand(n, generator=gen)}
    cfg = losses.resolve_config(loss_fn, CONFIGS[loss_fn] or None)
    whole = losses.LOSSES[loss_fn](lp, inputs, cfg)
    (grad_whole,) = torch.autograd.grad(whole, lp)
    order = torch.randperm(n, generator=gen)
    parts, grad_parts = 0.0, torch.zeros(n)
    for idx in order.split(7):
        piece = losses.LOSSES[loss_fn](lp[idx], {k: v[idx] for k, v in inputs.items()}, cfg)
        (g,) = torch.autograd.grad(piece, lp)
        parts, grad_parts = parts + float(piece), grad_parts + g
    assert parts == pytest.approx(float(whole), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad_parts, grad_whole, atol=1e-6)


def test_the_registry_is_the_one_list_of_losses() -> None:
    """One @register_loss per loss: the SDK's LossFnType, the config's valid names and the
    trainer's input check all follow it."""
    from typing import get_args

    from grpo.rl.config import GRPOConfig
    from grpo.types import LossFnType

    assert tuple(losses.LOSSES) == get_args(LossFnType)
    for name, spec in losses.LOSSES.items():
        assert GRPOConfig(loss_fn=name).loss_fn == name
        assert spec.fn.__name__ == name and spec.fn.__doc__, f"{name} needs its formula in a docstring"
        assert set(spec.inputs) <= {"logprobs", "advantages", "weights"}
    with pytest.raises(ValueError, match="registered twice"):
        losses.register_loss("ppo")(losses.ppo)


def _random_problem(n: int = 24, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    lp = (torch.randn(n, generator=gen, dtype=torch.float64) - 2).requires_grad_()
    return lp, {"logprobs": torch.randn(n, generator=gen, dtype=torch.float64) - 2,
                "advantages": torch.randn(n, generator=gen, dtype=torch.float64),
                "weights": (torch.rand(n, generator=gen) > 0.3).double() * torch.rand(n, generator=gen).double()}


@pytest.mark.parametrize("loss_fn", list(CONFIGS))
def test_the_aggregation_goes_where_the_loss_declares(loss_fn: str) -> None:
    """build_datums multiplies a sequence's loss_agg factor s > 0 into spec.aggregate_into: that
    must scale the loss, value and gradient, by s (so token_mean and seq_mean mean what they say)."""
    spec = losses.LOSSES[loss_fn]
    lp, inputs = _random_problem()
    cfg = losses.resolve_config(loss_fn, CONFIGS[loss_fn] or None)
    whole = spec(lp, inputs, cfg)
    (grad_whole,) = torch.autograd.grad(whole, lp)
    s = 0.125
    scaled = spec(lp, {**inputs, spec.aggregate_into: inputs[spec.aggregate_into] * s}, cfg)
    (grad_scaled,) = torch.autograd.grad(scaled, lp)
    assert float(scaled) == pytest.approx(s * float(whole), rel=1e-6)
    assert torch.allclose(grad_scaled, s * grad_whole, rtol=1e-6, atol=1e-9)


def test_the_linear_surrogate_is_what_its_loss_declares() -> None:
    """Every loss with a linear_config is ``-Σ w·A·lp`` over w > 0 under it (forward_backward_custom
    backpropagates that), and linear_surrogate() finds one."""
    declared = [spec for spec in losses.LOSSES.values() if spec.linear_config is not None]
    assert declared and losses.linear_surrogate()[0] == declared[0].name
    lp, inputs = _random_problem()
    for spec in declared:
        got = spec(lp, inputs, losses.resolve_config(spec.name, spec.linear_config))
        mask = inputs["weights"] > 0
        want = -(inputs["weights"] * inputs["advantages"] * lp)[mask].sum()
        assert torch.allclose(torch.autograd.grad(got, lp)[0], torch.autograd.grad(want, lp)[0], atol=1e-6)
        assert float(got) == pytest.approx(float(want), rel=1e-6)
