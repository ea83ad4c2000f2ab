"""The local TrainingClient on the tiny model: logprobs, gradients, optimizer, LoRA targets, errors."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from backend_helpers import (
    adapter_tensors,
    next_token_datum,
    perturb_adapter,
    plain_entropy,
    plain_logprobs,
    rl_datum,
)

from grpo import models, types
from grpo.backends.local import ServiceClient, trainer
from grpo.models import native_kernels

PROMPT = [1, 504, 3458, 314, 253, 1345, 28]
RESPONSE = [216, 1023, 30, 4589, 17, 2]


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> ServiceClient:
    """One tiny engine for the whole module; each test adds its own adapter(s) to it. CPU fp32:
    the comparisons below are at fp32 tolerances."""
    return ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), device="cpu", dtype="float32")


def new_client(svc: ServiceClient, seed: int = 0, perturb: int | None = 1, **kwargs):
    client = svc.create_lora_training_client("tiny", seed=seed, **kwargs)
    if perturb is not None:
        perturb_adapter(client, perturb)
    return client


def clear_grads(client) -> None:
    with client.engine.lock:
        for p in client.engine.adapter_parameters(client.adapter).values():
            p.grad = None


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    """Equal up to float32 summation order, measured against the tensor's own scale."""
    return float((a - b).abs().max()) <= rel * float(a.abs().max()) + 1e-9


def grad_sum(client) -> dict[str, torch.Tensor]:
    return {k: v for k, v in adapter_tensors(client, "grad").items() if v is not None}


# --------------------------------------------------------------------------- logprobs (2)


def test_forward_backward_logprobs_equal_plain_forward(svc) -> None:
    client = new_client(svc)
    seqs = [PROMPT + RESPONSE, PROMPT[:3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    data = [next_token_datum(s, weights=[1.0] * (len(s) - 1)) for s in seqs]
    out = client.forward_backward(data, "cross_entropy").result()
    total = 0.0
    for seq, o in zip(seqs, out.loss_fn_outputs, strict=True):
        want = plain_logprobs(client, seq[:-1], seq[1:])
        got = o["logprobs"].to_torch()
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
        total += -float(want.sum())
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    # forward() gives the same numbers and leaves no gradient behind.
    clear_grads(client)
    fwd = client.forward(data, "cross_entropy").result()
    assert torch.allclose(fwd.loss_fn_outputs[0]["logprobs"].to_torch(), out.loss_fn_outputs[0]["logprobs"].to_torch(),
                          atol=1e-6)
    assert not grad_sum(client)


def test_importance_sampling_loss_without_weights_counts_nonzero_advantages(svc) -> None:
    client = new_client(svc)
    seq = PROMPT + RESPONSE
    n = len(seq) - 1
    q = [-10.0 + 0.5 * i for i in range(n)]
    adv = [0.0] * 3 + [1.5, -0.5, 0.0, 2.0] + [0.25] * (n - 7)
    datum = next_token_datum(seq, logprobs=q, advantages=adv)
    out = client.forward([datum], "importance_sampling").result()
    lp = plain_logprobs(client, seq[:-1], seq[1:]).double()
    want = -sum(math.exp(lp[i] - q[i]) * adv[i] for i in range(n) if adv[i] != 0)
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)


def test_entropy_metric_is_mean_over_counted_positions(svc) -> None:
    client = new_client(svc)
    seq = PROMPT + RESPONSE
    datum = rl_datum(PROMPT, RESPONSE, advantage=1.0, sampler_logprobs=[-3.0] * len(RESPONSE))
    out = client.forward([datum], "importance_sampling").result()
    ent = plain_entropy(client, seq[:-1])[len(PROMPT) - 1:]
    assert out.metrics["entropy:mean"] == pytest.approx(float(ent.mean()), rel=1e-5)


# --------------------------------------------------------------------------- gradients (4, 10, micro-batches)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_weight_zero_tokens_contribute_no_gradient(svc, loss_fn) -> None:
    client = new_client(svc)
    q = [-2.0] * len(RESPONSE)
    base = rl_datum(PROMPT, RESPONSE, advantage=0.7, sampler_logprobs=q)
    # Same datum, but the weight-0 (prompt) positions get wild advantages and sampler logprobs.
    n_prompt = len(PROMPT) - 1
    inputs = {k: v.tolist() for k, v in base.loss_fn_inputs.items()}
    inputs["advantages"][:n_prompt] = [5.0, -3.0, 100.0, 1.0, -7.0, 2.0][:n_prompt]
    inputs["logprobs"][:n_prompt] = [-50.0] * n_prompt
    poked = types.Datum(model_input=base.model_input, loss_fn_inputs=inputs)

    clear_grads(client)
    a = client.forward_backward([base], loss_fn).result()
    grads_a = grad_sum(client)
    clear_grads(client)
    b = client.forward_backward([poked], loss_fn).result()
    grads_b = grad_sum(client)
    clear_grads(client)
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    assert grads_a.keys() == grads_b.keys() and grads_a
    assert any(g.abs().sum() > 0 for g in grads_a.values())
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_gradients_equal_plain_autograd_through_full_logits(svc, loss_fn, monkeypatch) -> None:
    """The trainer never holds a batch's logits and backpropagates the unembedding chunk by chunk;
    its gradients must be those of the textbook computation: full-vocabulary logits of one plain
    forward, log_softmax, the loss formula, backward. LoRA sits on lm_head too (train_unembed)."""
    from grpo.api import losses

    client = new_client(svc, seed=4)
    gen = torch.Generator().manual_seed(2)
    # A GRPO group (its prompt is run once, shared) plus two datums of their own; chunks of 5
    # positions, so the unembedding runs in several pieces that cross datum boundaries.
    monkeypatch.setattr(trainer, "LOGIT_CHUNK_POSITIONS", 5)
    prompt = PROMPT + [40, 41, 42, 43]
    assert len(prompt) - 1 >= trainer.MIN_SHARED_PREFIX
    responses = [RESPONSE, RESPONSE[::-1] + [9, 10], [77] * 9, RESPONSE[:2]]
    data = [rl_datum(prompt, r, advantage=a, sampler_logprobs=(torch.randn(len(r), generator=gen) - 3).tolist())
            for r, a in zip(responses, [1.0, -0.5, 0.25, -0.75], strict=True)]
    data += [rl_datum([5, 6, 7], [8, 9, 10, 11], advantage=0.6, sampler_logprobs=[-2.5] * 4, weight=0.5),
             rl_datum(PROMPT[:4], RESPONSE, advantage=-1.2, sampler_logprobs=[-1.0] * len(RESPONSE))]
    clear_grads(client)
    out = client.forward_backward(data, loss_fn).result()
    got = grad_sum(client)
    clear_grads(client)

    cfg = losses.resolve_config(loss_fn, None)
    want_loss = 0.0
    with client.engine.use(client.adapter):
        model = client.engine.causal_lm()
        for d in data:
            tokens = torch.tensor([d.model_input.to_ints()])
            targets = d.loss_fn_inputs["target_tokens"].to_torch().long()
            inputs = {k: v.to_torch().float() for k, v in d.loss_fn_inputs.items() if k != "target_tokens"}
            logits = model(input_ids=tokens).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
            loss = losses.LOSSES[loss_fn](lp, inputs, cfg)
            loss.backward()
            want_loss += float(loss)
    want = grad_sum(client)
    clear_grads(client)
    assert out.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert want.keys() == got.keys() and any("lm_head" in k for k in want)
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3
    for name in want:
        assert close(want[name], got[name], rel=1e-4), (name, float((want[name] - got[name]).abs().max()))


def test_two_forward_backward_calls_equal_one_over_both_halves(svc) -> None:
    seqs = [PROMPT + RESPONSE, PROMPT[:4] + RESPONSE[:2], [9, 8, 7, 6, 5, 4], PROMPT + [11, 12]]
    data = [rl_datum(s[:3], s[3:], advantage=a, sampler_logprobs=[-4.0] * (len(s) - 3))
            for s, a in zip(seqs, [1.0, -0.5, 0.3, 2.0], strict=True)]
    split = new_client(svc, seed=3)
    whole = new_client(svc, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(adapter_tensors(split).values(), adapter_tensors(whole).values(),
                                                 strict=True))
    l1 = split.forward_backward(data[:2], "importance_sampling").result().metrics["loss:sum"]
    l2 = split.forward_backward(data[2:], "importance_sampling").result().metrics["loss:sum"]
    lw = whole.forward_backward(data, "importance_sampling").result().metrics["loss:sum"]
    assert l1 + l2 == pytest.approx(lw, rel=1e-6)
    g_split, g_whole = grad_sum(split), grad_sum(whole)
    for name in g_whole:
        assert close(g_whole[name], g_split[name]), name
    # A large eps keeps Adam's g / |g| from turning float noise on near-zero grads into +-lr.
    adam = types.AdamParams(learning_rate=1e-2, eps=1e-3)
    split.optim_step(adam).result()
    whole.optim_step(adam).result()
    w_split, w_whole = adapter_tensors(split), adapter_tensors(whole)
    for name in w_whole:
        assert torch.allclose(w_split[name], w_whole[name], rtol=0, atol=1e-6), name
    assert not grad_sum(split), "optim_step must clear the gradients"


def test_micro_batches_give_the_same_loss_and_grads(svc) -> None:
    seqs = [PROMPT + RESPONSE, PROMPT[:2] + RESPONSE, [5] * 3, PROMPT + RESPONSE + RESPONSE, [3, 4]]
    data = [next_token_datum(s, weights=[1.0] * (len(s) - 1)) for s in seqs]
    prepared = trainer.prepare(data, "cross_entropy", 10**6, lambda *_: None)
    assert len(trainer.micro_batches(prepared, 8)) >= 3  # the small budget really splits
    client = new_client(svc)
    one = client.forward_backward(data, "cross_entropy").result()
    g_one = grad_sum(client)
    clear_grads(client)
    old = svc.micro_batch_tokens
    svc.micro_batch_tokens = 8
    try:
        many = client.forward_backward(data, "cross_entropy").result()
    finally:
        svc.micro_batch_tokens = old
    g_many = grad_sum(client)
    clear_grads(client)
    assert many.metrics["loss:sum"] == pytest.approx(one.metrics["loss:sum"], rel=1e-6)
    for a, b in zip(one.loss_fn_outputs, many.loss_fn_outputs, strict=True):
        assert torch.allclose(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-5)
    for name in g_one:
        assert close(g_one[name], g_many[name]), name


# --------------------------------------------------------------------------- optimizer (5, grad norm)


def test_bf16_engine_trains_like_float32(svc) -> None:
    """A CUDA GPU trains in bf16 (CI has none): the same step on a bf16 engine on the CPU, same
    adapter init and data, must give the float32 loss and gradients up to bf16 rounding, and its
    sampler's logprobs must stay within bf16 noise of its trainer's."""
    bf16 = ServiceClient(device="cpu", dtype="bfloat16")
    clients = {"fp32": new_client(svc, seed=5), "bf16": new_client(bf16, seed=5)}
    prompt = PROMPT + [40, 41, 42, 43]  # long enough to be shared by the group
    sampled = clients["bf16"].save_weights_and_get_sampling_client().sample(
        types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=8, seed=0)).result()
    data = [rl_datum(prompt, s.tokens, advantage=0.5 - 0.3 * i, sampler_logprobs=s.logprobs)
            for i, s in enumerate(sampled.sequences)]
    out, grads = {}, {}
    for name, client in clients.items():
        clear_grads(client)
        out[name] = client.forward_backward(data, "ppo").result()
        grads[name] = grad_sum(client)
        clear_grads(client)
    assert out["bf16"].metrics["loss:sum"] == pytest.approx(out["fp32"].metrics["loss:sum"], rel=5e-3)
    flat = {k: torch.cat([g.float().flatten() for _, g in sorted(v.items())]) for k, v in grads.items()}
    cosine = float(torch.nn.functional.cosine_similarity(flat["bf16"], flat["fp32"], dim=0))
    assert cosine > 0.999, cosine
    n = len(prompt) - 1
    worst = max(float((o["logprobs"].to_torch()[n:] - torch.tensor(s.logprobs)).abs().max())
                for o, s in zip(out["bf16"].loss_fn_outputs, sampled.sequences, strict=True))
    assert worst < 1e-2, worst


def test_cross_entropy_twenty_steps_halve_the_loss(svc) -> None:
    client = new_client(svc, perturb=None, rank=8)
    seqs = [PROMPT + RESPONSE, [1, 42, 43, 44, 45, 46, 47, 48, 2]]
    data = [next_token_datum(s, weights=[1.0] * (len(s) - 1)) for s in seqs]
    adam = types.AdamParams(learning_rate=1e-2)
    first = client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    client.optim_step(adam)
    for _ in range(19):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(adam)
    last = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert last <= 0.5 * first, (first, last)


def test_optim_step_reports_the_pre_clip_grad_norm_and_applies_adamw(svc) -> None:
    client = new_client(svc)
    data = [rl_datum(PROMPT, RESPONSE, advantage=1.0, sampler_logprobs=[-5.0] * len(RESPONSE))]
    client.forward_backward(data, "importance_sampling").result()
    grads = grad_sum(client)
    before = adapter_tensors(client)
    want_norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()])))
    lr, eps = 1e-3, 1e-8
    out = client.optim_step(types.AdamParams(learning_rate=lr, eps=eps, grad_clip_norm=want_norm / 10)).result()
    assert out.metrics["grad_norm"] == pytest.approx(want_norm, rel=1e-5)
    after = adapter_tensors(client)
    # First AdamW step with bias correction: p -= lr * g / (|g| + eps), whatever the clipping scale.
    for name, g in grads.items():
        g = g / 10  # clipped
        step = lr * g / (g.abs() + eps)
        assert torch.allclose(after[name], before[name] - step, atol=1e-7), name


def test_async_twins(svc) -> None:
    client = new_client(svc)
    data = [rl_datum(PROMPT, RESPONSE, advantage=1.0, sampler_logprobs=[-5.0] * len(RESPONSE))]

    async def main():
        fb_future = await client.forward_backward_async(data, "importance_sampling")
        opt_future = await client.optim_step_async(types.AdamParams(learning_rate=1e-3))
        return await fb_future, await opt_future.result_async()

    fb, opt = asyncio.run(main())
    assert isinstance(fb, types.ForwardBackwardOutput) and math.isfinite(fb.metrics["loss:sum"])
    assert opt.metrics["grad_norm"] > 0


# --------------------------------------------------------------------------- LoRA targets (6)


def lora_count(fan_in: int, fan_out: int, rank: int) -> int:
    return rank * (fan_in + fan_out)


@pytest.mark.parametrize(
    ("rank", "attn", "mlp", "unembed"),
    [(4, True, True, True), (2, True, False, False), (3, False, True, False), (5, False, False, True),
     (8, True, True, False)],
)
def test_train_flags_and_rank_select_modules_and_parameter_count(svc, tokenizer, rank, attn, mlp, unembed) -> None:
    cfg = models.TINY_CONFIG
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    vocab = len(tokenizer)
    attn_mods = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden)}
    mlp_mods = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    want_modules, want_count = set(), 0
    for layer in range(layers):
        for block, mods, on in (("self_attn", attn_mods, attn), ("mlp", mlp_mods, mlp)):
            if on:
                for proj, (fi, fo) in mods.items():
                    want_modules.add(f"model.layers.{layer}.{block}.{proj}")
                    want_count += lora_count(fi, fo, rank)
    if unembed:
        want_modules.add("lm_head")
        want_count += lora_count(hidden, vocab, rank)

    # A second client on the same engine must get the same modules as the first one did.
    client = new_client(svc, perturb=None, rank=rank, train_attn=attn, train_mlp=mlp, train_unembed=unembed)
    assert set(client.engine.peft_model.peft_config[client.adapter].target_modules) == want_modules
    assert client.num_trainable_parameters() == want_count
    adapted = {n.split(".lora_")[0].removeprefix("base_model.model.")
               for n in client.engine.adapter_parameters(client.adapter)}
    assert adapted == want_modules
    assert client.get_info().lora_rank == rank


def test_no_trainable_module_is_an_error(svc) -> None:
    with pytest.raises(ValueError, match="train_mlp, train_attn and train_unembed are all false: at least one must be true"):
        svc.create_lora_training_client("tiny", train_attn=False, train_mlp=False, train_unembed=False)
    with pytest.raises(ValueError, match="rank must be a positive integer, got 0"):
        svc.create_lora_training_client("tiny", rank=0)


def test_clients_on_one_engine_train_independently(svc) -> None:
    a = new_client(svc)
    b = new_client(svc)
    before = adapter_tensors(a)
    data = [next_token_datum(PROMPT, weights=[1.0] * (len(PROMPT) - 1))]
    b.forward_backward(data, "cross_entropy")
    b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert all(torch.equal(before[k], v) for k, v in adapter_tensors(a).items())
    assert not all(torch.equal(adapter_tensors(a)[k], v) for k, v in adapter_tensors(b).items() if "lora_B" in k)


# --------------------------------------------------------------------------- bad input (12)


def test_training_input_errors_name_the_problem(svc) -> None:
    client = new_client(svc, perturb=None)
    good = next_token_datum(PROMPT, weights=[1.0] * (len(PROMPT) - 1))
    with pytest.raises(ValueError, match=r"missing loss input\(s\) \['logprobs', 'advantages'\] required by "
                                         r"loss_fn='importance_sampling'"):
        client.forward_backward([good], "importance_sampling")
    with pytest.raises(ValueError, match=r"unknown loss_fn 'reinforce'; valid: cross_entropy, importance_sampling"):
        client.forward_backward([good], "reinforce")
    vocab = client.engine.vocab_size
    bad_input = next_token_datum([1, 2, vocab + 5, 4], weights=[1.0] * 3)
    with pytest.raises(ValueError, match=rf"data\[0\].model_input has token ids outside the vocabulary.*0..{vocab - 1}"):
        client.forward_backward([bad_input], "cross_entropy")
    bad_target = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                             loss_fn_inputs={"target_tokens": [2, -1], "weights": [1.0, 1.0]})
    with pytest.raises(ValueError, match=r"data\[1\].loss_fn_inputs\['target_tokens'\] has token ids outside"):
        client.forward_backward([good, bad_target], "cross_entropy")
    with pytest.raises(ValueError, match="non-empty list of Datum"):
        client.forward_backward([], "cross_entropy")
    with pytest.raises(ValueError, match=r"data\[0\] has an empty model_input"):
        client.forward_backward([types.Datum(model_input=types.ModelInput.empty(),
                                             loss_fn_inputs={"target_tokens": []})], "cross_entropy")
    with pytest.raises(TypeError, match="optim_step takes grpo.types.AdamParams"):
        client.optim_step({"learning_rate": 1e-3})
    # Nothing above touched the gradients.
    assert not grad_sum(client)


def test_cpu_logit_chunks_stay_under_the_heap_ceiling() -> None:
    """On a CPU, where PyTorch's operators take the logits, a chunk's float32 logits stay under
    CPU_LOGIT_CHUNK_BYTES (reused heap memory, heap.py) within [CPU_MIN_CHUNK_POSITIONS,
    LOGIT_CHUNK_POSITIONS]; the native loss head and other devices take LOGIT_CHUNK_POSITIONS.
    Together the slices cover every position once."""
    def widths(vocab: int, device: str = "cpu", n: int = 1000, native_head: bool = False) -> set[int]:
        lm_head = torch.nn.Linear(4, vocab, bias=False, device="meta")
        slices = trainer._chunks(n, lm_head, torch.empty(n, 4, device=device), native_head)
        assert [i for sl in slices for i in range(n)[sl]] == list(range(n))
        return {len(range(n)[sl]) for sl in slices[:-1]}

    assert widths(49152) == {128}  # SmolLM2's vocabulary: 24 MiB of float32 logits
    assert 128 * 49152 * 4 <= trainer.CPU_LOGIT_CHUNK_BYTES < 32 * 2**20
    assert widths(1000) == {trainer.LOGIT_CHUNK_POSITIONS}
    assert widths(1_000_000) == {trainer.CPU_MIN_CHUNK_POSITIONS}
    assert widths(49152, device="meta") == {trainer.LOGIT_CHUNK_POSITIONS}
    assert widths(262144, native_head=True) == widths(49152, native_head=True) == {trainer.LOGIT_CHUNK_POSITIONS}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_native_loss_head_takes_whole_chunks_and_computes_the_same(dtype, monkeypatch) -> None:
    """The counted positions reach the native loss head in whole chunks on a CPU; the logprobs are
    those of smaller chunks (the same rows, other slices)."""
    if native_kernels.kernels() is None:
        pytest.skip("grpo's native kernels are not built here")
    client = ServiceClient(device="cpu", dtype=dtype).create_lora_training_client("tiny", seed=0, rank=4)
    widths: list[int] = []
    real = trainer._chunks
    monkeypatch.setattr(trainer, "_chunks", lambda n, lm_head, hidden, native_head=False: widths.append(native_head)
                        or real(n, lm_head, hidden, native_head))
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(3, 3 + n))),
                        loss_fn_inputs={"target_tokens": list(range(4, 4 + n)), "weights": [1.0] * n})
            for n in (150, 170, 90)]
    whole = client.forward(data, "cross_entropy").result()
    assert any(widths)  # (the counted positions through the native head; a shared prefix's through PyTorch's)
    monkeypatch.setattr(trainer, "LOGIT_CHUNK_POSITIONS", 64)
    split = client.forward(data, "cross_entropy").result()
    for a, b in zip(whole.loss_fn_outputs, split.loss_fn_outputs, strict=True):  # (a product's rows may sum in
        assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-5)  # another order)


# --------------------------------------------------------------------------- unloading (1)


@pytest.mark.parametrize("sample_dtype", ["fp32", "bf16"])
def test_unloading_clients_frees_their_adapters_and_leaves_the_rest_as_it_was(tmp_path, sample_dtype) -> None:
    """What grpo.serve does for a finished session: a training client and a sampling client of
    saved weights unloaded after both sampled (so the sampler's folded or bf16 copy holds one of
    them); the other client samples and trains exactly as before, the saved weights still load."""
    service = ServiceClient(checkpoint_dir=tmp_path, device="cpu", train_dtype="fp32", sample_dtype=sample_dtype)
    a, b = new_client(service, seed=0, perturb=1), new_client(service, seed=1, perturb=2)
    prompt, params = types.ModelInput.from_ints(PROMPT), types.SamplingParams(max_tokens=8, temperature=1.0, seed=5)

    def draws(client) -> list[tuple[list[int], list[float]]]:
        return [(list(s.tokens), list(s.logprobs)) for s in client.sample(prompt, 2, params).result().sequences]

    a_sampler = a.save_weights_and_get_sampling_client()
    a_before = draws(a_sampler)
    path = b.save_weights_for_sampler("b").result().path
    b_sampler = service.create_sampling_client(model_path=path)
    b_draws = draws(b_sampler)  # the sampler's copy now holds b's weights
    assert b_draws != a_before  # the adapters differ: the comparisons below can fail

    engine = a.engine
    service.unload(b_sampler)
    service.unload(b)
    service.unload(a_sampler)  # sampling a's own weights: holds no adapter of its own
    assert set(engine.versions) == set(engine.peft_model.peft_config) == {a.adapter}
    assert not [n for n, _ in engine.peft_model.named_parameters()
                if f".{b.adapter}." in n or f".{b_sampler.adapter}." in n]
    assert draws(a_sampler) == a_before
    a.forward_backward([next_token_datum(PROMPT, weights=[1.0] * (len(PROMPT) - 1))], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    b_again = service.create_sampling_client(model_path=path)
    assert draws(b_again) == b_draws  # checkpoints stay
    service.unload(b_again)
    # the last adapter too: the model is the plain base model again, and takes new adapters
    service.unload(a)
    assert engine.peft_model is None and not engine.versions
    assert not [m for m in engine.model.modules() if "lora" in type(m).__name__.lower()]
    c = new_client(service, seed=0, perturb=1)
    assert draws(c.save_weights_and_get_sampling_client()) == a_before  # a's seed and weights, a's draws
    c.forward_backward([next_token_datum(PROMPT, weights=[1.0] * (len(PROMPT) - 1))], "cross_entropy").result()
    service.close()
