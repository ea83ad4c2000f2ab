"""The start a batch of sequences shares, run once for all of them.

GRPO prompts under one chat template begin alike (SmolLM2's system prompt is 27 of the bench's
46 prompt tokens), few-shot prompts far more. The sampler prefills that trunk once per admission
(sampler.py) and the trainer runs it once per micro-batch before each group's own prompt
(trainer.py), each laying out keys and values as if every sequence had been run whole.
"""

from __future__ import annotations

from collections.abc import Sequence

# Shorter common starts are not worth the extra decoder call a pass of their own costs.
MIN_TRUNK_TOKENS = 8


def common_trunk(sequences: Sequence[Sequence[int]], min_tokens: int = MIN_TRUNK_TOKENS) -> int:
    """How many leading tokens two or more ``sequences`` all share, when at least ``min_tokens``
    (else 0); each sequence keeps at least one token of its own after it."""
    if len(sequences) < 2:
        return 0
    first = sequences[0]
    n = min(len(s) for s in sequences) - 1
    for s in sequences[1:]:
        n = next((i for i in range(n) if first[i] != s[i]), n)
    return n if n >= min_tokens else 0
