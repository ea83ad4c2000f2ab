"""Continuous batching across calls (grpo.serve's): requests that arrive while a generation runs
join it between decoding steps, the slot cache growing where they need more rows or columns, and
each request is answered as its own rows finish. The tiny model in fp32, the real sampler."""

from __future__ import annotations

import threading

import pytest
import torch
from backend_helpers import perturb_adapter, plain_logprobs

from grpo import types
from grpo.backends.local import ServiceClient, sampler

SHORT = [1, 504, 3458, 314, 253, 1345, 28]
LONG = [1 + (7 * i) % 500 for i in range(40)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    svc = ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), device="cpu", dtype="float32")
    client = svc.create_lora_training_client("tiny", seed=0, rank=8)
    perturb_adapter(client, seed=7, scale=0.2)
    return client


def request(prompt, n, max_tokens, seed, **kwargs) -> sampler.GenerationRequest:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
    return sampler.GenerationRequest(list(prompt), n, params, **kwargs)


def outcome(req: sampler.GenerationRequest) -> list[tuple[list[int], list[float], str]]:
    return [(s.tokens, s.logprobs, s.stop_reason) for s in req.sequences]


def run(client, tokenizer, requests, **kwargs) -> sampler.GenerationStats:
    with client.engine.use(client.adapter) as model:
        return sampler.generate(model, requests, tokenizer, client.engine.device, **kwargs)


class Arrivals:
    """``joining`` for generate: hands over ``later`` at the ``at``-th time it is asked, where
    ``joinable`` accepts them; keeps what it refuses."""

    def __init__(self, later: list[sampler.GenerationRequest], at: int):
        self.later, self.at, self.asked, self.refused = later, at, 0, []

    def __call__(self, joinable):
        self.asked += 1
        if self.asked != self.at:
            return []
        self.refused = [req for req in self.later if not joinable(req)]
        return [req for req in self.later if joinable(req)]


def test_requests_that_join_a_running_generation_sample_what_they_would_alone(trained, tokenizer) -> None:
    """A joiner with more rows than the generation's slots, a longer prompt and more tokens than
    its columns hold (the cache grows), a logprobs-only request and a one-token sample with its
    prompt's logprobs (both answered at once): the same tokens as each run alone, logprobs as a
    plain forward pass gives; each request answered once, the first before the joiners end."""
    first = request(SHORT, 2, 4, seed=1)
    joiners = [request(LONG, 5, 12, seed=2), request(SHORT, 3, 6, seed=3),
               request(LONG, 0, 1, seed=None, include_prompt_logprobs=True),
               request(SHORT, 2, 1, seed=4, include_prompt_logprobs=True)]
    answered: list[int] = []
    arrivals = Arrivals(joiners, at=2)  # after the first request's first decoding step
    stats = run(trained, tokenizer, [first], joining=arrivals, finished=lambda req: answered.append(id(req)))
    assert arrivals.refused == [] and stats.admissions == 2  # the first; the two joiners with rows, together
    # each answered once as it finished, but the last (it ends with the generation: the caller answers it)
    assert sorted(answered) == sorted(id(r) for r in [first, *joiners[1:]]) and len(answered) == 4
    for req in [first, *joiners]:
        alone = request(req.prompt, req.num_samples, req.params.max_tokens, req.params.seed,
                        include_prompt_logprobs=req.include_prompt_logprobs)
        run(trained, tokenizer, [alone])
        got, want = outcome(req), outcome(alone)
        assert [t for t, _, _ in got] == [t for t, _, _ in want] and [s for *_, s in got] == [s for *_, s in want]
        for tokens, logprobs, _ in got:
            sequence = req.prompt + tokens
            plain = plain_logprobs(trained, sequence[:-1], sequence[1:])[-len(tokens):]
            torch.testing.assert_close(torch.tensor(logprobs), plain, atol=1e-5, rtol=0)
        if req.include_prompt_logprobs:
            assert req.prompt_logprobs[0] is None
            torch.testing.assert_close(torch.tensor(req.prompt_logprobs[1:]), torch.tensor(alone.prompt_logprobs[1:]),
                                       atol=1e-5, rtol=0)
    assert len(joiners[0].sequences) == 5 and all(len(s.tokens) == 12 for s in joiners[0].sequences)


def test_what_the_graphs_static_buffers_cannot_hold_does_not_join(trained, tokenizer) -> None:
    """Decoding steps replayed from graphs (static shapes; run here without capture) take only
    joiners that fit their slots and columns; the others stay with the caller's queue."""
    first = request(SHORT, 4, 6, seed=1)
    fits, too_long, too_many = request(SHORT, 2, 3, seed=2), request(LONG, 1, 6, seed=3), request(SHORT, 6, 2, seed=4)
    arrivals = Arrivals([fits, too_long, too_many], at=2)
    run(trained, tokenizer, [first], joining=arrivals, cuda_graphs=True)
    assert arrivals.refused == [too_long, too_many]
    assert len(fits.sequences) == 2 and too_long.sequences == [] and too_many.sequences == []
    alone = request(SHORT, 2, 3, seed=2)
    run(trained, tokenizer, [alone])
    assert [s.tokens for s in fits.sequences] == [s.tokens for s in alone.sequences]


def test_finished_is_called_for_what_ends_before_the_generation(trained, tokenizer) -> None:
    """``finished`` names the logprobs-only request and the short one, not the long one the
    generation ends with; every request has its results when generate returns."""
    answered: list[int] = []
    reqs = [request(SHORT, 2, 3, seed=1), request(LONG, 1, 8, seed=2), request(SHORT, 0, 1, seed=None)]
    run(trained, tokenizer, reqs, finished=lambda req: answered.append(id(req)))
    assert sorted(answered) == sorted(id(r) for r in (reqs[0], reqs[2]))
    assert [len(s.tokens) for s in reqs[1].sequences] == [8] and reqs[2].prompt_logprobs is not None


@pytest.mark.parametrize("other_weights_waiting", [False, True])
def test_a_servers_sample_call_joins_the_generation_running_and_is_answered_first(tmp_path, monkeypatch,
                                                                                  other_weights_waiting) -> None:
    """ServiceClient.continuous_batching (grpo.serve's): a short call made while a long one
    generates joins its generation and is answered while the long one still runs -- unless a call
    for other weights waits too: then the generation takes no more, and each runs after it."""
    svc = ServiceClient(checkpoint_dir=tmp_path, device="cpu", dtype="float32")
    svc.continuous_batching = True
    client = svc.create_lora_training_client("tiny", seed=0, rank=8)
    sampling = client.save_weights_and_get_sampling_client()
    other = client.save_weights_and_get_sampling_client()  # (a new snapshot: other weights)
    started, submitted, generations = threading.Event(), threading.Event(), []
    real = sampler.generate

    def watched(model, requests, *args, joining=None, **kwargs):
        generations.append(len(requests))
        started.set()

        def held(joinable):  # the generation's first look for joiners waits for the short call
            submitted.wait(30)
            return joining(joinable)

        return real(model, requests, *args, joining=held if joining else None, **kwargs)

    monkeypatch.setattr(sampler, "generate", watched)
    answered: list[str] = []
    long = sampling.sample(types.ModelInput.from_ints(SHORT), 1, types.SamplingParams(max_tokens=64, seed=5, stop=[]))
    long._future.add_done_callback(lambda _f: answered.append("long"))  # (closes its batch: it runs)
    assert started.wait(30)
    short = sampling.sample(types.ModelInput.from_ints(LONG), 2, types.SamplingParams(max_tokens=3, seed=6))
    if other_weights_waiting:
        elsewhere = other.sample(types.ModelInput.from_ints(SHORT), 1, types.SamplingParams(max_tokens=2))
    short._future.add_done_callback(lambda _f: answered.append("short"))  # closes its batch: it may join
    submitted.set()
    got, whole = short.result(timeout=60), long.result(timeout=60)
    assert [len(s.tokens) for s in got.sequences] == [3, 3] and len(whole.sequences[0].tokens) == 64
    if not other_weights_waiting:
        assert generations == [1] and answered == ["short", "long"], (generations, answered)
    else:
        assert len(elsewhere.result(timeout=60).sequences[0].tokens) == 2
        assert generations == [1, 1, 1] and answered == ["long", "short"], (generations, answered)
