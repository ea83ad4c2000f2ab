"""The five loss functions as pure torch functions of per-token tensors.

Every loss is a *sum* over tokens (Tinker semantics). Means, per-sequence normalisation and
the like are the loop's job: it folds them into ``advantages`` or ``weights`` before calling.
Each term depends on its own position alone, and the trainer relies on it: it backpropagates the
loss a chunk of positions at a time (trainer.unembed_counted; tests/test_losses.py checks it).

Notation, per token: ``lp`` the trainer's logprob of the target token (differentiable), ``q`` the
sampler's logprob, ``r = exp(lp - q)``, ``A`` the advantage, ``w`` the weight. Positions count when
``w > 0``; where a datum has no weights, where ``A != 0``. cross_entropy and dro scale each
counted token by ``w``; importance_sampling, ppo and cispo use the weights only as that mask
(as Tinker's, which take no weights), so fractional aggregation goes into the advantages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from grpo.loss_config import DEFAULT_CONFIG, REQUIRED_INPUTS, check_loss_fn, resolve_config
from grpo.types import LOSS_FNS

__all__ = [
    "DEFAULT_CONFIG", "LOSSES", "REQUIRED_INPUTS", "check_loss_fn", "compute_loss", "resolve_config",
    "token_mask", "token_weights",
]


def token_mask(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Which positions count: weight > 0 where weights are given, else advantage != 0."""
    if "weights" in inputs:
        return inputs["weights"] > 0
    return inputs["advantages"] != 0


def token_weights(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The counting positions as a 0/1 float tensor (the trainer averages metrics over it)."""
    return token_mask(inputs).float()


def _masked(inputs: Mapping[str, torch.Tensor], key: str, mask: torch.Tensor) -> torch.Tensor:
    # Positions that do not count are zeroed *before* any arithmetic, so whatever they hold
    # (a prompt's placeholder logprob of 0, a huge advantage) cannot overflow exp() and leak a
    # NaN into the sum or the gradient through 0 * inf.
    return torch.where(mask, inputs[key].float(), torch.zeros((), device=mask.device))


def _log_ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, lp - inputs["logprobs"], torch.zeros((), device=lp.device))


def cross_entropy(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    if "weights" in inputs:
        return -(_masked(inputs, "weights", token_mask(inputs)) * lp).sum()
    if "advantages" in inputs:
        return -(lp * token_weights(inputs)).sum()
    return -lp.sum()  # neither weights nor advantages: every position is a target


def importance_sampling(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    mask = token_mask(inputs)
    ratio = torch.exp(_log_ratio(lp, inputs, mask))
    return -(ratio * _masked(inputs, "advantages", mask)).sum()


def ppo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    mask = token_mask(inputs)
    adv = _masked(inputs, "advantages", mask)
    ratio = torch.exp(_log_ratio(lp, inputs, mask))
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def cispo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    # The clipped ratio is a constant weight on a REINFORCE term: gradients flow through lp only.
    mask = token_mask(inputs)
    ratio = torch.exp(_log_ratio(lp, inputs, mask)).detach()
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(clipped * lp * _masked(inputs, "advantages", mask)).sum()


def dro(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    mask = token_mask(inputs)
    weights = _masked(inputs, "weights", mask) if "weights" in inputs else mask.float()
    objective = lp * _masked(inputs, "advantages", mask) - 0.5 * cfg["beta"] * _log_ratio(lp, inputs, mask) ** 2
    return -(weights * objective).sum()


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}
assert set(LOSSES) == set(LOSS_FNS)


def compute_loss(
    loss_fn: str,
    target_logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    loss_fn_config: Mapping[str, float] | None = None,
) -> torch.Tensor:
    """Summed loss of ``loss_fn`` for per-token tensors of one shape."""
    cfg = resolve_config(loss_fn, loss_fn_config)
    return LOSSES[loss_fn](target_logprobs, inputs, cfg)
