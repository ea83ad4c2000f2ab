"""The local SamplingClient on the tiny model: logprobs agree with the trainer, stops, seeds,
batching of concurrent requests, snapshots that stay put while training moves on."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from backend_helpers import (
    adapter_tensors,
    next_token_datum,
    perturb_adapter,
    plain_logprobs,
    rl_datum,
)

from grpo import types
from grpo.backends.local import ServiceClient, sampler
from grpo.models.cpu_linear import packing_works

PROMPTS = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906, 30], [1, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> ServiceClient:
    return ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def trained(svc):
    """A training client whose adapter is not the identity, and a sampler of its weights."""
    client = svc.create_lora_training_client("tiny", seed=0, rank=8)
    perturb_adapter(client, seed=7, scale=0.2)
    return client, client.save_weights_and_get_sampling_client()


@pytest.fixture
def generations(monkeypatch):
    """The number of requests in each generation the batcher runs (the real sampler.generate
    does the work)."""
    calls: list[int] = []
    real = sampler.generate

    def counting(model, requests, *args, **kwargs):
        calls.append(len(requests))
        return real(model, requests, *args, **kwargs)

    monkeypatch.setattr(sampler, "generate", counting)
    return calls


def sample(sampling_client, prompt, n=1, **params):
    return sampling_client.sample(types.ModelInput.from_ints(prompt), n, types.SamplingParams(**params))


# --------------------------------------------------------------------------- logprobs (3)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampler_logprobs_equal_trainer_logprobs(trained, generations, temperature) -> None:
    client, sampling_client = trained
    # Prompts of different lengths in one batch: left padding must not move any logprob.
    futures = [sample(sampling_client, p, 3, max_tokens=10, temperature=temperature, seed=i)
               for i, p in enumerate(PROMPTS)]
    results = [f.result() for f in futures]
    assert generations == [len(PROMPTS)]
    data, sampled = [], []
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert len(res.sequences) == 3
        for seq in res.sequences:
            assert len(seq.tokens) == len(seq.logprobs) > 0
            data.append(rl_datum(prompt, seq.tokens, advantage=1.0, sampler_logprobs=seq.logprobs))
            sampled.append((len(prompt) - 1, seq.logprobs))
    out = client.forward(data, "importance_sampling").result()
    worst = 0.0
    for (start, q), o in zip(sampled, out.loss_fn_outputs, strict=True):
        lp = o["logprobs"].to_torch()[start:]
        worst = max(worst, float((lp - torch.tensor(q)).abs().max()))
    assert worst <= 1e-4, worst


def test_compute_logprobs_and_prompt_logprobs_equal_plain_forward(trained) -> None:
    client, sampling_client = trained
    prompt = PROMPTS[0]
    got = sampling_client.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    want = plain_logprobs(client, prompt[:-1], prompt[1:])
    assert got[0] is None and len(got) == len(prompt)
    assert torch.allclose(torch.tensor(got[1:]), want, atol=1e-5)
    res = sampling_client.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2),
                                 include_prompt_logprobs=True).result()
    assert res.prompt_logprobs[0] is None
    assert torch.allclose(torch.tensor(res.prompt_logprobs[1:]), want, atol=1e-5)
    res = sampling_client.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2),
                                 prompt_logprobs_last_n=3).result()
    assert res.prompt_logprobs[:-3] == [None] * (len(prompt) - 3) and len(res.sequences) == 1
    assert torch.allclose(torch.tensor(res.prompt_logprobs[-3:]), want[-3:], atol=1e-5)


def test_compute_logprobs_called_together_share_a_generation_and_equal_plain_forward(trained, generations,
                                                                                      monkeypatch) -> None:
    """A KL penalty's reference logprobs, or the SDK's ``compute_logprobs_async`` under ``gather``:
    calls issued before any is waited on run in one generation, prompts of different lengths padded
    together; each equals a plain forward pass of its own prompt alone. The unembedding takes at most
    a chunk of positions at a time, and with ``prompt_logprobs_last_n`` only the positions asked for."""
    from grpo.backends.local import prompt_logprobs, trainer

    client, sampling_client = trained
    head_rows: list[int] = []
    real_head = prompt_logprobs.logit_head

    def counting_head(model):
        head = real_head(model)
        return lambda hidden: head_rows.append(hidden.shape[0]) or head(hidden)

    monkeypatch.setattr(prompt_logprobs, "logit_head", counting_head)
    long_prompt = [1 + (7 * i) % 500 for i in range(300)]  # more positions than one chunk of the head
    other_long = [2 + (11 * i) % 500 for i in range(300)]
    prompts = [*PROMPTS, [1, 77], long_prompt]  # no two begin alike (see the next test for those)
    futures = [sampling_client.compute_logprobs(types.ModelInput.from_ints(p)) for p in prompts]
    last = sampling_client.compute_logprobs(types.ModelInput.from_ints(other_long), prompt_logprobs_last_n=5)
    got = [f.result() for f in futures] + [last.result()]
    assert generations == [len(prompts) + 1]  # one generation, nothing sampled
    assert max(head_rows) <= trainer.LOGIT_CHUNK_POSITIONS
    assert sum(head_rows) == sum(len(p) - 1 for p in prompts) + 5
    for prompt, lp in zip([*prompts, other_long], got, strict=True):
        want = plain_logprobs(client, prompt[:-1], prompt[1:])
        assert len(lp) == len(prompt) and lp[0] is None
        if lp is got[-1]:
            assert lp[:-5] == [None] * (len(prompt) - 5)
            lp, want = [None, *lp[-5:]], want[-5:]
        torch.testing.assert_close(torch.tensor(lp[1:]), want, atol=1e-5, rtol=0)


def test_prompts_that_begin_alike_run_their_beginning_once(trained, monkeypatch) -> None:
    """A GRPO group's reference logprobs (a KL penalty's): the group's prompt, then each sample's
    answer. The decoder takes the shared beginning once and each prompt's rest after it, and each
    prompt's logprobs equal a plain forward pass of it alone."""
    client, sampling_client = trained
    shared = [1 + (13 * i) % 400 for i in range(40)]
    prompts = [shared + [500 + 3 * k + j for j in range(10)] for k in range(4)]
    positions: list[int] = []

    def count(module, args, kwargs):
        positions.append(kwargs["input_ids"].shape[0] * kwargs["input_ids"].shape[1])

    def work():
        with sampling_client.engine.sampling_model(sampling_client.adapter, sampling_client.snapshot) as model:
            handle = model.get_decoder().register_forward_pre_hook(count, with_kwargs=True)
        return handle

    handle = sampling_client.handle.submit(work).result()
    try:
        futures = [sampling_client.compute_logprobs(types.ModelInput.from_ints(p)) for p in prompts]
        got = [f.result() for f in futures]
    finally:
        handle.remove()
    # the 40 shared positions once, then each prompt's other 9 (its last token is only a target)
    assert positions == [40, 4 * 9]
    for prompt, lp in zip(prompts, got, strict=True):
        torch.testing.assert_close(torch.tensor(lp[1:]), plain_logprobs(client, prompt[:-1], prompt[1:]),
                                   atol=1e-5, rtol=0)


def test_a_one_token_sample_with_its_prompt_logprobs_runs_its_prompt_once(trained, generations) -> None:
    """The Tinker SDK's ``compute_logprobs`` over HTTP is a sample of one token that asks for its
    prompt's logprobs. The token is drawn from the logits of the pass that scores the prompt:
    every prompt position goes through the decoder once (no prefill after it), and the samples,
    their logprobs and the prompt logprobs are what a plain forward pass and a seeded sample of
    the same prompt without prompt logprobs give."""
    client, sampling_client = trained
    shared = [1 + (13 * i) % 400 for i in range(40)]
    group = [shared + [500 + 3 * k + j for j in range(10)] for k in range(3)]  # a GRPO group's answers
    prompts = [*PROMPTS, *group, [1]]
    positions: list[int] = []

    def count(module, args, kwargs):
        positions.append(kwargs["input_ids"].numel())

    def work():
        with sampling_client.engine.sampling_model(sampling_client.adapter, sampling_client.snapshot) as model:
            return model.get_decoder().register_forward_pre_hook(count, with_kwargs=True)

    handle = sampling_client.handle.submit(work).result()
    try:
        futures = [sampling_client.sample(types.ModelInput.from_ints(p), 2, types.SamplingParams(
            max_tokens=1, temperature=1.0, seed=20 + i), include_prompt_logprobs=True) for i, p in enumerate(prompts)]
        got = [f.result() for f in futures]
    finally:
        handle.remove()
    assert generations == [len(prompts)]
    # the group's 40 shared positions once and each member's other 10; every other prompt whole
    assert sum(positions) == 40 + 3 * 10 + sum(len(p) for p in PROMPTS) + 1
    for i, (prompt, res) in enumerate(zip(prompts, got, strict=True)):
        alone = sample(sampling_client, prompt, 2, max_tokens=1, temperature=1.0, seed=20 + i).result()
        assert [s.tokens for s in res.sequences] == [s.tokens for s in alone.sequences]
        assert {s.stop_reason for s in res.sequences} == {"length"}
        assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
        for seq in res.sequences:
            want = plain_logprobs(client, prompt, [*prompt[1:], *seq.tokens])
            torch.testing.assert_close(torch.tensor(res.prompt_logprobs[1:] + seq.logprobs), want, atol=1e-5, rtol=0)


def test_prompt_logprobs_of_a_one_token_prompt_are_one_none(trained) -> None:
    _, sampling_client = trained
    assert sampling_client.compute_logprobs(types.ModelInput.from_ints([1])).result() == [None]


# --------------------------------------------------------------------------- stops and seeds (9)


def test_length_limit_and_stop_ids_and_stop_strings(trained, tokenizer) -> None:
    _, sampling_client = trained
    prompt = PROMPTS[0]
    greedy = sample(sampling_client, prompt, 2, max_tokens=8, temperature=0.0).result()
    assert [s.stop_reason for s in greedy.sequences] == ["length", "length"]
    tokens = greedy.sequences[0].tokens
    assert len(tokens) == 8 and greedy.sequences[1].tokens == tokens
    # Stop at the last position k whose token did not appear before it.
    k = max(i for i in range(len(tokens)) if tokens[i] not in tokens[:i])
    by_id = sample(sampling_client, prompt, 1, max_tokens=8, temperature=0.0, stop_token_ids=[tokens[k]]).result()
    assert by_id.sequences[0].tokens == tokens[:k + 1] and by_id.sequences[0].stop_reason == "stop"
    by_stop = sample(sampling_client, prompt, 1, max_tokens=8, temperature=0.0, stop=[tokens[k]]).result()
    assert by_stop.sequences[0].tokens == tokens[:k + 1] and by_stop.sequences[0].stop_reason == "stop"
    # A stop string: the text of the first token whose decoded piece is new in the text so far.
    for j in range(1, len(tokens)):
        piece = tokenizer.decode([tokens[j]])
        if piece.strip() and piece not in tokenizer.decode(tokens[:j]):
            break
    else:
        pytest.skip("greedy continuation has no distinct decodable token")
    by_str = sample(sampling_client, prompt, 1, max_tokens=8, temperature=0.0, stop=[piece]).result()
    assert by_str.sequences[0].tokens == tokens[:j + 1] and by_str.sequences[0].stop_reason == "stop"
    # top_k=1 at any temperature is greedy.
    top1 = sample(sampling_client, prompt, 1, max_tokens=8, temperature=1.0, top_k=1).result()
    assert top1.sequences[0].tokens == tokens


def test_fixed_seed_reproduces_samples_alone_and_in_a_shared_batch(trained, generations) -> None:
    _, sampling_client = trained
    params = dict(max_tokens=12, temperature=1.0, seed=1234)
    alone = sample(sampling_client, PROMPTS[0], 4, **params).result()
    again = sample(sampling_client, PROMPTS[0], 4, **params).result()
    # The same request while other requests (other lengths, other seeds, none) share the batch.
    others = [sample(sampling_client, PROMPTS[1], 3, max_tokens=12, temperature=0.9),
              sample(sampling_client, PROMPTS[2], 2, max_tokens=5, temperature=1.0, seed=5)]
    shared = sample(sampling_client, PROMPTS[0], 4, **params)
    others.append(sample(sampling_client, PROMPTS[1], 1, max_tokens=3, temperature=0.0))
    shared = shared.result()
    [o.result() for o in others]
    assert generations[-1] == 4, generations  # the shared batch really held all four requests
    toks = [[s.tokens for s in r.sequences] for r in (alone, again, shared)]
    assert toks[0] == toks[1] == toks[2]
    assert len({tuple(t) for t in toks[0]}) > 1, "the four samples of one prompt should differ"
    other_seed = sample(sampling_client, PROMPTS[0], 4, **{**params, "seed": 99}).result()
    assert [s.tokens for s in other_seed.sequences] != toks[0]


def test_concurrent_sample_calls_are_batched_into_one_generation(trained, generations) -> None:
    _, sampling_client = trained
    futures = [sample(sampling_client, p, n, max_tokens=4, temperature=1.0) for p, n in zip(PROMPTS, [2, 3, 1],
                                                                                            strict=True)]
    results = [f.result() for f in futures]
    assert generations == [3]
    assert [len(r.sequences) for r in results] == [2, 3, 1]
    assert all(len(s.tokens) == 4 and s.stop_reason == "length" for r in results for s in r.sequences)


def test_a_batch_holds_what_was_issued_before_waiting_however_slowly(trained, generations) -> None:
    """Batch make-up changes float results, so it must follow the calls, not the clock: requests
    issued with pauses between them still share one generation, and give the same bits as ones
    issued back to back."""
    _, sampling_client = trained

    def wave(pause_s: float) -> list:
        futures = []
        for i, p in enumerate(PROMPTS):
            futures.append(sample(sampling_client, p, 3, max_tokens=6, temperature=1.0, seed=40 + i))
            time.sleep(pause_s)
        return [[(s.tokens, s.logprobs) for s in f.result().sequences] for f in futures]

    # A first wave puts the prompts in the sampler's prefix cache, as the two compared find them
    # whichever tests ran before on this worker: a prompt found there has its last token computed
    # in a smaller product than a whole prefill, which can move a logprob's last bit.
    wave(0.0)
    back_to_back, paused = wave(0.0), wave(0.05)
    assert generations == [3, 3, 3]
    assert paused == back_to_back
    # each request on its own is a different batch: waiting closes it
    alone = [[(s.tokens, s.logprobs) for s in sample(sampling_client, p, 3, max_tokens=6, temperature=1.0,
                                                     seed=40 + i).result().sequences] for i, p in enumerate(PROMPTS)]
    assert generations == [3, 3, 3, 1, 1, 1]
    assert [[t for t, _ in r] for r in alone] == [[t for t, _ in r] for r in back_to_back]  # seeds hold


def test_gathered_sample_async_calls_share_one_generation(trained, generations) -> None:
    _, sampling_client = trained

    async def main():
        return await asyncio.gather(*[
            sampling_client.sample_async(types.ModelInput.from_ints(p), 2, types.SamplingParams(max_tokens=3))
            for p in PROMPTS])

    results = asyncio.run(main())
    assert generations == [3]
    assert [len(r.sequences) for r in results] == [2, 2, 2]


def test_requests_nobody_waits_on_still_run(trained, generations) -> None:
    """concurrent.futures.wait looks at no method of the future: the idle timeout closes the batch."""
    import concurrent.futures

    _, sampling_client = trained
    futures = [sample(sampling_client, p, 1, max_tokens=2) for p in PROMPTS[:2]]
    done, _ = concurrent.futures.wait([f._future for f in futures], timeout=30)
    assert len(done) == 2 and generations == [2]


def test_sample_async(trained) -> None:
    _, sampling_client = trained

    async def main():
        prompt = types.ModelInput.from_ints(PROMPTS[1])
        return await asyncio.gather(
            sampling_client.sample_async(prompt, 2, types.SamplingParams(max_tokens=3)),
            sampling_client.compute_logprobs_async(prompt),
        )

    response, logprobs = asyncio.run(main())
    assert isinstance(response, types.SampleResponse) and len(response.sequences) == 2
    assert logprobs[0] is None and len(logprobs) == len(PROMPTS[1])


# --------------------------------------------------------------------------- snapshots vs training


def test_snapshot_sampler_is_unaffected_by_concurrent_training(svc) -> None:
    # Two identical clients; one trains while a sampler of its step-0 weights samples in parallel.
    busy = svc.create_lora_training_client("tiny", seed=11)
    quiet = svc.create_lora_training_client("tiny", seed=11)
    perturb_adapter(busy, 3)
    perturb_adapter(quiet, 3)
    prompt = PROMPTS[0]
    reference = busy.save_weights_and_get_sampling_client()
    want = reference.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    data = [next_token_datum(p, weights=[1.0] * (len(p) - 1)) for p in PROMPTS]
    adam = types.AdamParams(learning_rate=5e-2)
    samples = []
    for _ in range(4):
        busy.forward_backward(data, "cross_entropy")
        samples.append(sample(reference, prompt, 2, max_tokens=6, temperature=1.0))
        busy.optim_step(adam)
        samples.append(reference.compute_logprobs(types.ModelInput.from_ints(prompt)))
        quiet.forward_backward(data, "cross_entropy")
        last = quiet.optim_step(adam)
    results = [f.result() for f in samples]
    last.result()
    for r in results[1::2]:
        assert r == want  # the snapshot's logprobs, bit for bit, at every point of training
    # Training saw only its own weights: identical to the run with no sampler around.
    busy_w, quiet_w = adapter_tensors(busy), adapter_tensors(quiet)
    assert all(torch.equal(busy_w[k], quiet_w[k]) for k in busy_w)
    # The snapshot's sampled logprobs are the step-0 policy's, and a fresh sampler moved on.
    fresh = busy.save_weights_and_get_sampling_client()
    moved = fresh.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert max(abs(a - b) for a, b in zip(moved[1:], want[1:], strict=True)) > 1e-3
    for res in results[0::2]:
        for seq in res.sequences:
            full = prompt + seq.tokens
            step0 = reference.compute_logprobs(types.ModelInput.from_ints(full)).result()
            assert max(abs(a - b) for a, b in zip(step0[len(prompt):], seq.logprobs, strict=True)) <= 1e-4


# --------------------------------------------------------------------------- bad input (12)


def test_sampling_input_errors_name_the_problem(trained, svc, tmp_path) -> None:
    _, sampling_client = trained
    vocab = sampling_client.engine.vocab_size
    with pytest.raises(ValueError, match="prompt is empty"):
        sampling_client.sample(types.ModelInput.empty(), 1, types.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=rf"prompt has token ids outside the vocabulary .*0..{vocab - 1}.*\[{vocab}\]"):
        sample(sampling_client, [1, vocab], max_tokens=2)
    with pytest.raises(ValueError, match="SamplingParams.stop token ids has token ids outside the vocabulary"):
        sample(sampling_client, [1, 2], max_tokens=2, stop_token_ids=[vocab + 1])
    with pytest.raises(ValueError, match="max_tokens must be a positive integer, got 0"):
        sample(sampling_client, [1, 2], max_tokens=0)
    with pytest.raises(ValueError, match="num_samples must be a positive integer"):
        sample(sampling_client, [1, 2], 0, max_tokens=2)
    with pytest.raises(TypeError, match="prompt must be a grpo.types.ModelInput, got list"):
        sampling_client.sample([1, 2], 1, types.SamplingParams(max_tokens=2))
    with pytest.raises(FileNotFoundError, match="holds no adapter_config.json"):
        svc.create_sampling_client(model_path=str(tmp_path))


def test_dropping_finished_rows_early_or_late_gives_the_same_samples(trained, tokenizer) -> None:
    """CPU drops a finished row at once, CUDA only when half the batch is done; the rows that stay
    behind draw no random numbers, so seeded samples and their logprobs are the same either way."""
    client, _ = trained
    stop = list(range(0, 4000))  # ~8% of the vocabulary: rows stop at scattered steps

    def run(compact: str) -> list[list[tuple[list[int], list[float], str]]]:
        requests = [sampler.GenerationRequest(p, 4, types.SamplingParams(max_tokens=6 + 3 * i, temperature=1.0,
                                                                          seed=11 + i, stop=stop))
                    for i, p in enumerate(PROMPTS)]
        with client.engine.use(client.adapter) as model:
            sampler.generate(model, requests, tokenizer, client.engine.device, compact=compact)
        return [[(s.tokens, s.logprobs, s.stop_reason) for s in r.sequences] for r in requests]

    eager, half = run("eager"), run("half")
    lengths = sorted(len(t) for r in eager for t, _, _ in r)
    assert lengths[0] < lengths[-1] and {s for r in eager for *_, s in r} == {"stop", "length"}
    for rows_e, rows_h in zip(eager, half, strict=True):
        for (te, le, se), (th, lh, sh) in zip(rows_e, rows_h, strict=True):
            assert te == th and se == sh
            assert le == pytest.approx(lh, abs=1e-5)


# --------------------------------------------------------------------------- the draw itself


def test_draw_follows_the_distribution_and_never_picks_a_cut_token() -> None:
    """Inverse-CDF sampling (one uniform per row) against the probabilities it draws from."""
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.0, 0.05])
    n = 200_000
    draws = sampler._draw(probs.expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=len(probs)).double()
    assert counts[1] == counts[4] == 0, "a token of zero probability was drawn"
    # Each count is binomial: within 5 standard deviations of n * p.
    sd = (n * probs * (1 - probs)).double().sqrt()
    assert ((counts - n * probs.double()).abs() <= 5 * sd + 1e-9).all(), counts / n
    # Unnormalised rows and a degenerate row; the same seed draws the same tokens.
    rows = torch.tensor([[0.0, 3.0, 1.0], [0.0, 0.0, 2.0]])
    a = sampler._draw(rows.repeat(1000, 1), torch.Generator().manual_seed(5))
    b = sampler._draw(rows.repeat(1000, 1), torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and (a != 0).all() and (a[1::2] == 2).all()
    assert 0.70 < float((a[0::2] == 1).double().mean()) < 0.80


def test_top_k_and_top_p_cut_the_tail_before_the_draw() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    kept_k = sampler._filter_top_k_top_p(logits, 2, 1.0)
    assert torch.isinf(kept_k[0, 2:]).all() and torch.isfinite(kept_k[0, :2]).all()
    kept_p = sampler._filter_top_k_top_p(logits, 0, 0.65)  # 0.4 + 0.3 reach 0.65: the rest goes
    assert torch.isfinite(kept_p[0, :2]).all() and torch.isinf(kept_p[0, 2:]).all()
    draws = sampler._draw(torch.softmax(kept_p, -1).expand(20_000, -1), torch.Generator().manual_seed(1))
    assert set(draws.tolist()) == {0, 1}
    assert abs(float((draws == 0).double().mean()) - 0.4 / 0.7) < 0.02


# --------------------------------------------------------------------------- LoRA folded for sampling


def test_folded_sampling_matches_peft_layers_and_leaves_the_model_as_it_was(trained) -> None:
    """float32 sampling folds LoRA into the base weights; samples and logprobs must be those of
    peft's own LoRA layers, and the module tree and base weights must be untouched afterwards."""
    client, sampling_client = trained
    engine = client.engine
    modules_before = dict(engine.peft_model.named_modules())
    base_before = {n: p.detach().clone() for n, p in engine.peft_model.named_parameters() if "lora_" not in n}
    params = dict(max_tokens=10, temperature=1.0, seed=3)

    def draw(fold: bool):
        engine.fold_lora_for_sampling = fold
        try:
            return [sample(sampling_client, p, 3, **params).result() for p in PROMPTS]
        finally:
            engine.fold_lora_for_sampling = True

    folded, unfolded = draw(True), draw(False)
    assert engine._folded is not None and engine._folded.key[0] == client.adapter
    if packing_works(torch.float32):  # siblings folded into one stacked, packed weight (one call each)
        from grpo.models.fused_projections import FusedMember

        siblings = {n: m for n, m in engine._folded.replacements.items()
                    if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
        assert siblings and all(type(m) is FusedMember for m in siblings.values())
        assert {len(m.group.sizes) for m in siblings.values()} == {2, 3}
    for rf, ru in zip(folded, unfolded, strict=True):
        for sf, su in zip(rf.sequences, ru.sequences, strict=True):
            assert sf.tokens == su.tokens
            assert sf.logprobs == pytest.approx(su.logprobs, abs=1e-5)
    assert dict(engine.peft_model.named_modules()) == modules_before
    for n, p in engine.peft_model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n
    got = sampling_client.compute_logprobs(types.ModelInput.from_ints(PROMPTS[0])).result()
    assert torch.allclose(torch.tensor(got[1:]), plain_logprobs(client, PROMPTS[0][:-1], PROMPTS[0][1:]), atol=1e-5)


def test_lora_is_folded_only_into_float32_weights() -> None:
    from grpo.backends.local.folded_lora import can_fold

    svc = ServiceClient(device="cpu", dtype="bfloat16")
    client = svc.create_lora_training_client("tiny", seed=0, rank=4)
    assert not can_fold(client.engine.peft_model, client.adapter)
    # ... and sampling through peft's layers still works there
    res = client.save_weights_and_get_sampling_client().sample(
        types.ModelInput.from_ints(PROMPTS[1]), 2, types.SamplingParams(max_tokens=3, seed=0)).result()
    assert client.engine._folded is None and all(len(s.tokens) == 3 for s in res.sequences)
