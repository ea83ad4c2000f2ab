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

from grpo.types import LOSS_FNS

# Inputs each loss needs besides target_tokens (which every loss needs).
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}

DEFAULT_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
}


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


def resolve_config(loss_fn: str, loss_fn_config: Mapping[str, float] | None) -> dict[str, float]:
    """Defaults for ``loss_fn`` overlaid with the caller's config; unknown keys are an error."""
    check_loss_fn(loss_fn)
    cfg = dict(DEFAULT_CONFIG[loss_fn])
    for key, value in dict(loss_fn_config or {}).items():
        if key not in cfg:
            valid = ", ".join(cfg) or "none"
            raise ValueError(f"loss_fn_config key {key!r} is not used by loss_fn={loss_fn!r}; valid keys: {valid}")
        cfg[key] = float(value)
    if "clip_low_threshold" in cfg and not 0 <= cfg["clip_low_threshold"] <= 1 <= cfg["clip_high_threshold"]:
        raise ValueError(
            "loss_fn_config needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
            f"got {cfg['clip_low_threshold']} and {cfg['clip_high_threshold']}"
        )
    return cfg


def check_loss_fn(loss_fn: str) -> None:
    if loss_fn not in LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; valid: {', '.join(LOSS_FNS)}")


def compute_loss(
    loss_fn: str,
    target_logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    loss_fn_config: Mapping[str, float] | None = None,
) -> torch.Tensor:
    """Summed loss of ``loss_fn`` for per-token tensors of one shape."""
    cfg = resolve_config(loss_fn, loss_fn_config)
    return LOSSES[loss_fn](target_logprobs, inputs, cfg)
