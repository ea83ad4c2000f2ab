"""The loss functions, each registered once with the inputs and config it takes.

Every loss is a *sum* over tokens (Tinker semantics): each function returns its per-token terms and
``LossSpec.__call__`` sums them. Means, per-sequence normalisation and
the like are the loop's job: it folds them into ``advantages`` or ``weights`` before calling.
Each term depends on its own position alone, and the trainer relies on it: it backpropagates the
loss a chunk of positions at a time (trainer.unembed_counted; tests/test_losses.py checks it).

Notation, per token: ``lp`` the trainer's logprob of the target token (differentiable), ``q`` the
sampler's logprob, ``r = exp(lp - q)``, ``A`` the advantage, ``w`` the weight. Positions count when
``w > 0``; where a datum has no weights, where ``A != 0``. cross_entropy and dro scale each
counted token by ``w``; importance_sampling, ppo and cispo use the weights only as that mask
(as Tinker's, which take no weights), so fractional aggregation goes into the advantages.

Truncated importance sampling (TIS), for every loss through ``LossSpec.__call__``: with
``loss_fn_config={"tis_cap": C}`` each counted token's loss term is multiplied by
``sg(min(exp(lp - q), C))``, the trainer/sampler ratio capped at C and held constant (no gradient
flows through it), as verl's TIS and TRL's vllm_importance_sampling_correction do. It corrects for
a sampler that does not compute the trainer's policy exactly (bf16 sampling, another kernel):
tokens the sampler over-rated weigh less, under-rated ones more but never more than C. Absent (or
null in the loop's config): off. Each loss function below therefore returns its per-token terms;
the sum is taken in one place.

Adding a loss is one ``@register_loss`` next to its function: the config validation, the
trainer's input check, the CLI's and the server's list of valid names, how the loop folds its
aggregation (``aggregate_into``) and which loss backpropagates a custom loss (``linear_config``)
all read ``LOSSES``; nothing else names a loss to decide what to do with it. The functions use
tensor methods only, so importing this module does not import torch and a config can be
validated before any heavy import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor

LossFunction = Callable[["Tensor", Mapping[str, "Tensor"], Mapping[str, float]], "Tensor"]
POLICY_INPUTS = ("logprobs", "advantages")
AGGREGATE_INTO = ("advantages", "weights")


@dataclass(frozen=True)
class LossSpec:
    """One loss: its function, the loss inputs it needs besides ``target_tokens``, its config
    keys with their defaults, a check of a resolved config (an error message, or None), and two
    facts the callers act on:

    ``aggregate_into``: the loss input a per-sequence factor ``s > 0`` (the loop's ``loss_agg``)
    is multiplied into so that the loss's terms scale by ``s``: ``"advantages"`` for a loss whose
    every term is linear in ``A`` (importance_sampling, ppo, cispo), ``"weights"`` for one with a
    term ``A`` does not scale (dro's quadratic penalty) or that reads no advantage.

    ``linear_config``: the config under which the loss is exactly ``-Σ w·A·lp`` over positions
    with ``w > 0``, or None where it never is; forward_backward_custom backpropagates that linear
    loss (grpo/backends/local/custom_loss.py, ``linear_surrogate`` below).

    tests/test_losses.py holds every registered loss to both declarations."""

    name: str
    fn: LossFunction
    inputs: tuple[str, ...]
    defaults: Mapping[str, float] = field(default_factory=dict)
    check: Callable[[Mapping[str, float]], str | None] | None = None
    aggregate_into: Literal["advantages", "weights"] = "advantages"
    linear_config: Mapping[str, float] | None = None

    def __call__(self, lp: Tensor, inputs: Mapping[str, Tensor], params: Mapping[str, float]) -> Tensor:
        """The summed loss: the function's per-token terms, times the TIS weight where asked."""
        terms = self.fn(lp, inputs, params)
        if params.get(TIS_CAP) is not None:
            terms = terms * tis_weight(lp, inputs, params[TIS_CAP])
        return terms.sum()


# The one config key every loss takes: the truncated importance weight's cap C (module docstring).
TIS_CAP = "tis_cap"


def _check_tis_cap(value: float) -> str | None:
    if not value >= 1 or value == float("inf"):
        return f"tis_cap must be a finite number >= 1 (a cap below 1 would shrink on-policy tokens too), got {value}"
    return None


def tis_weight(lp: Tensor, inputs: Mapping[str, Tensor], cap: float) -> Tensor:
    """``sg(min(exp(lp - q), cap))`` per token, 0 where a position does not count."""
    if "logprobs" not in inputs:
        raise ValueError("loss_fn_config tis_cap needs the sampler's logprobs as loss input 'logprobs'")
    mask = token_mask(inputs) if ("weights" in inputs or "advantages" in inputs) else inputs["logprobs"].isfinite()
    return _log_ratio(lp.detach(), inputs, mask).exp().clamp(max=cap).where(mask, 0.0)


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, inputs: tuple[str, ...] = POLICY_INPUTS, defaults: Mapping[str, float] | None = None,
                  check: Callable[[Mapping[str, float]], str | None] | None = None,
                  aggregate_into: Literal["advantages", "weights"] = "advantages",
                  linear_config: Mapping[str, float] | None = None) -> Callable[[LossFunction], LossFunction]:
    """Register ``fn`` as loss ``name``; the keywords are LossSpec's fields."""
    if aggregate_into not in AGGREGATE_INTO:
        raise ValueError(f"aggregate_into of loss_fn {name!r} must be one of {', '.join(AGGREGATE_INTO)}, "
                         f"got {aggregate_into!r}")

    def register(fn: LossFunction) -> LossFunction:
        if name in LOSSES:
            raise ValueError(f"loss_fn {name!r} is registered twice")
        LOSSES[name] = LossSpec(name, fn, tuple(inputs), dict(defaults or {}), check, aggregate_into,
                                None if linear_config is None else dict(linear_config))
        return fn

    return register


def check_loss_fn(loss_fn: str) -> LossSpec:
    if loss_fn not in LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; valid: {', '.join(LOSSES)}")
    return LOSSES[loss_fn]


def resolve_config(loss_fn: str, loss_fn_config: Mapping[str, float] | None) -> dict[str, float]:
    """Defaults for ``loss_fn`` overlaid with the caller's config; unknown keys are an error."""
    spec = check_loss_fn(loss_fn)
    params = dict(spec.defaults)
    for key, value in dict(loss_fn_config or {}).items():
        if key == TIS_CAP:
            if value is not None:
                params[key] = float(value)
                problem = _check_tis_cap(params[key])
                if problem:
                    raise ValueError(f"loss_fn_config for {loss_fn!r}: {problem}")
            continue
        if key not in params:
            valid = ", ".join([*params, TIS_CAP])
            raise ValueError(f"loss_fn_config key {key!r} is not used by loss_fn={loss_fn!r}; valid keys: {valid}")
        params[key] = float(value)
    problem = spec.check(params) if spec.check else None
    if problem:
        raise ValueError(f"loss_fn_config for {loss_fn!r}: {problem}")
    return params


def linear_surrogate() -> tuple[str, dict[str, float]]:
    """The first registered loss that declares a ``linear_config``, with that config resolved:
    the loss ``-Σ w·A·lp`` that forward_backward_custom backpropagates."""
    for spec in LOSSES.values():
        if spec.linear_config is not None:
            return spec.name, resolve_config(spec.name, spec.linear_config)
    raise LookupError("no registered loss declares a linear_config (-Σ w·A·lp); forward_backward_custom needs one")


def compute_loss(loss_fn: str, target_logprobs: Tensor, inputs: Mapping[str, Tensor],
                 loss_fn_config: Mapping[str, float] | None = None) -> Tensor:
    """Summed loss of ``loss_fn`` for per-token tensors of one shape."""
    params = resolve_config(loss_fn, loss_fn_config)
    return LOSSES[loss_fn](target_logprobs, inputs, params)


# --------------------------------------------------------------------------- masks


def token_mask(inputs: Mapping[str, Tensor]) -> Tensor:
    """Which positions count: weight > 0 where weights are given, else advantage != 0."""
    if "weights" in inputs:
        return inputs["weights"] > 0
    return inputs["advantages"] != 0


def token_weights(inputs: Mapping[str, Tensor]) -> Tensor:
    """The counting positions as a 0/1 float tensor (the trainer averages metrics over it)."""
    return token_mask(inputs).float()


def _masked(inputs: Mapping[str, Tensor], key: str, mask: Tensor) -> Tensor:
    # Positions that do not count are zeroed *before* any arithmetic, so whatever they hold
    # (a prompt's placeholder logprob of 0, a huge advantage) cannot overflow exp() and leak a
    # NaN into the sum or the gradient through 0 * inf.
    return inputs[key].float().where(mask, 0.0)


def _log_ratio(lp: Tensor, inputs: Mapping[str, Tensor], mask: Tensor) -> Tensor:
    return (lp - inputs["logprobs"]).where(mask, 0.0)


def _clip_range(params: Mapping[str, float]) -> str | None:
    if not 0 <= params["clip_low_threshold"] <= 1 <= params["clip_high_threshold"]:
        return ("needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                f"got {params['clip_low_threshold']} and {params['clip_high_threshold']}")
    return None


CLIPS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


# --------------------------------------------------------------------------- the losses


@register_loss("cross_entropy", inputs=(), aggregate_into="weights")
def cross_entropy(lp: Tensor, inputs: Mapping[str, Tensor], params: Mapping[str, float]) -> Tensor:
    """``-Σ w·lp`` (supervised fine-tuning)."""
    if "weights" in inputs:
        return -(_masked(inputs, "weights", token_mask(inputs)) * lp)
    if "advantages" in inputs:
        return -(lp * token_weights(inputs))
    return -lp  # neither weights nor advantages: every position is a target


@register_loss("importance_sampling")
def importance_sampling(lp: Tensor, inputs: Mapping[str, Tensor], params: Mapping[str, float]) -> Tensor:
    """``-Σ r·A``."""
    mask = token_mask(inputs)
    ratio = _log_ratio(lp, inputs, mask).exp()
    return -(ratio * _masked(inputs, "advantages", mask))


@register_loss("ppo", defaults=CLIPS, check=_clip_range)
def ppo(lp: Tensor, inputs: Mapping[str, Tensor], params: Mapping[str, float]) -> Tensor:
    """``-Σ min(r·A, clip(r, lo, hi)·A)``."""
    mask = token_mask(inputs)
    adv = _masked(inputs, "advantages", mask)
    ratio = _log_ratio(lp, inputs, mask).exp()
    clipped = ratio.clamp(params["clip_low_threshold"], params["clip_high_threshold"])
    return -(ratio * adv).minimum(clipped * adv)


@register_loss("cispo", defaults=CLIPS, check=_clip_range)
def cispo(lp: Tensor, inputs: Mapping[str, Tensor], params: Mapping[str, float]) -> Tensor:
    """``-Σ sg(clip(r, lo, hi))·lp·A``: the clipped ratio is a constant weight on a REINFORCE
    term, so gradients flow through lp only."""
    mask = token_mask(inputs)
    ratio = _log_ratio(lp, inputs, mask).exp().detach()
    clipped = ratio.clamp(params["clip_low_threshold"], params["clip_high_threshold"])
    return -(clipped * lp * _masked(inputs, "advantages", mask))


def _beta_range(params: Mapping[str, float]) -> str | None:
    beta = params["beta"]
    if not 0 <= beta < float("inf"):
        return f"beta must be a finite number >= 0 (a negative beta would reward drifting from the sampler), got {beta}"
    return None


@register_loss("dro", defaults={"beta": 0.05}, check=_beta_range, aggregate_into="weights",
               linear_config={"beta": 0.0})
def dro(lp: Tensor, inputs: Mapping[str, Tensor], params: Mapping[str, float]) -> Tensor:
    """``-Σ w·[lp·A − ½β(lp − q)²]``."""
    mask = token_mask(inputs)
    weights = _masked(inputs, "weights", mask) if "weights" in inputs else mask.float()
    objective = lp * _masked(inputs, "advantages", mask) - 0.5 * params["beta"] * _log_ratio(lp, inputs, mask) ** 2
    return -(weights * objective)
