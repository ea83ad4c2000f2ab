"""Sampling a model whose layers the slot cache cannot hold (recurrent_sampler.py): a hybrid's
linear-attention layers keep a recurrent state, so its requests run one after another on the
model's own cache. What it draws is what the slot-cache sampler draws, and its logprobs are the
model's own."""

from __future__ import annotations

import pytest
import torch
import transformers
from backend_helpers import assert_logprobs_of_a_plain_forward

from grpo import models
from grpo.backends.local import recurrent_sampler, sampler
from grpo.types import SamplingParams

PROMPTS = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906], [1, *range(42, 52)]]
STOP_IDS = list(range(3000, 9000))  # a eighth of the vocabulary stops a row: rows finish at different steps


def _requests(seed0: int = 11) -> list[sampler.GenerationRequest]:
    return [sampler.GenerationRequest(p, 3, SamplingParams(max_tokens=6 + 4 * i, temperature=1.0, seed=seed0 + i,
                                                           stop=STOP_IDS))
            for i, p in enumerate(PROMPTS)]


def test_one_request_at_a_time_draws_what_the_slot_cache_draws() -> None:
    """On an attention-only model both paths apply: the same seeded tokens, the same logprobs
    (to float32 rounding: the batches differ), the same stop reasons."""
    model, tokenizer = models.load_model("tiny"), models.load_tokenizer("tiny")
    slots, each = _requests(), _requests()
    sampler.generate(model, slots, tokenizer, torch.device("cpu"))
    stats = recurrent_sampler.generate_each(model, each, tokenizer, torch.device("cpu"))
    assert stats.admissions == 3 and stats.decode_steps > 0
    got = [s for r in each for s in r.sequences]
    want = [s for r in slots for s in r.sequences]
    assert [(s.tokens, s.stop_reason) for s in got] == [(s.tokens, s.stop_reason) for s in want]
    assert len({len(s.tokens) for s in got}) > 1  # (rows stopped at different steps)
    for a, b in zip(got, want, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_hybrid_samples_through_its_own_cache_with_the_logprobs_of_a_plain_forward(monkeypatch) -> None:
    tokenizer = models.load_tokenizer("tiny")
    config = transformers.Qwen3_5TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    calls = []
    real = recurrent_sampler.generate_each
    monkeypatch.setattr(recurrent_sampler, "generate_each", lambda *a, **k: calls.append(1) or real(*a, **k))
    done = _requests()
    sampler.generate(model, done, tokenizer, torch.device("cpu"))
    assert calls == [1]
    assert_logprobs_of_a_plain_forward(model, done)
