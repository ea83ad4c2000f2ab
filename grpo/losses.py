"""The five loss functions as pure torch functions of per-token tensors.

Every loss is a *sum* over tokens (Tinker semantics). Means, per-sequence normalisation and
the like are the loop's job: it folds them into ``advantages`` or ``weights`` before calling.

Notation, per token: ``lp`` the trainer's logprob of the target token (differentiable), ``q`` the
sampler's logprob, ``r = exp(lp - q)``, ``A`` the advantage, ``w`` the weight. Positions count when
``w > 0``; where a datum has no weights, where ``A != 0``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from grpo.loss_config import DEFAULT_CONFIG, REQUIRED_INPUTS, check_loss_fn, resolve_config
from grpo.types import LOSS_FNS

__all__ = ["DEFAULT_CONFIG", "LOSSES", "REQUIRED_INPUTS", "check_loss_fn", "compute_loss", "resolve_config"]

def token_weights(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per-token factor: the weights where given, else a 0/1 mask of non-zero advantages."""
    if "weights" in inputs:
        return inputs["weights"].float()
    return (inputs["advantages"] != 0).float()


def cross_entropy(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    weights = inputs["weights"].float() if "weights" in inputs else torch.ones_like(lp)
    return -(weights * lp).sum()


def importance_sampling(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return -(token_weights(inputs) * ratio * inputs["advantages"]).sum()


def ppo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    adv = inputs["advantages"]
    ratio = torch.exp(lp - inputs["logprobs"])
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    objective = torch.minimum(ratio * adv, clipped * adv)
    return -(token_weights(inputs) * objective).sum()


def cispo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    # The clipped ratio is a constant weight on a REINFORCE term: gradients flow through lp only.
    ratio = torch.exp(lp - inputs["logprobs"]).detach()
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(token_weights(inputs) * clipped * lp * inputs["advantages"]).sum()


def dro(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    q = inputs["logprobs"]
    objective = lp * inputs["advantages"] - 0.5 * cfg["beta"] * (lp - q) ** 2
    return -(token_weights(inputs) * objective).sum()


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
