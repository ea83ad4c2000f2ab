"""Sampling a model whose layers the slot cache cannot hold (recurrent_sampler.py): a hybrid's
linear-attention layers keep a recurrent state, so its requests' rows run in lockstep on the
model's own cache, left-padded behind the longest prompt. What it draws is what the slot-cache
sampler draws, and its logprobs are the model's own."""

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


@pytest.mark.parametrize("budget_rows", [None, 3, 6])
def test_rows_in_lockstep_draw_what_the_slot_cache_draws(budget_rows) -> None:
    """On an attention-only model both paths apply: the same seeded tokens, the same logprobs
    (to float32 rounding: the batches and their padding differ), the same stop reasons -- all
    requests in one batch, or as many as a budget of 3 or 6 rows holds (one batch per request, or
    the first two together)."""
    model, tokenizer = models.load_model("tiny"), models.load_tokenizer("tiny")
    slots, each = _requests(), _requests()
    sampler.generate(model, slots, tokenizer, torch.device("cpu"))
    budget = {} if budget_rows is None else dict(row_bytes=lambda positions: 1000, budget=1000 * budget_rows)
    stats = recurrent_sampler.generate_lockstep(model, each, tokenizer, torch.device("cpu"), **budget)
    assert stats.admissions == {None: 1, 3: 3, 6: 2}[budget_rows] and stats.decode_steps > 0
    assert stats.prefilled_tokens == sum(len(p) for p in PROMPTS) and stats.peak_rows == (budget_rows or 9)
    if budget_rows is None:  # (finished rows left the batch as it went: 46 rows over 13 steps)
        assert stats.rows_decoded < stats.decode_steps * stats.peak_rows
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
    real = recurrent_sampler.generate_lockstep
    monkeypatch.setattr(recurrent_sampler, "generate_lockstep", lambda *a, **k: calls.append(1) or real(*a, **k))
    done = _requests()
    sampler.generate(model, done, tokenizer, torch.device("cpu"))
    assert calls == [1]
    assert_logprobs_of_a_plain_forward(model, done)


def test_a_group_prompt_is_prefilled_once_for_every_request_that_repeats_it() -> None:
    """GRPO's groups: two requests of one prompt share its prefill; each draws with its own seed."""
    model, tokenizer = models.load_model("tiny"), models.load_tokenizer("tiny")
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=s) for s in (3, 4)]
    together = [sampler.GenerationRequest(PROMPTS[0], 2, p) for p in params]
    alone = [[sampler.GenerationRequest(PROMPTS[0], 2, p)] for p in params]
    stats = recurrent_sampler.generate_lockstep(model, together, tokenizer, torch.device("cpu"))
    assert stats.prefilled_tokens == len(PROMPTS[0]) and stats.prompt_tokens == 4 * len(PROMPTS[0])
    for req, (single,) in zip(together, alone, strict=True):
        recurrent_sampler.generate_lockstep(model, [single], tokenizer, torch.device("cpu"))
        assert [s.tokens for s in req.sequences] == [s.tokens for s in single.sequences]
    assert together[0].sequences[0].tokens != together[1].sequences[0].tokens
