"""From rewards to Datums: centre in the group, shape, aggregate, mask the prompt.

Everything here is a pure function of numbers, so each rule is testable by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from grpo.rollouts import Group, Response
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


def build_datum(prompt_tokens: Sequence[int], response: Response, token_advantages: Sequence[float],
                weight: float = 1.0) -> Datum:
    """A next-token datum over prompt + response with the prompt masked out.

    Inputs are tokens[:-1] and targets tokens[1:]; the first ``len(prompt) - 1`` targets are
    prompt tokens and get weight 0, advantage 0 and logprob 0.
    """
    tokens = list(prompt_tokens) + list(response.tokens)
    n_prompt = len(prompt_tokens) - 1
    n_resp = len(response.tokens)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [0.0] * n_prompt + [weight] * n_resp,
            "logprobs": [0.0] * n_prompt + list(response.logprobs),
            "advantages": [0.0] * n_prompt + [float(a) for a in token_advantages],
        },
    )


def trainable_responses(groups: Sequence[Group], skip_flat_groups: bool, overlong: str) -> list[tuple[Group, Response]]:
    """The (group, response) pairs that become datums, in order."""
    pairs: list[tuple[Group, Response]] = []
    for group in groups:
        if skip_flat_groups and group.is_flat:
            continue
        for response in group.responses:
            if not response.scored or not response.tokens:
                continue
            if overlong == "drop" and response.truncated:
                continue
            pairs.append((group, response))
    return pairs


def assign_advantages(groups: Sequence[Group], norm: str, overlong: str) -> None:
    """Set every response's advantage from its group's rewards (after overlong handling)."""
    for group in groups:
        if overlong == "zero":
            for r in group.responses:
                if r.truncated and r.scored:
                    r.reward = 0.0
        for r, a in zip(group.responses, group_advantages([r.reward for r in group.responses], norm), strict=True):
            r.advantage = a if math.isfinite(a) else 0.0


def build_datums(pairs: Sequence[tuple[Group, Response]], loss_fn: str, loss_agg: str,
                 kl_penalty_coef: float = 0.0) -> tuple[list[Datum], dict[str, float]]:
    """Datums for the trainable pairs; returns them with the KL-to-reference metric if used."""
    scales = loss_scales([len(r.tokens) for _, r in pairs], loss_agg)
    metrics: dict[str, float] = {}
    mean_kl = 0.0
    if kl_penalty_coef > 0:
        diffs = [q - ref for _, r in pairs for q, ref in zip(r.logprobs, r.ref_logprobs or r.logprobs, strict=True)]
        mean_kl = sum(diffs) / len(diffs) if diffs else 0.0
        metrics["kl/reference"] = mean_kl
    datums = []
    for (group, response), scale in zip(pairs, scales, strict=True):
        if kl_penalty_coef > 0 and response.ref_logprobs is not None:
            token_adv = kl_penalised(response.advantage, response.logprobs, response.ref_logprobs,
                                     kl_penalty_coef, mean_kl)
        else:
            token_adv = [response.advantage] * len(response.tokens)
        # DRO's quadratic term does not scale with the advantage, so its aggregation goes into the
        # weights; every other loss is linear in the advantage and takes it there, which also
        # holds on services whose importance_sampling ignores weights.
        if loss_fn == "dro":
            datums.append(build_datum(group.prompt_tokens, response, token_adv, weight=scale))
        else:
            datums.append(build_datum(group.prompt_tokens, response, [a * scale for a in token_adv]))
    return datums, metrics
