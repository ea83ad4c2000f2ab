"""A small AgentAdapter for episode tests on the tiny random model.

The random model never writes a tool's closing tag, so turns end at stop *token ids* instead:
every third token id of the vocabulary stops a turn, which gives turns of a few tokens (a turn
runs past ``max_tokens=16`` with probability (2/3)^16 ~ 0.2%). The environment answers every turn
with an observation until ``max_turns``; ``behaviour`` makes it raise, hang, or return garbage
for chosen items, so fault handling can be tested with real sampling.
"""

from __future__ import annotations

import threading

from grpo.rl.adapter import chat_prompt_tokens
from grpo.rl.agent import AgentAdapter

VOCAB = 49152
STOP_IDS = list(range(0, VOCAB, 3))
HANG = threading.Event()  # never set: a hanging tool waits on it (its thread is a daemon)


class ToyAgent(AgentAdapter):
    tool_timeout_s = 0.5

    def __init__(self, num_items: int = 8, max_turns: int = 3, behaviour: dict[int, str] | None = None,
                 max_context_tokens: int = 2048, tool_errors: str = "observe", observation_style: str = "inline",
                 eval_items: int = 0):
        self.items = [{"id": i, "text": f"Count the vowels in word number {i}."} for i in range(num_items)]
        self.max_turns, self.max_context_tokens = max_turns, max_context_tokens
        self.tool_errors, self.observation_style = tool_errors, observation_style
        self.behaviour = behaviour or {}
        self.eval_items = eval_items
        self.calls = 0

    def build_dataset(self):
        return self.items

    def build_eval_dataset(self):
        return self.items[: self.eval_items]

    def make_prompt(self, sample, tokenizer):
        return chat_prompt_tokens(tokenizer, [{"role": "user", "content": sample["text"]}])

    def stop_sequences(self, tokenizer):
        return STOP_IDS

    def observe(self, text, sample, episode):
        self.calls += 1
        kind = self.behaviour.get(sample["id"], "ok")
        if kind == "raise":
            raise RuntimeError(f"tool crashed on item {sample['id']}")
        if kind == "hang":
            HANG.wait()
        if kind == "garbage":
            return object()
        if kind == "end":
            return None
        return f"seen {len(text)} characters at turn {episode.model_turns}"

    def compute_reward(self, response, sample):
        letters = [c for c in response if c.isalpha()]
        return sum(c in "aeiouAEIOU" for c in letters) / len(letters) if letters else 0.0

    def is_correct(self, reward, sample):
        return reward >= 0.3
