"""Which inputs and config keys each loss takes, and their validation; free of torch so the
CLI can check a config before heavy imports. The loss functions live in grpo.losses."""

from __future__ import annotations

from collections.abc import Mapping

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
    if loss_fn not in LOSS_FNS:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; valid: {', '.join(LOSS_FNS)}")
