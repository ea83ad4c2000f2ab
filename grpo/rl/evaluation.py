"""Held-out evaluation on the adapter's eval items.

Two kinds, chosen by the adapter:

- rewards it can score one response at a time (math, code): greedy accuracy and reward, sampled
  accuracy and pass@k;
- comparisons (chat, whose judge ranks responses against each other, so a lone response has no
  score): the win rate of the current policy's greedy answers against the base model's greedy
  answers to the same held-out prompts, through the adapter's ``compare_responses`` (the chat
  judge asks both orders). 0.5 at step 0, where the policy is the base model; above 0.5 when
  training helps.

A reward or comparison that raises is recorded (``failures.jsonl``, ``"phase": "eval"``) and the
item left out, as in training.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Sequence
from math import comb
from typing import Any

from grpo.api.protocols import SamplingClient
from grpo.rl.adapter import RLAdapter
from grpo.rl.episodes import sample_rollouts
from grpo.rl.rollouts import Failure, Group, ScoredGroup, sampling_seed, score_group
from grpo.types import SamplingParams

EVAL_WAVE = 99_991  # keeps eval seeds apart from training seeds
EVAL_PHASE = "eval"  # the "phase" of eval rows in failures.jsonl


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def compares_responses(adapter: RLAdapter) -> bool:
    """Whether the adapter is evaluated by comparison with the base model's answers."""
    return type(adapter).compare_responses is not RLAdapter.compare_responses


def evaluate(sampling_client: SamplingClient, adapter: RLAdapter, items: Sequence[Any], tokenizer: Any, *, seed: int,
             step: int, max_tokens: int, num_samples: int, temperature: float, stop: list,
             baseline_sampler: Callable[[], SamplingClient] | None = None,
             record_failures: Callable[[Iterable[dict[str, Any]]], None] | None = None) -> dict[str, float]:
    """Held-out metrics at ``step`` (``eval/*``).

    ``baseline_sampler`` makes a sampling client of the base model, for comparing adapters;
    ``record_failures`` receives failures.jsonl rows for rewards or comparisons that raised.
    """
    if not items:
        return {}
    prompts = [adapter.make_prompt(item, tokenizer) for item in items]
    failures: list[Failure] = []

    def greedy(sampler: SamplingClient) -> list[Group]:
        rollouts = sample_rollouts(sampler, adapter, items, prompts, 1,
                                   lambda i: SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop),
                                   tokenizer)
        return [Group(i, item, p, rs) for i, (item, p, rs) in enumerate(zip(items, prompts, rollouts, strict=True))]

    if compares_responses(adapter):
        metrics = _compare_with_base(adapter, items, greedy(sampling_client), baseline_sampler, greedy, failures)
    else:
        metrics = _score(adapter, items, prompts, greedy(sampling_client), sampling_client, tokenizer, failures,
                         seed=seed, step=step, max_tokens=max_tokens, num_samples=num_samples,
                         temperature=temperature, stop=stop)
    metrics["eval/failures"] = float(len(failures))
    if failures and record_failures is not None:
        record_failures({"step": step, "phase": EVAL_PHASE, "group": f.item_index, "sample": f.sample,
                         "error": f.error, "traceback": f.traceback} for f in failures)
    return metrics


def _score(adapter: RLAdapter, items: Sequence[Any], prompts: list[list[int]], greedy: list[Group],
           sampling_client: SamplingClient, tokenizer: Any, failures: list[Failure], *, seed: int, step: int, max_tokens: int,
           num_samples: int, temperature: float, stop: list) -> dict[str, float]:
    """Greedy accuracy/reward, sampled accuracy and pass@k from the adapter's own rewards."""
    sampled_rollouts = sample_rollouts(
        sampling_client, adapter, items, prompts, num_samples,
        lambda i: SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop,
                                 seed=sampling_seed(seed, step, EVAL_WAVE, i)), tokenizer)
    sampled_groups = [Group(i, item, p, rs) for i, (item, p, rs) in enumerate(zip(items, prompts, sampled_rollouts,
                                                                                  strict=True))]
    scored_greedy = [score_group(adapter, g) for g in greedy]
    scored_sampled = [score_group(adapter, g) for g in sampled_groups]
    failures.extend(f for g in scored_greedy + scored_sampled for f in g.failures)

    def correct(g: ScoredGroup) -> list[bool]:
        return [g.scored(i) and adapter.is_correct(x, g.group.item) for i, x in enumerate(g.rewards)]

    greedy_correct = [correct(g)[0] for g in scored_greedy]
    greedy_rewards = [g.rewards[0] for g in scored_greedy if g.scored(0)]
    sampled = scored_sampled
    k = num_samples
    return {
        "eval/accuracy": sum(greedy_correct) / len(items),
        "eval/reward": sum(greedy_rewards) / len(greedy_rewards) if greedy_rewards else float("nan"),
        "eval/sampled_accuracy": sum(sum(correct(g)) for g in sampled) / (len(items) * k),
        f"eval/pass@{k}": sum(pass_at_k(k, sum(correct(g)), k) for g in sampled) / len(items),
        "eval/items": float(len(items)),
    }


def _compare_with_base(adapter: RLAdapter, items: Sequence[Any], current: list[Group],
                       baseline_sampler: Callable[[], SamplingClient] | None,
                       greedy: Callable[[SamplingClient], list[Group]],
                       failures: list[Failure]) -> dict[str, float]:
    """Win rate of the current greedy answers over the base model's, item by item."""
    if baseline_sampler is None:
        return {"eval/items": float(len(items))}
    base = greedy(baseline_sampler())
    answers = [g.rollouts[0].text for g in current]
    base_answers = [g.rollouts[0].text for g in base]
    try:
        wins = [float(w) for w in adapter.compare_responses(items, answers, base_answers)]
        if len(wins) != len(items) or not all(0.0 <= w <= 1.0 for w in wins):
            raise ValueError(f"compare_responses returned {wins!r} for {len(items)} items; want one "
                             "probability in [0, 1] per item")
    except Exception as err:
        tb = traceback.format_exc()
        failures.extend(Failure(i, 0, f"{type(err).__name__}: {err}", tb) for i in range(len(items)))
        return {"eval/items": float(len(items))}
    return {
        "eval/win_rate": sum(wins) / len(wins),  # mean P(current answer beats the base model's)
        "eval/wins": sum(w > 0.5 for w in wins) / len(wins),  # share of prompts where it does
        "eval/same_as_base": sum(a == b for a, b in zip(answers, base_answers, strict=True)) / len(items),
        "eval/items": float(len(items)),
    }


def summary(evals: dict[int, dict[str, float]], num_items: int) -> str | None:
    """The closing line comparing the first and last evaluations, or None without two."""
    if len(evals) < 2:
        return None
    first, last = min(evals), max(evals)
    for key, what in (("eval/accuracy", "held-out accuracy"), ("eval/win_rate", "held-out win rate vs the base model")):
        if key in evals[first] and key in evals[last]:
            return (f"{what} {evals[first][key]:.3f} (step {first}) -> {evals[last][key]:.3f} (step {last}), "
                    f"{num_items} items, greedy")
    return None
