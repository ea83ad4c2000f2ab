#!/usr/bin/env python3
"""Shaped like the MinT quickstart's RL-2 demo: a chat-template prompt and a proxy preference score."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo import RLAdapter, RLConfig, run_grpo  # noqa: E402

QUESTIONS = [
    "What does a compiler do?",
    "Name a reason to drink water.",
    "How do bees help flowers?",
    "Why do leaves change colour in autumn?",
]


class ProxyPreferenceAdapter(RLAdapter):

    def build_dataset(self) -> list[str]:
        return [random.choice(QUESTIONS) for _ in range(40)]

    def make_prompt(self, sample: str, tokenizer: Any) -> list[int]:
        messages = [{"role": "user", "content": sample}]
        if hasattr(tokenizer, "apply_chat_template"):
            return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
        return tokenizer.encode(f"User: {sample}\nAssistant:")

    def compute_reward(self, response: str, sample: str) -> float:
        words = response.split()
        score = 0.5 if 5 <= len(words) <= 60 else 0.0
        if words and len(set(w.lower() for w in words)) > 0.6 * len(words):
            score += 0.3
        if response.rstrip().endswith("."):
            score += 0.2
        return score

    def evaluate(self, step: int, rewards: list[float], num_datums: int) -> None:
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        print(f"Step {step}: avg_reward={mean:.3f}, datums={num_datums}")


if __name__ == "__main__":
    cfg = RLConfig.from_env()
    cfg.steps = int(os.environ.get("MINT_RL_STEPS", "10"))
    cfg.batch = int(os.environ.get("MINT_RL_BATCH", "8"))
    cfg.max_tokens = int(os.environ.get("MINT_RL_MAX_TOKENS", "128"))
    run_grpo(ProxyPreferenceAdapter(), cfg)
