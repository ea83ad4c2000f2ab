"""Held-out evaluation: greedy accuracy and pass@k on the adapter's eval items."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb
from typing import Any

from grpo.adapter import RLAdapter
from grpo.client_api import SamplingClient
from grpo.episodes import sample_rollouts
from grpo.rollouts import Group, ScoredGroup, sampling_seed, score_group
from grpo.types import SamplingParams

EVAL_WAVE = 99_991  # keeps eval seeds apart from training seeds


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(sampling_client: SamplingClient, adapter: RLAdapter, items: Sequence[Any], tokenizer: Any, *, seed: int,
             step: int, max_tokens: int, num_samples: int, temperature: float, stop: list) -> dict[str, float]:
    if not items:
        return {}
    prompts = [adapter.make_prompt(item, tokenizer) for item in items]

    def score(rollouts_per_item) -> list[ScoredGroup]:
        return [score_group(adapter, Group(i, item, p, rs))
                for i, (item, p, rs) in enumerate(zip(items, prompts, rollouts_per_item, strict=True))]

    greedy = score(sample_rollouts(sampling_client, adapter, items, prompts, 1,
                                   lambda i: SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop),
                                   tokenizer))
    sampled = score(sample_rollouts(
        sampling_client, adapter, items, prompts, num_samples,
        lambda i: SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop,
                                 seed=sampling_seed(seed, step, EVAL_WAVE, i)), tokenizer))

    def correct(g: ScoredGroup) -> list[bool]:
        return [g.scored(i) and adapter.is_correct(x, g.group.item) for i, x in enumerate(g.rewards)]

    greedy_correct = [correct(g)[0] for g in greedy]
    greedy_rewards = [g.rewards[0] for g in greedy if g.scored(0)]
    k = num_samples
    metrics = {
        "eval/accuracy": sum(greedy_correct) / len(items),
        "eval/reward": sum(greedy_rewards) / len(greedy_rewards) if greedy_rewards else float("nan"),
        "eval/sampled_accuracy": sum(sum(correct(g)) for g in sampled) / (len(items) * k),
        f"eval/pass@{k}": sum(pass_at_k(k, sum(correct(g)), k) for g in sampled) / len(items),
        "eval/items": float(len(items)),
    }
    return metrics
