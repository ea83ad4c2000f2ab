"""Sampling groups of responses and scoring them, with every reward failure isolated.

A group is one prompt with ``group_size`` responses. All sampling requests of a wave are issued
before any is awaited, so the backend can batch them (locally) or run them in parallel (remote).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo.adapter import RLAdapter
from grpo.types import ModelInput, SamplingParams


@dataclass
class Response:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    text: str
    reward: float = math.nan  # NaN: the reward failed and the response is left out
    advantage: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    ref_logprobs: list[float] | None = None

    @property
    def truncated(self) -> bool:
        return self.stop_reason == "length"

    @property
    def scored(self) -> bool:
        return math.isfinite(self.reward)


@dataclass
class Group:
    item_index: int  # position of the item in the training stream
    item: Any
    prompt_tokens: list[int]
    responses: list[Response]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.responses if r.scored]

    @property
    def is_flat(self) -> bool:
        rewards = self.rewards
        return len(rewards) < 2 or max(rewards) - min(rewards) < 1e-9


@dataclass
class Failure:
    item_index: int
    sample: int
    error: str
    traceback: str


def sampling_seed(run_seed: int, step: int, wave: int, index: int) -> int:
    """A per-request seed that depends only on where the request sits in the run, so a resumed
    run draws exactly the samples the interrupted one would have."""
    return (run_seed * 1_000_003 + step * 10_007 + wave * 101 + index) % (2**31 - 1)


def sample_groups(sampling_client: Any, prompts: Sequence[list[int]], num_samples: int,
                  params_for: Callable[[int], SamplingParams], tokenizer: Any) -> list[list[Response]]:
    """Sample ``num_samples`` responses for each prompt; all requests in flight together."""
    futures = [
        sampling_client.sample(prompt=ModelInput.from_ints(p), num_samples=num_samples, sampling_params=params_for(i))
        for i, p in enumerate(prompts)
    ]
    groups: list[list[Response]] = []
    for future in futures:
        result = future.result()
        groups.append([
            Response(tokens=list(seq.tokens), logprobs=list(seq.logprobs or []), stop_reason=seq.stop_reason,
                     text=tokenizer.decode(seq.tokens, skip_special_tokens=True))
            for seq in result.sequences
        ])
    return groups


def score_group(adapter: RLAdapter, group: Group) -> list[Failure]:
    """Fill in rewards (and per-sample metrics); return the failures, never raise."""
    texts = [r.text for r in group.responses]
    failures: list[Failure] = []
    overrides_group = type(adapter).compute_group_rewards is not RLAdapter.compute_group_rewards
    if overrides_group:
        try:
            rewards = list(adapter.compute_group_rewards(texts, group.item))
            if len(rewards) != len(texts):
                raise ValueError(f"compute_group_rewards returned {len(rewards)} rewards for {len(texts)} responses")
        except Exception as err:  # the whole group fails together
            tb = traceback.format_exc()
            return [Failure(group.item_index, i, _describe(err), tb) for i in range(len(texts))]
    else:
        rewards = []
        for i, text in enumerate(texts):
            try:
                rewards.append(adapter.compute_reward(text, group.item))
            except Exception as err:
                failures.append(Failure(group.item_index, i, _describe(err), traceback.format_exc()))
                rewards.append(math.nan)
    for i, (response, reward) in enumerate(zip(group.responses, rewards, strict=True)):
        value = _as_float(reward)
        if value is None:
            if not any(f.sample == i for f in failures):
                failures.append(Failure(group.item_index, i, f"reward is not a finite number: {reward!r}", ""))
            continue
        response.reward = value
        try:
            response.metrics = {k: float(v) for k, v in adapter.sample_metrics(response.text, group.item).items()}
        except Exception as err:
            failures.append(Failure(group.item_index, i, "sample_metrics failed: " + _describe(err), traceback.format_exc()))
    return failures


def _as_float(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"
