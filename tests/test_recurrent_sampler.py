"""Sampling a model whose layers the slot cache cannot hold (recurrent_sampler.py): a hybrid's
linear-attention layers keep a recurrent state, so its requests' rows run in lockstep on the
model's own cache, left-padded behind the longest prompt. What it draws is what the slot-cache
sampler draws, and its logprobs are the model's own."""

from __future__ import annotations

import pytest
import torch
import transformers
from backend_helpers import assert_drew_alike, assert_logprobs_of_a_plain_forward, tiny_qwen3_5

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
    the first two together, the third joining their batch as their rows finish)."""
    model, tokenizer = models.load_model("tiny"), models.load_tokenizer("tiny")
    slots, each = _requests(), _requests()
    sampler.generate(model, slots, tokenizer, torch.device("cpu"))
    budget = {} if budget_rows is None else dict(row_bytes=lambda positions: 1000, budget=1000 * budget_rows)
    stats = recurrent_sampler.generate_lockstep(model, each, tokenizer, torch.device("cpu"), **budget)
    assert stats.admissions == {None: 1, 3: 3, 6: 2}[budget_rows] and stats.decode_steps > 0
    assert stats.prefilled_tokens == sum(len(p) for p in PROMPTS) and stats.peak_rows == (budget_rows or 9)
    if budget_rows is None:  # (finished rows left the batch as it went: 46 rows over 13 steps)
        assert stats.rows_decoded < stats.decode_steps * stats.peak_rows
    if budget_rows == 6:  # the third request joined the first two's rows as three of them finished
        lengths = [[len(s.tokens) for s in r.sequences] for r in each]
        one_after_another = max(lengths[0] + lengths[1]) - 1 + max(lengths[2]) - 1
        assert stats.decode_steps < one_after_another
    assert_drew_alike(each, slots)
    assert len({len(s.tokens) for r in each for s in r.sequences}) > 1  # (rows stopped at different steps)


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


def _varied_requests(seed0: int = 5) -> list[sampler.GenerationRequest]:
    """Two rows a request, prompts of 2 to 22 tokens (the long one admitted late, a short one after
    it), answers of 3 to 12 tokens or a stop token."""
    prompts = [[1, 7], [1, 8, 9], [1, *range(100, 104)], [1, *range(200, 221)], [1, 9], [1, *range(300, 309)]]
    return [sampler.GenerationRequest(p, 2, SamplingParams(max_tokens=3 + 2 * (i % 5), temperature=1.0,
                                                           seed=seed0 + i, stop=STOP_IDS))
            for i, p in enumerate(prompts)]


def test_a_hybrids_requests_join_its_running_batch_as_rows_finish(monkeypatch) -> None:
    """Continuous batching on a Qwen3.5: with a budget of 4 rows, each request joins the running
    batch once 2 of its rows have finished -- its prompt wider than the batch's columns or
    narrower -- and draws exactly what it draws with every request in one batch, or with each
    batch run to its end before the next (the logprobs within float32 rounding, and a plain
    forward's); in fewer decoding steps than the latter."""
    model, tokenizer = tiny_qwen3_5()
    budget = dict(row_bytes=lambda positions: 1000, budget=4000)
    widths = []
    real = recurrent_sampler._joined

    def joined(parts, model):
        widths.append([mask.shape[1] for _, mask, _ in parts])
        return real(parts, model)

    monkeypatch.setattr(recurrent_sampler, "_joined", joined)
    together, joining, one_after_another = _varied_requests(), _varied_requests(), _varied_requests()
    recurrent_sampler.generate_lockstep(model, together, tokenizer, torch.device("cpu"))
    stats = recurrent_sampler.generate_lockstep(model, joining, tokenizer, torch.device("cpu"), **budget)
    assert stats.peak_rows == 4 and stats.admissions >= 3
    assert any(new > running for running, new in widths) and any(new < running for running, new in widths)
    monkeypatch.setattr(recurrent_sampler, "JOIN_RUNNING_BATCH", False)
    widths.clear()
    before = recurrent_sampler.generate_lockstep(model, one_after_another, tokenizer, torch.device("cpu"), **budget)
    assert not widths and stats.decode_steps < before.decode_steps
    assert stats.rows_decoded / stats.decode_steps > before.rows_decoded / before.decode_steps
    assert_drew_alike(joining, together)
    assert_drew_alike(one_after_another, together)
    assert len({len(s.tokens) for r in together for s in r.sequences}) > 2
    assert_logprobs_of_a_plain_forward(model, joining)



def test_a_request_larger_than_the_budget_runs_alone_and_rows_of_one_token_never_decode() -> None:
    """A 3-row budget: requests of 3, 5 (more than the budget: alone, once nothing runs), 1 and 2 rows,
    the first and the last of one token each (done at their prefill: the next requests are admitted,
    nothing decodes for them). Each draws what it draws with every request in one batch."""
    model, tokenizer = tiny_qwen3_5()

    def requests() -> list[sampler.GenerationRequest]:
        shapes = [([1, 7, 8], 3, 1), ([1, *range(50, 60)], 5, 6), ([1, 9], 1, 9), ([1, 11, 12, 13], 2, 1)]
        return [sampler.GenerationRequest(p, n, SamplingParams(max_tokens=m, temperature=1.0, seed=20 + i,
                                                               stop=STOP_IDS))
                for i, (p, n, m) in enumerate(shapes)]

    together, budgeted = requests(), requests()
    recurrent_sampler.generate_lockstep(model, together, tokenizer, torch.device("cpu"))
    stats = recurrent_sampler.generate_lockstep(model, budgeted, tokenizer, torch.device("cpu"),
                                                row_bytes=lambda positions: 1000, budget=3000)
    assert stats.peak_rows == 5 and stats.admissions >= 3
    assert_drew_alike(budgeted, together)
    assert [len(s.tokens) for r in (budgeted[0], budgeted[3]) for s in r.sequences] == [1] * 5


def test_the_lockstep_bench_script_measures_joining_against_one_batch_after_another(tmp_path) -> None:
    """scripts/lockstep_bench.py on a tiny Qwen3.5 whose budget holds a few rows: one JSON line a
    call, each setting's rows and tokens alike, the joining calls in fewer decoding steps of more
    rows each, and the ratio of the two settings' times."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    model, tokenizer = tiny_qwen3_5()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    script = Path(__file__).resolve().parent.parent / "scripts" / "lockstep_bench.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "6", "2", "12", "0.05", "9", "1"], check=True,
                          capture_output=True, text=True, timeout=600)
    joining, apart, ratio = (json.loads(line) for line in done.stdout.strip().splitlines()[-3:])
    assert (joining["join"], apart["join"]) == (True, False) and joining["rows"] == apart["rows"] == 12
    assert joining["tokens"] == apart["tokens"] and joining["peak_rows"] < 12
    assert joining["admissions"] > apart["admissions"] > 1 and joining["decode_steps"] < apart["decode_steps"]
    assert joining["rows_a_step"] > apart["rows_a_step"] and ratio["ratio_joining_over_one_after_another"] > 0
