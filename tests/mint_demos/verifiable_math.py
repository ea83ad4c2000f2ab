#!/usr/bin/env python3
"""Shaped like the MinT quickstart's RL-1 demo: an exact-match verifier on sums."""

from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo import RLAdapter, RLConfig, run_grpo  # noqa: E402


class SumsAdapter(RLAdapter):
    EXAMPLE = "Q: What is 2 + 6?\nA: 8\n\n"

    def build_dataset(self) -> list[tuple[str, int]]:
        rows = [(random.randint(0, 9), random.randint(0, 9)) for _ in range(40)]
        return [(f"Q: What is {a} + {b}?\nA:", a + b) for a, b in rows]

    def make_prompt(self, sample: tuple[str, int], tokenizer: Any) -> list[int]:
        return tokenizer.encode(self.EXAMPLE + sample[0])

    def compute_reward(self, response: str, sample: tuple[str, int]) -> float:
        found = re.search(r"-?\d+", response)
        return 1.0 if found and int(found.group()) == sample[1] else 0.0

    def evaluate(self, step: int, rewards: list[float], num_datums: int) -> None:
        share = sum(r > 0 for r in rewards) / len(rewards) if rewards else 0.0
        print(f"Step {step}: accuracy={share:.1%}, datums={num_datums}")


if __name__ == "__main__":
    cfg = RLConfig.from_env()
    cfg.steps = int(os.environ.get("MINT_RL_STEPS", "5"))
    cfg.batch = int(os.environ.get("MINT_RL_BATCH", "10"))
    cfg.max_tokens = int(os.environ.get("MINT_RL_MAX_TOKENS", "8"))
    run_grpo(SumsAdapter(), cfg)
