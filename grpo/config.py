"""The loop's hyperparameters: one dataclass, validated before anything heavy loads.

Names follow the MinT parameter table (loss_fn, group_size, batch_size, max_tokens,
learning_rate, temperature, kl_penalty_coef, ...) so the docs, the CLI and the service agree.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo.types import LOSS_FNS

ADVANTAGE_NORMS = ("center", "std")
LOSS_AGGS = ("sum", "token_mean", "seq_mean")
OVERLONG = ("keep", "drop", "zero")
LR_SCHEDULES = ("constant", "linear", "cosine")

# Field names of the MinT demos' RLConfig, so `run_grpo(adapter, RLConfig(...))` keeps working.
ALIASES = {"model": "base_model", "batch": "batch_size", "group": "group_size", "lr": "learning_rate",
           "groups_per_batch": "batch_size"}


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "grpo"
    entity: str | None = None
    mode: str = "offline"  # offline works with no network; "online" syncs as it goes
    name: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class GRPOConfig:
    # model and LoRA
    base_model: str = "smollm2"
    rank: int = 16
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    # the loop
    steps: int = 20
    seed: int = 0
    batch_size: int = 8  # groups (prompts) per step
    group_size: int = 4  # samples per prompt
    # sampling
    max_tokens: int = 16
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = -1
    # loss and advantages
    loss_fn: str = "importance_sampling"
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    advantage_norm: str = "center"  # center: r - mean; std: (r - mean) / (std + eps)
    loss_agg: str = "sum"  # folded into advantages: sum | token_mean | seq_mean
    kl_penalty_coef: float = 0.0
    skip_flat_groups: bool = True  # groups whose rewards are all equal carry no signal
    dynamic_sampling_waves: int = 0  # resample flat groups with fresh prompts up to N times
    overlong: str = "keep"  # truncated responses: keep | drop from training | zero their reward
    # optimizer
    learning_rate: float = 2e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    # evaluation
    eval_every: int = 0  # 0: only at start and end (when the adapter has held-out data)
    eval_size: int = 32
    eval_samples: int = 4  # samples per item for pass@k
    eval_temperature: float = 0.8
    eval_max_tokens: int | None = None  # default: max_tokens
    # logging, checkpoints, faults
    save_every: int = 5
    rollouts_per_step: int = 64  # responses written to rollouts.jsonl each step (-1: all)
    max_failure_rate: float = 0.5  # stop (after a checkpoint) when more rewards fail in a step
    report: bool = True  # write report.html at checkpoints and at the end
    progress: bool = True
    objective: str = "eval/accuracy"  # metric python -m grpo returns (last value) for Hydra sweepers
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        if isinstance(self.wandb, Mapping):
            self.wandb = WandbConfig(**dict(self.wandb))
        self.validate()

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        def need(ok: bool, key: str, valid: str) -> None:
            if not ok:
                raise ConfigError(f"{key}={getattr(self, key)!r} is invalid: {valid}")

        need(isinstance(self.base_model, str) and bool(self.base_model), "base_model", "a model name, directory or hub id")
        need(_is_int(self.rank) and self.rank > 0, "rank", "must be a positive integer")
        need(self.train_mlp or self.train_attn or self.train_unembed, "train_mlp",
             "at least one of train_mlp, train_attn, train_unembed must be true")
        need(_is_int(self.steps) and self.steps >= 0, "steps", "must be an integer >= 0")
        need(_is_int(self.batch_size) and self.batch_size > 0, "batch_size", "must be a positive integer")
        need(_is_int(self.group_size) and self.group_size >= 2, "group_size",
             "must be an integer >= 2 (advantages are relative to the group)")
        need(_is_int(self.max_tokens) and self.max_tokens > 0, "max_tokens", "must be a positive integer")
        need(self.temperature >= 0, "temperature", "must be >= 0 (0 is greedy)")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(_is_int(self.top_k) and (self.top_k == -1 or self.top_k > 0), "top_k", "must be -1 (off) or positive")
        need(self.loss_fn in LOSS_FNS, "loss_fn", f"valid: {', '.join(LOSS_FNS)}")
        need(self.advantage_norm in ADVANTAGE_NORMS, "advantage_norm", f"valid: {', '.join(ADVANTAGE_NORMS)}")
        need(self.loss_agg in LOSS_AGGS, "loss_agg", f"valid: {', '.join(LOSS_AGGS)}")
        need(self.overlong in OVERLONG, "overlong", f"valid: {', '.join(OVERLONG)}")
        need(self.kl_penalty_coef >= 0, "kl_penalty_coef", "must be >= 0")
        need(_is_int(self.dynamic_sampling_waves) and self.dynamic_sampling_waves >= 0, "dynamic_sampling_waves",
             "must be an integer >= 0")
        need(self.learning_rate >= 0, "learning_rate", "must be >= 0")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "two numbers in [0, 1)")
        need(self.eps > 0, "eps", "must be > 0")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.grad_clip_norm >= 0, "grad_clip_norm", "must be >= 0 (0: no clipping)")
        need(self.lr_schedule in LR_SCHEDULES, "lr_schedule", f"valid: {', '.join(LR_SCHEDULES)}")
        need(_is_int(self.warmup_steps) and self.warmup_steps >= 0, "warmup_steps", "must be an integer >= 0")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        need(_is_int(self.eval_every) and self.eval_every >= 0, "eval_every", "must be an integer >= 0")
        need(_is_int(self.eval_size) and self.eval_size >= 0, "eval_size", "must be an integer >= 0")
        need(_is_int(self.eval_samples) and self.eval_samples >= 1, "eval_samples", "must be a positive integer")
        need(self.eval_temperature >= 0, "eval_temperature", "must be >= 0")
        need(self.eval_max_tokens is None or (_is_int(self.eval_max_tokens) and self.eval_max_tokens > 0),
             "eval_max_tokens", "must be a positive integer or null")
        need(_is_int(self.save_every) and self.save_every >= 0, "save_every", "must be an integer >= 0 (0: only at the end)")
        need(_is_int(self.rollouts_per_step) and self.rollouts_per_step >= -1, "rollouts_per_step", "-1 (all) or >= 0")
        need(0 <= self.max_failure_rate <= 1, "max_failure_rate", "must be in [0, 1]")
        from grpo import loss_config as losses

        try:
            losses.resolve_config(self.loss_fn, self.loss_fn_config)
        except ValueError as err:
            raise ConfigError(str(err)) from err

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_any(cls, cfg: Any = None, **overrides: Any) -> GRPOConfig:
        """Build from None, a GRPOConfig, a mapping (dict / OmegaConf) or any object with
        attributes (such as the MinT demos' RLConfig); unknown keys are an error with a hint."""
        if isinstance(cfg, GRPOConfig) and not overrides:
            return cfg
        if cfg is None:
            raw: dict[str, Any] = {}
        elif isinstance(cfg, GRPOConfig):
            raw = dataclasses.asdict(cfg)
        elif isinstance(cfg, Mapping) or hasattr(cfg, "items"):
            raw = {str(k): v for k, v in cfg.items()}
        elif dataclasses.is_dataclass(cfg):
            raw = dataclasses.asdict(cfg)
        else:
            raw = {k: v for k, v in vars(cfg).items() if not k.startswith("_")}
        raw.update(overrides)
        valid = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            key = ALIASES.get(key, key)
            if key not in valid:
                hint = difflib.get_close_matches(key, sorted(valid), n=1)
                raise ConfigError(f"unknown config key {key!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                                  + f" Valid keys: {', '.join(sorted(valid))}")
            values[key] = _plain(value)
        if isinstance(values.get("loss_fn_config"), Mapping):  # null entries mean "the default"
            values["loss_fn_config"] = {k: v for k, v in values["loss_fn_config"].items() if v is not None}
        return cls(**values)

    def lr_at(self, step: int) -> float:
        """Learning rate for ``step``: linear warmup, then constant, linear or cosine decay to
        ``min_lr_ratio * learning_rate`` at the last step."""
        import math

        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.learning_rate
        span = max(1, self.steps - self.warmup_steps - 1)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.min_lr_ratio
        if self.lr_schedule == "linear":
            factor = 1.0 - (1.0 - floor) * progress
        else:
            factor = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.learning_rate * factor

    def eval_due(self, step: int) -> bool:
        """Evaluate before step 0, every ``eval_every`` steps, and after the last step."""
        return step == 0 or step == self.steps or (self.eval_every > 0 and step % self.eval_every == 0)

    def save_due(self, step: int) -> bool:
        """Checkpoint after ``step`` (0-based) completes."""
        return self.save_every > 0 and (step + 1) % self.save_every == 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    pass


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain python, so the dataclass holds lists and dicts."""
    if hasattr(value, "_metadata") or type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value
