"""From rewards to Datums: shape, centre in the group, aggregate, mask the prompt.

Everything here is a pure function of its arguments that returns what it computes: the adapter's
rewards in a ScoredGroup are never changed, shaped rewards and advantages are new lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from grpo.api.losses import check_loss_fn
from grpo.rl.rollouts import Group, Rollout, ScoredGroup
from grpo.types import Datum, ModelInput

STD_EPS = 1e-6


def group_advantages(rewards: Sequence[float], norm: str = "center") -> list[float]:
    """``r - mean(r)`` over the scored responses, divided by the group's std when norm == "std".
    NaN rewards (failed) get NaN advantages and are left out of the mean."""
    scored = [r for r in rewards if math.isfinite(r)]
    if not scored:
        return [math.nan] * len(rewards)
    mean = sum(scored) / len(scored)
    scale = 1.0
    if norm == "std":
        var = sum((r - mean) ** 2 for r in scored) / len(scored)
        scale = 1.0 / (math.sqrt(var) + STD_EPS)
    elif norm != "center":
        raise ValueError(f"advantage_norm must be 'center' or 'std', got {norm!r}")
    return [(r - mean) * scale if math.isfinite(r) else math.nan for r in rewards]


def loss_scales(lengths: Sequence[int], loss_agg: str) -> list[float]:
    """Per-sequence factor that turns the backend's token *sum* into the wanted aggregation.

    sum: 1.  token_mean: 1 / (tokens in the batch).  seq_mean: 1 / (len(seq) * sequences).
    """
    if loss_agg == "sum":
        return [1.0] * len(lengths)
    if loss_agg == "token_mean":
        total = sum(lengths)
        return [1.0 / total if total else 0.0] * len(lengths)
    if loss_agg == "seq_mean":
        return [1.0 / (n * len(lengths)) if n else 0.0 for n in lengths]
    raise ValueError(f"loss_agg must be one of sum, token_mean, seq_mean, got {loss_agg!r}")


def kl_penalised(advantage: float, sampler_logprobs: Sequence[float], ref_logprobs: Sequence[float],
                 coef: float, mean_kl: float) -> list[float]:
    """Per-token advantages with a KL penalty against the reference folded in.

    Token t's log-ratio ``k_t = q_t - ref_t`` estimates its KL contribution; subtracting
    ``coef * (k_t - mean_kl)`` pushes tokens that drifted most back towards the reference while
    leaving the batch's mean advantage unchanged.
    """
    return [advantage - coef * ((q - ref) - mean_kl) for q, ref in zip(sampler_logprobs, ref_logprobs, strict=True)]


def training_rewards(scored: ScoredGroup, overlong: str) -> list[float]:
    """The rewards training sees: the adapter's, except that ``overlong="zero"`` sets a truncated
    rollout's reward to 0. NaN (a failed reward) stays NaN."""
    if overlong != "zero":
        return list(scored.rewards)
    return [0.0 if r.truncated and math.isfinite(x) else x
            for r, x in zip(scored.group.rollouts, scored.rewards, strict=True)]


def is_flat(rewards: Sequence[float]) -> bool:
    """A group whose scored rewards are all equal (or with fewer than two) carries no signal."""
    scored = [r for r in rewards if math.isfinite(r)]
    return len(scored) < 2 or max(scored) - min(scored) < 1e-9


@dataclass(frozen=True)
class TrainSample:
    """One rollout chosen for training, with its group (for the prompt) and its advantage. A split
    episode gives one per segment, each with the ``context`` its tokens were sampled after."""

    group: Group
    rollout: Rollout
    advantage: float
    context: list[int] | None = None  # None: the group's prompt

    @property
    def prompt_tokens(self) -> list[int]:
        return self.context if self.context is not None else self.group.prompt_tokens


def compute_advantages(scored_groups: Sequence[ScoredGroup], norm: str, overlong: str) -> list[list[float]]:
    """Per group, each rollout's advantage from the group's training rewards (0 where failed)."""
    out = []
    for scored in scored_groups:
        advantages = group_advantages(training_rewards(scored, overlong), norm)
        out.append([a if math.isfinite(a) else 0.0 for a in advantages])
    return out


def select_for_training(scored_groups: Sequence[ScoredGroup], advantages: Sequence[Sequence[float]],
                        skip_flat_groups: bool, overlong: str) -> list[TrainSample]:
    """The rollouts that become datums, in order: scored, non-empty, not in a flat group (when
    skipped) and not truncated when ``overlong="drop"``."""
    chosen: list[TrainSample] = []
    for scored, group_adv in zip(scored_groups, advantages, strict=True):
        if skip_flat_groups and is_flat(training_rewards(scored, overlong)):
            continue
        group: Group = scored.group
        for i, (rollout, advantage) in enumerate(zip(group.rollouts, group_adv, strict=True)):
            if not scored.scored(i) or not rollout.tokens:
                continue
            if overlong == "drop" and rollout.truncated:
                continue
            chosen.extend(TrainSample(group, part, advantage, context)
                          for context, part in rollout.datum_parts() if part.tokens)
    return chosen


def build_datum(prompt_tokens: Sequence[int], rollout: Rollout, token_advantages: Sequence[float],
                weight: float = 1.0) -> Datum:
    """A next-token datum over prompt + rollout with the prompt masked out.

    Inputs are tokens[:-1] and targets tokens[1:]; the first ``len(prompt) - 1`` targets are
    prompt tokens and get weight 0, advantage 0 and logprob 0. In an episode, observation tokens
    (``rollout.mask`` 0) are masked the same way: only model-written tokens train.
    """
    tokens = list(prompt_tokens) + list(rollout.tokens)
    n_prompt = len(prompt_tokens) - 1
    mask = rollout.model_mask
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [0.0] * n_prompt + [weight * m for m in mask],
            "logprobs": [0.0] * n_prompt + [q * m for q, m in zip(rollout.logprobs, mask, strict=True)],
            "advantages": [0.0] * n_prompt + [float(a) * m for a, m in zip(token_advantages, mask, strict=True)],
        },
    )


def build_datums(samples: Sequence[TrainSample], loss_fn: str, loss_agg: str, kl_penalty_coef: float = 0.0,
                 ref_logprobs: Sequence[Sequence[float]] | None = None) -> tuple[list[Datum], dict[str, float]]:
    """Datums for the chosen samples; returns them with the KL-to-reference metric when the KL
    penalty is on (``ref_logprobs``: the reference's logprobs of each sample's tokens)."""
    scales = loss_scales([s.rollout.num_model_tokens for s in samples], loss_agg)
    aggregate_into = check_loss_fn(loss_fn).aggregate_into
    metrics: dict[str, float] = {}
    use_kl = kl_penalty_coef > 0 and ref_logprobs is not None
    mean_kl = 0.0
    if use_kl:
        diffs = [q - ref for s, refs in zip(samples, ref_logprobs, strict=True)
                 for q, ref, m in zip(s.rollout.logprobs, refs, s.rollout.model_mask, strict=True) if m]
        mean_kl = sum(diffs) / len(diffs) if diffs else 0.0
        metrics["kl/reference"] = mean_kl
    datums = []
    for i, (sample, scale) in enumerate(zip(samples, scales, strict=True)):
        if use_kl:
            token_adv = kl_penalised(sample.advantage, sample.rollout.logprobs, ref_logprobs[i],
                                     kl_penalty_coef, mean_kl)
        else:
            token_adv = [sample.advantage] * len(sample.rollout.tokens)
        # The loss declares where a per-sequence factor scales it (LossSpec.aggregate_into): a
        # loss linear in the advantage takes it there, which also holds on services whose
        # importance_sampling ignores weights; one with a term the advantage does not scale
        # (dro's quadratic penalty) takes it in the weights.
        if aggregate_into == "weights":
            datums.append(build_datum(sample.prompt_tokens, sample.rollout, token_adv, weight=scale))
        else:
            datums.append(build_datum(sample.prompt_tokens, sample.rollout, [a * scale for a in token_adv]))
    return datums, metrics
