"""Open-ended chat with rewards from a judge model: ``python -m grpo adapter=chat``.

Each group's responses are compared pairwise by a frozen judge LM (``adapters.judge``) and each
response is rewarded with its win rate in [0, 1]. ``scorer`` chooses the reward:

- ``judge``: the judge's win rate (default)
- ``rules``: the rule-based score (empty / repetition / relevance / length / ending checks)
- ``judge+rules``: ``(1 - rules_weight) * win rate + rules_weight * rule score``; the rules catch
  what a 135M judge misses (off-topic answers) and what a policy learns to exploit

Prompts are the built-in set (``adapters.chat_prompts``) or any ``datasets`` source whose
``prompt_column`` holds an instruction string or a list of chat messages.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from adapters.chat_prompts import REFERENCE_ANSWERS, builtin_prompts
from adapters.data import DataSourceError, load_rows, require_columns
from adapters.judge import PairwiseJudge, rule_checks, rule_score
from grpo.checks import check, check_choice, is_int
from grpo.rl.adapter import RLAdapter, chat_prompt_tokens

SCORERS = ("judge", "rules", "judge+rules")


class ChatAdapter(RLAdapter):
    """Open-ended chat, rewarded by a judge LM's pairwise win rate within each group.

      python -m grpo adapter=chat adapter.judge_model=smollm2 adapter.scorer=judge+rules
      python -m grpo adapter=chat adapter.prompts=data/prompts.jsonl adapter.prompt_column=instruction

    Args:
        prompts: builtin | a datasets source: hub id, local jsonl/json/parquet/csv file or dir, or in-memory rows
        prompt_column: column with an instruction string or a list of chat messages
        split: split of a datasets source
        subset: hub dataset config name
        limit: use at most this many prompt rows
        eval_size: held-out prompts: eval/win_rate of greedy answers vs the base model's (0 = off)
        system_prompt: a system message before each prompt; null: none
        scorer: judge | rules | judge+rules
        judge_model: any causal LM grpo.models loads: smollm2 | tiny | local dir | hub id
        judge_device: default: cuda when available, else cpu
        judge_dtype: also on cuda: the judge's margins are small (bf16 costs ~5 points)
        judge_max_response_tokens: longer responses are cut to this many tokens before judging
        judge_batch_size: comparisons per judge forward (a group of 4 is 12)
        rules_weight: judge+rules: reward = (1 - w) * win rate + w * rule score
        seed: shuffle of the prompts before the eval hold-out
        reference_column: a good answer per prompt (built-in: 28 of 60): adapter/judge_vs_reference
    """

    loop_overrides = {"max_tokens": (64, "room for a short answer; the judge reads up to judge_max_response_tokens")}

    def __init__(self, prompts: str | Sequence[Any] = "builtin", prompt_column: str = "prompt",
                 split: str = "train", subset: str | None = None, limit: int | None = None,
                 eval_size: int = 12, system_prompt: str | None = None, scorer: str = "judge",
                 judge_model: str = "smollm2", judge_device: str | None = None, judge_dtype: str | None = "float32",
                 judge_max_response_tokens: int = 96, judge_batch_size: int = 32,
                 rules_weight: float = 0.5, seed: int = 0, reference_column: str | None = "reference"):
        check_choice("adapter.scorer", scorer, SCORERS)
        check(isinstance(rules_weight, int | float) and 0.0 <= rules_weight <= 1.0, "adapter.rules_weight",
              rules_weight, "must be between 0 and 1")
        check(is_int(eval_size) and eval_size >= 0, "adapter.eval_size", eval_size, "must be an integer >= 0")
        self.prompts_source = prompts
        self.prompt_column = prompt_column
        self.split = split
        self.subset = subset
        self.limit = limit
        self.eval_size = int(eval_size)
        self.system_prompt = system_prompt
        self.scorer = scorer
        self.rules_weight = float(rules_weight)
        self.seed = seed
        self.reference_column = reference_column
        self._vs_reference: dict[str, float] = {}  # response -> judge P(beats the reference), this group
        # Built now (cheap: nothing loads until the first comparison), so a bad judge option fails at once.
        self.judge = (PairwiseJudge(judge_model, device=judge_device, dtype=judge_dtype, max_response_tokens=judge_max_response_tokens,
                                    batch_size=judge_batch_size) if scorer != "rules" else None)
        self._items: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ data

    def _all_items(self) -> list[dict[str, Any]]:
        if self._items is None:
            if isinstance(self.prompts_source, str) and self.prompts_source == "builtin":
                rows: list[dict[str, Any]] = [{self.prompt_column: p, "reference": REFERENCE_ANSWERS.get(p)}
                                              for p in builtin_prompts()]
                rows = rows[: self.limit] if self.limit is not None else rows
            else:
                rows = load_rows(self.prompts_source, split=self.split, name=self.subset, limit=self.limit)
                require_columns(rows, [self.prompt_column], self.prompts_source)
            items = [self._item(row[self.prompt_column], k, row.get(self.reference_column or "", None))
                     for k, row in enumerate(rows)]
            random.Random(self.seed).shuffle(items)
            if len(items) <= self.eval_size:
                raise DataSourceError(f"chat prompts: {len(items)} prompt(s) cannot hold out eval_size="
                                      f"{self.eval_size} and still train; lower adapter.eval_size")
            self._items = items
        return self._items

    def _item(self, value: Any, index: int, reference: Any = None) -> dict[str, Any]:
        """One prompt row as ``{"messages": [...], "instruction": str, "reference": str | None}``."""
        if isinstance(value, str) and value.strip():
            messages = [{"role": "user", "content": value.strip()}]
        elif isinstance(value, Sequence) and value and all(isinstance(m, Mapping) and "role" in m
                                                            and "content" in m for m in value):
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
            if messages[-1]["role"] != "user":
                raise DataSourceError(f"prompt row {index}: the last chat message must be the user's, got "
                                      f"role {messages[-1]['role']!r}")
        else:
            raise DataSourceError(f"prompt row {index}: column {self.prompt_column!r} must hold a non-empty "
                                  f"instruction string or a list of {{'role', 'content'}} messages, got {value!r}")
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        reference = reference.strip() if isinstance(reference, str) and reference.strip() else None
        return {"messages": messages, "instruction": messages[-1]["content"], "reference": reference}

    def build_dataset(self) -> list[dict[str, Any]]:
        return self._all_items()[self.eval_size:]

    def build_eval_dataset(self) -> list[dict[str, Any]]:
        return self._all_items()[: self.eval_size]

    def make_prompt(self, sample: dict[str, Any], tokenizer: Any) -> list[int]:
        return chat_prompt_tokens(tokenizer, sample["messages"])

    # ------------------------------------------------------------------ rewards

    def compute_reward(self, response: str, sample: dict[str, Any]) -> float:
        if self.scorer != "rules":
            raise ValueError(f"scorer={self.scorer!r} compares responses within a group; "
                             "use compute_group_rewards (the loop does)")
        return rule_score(response, sample["instruction"])

    def compute_group_rewards(self, responses: Sequence[str], sample: dict[str, Any]) -> list[float]:
        instruction = sample["instruction"]
        if self.scorer == "rules":
            return [rule_score(r, instruction) for r in responses]
        assert self.judge is not None
        wins = self.judge.win_rates(instruction, responses)
        # A score that is not relative to the group, so progress shows while the win rates
        # average 0.5 by construction: P(response beats a fixed good answer), where there is one.
        self._vs_reference = {}
        if sample.get("reference"):
            p = self.judge.p_better([instruction] * len(responses), responses, [sample["reference"]] * len(responses))
            self._vs_reference = dict(zip(responses, p, strict=True))
        if self.scorer == "judge":
            return wins
        w = self.rules_weight
        return [(1 - w) * win + w * rule_score(r, instruction) for win, r in zip(wins, responses, strict=True)]

    def compare_responses(self, samples: Sequence[dict[str, Any]], responses: Sequence[str],
                          baselines: Sequence[str]) -> list[float]:
        """P(response beats the baseline) for held-out evaluation, by the training reward's own
        measure: the judge (both orders), the rule score (1 / 0.5 / 0 for better / equal / worse),
        or their ``rules_weight`` mix."""
        instructions = [s["instruction"] for s in samples]
        rules = [0.5 + 0.5 * _sign(rule_score(r, p) - rule_score(b, p))
                 for p, r, b in zip(instructions, responses, baselines, strict=True)]
        if self.scorer == "rules":
            return rules
        assert self.judge is not None
        judged = self.judge.p_better(instructions, responses, baselines)
        if self.scorer == "judge":
            return judged
        w = self.rules_weight
        return [(1 - w) * j + w * r for j, r in zip(judged, rules, strict=True)]

    def is_correct(self, reward: float, sample: Any) -> bool:
        # Win rates centre on 0.5 and rule scores run 0..1: above the midpoint counts as "good".
        return reward > 0.5

    def sample_metrics(self, response: str, sample: dict[str, Any]) -> dict[str, float]:
        checks = rule_checks(response, sample["instruction"])
        metrics = {"words": float(len(response.split())), "empty": checks["empty"],
                   "distinct": checks["distinct"], "rule_score": rule_score(response, sample["instruction"])}
        if response in self._vs_reference:
            metrics["judge_vs_reference"] = self._vs_reference[response]
        return metrics


def _sign(x: float) -> float:
    return (x > 1e-12) - (x < -1e-12)
