"""The RLAdapter protocol: everything task-specific, nothing about models or training.

An adapter written for the MinT demos' ``rl_core.run_grpo`` (``build_dataset``, ``make_prompt``,
``compute_reward``, ``evaluate``) runs here unchanged apart from its import line. The optional
hooks below have defaults, so the four methods are all a new task needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar


class RLAdapter(ABC):
    """Task logic for the GRPO loop: data, prompts, rewards."""

    #: Loop keys (GRPOConfig fields) that this adapter's Hydra group sets for its task, each with
    #: why: ``{"max_tokens": (256, "a function needs room")}``. A built-in adapter's group file
    #: (conf/adapter/<name>.yaml) is rendered from its constructor, docstring and this
    #: (grpo/rl/config_docs.py); the command line still wins. Python callers pass their own config.
    loop_overrides: ClassVar[dict[str, tuple[Any, str]]] = {}

    # ------------------------------------------------------------------ required

    @abstractmethod
    def build_dataset(self) -> list[Any]:
        """Training items. The loop shuffles them with the run's seed and cycles through them."""

    @abstractmethod
    def make_prompt(self, sample: Any, tokenizer: Any) -> list[int]:
        """Token ids of the prompt for one item."""

    @abstractmethod
    def compute_reward(self, response: str, sample: Any) -> float:
        """Scalar reward of one decoded response. Exceptions and NaN/inf are recorded and the
        response is left out of training; they never stop the run."""

    def evaluate(self, step: int, rewards: list[float], num_datums: int) -> None:  # noqa: B027 (optional hook)
        """Called after every step with that step's rewards. The loop logs its own metrics, so
        the default does nothing; MinT-style adapters that print here keep working."""

    # ------------------------------------------------------------------ optional hooks

    def build_eval_dataset(self) -> list[Any]:
        """Held-out items for evaluation (greedy accuracy and pass@k). Empty: no evaluation."""
        return []

    def compare_responses(self, samples: Sequence[Any], responses: Sequence[str],
                          baselines: Sequence[str]) -> list[float]:
        """For adapters whose reward only ranks responses against each other (a pairwise judge):
        P(``responses[i]`` is better than ``baselines[i]``) for each held-out item, in [0, 1].

        Overriding it changes held-out evaluation from accuracy/pass@k to the win rate of the
        current policy's greedy answers against the base model's (``eval/win_rate``); see
        grpo/rl/evaluation.py. Not overridden: accuracy and pass@k from ``compute_reward``.
        """
        raise NotImplementedError

    def compute_group_rewards(self, responses: Sequence[str], sample: Any) -> list[float]:
        """Rewards of a whole group at once, for judges that compare responses. By default each
        response is scored on its own with ``compute_reward`` (and the loop then isolates a
        failure to the one response that caused it)."""
        return [float(self.compute_reward(r, sample)) for r in responses]

    def stop_sequences(self, tokenizer: Any) -> list[str | int]:
        """Strings or token ids that end a response. Default: the tokenizer's end-of-sequence."""
        stops: list[str | int] = []
        for token_id in (getattr(tokenizer, "eos_token_id", None),):
            if token_id is not None:
                stops.append(int(token_id))
        return stops

    def is_correct(self, reward: float, sample: Any) -> bool:
        """Whether a reward counts as a correct answer for accuracy and pass@k."""
        return reward > 0

    def sample_metrics(self, response: str, sample: Any) -> dict[str, float]:
        """Per-response metrics beyond the reward (format ok, length in words, ...). The loop
        averages them over the step and logs them under ``adapter/``."""
        return {}


def chat_prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template, ending with the assistant turn.

    Works across transformers versions (v5's ``apply_chat_template(tokenize=True)`` returns a
    mapping, v4's a list) by rendering text first; the template already holds special tokens.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
