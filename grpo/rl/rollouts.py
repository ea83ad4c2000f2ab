"""Sampling groups of rollouts and scoring them, with every reward failure isolated.

A group is one prompt with ``group_size`` rollouts. All sampling requests of a wave are issued
before any is awaited, so the backend can batch them (locally) or run them in parallel (remote).

The records here are frozen: sampling returns ``Group``s, scoring returns a ``ScoredGroup`` that
holds the adapter's rewards beside the group, and later stages (advantages, reference logprobs)
return their own results instead of writing into these.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpo.api.protocols import SamplingClient
from grpo.rl.adapter import RLAdapter
from grpo.types import ModelInput, SamplingParams


@dataclass(frozen=True)
class Rollout:
    """One sampled response: its tokens (after the prompt), the sampler's logprobs of them, why
    sampling stopped, and the decoded text the adapter scores.

    A multi-turn episode (grpo.rl.episodes) is a Rollout too: its tokens interleave model turns and
    observations, ``mask`` marks each token 1 (model-written) or 0 (observation; its logprob is
    0), and ``episode`` holds the trace. Single-turn rollouts leave both None: all model tokens.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    text: str
    mask: tuple[int, ...] | None = None
    episode: Any = None  # grpo.rl.episodes.Episode for an episode
    # An episode whose environment rebuilt the context (breaking the token prefix) trains as
    # several Datums: (the context the sampler continued, the part sampled after it) each.
    segments: tuple[tuple[list[int], Rollout], ...] | None = None

    @property
    def truncated(self) -> bool:
        return self.stop_reason == "length"

    @property
    def model_mask(self) -> list[int]:
        """1 for each token the model wrote, 0 for observation tokens."""
        return list(self.mask) if self.mask is not None else [1] * len(self.tokens)

    @property
    def num_model_tokens(self) -> int:
        return len(self.tokens) if self.mask is None else sum(self.mask)

    def datum_parts(self) -> list[tuple[list[int] | None, Rollout]]:
        """(context, part) for each Datum this rollout trains as: itself after the group's prompt
        (context None), or each segment of an episode whose context was rebuilt."""
        return list(self.segments) if self.segments else [(None, self)]


@dataclass(frozen=True)
class Group:
    item_index: int  # position of the item in the training stream
    item: Any
    prompt_tokens: list[int]
    rollouts: list[Rollout]


@dataclass(frozen=True)
class Failure:
    item_index: int
    sample: int
    error: str
    traceback: str


@dataclass(frozen=True)
class ScoredGroup:
    """A group with the adapter's rewards (NaN where the reward failed; such a rollout is left
    out of training) and its per-rollout metrics. Rewards are exactly what the adapter returned."""

    group: Group
    rewards: list[float]
    metrics: list[dict[str, float]]
    failures: list[Failure]

    def scored(self, i: int) -> bool:
        return math.isfinite(self.rewards[i])


def sampling_seed(run_seed: int, step: int, wave: int, index: int) -> int:
    """A per-request seed that depends only on where the request sits in the run, so a resumed
    run draws exactly the samples the interrupted one would have."""
    return (run_seed * 1_000_003 + step * 10_007 + wave * 101 + index) % (2**31 - 1)


def sample_groups(sampling_client: SamplingClient, prompts: Sequence[list[int]], num_samples: int,
                  params_for: Callable[[int], SamplingParams], tokenizer: Any) -> list[list[Rollout]]:
    """Sample ``num_samples`` rollouts for each prompt; all requests in flight together."""
    futures = [
        sampling_client.sample(prompt=ModelInput.from_ints(p), num_samples=num_samples, sampling_params=params_for(i))
        for i, p in enumerate(prompts)
    ]
    return [
        [Rollout(tokens=list(seq.tokens), logprobs=list(seq.logprobs or []), stop_reason=seq.stop_reason,
                 text=tokenizer.decode(seq.tokens, skip_special_tokens=True))
         for seq in future.result().sequences]
        for future in futures
    ]


def score_group(adapter: RLAdapter, group: Group) -> ScoredGroup:
    """The adapter's rewards and per-rollout metrics for ``group``; failures are recorded in the
    result, never raised."""
    texts = [r.text for r in group.rollouts]
    failures: list[Failure] = []
    overrides_group = type(adapter).compute_group_rewards is not RLAdapter.compute_group_rewards
    if overrides_group:
        try:
            raw = list(adapter.compute_group_rewards(texts, group.item))
            if len(raw) != len(texts):
                raise ValueError(f"compute_group_rewards returned {len(raw)} rewards for {len(texts)} responses")
        except Exception as err:  # the whole group fails together
            tb = traceback.format_exc()
            failures = [Failure(group.item_index, i, _describe(err), tb) for i in range(len(texts))]
            return ScoredGroup(group, [math.nan] * len(texts), [{} for _ in texts], failures)
    else:
        raw = []
        for i, (text, rollout) in enumerate(zip(texts, group.rollouts, strict=True)):
            try:
                if rollout.episode is not None:  # an AgentAdapter's episode: the reward reads its trace
                    raw.append(adapter.episode_reward(rollout.episode, group.item))
                else:
                    raw.append(adapter.compute_reward(text, group.item))
            except Exception as err:
                failures.append(Failure(group.item_index, i, _describe(err), traceback.format_exc()))
                raw.append(math.nan)
    rewards: list[float] = []
    metrics: list[dict[str, float]] = []
    for i, (text, value) in enumerate(zip(texts, raw, strict=True)):
        reward = _as_float(value)
        if reward is None:
            if not any(f.sample == i for f in failures):
                failures.append(Failure(group.item_index, i, f"reward is not a finite number: {value!r}", ""))
            rewards.append(math.nan)
            metrics.append({})
            continue
        rewards.append(reward)
        try:
            metrics.append({k: float(v) for k, v in adapter.sample_metrics(text, group.item).items()})
        except Exception as err:
            metrics.append({})
            failures.append(Failure(group.item_index, i, "sample_metrics failed: " + _describe(err),
                                    traceback.format_exc()))
    return ScoredGroup(group, rewards, metrics, failures)


def _as_float(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"
