"""A small RLAdapter for loop tests on the tiny random model.

Its reward is continuous (the share of vowels in the response), so the random model's groups are
almost always mixed and every step trains. Optional faults let tests exercise failure handling:
``fail_every`` raises on every Nth reward call, ``nan_every`` returns NaN, and
``GRPO_TEST_KILL_AT_CALL=N`` makes the process SIGKILL itself on the Nth reward call (a crash in the
middle of a step), ``GRPO_TEST_INTERRUPT_AT_CALL=N`` sends it SIGINT (Ctrl-C) instead.
"""

from __future__ import annotations

import os
import signal

from grpo.rl.adapter import RLAdapter, chat_prompt_tokens

VOWELS = set("aeiouAEIOU")


class ToyAdapter(RLAdapter):
    def __init__(self, num_items: int = 24, fail_every: int = 0, nan_every: int = 0, eval_items: int = 3):
        self.items = [{"id": i, "text": f"Say something about the number {i}."} for i in range(num_items)]
        self.fail_every = fail_every
        self.nan_every = nan_every
        self.eval_items = eval_items
        self.calls = 0
        self.evaluated: list[tuple[int, int, int]] = []

    def build_dataset(self):
        return self.items

    def build_eval_dataset(self):
        return self.items[: self.eval_items]

    def make_prompt(self, sample, tokenizer):
        return chat_prompt_tokens(tokenizer, [{"role": "user", "content": sample["text"]}])

    def compute_reward(self, response, sample):
        self.calls += 1
        if os.environ.get("GRPO_TEST_KILL_AT_CALL") == str(self.calls):
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("GRPO_TEST_INTERRUPT_AT_CALL") == str(self.calls):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError(f"reward blew up on call {self.calls}")
        if self.nan_every and self.calls % self.nan_every == 0:
            return float("nan")
        letters = [c for c in response if c.isalpha()]
        return sum(c in VOWELS for c in letters) / len(letters) if letters else 0.0

    def is_correct(self, reward, sample):
        return reward >= 0.3

    def sample_metrics(self, response, sample):
        return {"chars": float(len(response))}

    def evaluate(self, step, rewards, num_datums):
        self.evaluated.append((step, len(rewards), num_datums))
