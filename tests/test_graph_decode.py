"""The decoding step at the static shapes CUDA graphs replay computes what the lean step computes.

On a CPU no graph is captured (``capture=False``): the same padded rows, fixed attention columns
and masks run eagerly, which is what a graph records. Reference: the same sampling calls with the
static step switched off. Rows finish at different steps (different ``max_tokens``), so the batch
shrinks through several row buckets, and answers grow past the first column bucket.
"""

from __future__ import annotations

import pytest
from backend_helpers import perturb_adapter

from grpo.backends.local import ServiceClient, graph_decode
from grpo.types import ModelInput, SamplingParams

PROMPTS = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906, 30], [1, *range(42, 60)]]
MAX_TOKENS = [5, 70, 23]  # the third prompt's rows reach column 18 + 23; the second's 3 + 70 > 64


def _sample_all(tc) -> list[tuple[list[int], list[float]]]:
    client = tc.save_weights_and_get_sampling_client()
    futures = [client.sample(ModelInput.from_ints(p), 3, SamplingParams(max_tokens=n, temperature=1.0, seed=11 + i))
               for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))]
    return [(list(s.tokens), list(s.logprobs)) for f in futures for s in f.result().sequences]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_static_decoding_steps_sample_what_the_lean_step_samples(tmp_path, monkeypatch, tiny_of, family):
    """(Qwen3: the step CUDA would capture holds its norms of q's and k's heads; Mistral: its layers
    windowed, one mask for all; a CPU runs the same bucketed static step uncaptured.)"""
    service = ServiceClient(checkpoint_dir=tmp_path, device="cpu", train_dtype="fp32", sample_dtype="fp32")
    tc = service.create_lora_training_client(tiny_of(family), rank=4, seed=0)
    perturb_adapter(tc, seed=3)
    reference = _sample_all(tc)

    steps = []
    original = graph_decode.StaticDecodeStep

    class Spied(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            steps.append(self)

    monkeypatch.setattr(graph_decode, "enabled", lambda device: True)
    monkeypatch.setattr(graph_decode, "StaticDecodeStep", Spied)
    static = _sample_all(tc)

    assert steps and not any(s.capture for s in steps)  # a CPU never captures
    buckets = {key for s in steps for key in s.buckets}
    assert len({rows for rows, _ in buckets}) > 1 and len({columns for _, columns in buckets}) > 1, buckets
    assert [tokens for tokens, _ in static] == [tokens for tokens, _ in reference]
    for (_, lp_static), (_, lp_reference) in zip(static, reference, strict=True):
        assert lp_static == pytest.approx(lp_reference, abs=1e-5)
    assert [len(tokens) for tokens, _ in reference] == [n for n in MAX_TOKENS for _ in range(3)]


def test_buckets_are_powers_of_two_within_their_bounds():
    assert [graph_decode.bucket(n, 1, 24) for n in (1, 2, 3, 5, 16, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]
    assert [graph_decode.bucket(n, 64, 300) for n in (1, 64, 65, 129, 257)] == [64, 64, 128, 256, 300]
    assert graph_decode.bucket(40, 64, 50) == 50  # capacity below the floor: the capacity


def test_graphs_only_on_cuda_and_switched_off_by_the_environment(monkeypatch):
    import torch

    assert not graph_decode.enabled(torch.device("cpu"))
    assert graph_decode.enabled(torch.device("cuda"))
    monkeypatch.setenv("GRPO_CUDA_GRAPHS", "0")
    assert not graph_decode.enabled(torch.device("cuda"))


def test_a_failed_capture_names_the_switch_that_decodes_without_graphs(tmp_path, monkeypatch):
    """On a CPU a capture fails for real (no CUDA); the error says how to sample without graphs."""
    service = ServiceClient(checkpoint_dir=tmp_path, device="cpu", train_dtype="fp32", sample_dtype="fp32")
    tc = service.create_lora_training_client("tiny", rank=4, seed=0)
    original = graph_decode.StaticDecodeStep

    class Capturing(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "capture": True})

    monkeypatch.setattr(graph_decode, "enabled", lambda device: True)
    monkeypatch.setattr(graph_decode, "StaticDecodeStep", Capturing)
    with pytest.raises(RuntimeError, match="GRPO_CUDA_GRAPHS=0"):
        tc.save_weights_and_get_sampling_client().sample(ModelInput.from_ints(PROMPTS[0]), 1,
                                                         SamplingParams(max_tokens=3)).result()


@pytest.mark.parametrize("compact", ["eager", "half"])  # half: the GPU's default, finished rows ride along
def test_static_steps_through_continuous_batching_draw_what_the_lean_step_draws(compact):
    """Five slots for 16 rows: requests are admitted into slots that padded rows of the static
    step have written into, while other rows decode; rows stop at scattered steps."""
    import torch

    from grpo import models
    from grpo.backends.local import sampler

    model = models.load_model("tiny")
    tokenizer = models.load_tokenizer("tiny")
    prompts = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906, 30], [1, *range(42, 52)], [1, 5, 6]]

    def requests():
        return [sampler.GenerationRequest(p, 4, SamplingParams(max_tokens=6 + 5 * i, temperature=1.0, seed=11 + i,
                                                               stop=list(range(3000, 9000))))
                for i, p in enumerate(prompts)]

    runs = {}
    for graphs in (False, True):
        batch = requests()
        stats = sampler.generate(model, batch, tokenizer, torch.device("cpu"), compact=compact,
                                 row_bytes=lambda n: 1, budget=5, cuda_graphs=graphs)
        runs[graphs] = ([s for req in batch for s in req.sequences], stats)
    (plain, plain_stats), (static, static_stats) = runs[False], runs[True]
    assert static_stats.admissions == plain_stats.admissions == 4
    assert {s.stop_reason for s in plain} == {"stop", "length"}  # rows leave at different steps
    assert [s.tokens for s in static] == [s.tokens for s in plain]
    for a, b in zip(static, plain, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
