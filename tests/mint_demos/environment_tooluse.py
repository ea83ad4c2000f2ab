#!/usr/bin/env python3
"""Shaped like the MinT quickstart's RL-3 demo: code from the response run against test cases.

Like the demo, the code runs in a plain namespace (here without builtins), not a sandbox.
"""

from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo import RLAdapter, RLConfig, run_grpo  # noqa: E402

EXAMPLE = "Q: Write `inc(x)` that returns x + 1.\nA: ```python\ndef inc(x):\n    return x + 1\n```\n\n"

TASKS = [
    {"q": "Write `triple(x)` that returns 3 * x.", "tests": [("triple(2)", 6), ("triple(0)", 0)]},
    {"q": "Write `neg(x)` that returns -x.", "tests": [("neg(4)", -4), ("neg(-1)", 1)]},
    {"q": "Write `first(xs)` that returns xs[0].", "tests": [("first([5, 6])", 5)]},
]


def code_of(response: str) -> str | None:
    blocks = re.findall(r"```(?:\w+)?\n(.*?)```", response, re.DOTALL)
    if blocks:
        return blocks[-1].strip()
    return response[response.find("def "):].strip() if "def " in response else None


class ToolUseAdapter(RLAdapter):

    def build_dataset(self) -> list[dict]:
        return [random.choice(TASKS) for _ in range(40)]

    def make_prompt(self, sample: dict, tokenizer: Any) -> list[int]:
        return tokenizer.encode(EXAMPLE + f"Q: {sample['q']}\nA:")

    def compute_reward(self, response: str, sample: dict) -> float:
        code = code_of(response)
        if not code:
            return 0.0
        try:
            namespace: dict[str, Any] = {"__builtins__": {}}
            exec(code, namespace)  # noqa: S102
            return 1.0 if all(eval(expr, namespace) == want for expr, want in sample["tests"]) else 0.0  # noqa: S307
        except Exception:
            return 0.0

    def evaluate(self, step: int, rewards: list[float], num_datums: int) -> None:
        share = sum(r > 0 for r in rewards) / len(rewards) if rewards else 0.0
        print(f"Step {step}: accuracy={share:.1%}, datums={num_datums}")


if __name__ == "__main__":
    cfg = RLConfig.from_env()
    cfg.steps = int(os.environ.get("MINT_RL_STEPS", "10"))
    cfg.batch = int(os.environ.get("MINT_RL_BATCH", "8"))
    cfg.max_tokens = int(os.environ.get("MINT_RL_MAX_TOKENS", "256"))
    run_grpo(ToolUseAdapter(), cfg)
