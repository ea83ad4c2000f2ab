"""The loop's hyperparameters, declared once: this dataclass.

Each field carries its meaning (``help``) beside its default. conf/config.yaml's keys, the CLI's
``--help`` and docs/configuration.md's table are rendered from it (grpo.rl.config_docs; ``python -m
grpo.rl.config_docs --write`` refreshes the files, tests/test_config_docs.py fails when they drift),
and ``validate`` checks every value before anything heavy loads.

Names follow the MinT parameter table (loss_fn, group_size, batch_size, max_tokens,
learning_rate, temperature, kl_penalty_coef, ...) so the docs, the CLI and the service agree.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo.api.losses import LOSSES, resolve_config
from grpo.checks import ConfigError, check, check_choice, check_lora_targets, is_int
from grpo.record.report import DEFAULT_OBJECTIVE

__all__ = ["ConfigError", "GRPOConfig", "WandbConfig", "setting"]

ADVANTAGE_NORMS = ("center", "std")
LOSS_AGGS = ("sum", "token_mean", "seq_mean")
OVERLONG = ("keep", "drop", "zero")
LR_SCHEDULES = ("constant", "linear", "cosine")

# Field names of the MinT demos' RLConfig, so `run_grpo(adapter, RLConfig(...))` keeps working.
ALIASES = {"model": "base_model", "batch": "batch_size", "group": "group_size", "lr": "learning_rate",
           "groups_per_batch": "batch_size"}


def setting(default: Any, help: str, *, section: str | None = None) -> Any:
    """A config field: its default, what it means, and (on a section's first field) the heading
    it starts in conf/config.yaml and docs/configuration.md."""
    metadata = {"help": help, **({"section": section} if section else {})}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class WandbConfig:
    enabled: bool = setting(False, "log to Weights & Biases as well as the run directory")
    project: str = setting("grpo", "wandb project")
    entity: str | None = setting(None, "wandb entity (team or user); null: your default")
    mode: str = setting("offline", "offline (no network; `wandb sync` later) | online")
    name: str | None = setting(None, "run name; null: wandb picks one")
    tags: list[str] = setting([], "run tags")


@dataclass
class GRPOConfig:
    base_model: str = setting("smollm2", "tiny (random, for tests) | smollm2 (packaged SmolLM2-135M-Instruct) | a "
                              "local directory | a hub id", section="model and LoRA")
    rank: int = setting(16, "LoRA rank")
    train_mlp: bool = setting(True, "LoRA on the MLP projections")
    train_attn: bool = setting(True, "LoRA on the attention projections")
    train_unembed: bool = setting(True, "LoRA on the unembedding (lm_head)")

    steps: int = setting(20, "optimizer steps", section="the loop")
    seed: int = setting(0, "fixes data order, sampling and LoRA init")
    batch_size: int = setting(8, "prompts (groups) per step; groups_per_batch is accepted as an alias")
    group_size: int = setting(4, "samples per prompt (>= 2: advantages are relative to the group)")

    max_tokens: int = setting(16, "most tokens sampled per response", section="sampling")
    temperature: float = setting(0.8, "sampling temperature, > 0 (greedy sampling would make every group flat)")
    temperature_end: float | None = setting(None, "anneal the temperature linearly to this by the last step "
                                            "(explore early, exploit late); null: constant")
    top_p: float = setting(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability")
    top_k: int = setting(-1, "sample among the k most likely tokens; -1: off")

    loss_fn: str = setting("importance_sampling", " | ".join(LOSSES), section="loss and advantages")
    loss_fn_config: dict[str, float] = setting({}, "the loss's parameters; null: its default (see below)")
    advantage_norm: str = setting("center", "center: r - mean | std: (r - mean) / std, within each group")
    loss_agg: str = setting("sum", "sum | token_mean | seq_mean, folded into the advantages or the weights, as the loss declares")
    kl_penalty_coef: float = setting(0.0, "> 0: per-token KL to the base model (adapter disabled), folded into "
                                     "advantages; the base model's logprobs of a step's samples in one batched pass, "
                                     "each group's prompt once (part of time/train)")
    skip_flat_groups: bool = setting(True, "leave out groups whose rewards are all equal (no signal)")
    dynamic_sampling_waves: int = setting(0, "replace flat groups with fresh prompts, up to N more waves")
    overlong: str = setting("keep", "truncated responses: keep | drop from training | zero their reward for "
                            "training (the adapter's reward is still logged)")

    learning_rate: float = setting(2e-5, "AdamW learning rate", section="optimizer")
    betas: list[float] = setting([0.9, 0.999], "AdamW betas")
    eps: float = setting(1e-8, "AdamW epsilon")
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay")
    grad_clip_norm: float = setting(0.0, "clip the gradient's global norm; 0: no clipping")
    lr_schedule: str = setting("constant", "constant | linear | cosine, after the warmup")
    warmup_steps: int = setting(0, "linear warmup steps")
    min_lr_ratio: float = setting(0.0, "linear/cosine decay ends at this fraction of learning_rate")

    eval_every: int = setting(0, "held-out evaluation every N steps; 0: only at the start and the end",
                              section="evaluation (held-out: at the start, every eval_every steps, at the end)")
    eval_size: int = setting(32, "held-out items evaluated (at most)")
    eval_samples: int = setting(4, "samples per item for pass@k")
    eval_temperature: float = setting(0.8, "temperature of the pass@k samples (accuracy is greedy)")
    eval_max_tokens: int | None = setting(None, "most tokens per evaluation response; null: max_tokens")

    retire_solved_after: int = setting(0, "retire a training item once every sample of its group was correct "
                                       "this many times in a row (saturated: no signal left); 0: never",
                                       section="curriculum (per-item solve history, kept across resume)")
    retire_unsolved_after: int = setting(0, "retire a training item never solved after this many groups; 0: never")

    save_every: int = setting(5, "checkpoint every N steps (and at the end); 0: only at the end",
                              section="logging, checkpoints, faults")
    rollouts_per_step: int = setting(64, "responses written to rollouts.jsonl each step; -1: all")
    show_sample_every: int = setting(0, "print one sampled prompt, response and reward every N steps; 0: off")
    max_failure_rate: float = setting(0.5, "stop (after a checkpoint) when a larger share of a step's rewards fail")
    report: bool = setting(True, "write report.html at checkpoints and at the end")
    progress: bool = setting(True, "progress bar on a terminal, one line per step otherwise")
    objective: str = setting(DEFAULT_OBJECTIVE, "metric a sweep optimises: python -m grpo returns its last value "
                             "(eval/pass@K needs eval_samples=K)")
    wandb: WandbConfig = setting(WandbConfig(), "Weights & Biases logging")

    def __post_init__(self) -> None:
        if isinstance(self.wandb, Mapping):
            self.wandb = WandbConfig(**dict(self.wandb))
        self.validate()

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        def need(ok: bool, key: str, valid: str) -> None:
            check(ok, key, getattr(self, key), valid)

        def number(key: str) -> bool:
            # Not a number at all is its own message: "learning_rate='abc' ... must be >= 0" misleads.
            value = getattr(self, key)
            need(isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value), key,
                 "must be a finite number")
            return True

        need(isinstance(self.base_model, str) and bool(self.base_model), "base_model",
             "a model name (smollm2, tiny), a local directory or a hub id")
        need(is_int(self.rank) and self.rank > 0, "rank", "must be a positive integer")
        check_lora_targets(self.train_mlp, self.train_attn, self.train_unembed)
        need(is_int(self.steps) and self.steps >= 0, "steps", "must be an integer >= 0")
        need(is_int(self.seed), "seed", "must be an integer")
        need(is_int(self.batch_size) and self.batch_size > 0, "batch_size", "must be a positive integer")
        need(is_int(self.group_size) and self.group_size >= 2, "group_size",
             "must be an integer >= 2 (advantages are relative to the group)")
        need(is_int(self.max_tokens) and self.max_tokens > 0, "max_tokens", "must be a positive integer")
        need(number("temperature") and self.temperature > 0, "temperature",
             f"must be > 0: at 0 (greedy) all {self.group_size} samples of a group are the same response, "
             "so every group is flat and nothing trains")
        need(self.temperature_end is None or (isinstance(self.temperature_end, int | float)
                                              and not isinstance(self.temperature_end, bool)
                                              and self.temperature_end > 0),
             "temperature_end", "must be > 0 or null (constant temperature)")
        need(number("top_p") and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k > 0), "top_k", "must be -1 (off) or positive")
        check_choice("loss_fn", self.loss_fn, LOSSES)
        check_choice("advantage_norm", self.advantage_norm, ADVANTAGE_NORMS)
        check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        check_choice("overlong", self.overlong, OVERLONG)
        need(number("kl_penalty_coef") and self.kl_penalty_coef >= 0, "kl_penalty_coef", "must be >= 0")
        need(is_int(self.dynamic_sampling_waves) and self.dynamic_sampling_waves >= 0, "dynamic_sampling_waves",
             "must be an integer >= 0")
        need(number("learning_rate") and self.learning_rate >= 0, "learning_rate", "must be >= 0")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "two numbers in [0, 1)")
        need(number("eps") and self.eps > 0, "eps", "must be > 0")
        need(number("weight_decay") and self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(number("grad_clip_norm") and self.grad_clip_norm >= 0, "grad_clip_norm", "must be >= 0 (0: no clipping)")
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        need(is_int(self.warmup_steps) and self.warmup_steps >= 0, "warmup_steps", "must be an integer >= 0")
        need(number("min_lr_ratio") and 0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        need(is_int(self.eval_every) and self.eval_every >= 0, "eval_every", "must be an integer >= 0")
        need(is_int(self.eval_size) and self.eval_size >= 0, "eval_size", "must be an integer >= 0")
        need(is_int(self.eval_samples) and self.eval_samples >= 1, "eval_samples", "must be a positive integer")
        need(number("eval_temperature") and self.eval_temperature >= 0, "eval_temperature", "must be >= 0")
        need(self.eval_max_tokens is None or (is_int(self.eval_max_tokens) and self.eval_max_tokens > 0),
             "eval_max_tokens", "must be a positive integer or null")
        need(is_int(self.save_every) and self.save_every >= 0, "save_every", "must be an integer >= 0 (0: only at the end)")
        for key in ("retire_solved_after", "retire_unsolved_after", "show_sample_every"):
            need(is_int(getattr(self, key)) and getattr(self, key) >= 0, key, "must be an integer >= 0 (0: off)")
        need(is_int(self.rollouts_per_step) and self.rollouts_per_step >= -1, "rollouts_per_step", "-1 (all) or >= 0")
        need(number("max_failure_rate") and 0 <= self.max_failure_rate <= 1, "max_failure_rate", "must be in [0, 1]")
        try:
            resolve_config(self.loss_fn, self.loss_fn_config)
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

    def temperature_at(self, step: int) -> float:
        """Sampling temperature for ``step``: ``temperature`` annealed linearly to
        ``temperature_end`` at the last step, or constant."""
        if self.temperature_end is None:
            return self.temperature
        progress = min(1.0, step / max(1, self.steps - 1))
        return self.temperature + (self.temperature_end - self.temperature) * progress

    def eval_due(self, step: int) -> bool:
        """Evaluate before step 0, every ``eval_every`` steps, and after the last step."""
        return step == 0 or step == self.steps or (self.eval_every > 0 and step % self.eval_every == 0)

    def save_due(self, step: int) -> bool:
        """Checkpoint after ``step`` (0-based) completes."""
        return self.save_every > 0 and (step + 1) % self.save_every == 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain python, so the dataclass holds lists and dicts."""
    if hasattr(value, "_metadata") or type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value
