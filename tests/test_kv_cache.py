"""The preallocated decode cache holds what transformers' DynamicCache holds, step for step,
through the sampler's fan-out and compaction, and sampling with it draws the same tokens."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo import models
from grpo.backends.local import sampler
from grpo.backends.local.kv_cache import PreallocatedLayer, preallocated_cache
from grpo.types import SamplingParams

STOP_IDS = list(range(3000, 9000))


def test_layer_matches_dynamic_layer_through_fan_out_appends_and_compaction():
    gen = torch.Generator().manual_seed(0)
    ours, theirs = PreallocatedLayer(capacity=12), DynamicLayer()

    def step(k_len: int, rows: int):
        k = torch.randn(rows, 2, k_len, 4, generator=gen)
        v = torch.randn(rows, 2, k_len, 4, generator=gen)
        a, b = ours.update(k, v), theirs.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    step(5, 2)  # prefill of two prompts
    fan_out = torch.tensor([0, 0, 0, 1, 1])
    ours.batch_select_indices(fan_out)
    theirs.batch_select_indices(fan_out)
    step(1, 5)
    step(1, 5)
    survivors = torch.tensor([1, 3, 4])  # rows 0 and 2 finished
    ours.batch_select_indices(survivors)
    theirs.batch_select_indices(survivors)
    step(1, 3)
    assert ours.get_seq_length() == theirs.get_seq_length() == 8
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_layer_refuses_to_outgrow_its_capacity():
    layer = PreallocatedLayer(capacity=3)
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    try:
        layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    except ValueError as err:
        assert "3 positions cannot hold 4" in str(err)
    else:
        raise AssertionError("a fourth position fit in a cache of three")


def test_sampling_draws_the_same_tokens_as_with_dynamic_cache(monkeypatch, tokenizer):
    """Rows stop at different steps (stop token + max_tokens), so the wave compacts many times.
    The tiny model's next token is near uniform: an eighth of the vocabulary stops a row."""
    model = models.load_model("tiny")
    prompts = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906, 30], [1, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]

    def run():
        reqs = [sampler.GenerationRequest(p, 4, SamplingParams(max_tokens=6 + 5 * i, temperature=1.0, seed=11 + i,
                                                                stop=STOP_IDS))
                for i, p in enumerate(prompts)]
        sampler.generate(model, reqs, tokenizer, torch.device("cpu"))
        return [(s.tokens, s.logprobs, s.stop_reason) for r in reqs for s in r.sequences]

    ours = run()
    monkeypatch.setattr(sampler, "preallocated_cache", lambda config, capacity: DynamicCache(config=config))
    theirs = run()
    assert [t for t, _, _ in ours] == [t for t, _, _ in theirs]
    assert {reason for _, _, reason in ours} == {"stop", "length"}, "the test needs rows that stop early"
    for (_, a, _), (_, b, _) in zip(ours, theirs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_cache_of_a_model_config_replaces_only_full_attention_layers():
    model = models.load_model("tiny")
    cache = preallocated_cache(model.config, capacity=16)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
