"""Packed training micro-batches: sequences back to back in one row, attention kept apart.

References: each sequence run alone through the same decoder (transformers' own attention), and
the trainer's padded path (``packed=False``), which test_local_backend and test_prefix_sharing
check against plain forward passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from backend_helpers import adapter_tensors, perturb_adapter
from test_prefix_sharing import grpo_batch
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from grpo import models
from grpo.backends.local import ServiceClient, packed_attention, trainer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return models.load_model("tiny", CPU, torch.float32)


def _random_ids(gen: torch.Generator, lengths: list[int], vocab: int) -> list[torch.Tensor]:
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]


def _alone(decoder, ids: torch.Tensor) -> torch.Tensor:
    return decoder(input_ids=ids[None]).last_hidden_state[0]


def assert_same_gradients(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    """Equal to float32 rounding; a square-sum loss makes large gradients, so the rounding allowed
    scales with them (and they must be large enough for the check to bite)."""
    scale = max(float(g.abs().max()) for g in want)
    assert scale > 0.1
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5 * scale, rtol=1e-4)


def test_packed_sequences_equal_each_sequence_run_alone(tiny) -> None:
    decoder = tiny.get_decoder()
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 17, 1, 30, 9, 12, 2]  # unsorted, a single token, blocks of several sizes
    seqs = _random_ids(gen, lengths, 4000)
    packed = packed_attention.PackedPass(lengths, CPU)
    assert len(packed.blocks) > 1
    with torch.no_grad():
        got = torch.split(packed.run(decoder, torch.cat(seqs)), lengths)
        for ids, hidden in zip(seqs, got, strict=True):
            torch.testing.assert_close(hidden, _alone(decoder, ids), atol=1e-5, rtol=1e-4)
    # the model's own attention is back once the pass is over
    assert decoder.config._attn_implementation != packed_attention.IMPLEMENTATION


def test_answers_continuing_their_prompt_equal_the_whole_sequences_and_get_its_gradient(tiny) -> None:
    """Prompts, then answers each continuing one of them, in one pass: each answer equals its
    whole sequence run alone, and the prompts get the answers' gradients as through a KV cache."""
    decoder = tiny.get_decoder()
    gen = torch.Generator().manual_seed(2)
    prompts = _random_ids(gen, [7, 11], 4000)
    owners, suffix_lengths = [0, 1, 0, 1, 0], [4, 3, 9, 1, 6]
    suffixes = _random_ids(gen, suffix_lengths, 4000)
    params = [p for p in tiny.parameters() if p.requires_grad]

    lengths = [7, 11, *suffix_lengths]
    one = packed_attention.PackedPass(lengths, CPU, continues=[None, None, *owners])
    hidden = torch.split(one.run(decoder, torch.cat([*prompts, *suffixes])), lengths)
    loss = sum(h.square().sum() for h in hidden[2:]) + sum(h.sum() for h in hidden[:2])
    got_grads = torch.autograd.grad(loss, params)

    want = [_alone(decoder, torch.cat([prompts[u], s]))[len(prompts[u]):] for u, s in zip(owners, suffixes, strict=True)]
    for h, ref in zip(hidden[2:], want, strict=True):
        torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-4)
    ref_loss = sum(h.square().sum() for h in want) + sum(_alone(decoder, p).sum() for p in prompts)
    assert_same_gradients(got_grads, torch.autograd.grad(ref_loss, params))


def test_sequences_continuing_earlier_ones_of_the_same_pass_equal_the_whole_sequences(tiny) -> None:
    """The trainer's one-call layout: a trunk, prompts continuing it, suffixes continuing the
    prompts, all in one pass (``continues``), interleaved out of order; each equals its whole
    sequence run alone, gradients included."""
    decoder = tiny.get_decoder()
    gen = torch.Generator().manual_seed(4)
    trunk = _random_ids(gen, [9], 4000)[0]
    prompts = _random_ids(gen, [5, 1, 8], 4000)
    owners, suffix_lengths = [2, 0, 1, 0, 2, 2], [4, 3, 9, 1, 6, 2]
    suffixes = _random_ids(gen, suffix_lengths, 4000)
    params = [p for p in tiny.parameters() if p.requires_grad]

    # sequence 0 the trunk, 1-3 the prompts, 4-9 the suffixes
    lengths = [9, 5, 1, 8, *suffix_lengths]
    one = packed_attention.PackedPass(lengths, CPU, continues=[None, 0, 0, 0, *(1 + u for u in owners)])
    hidden = torch.split(one.run(decoder, torch.cat([trunk, *prompts, *suffixes])), lengths)
    assert one.position_ids[0, 9:14].tolist() == [9, 10, 11, 12, 13]  # prompt 0 after the trunk
    assert one.position_ids[0, 23:27].tolist() == [17, 18, 19, 20]  # suffix 0 after trunk 9 + prompt 8
    loss = sum(h.square().sum() for h in hidden[4:]) + sum(h.sum() for h in hidden[:4])
    got_grads = torch.autograd.grad(loss, params)

    whole = [torch.cat([trunk, prompts[u], s]) for u, s in zip(owners, suffixes, strict=True)]
    want = [_alone(decoder, ids)[9 + len(prompts[u]):] for u, ids in zip(owners, whole, strict=True)]
    want_prompts = [_alone(decoder, torch.cat([trunk, p]))[9:] for p in prompts]
    want_trunk = _alone(decoder, trunk)
    for h, ref in zip(hidden, [want_trunk, *want_prompts, *want], strict=True):
        torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-4)
    ref_loss = sum(h.square().sum() for h in want) + sum(h.sum() for h in want_prompts) + want_trunk.sum()
    assert_same_gradients(got_grads, torch.autograd.grad(ref_loss, params))


def test_a_sequence_can_continue_only_an_earlier_one_of_its_pass() -> None:
    with pytest.raises(ValueError, match=r"continues\[1\] = 1"):
        packed_attention.PackedPass([3, 4], CPU, continues=[None, 1])
    with pytest.raises(ValueError, match="2 entries for 3 sequences"):
        packed_attention.PackedPass([3, 4, 2], CPU, continues=[None, 0])


def test_sliding_window_attention_is_windowed_as_transformers_does() -> None:
    config = MistralConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
                           attn_implementation="sdpa")
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    assert packed_attention.supports(model)
    decoder = model.get_decoder()
    gen = torch.Generator().manual_seed(3)
    lengths = [12, 3, 20]  # longer than the window
    seqs = _random_ids(gen, lengths, 500)
    with torch.no_grad():
        got = torch.split(packed_attention.PackedPass(lengths, CPU).run(decoder, torch.cat(seqs)), lengths)
        for ids, hidden in zip(seqs, got, strict=True):
            torch.testing.assert_close(hidden, _alone(decoder, ids), atol=1e-5, rtol=1e-4)
        # the window matters here: without it the long sequences' last positions differ
        config.sliding_window = None
        assert not torch.allclose(got[2][-1], _alone(decoder, seqs[2])[-1], atol=1e-3)


def test_gemma2_packs_its_capped_scores_and_windows_as_its_own_attention_computes_them() -> None:
    """Gemma 2 caps its attention scores (softcap * tanh(score / softcap)) and windows every other
    layer: packed (grpo's kernel on a CPU), each sequence comes out as the model's own eager
    attention computes it alone -- and the cap and the window both matter at these sizes."""
    config = Gemma2Config(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                          attn_logit_softcapping=0.5, attn_implementation="eager")
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    decoder = model.get_decoder()
    with torch.no_grad():  # (scores of a few units, where a cap of 0.5 bites: initial weights make them ~0)
        for layer in decoder.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.k_proj.weight.mul_(30.0)
    assert packed_attention.supports(model)
    lengths = [12, 3, 20]  # longer than the window
    seqs = _random_ids(torch.Generator().manual_seed(3), lengths, 500)
    with torch.no_grad():
        packed = packed_attention.PackedPass(lengths, CPU)
        got = torch.split(packed.run(decoder, torch.cat(seqs)), lengths)
        assert packed._native_plan is not None  # (the kernel ran)
        for ids, hidden in zip(seqs, got, strict=True):
            torch.testing.assert_close(hidden, _alone(decoder, ids), atol=1e-5, rtol=1e-4)
        # each left out of the packed pass, its last sequence's last position moves
        for name in ("attn_logit_softcapping", "sliding_window"):
            kept = [getattr(layer.self_attn, name) for layer in decoder.layers]
            assert any(kept)
            for layer in decoder.layers:
                setattr(layer.self_attn, name, None)
            without = packed_attention.PackedPass(lengths, CPU).run(decoder, torch.cat(seqs))
            for layer, value in zip(decoder.layers, kept, strict=True):
                setattr(layer.self_attn, name, value)
            assert not torch.allclose(without[-1], got[2][-1], atol=1e-3), name


def test_attention_that_bypasses_the_interface_is_an_error_not_mixed_sequences(tiny) -> None:
    decoder = tiny.get_decoder()
    layer = decoder.layers[0].self_attn
    original = layer.forward

    def plain_forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        before = layer.config._attn_implementation
        layer.config._attn_implementation = "sdpa"
        try:
            return original(hidden_states, position_embeddings, attention_mask, **kwargs)
        finally:
            layer.config._attn_implementation = before

    layer.forward = plain_forward  # as a model with its own attention code would behave
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match="1 of|attention interface"):
            packed_attention.PackedPass([3, 4], CPU).run(decoder, torch.arange(3, 10))
    finally:
        del layer.forward


def test_packed_partition_fills_the_budget_whatever_the_lengths() -> None:
    lengths = [1, 1, 1, 1, 40, 40]
    padded = trainer.partition(lengths, lambda n: None, lambda n: 0, lambda n: n, 90)
    packed = trainer.partition(lengths, lambda n: None, lambda n: 0, lambda n: n, 90, packed=True)
    assert [len(b) for b in padded] == [4, 2]  # the short ones are not padded to 40
    assert packed == [lengths]  # 84 real tokens: one batch
    assert [len(b) for b in trainer.partition(lengths, lambda n: None, lambda n: 0, lambda n: n, 60, packed=True)] \
        == [5, 1]  # the budget still cuts


# --------------------------------------------------------------------------- the trainer, packed vs padded


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    svc = ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), device="cpu", dtype="float32")
    c = svc.create_lora_training_client("tiny", seed=0)
    perturb_adapter(c, 4)
    return c


def run_trainer(client, prepared, loss_fn: str, max_tokens: int | None, share: bool, packed: bool):
    """``trainer.run`` with a backward on the client's model: its output and the adapter's gradients."""
    for p in client.engine.adapter_parameters(client.adapter).values():
        p.grad = None
    with client.engine.use(client.adapter):
        out = trainer.run(client.engine.causal_lm(), prepared, loss_fn, None, client.engine.device, max_tokens,
                          True, share_prefixes=share, packed=packed)
    return out, {k: v for k, v in adapter_tensors(client, "grad").items() if v is not None}


def assert_packed_equals_padded(client, loss_fn: str, share: bool, max_tokens: int | None, trunk: int = 0) -> None:
    """The trainer's packed micro-batches give its padded ones' logprobs, loss, entropy and gradients
    (within float32 rounding) on GRPO groups (under a system prompt of ``trunk`` tokens)."""
    data = grpo_batch(seed=5, trunk=trunk)
    prepared = trainer.prepare(data, loss_fn, client.engine.vocab_size, client.engine.check_tokens)
    ref, ref_grads = run_trainer(client, prepared, loss_fn, max_tokens, share, packed=False)
    got, grads = run_trainer(client, prepared, loss_fn, max_tokens, share, packed=True)
    for a, b in zip(got.loss_fn_outputs, ref.loss_fn_outputs, strict=True):
        torch.testing.assert_close(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-5, rtol=0)
    assert got.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
    assert got.metrics["entropy:mean"] == pytest.approx(ref.metrics["entropy:mean"], rel=1e-5)
    assert ref_grads and set(grads) == set(ref_grads)
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 0.1
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("loss_fn", ["ppo", "importance_sampling"])
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("max_tokens", [None, 60])
def test_packed_micro_batches_equal_padded_ones(client, loss_fn, share, max_tokens) -> None:
    assert_packed_equals_padded(client, loss_fn, share, max_tokens)


def test_half_precision_attention_runs_in_float32_on_a_cpu(monkeypatch) -> None:
    """Through SDPA (the path without grpo's kernel), bf16 queries, keys and values are attended in
    float32 (PyTorch's CPU flash-attention backward is several times slower in bf16): the output is
    the float32 attention of the same bf16 values, rounded once to bf16, and gradients come back in
    bf16."""
    monkeypatch.setattr(packed_attention, "NATIVE_ATTENTION_ON_CPU", False)
    lengths = [3, 7, 5]
    packed = packed_attention.PackedPass(lengths, CPU)
    layer = torch.nn.Module()
    layer.layer_idx = 0
    gen = torch.Generator().manual_seed(3)
    n, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn((1, h, n, dim), generator=gen).to(torch.bfloat16).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    out = packed.attend(layer, q, k, v, None, 0.0, None)
    assert out.dtype == torch.bfloat16
    in_float32 = packed.attend(layer, q.float(), k.float(), v.float(), None, 0.0, None)
    assert torch.equal(out, in_float32.to(torch.bfloat16))
    out.float().square().sum().backward()
    assert q.grad.dtype == k.grad.dtype == torch.bfloat16 and q.grad.abs().sum() > 0
    monkeypatch.setattr(packed_attention, "FP32_ATTENTION_ON_CPU", False)
    assert not torch.equal(packed.attend(layer, q, k, v, None, 0.0, None), out)  # bf16 SDPA rounds otherwise


def _chained_pass() -> packed_attention.PackedPass:
    """A GRPO micro-batch's shape: a system prompt, two prompts continuing it, each prompt's answers
    continuing the prompt (the system prompt's keys then get gradients from seven sequences); two
    answers longer than the kernel's 64-query tasks (few tasks in all: it cuts no longer ones)."""
    lengths = [6, 9, 5, 4, 140, 1, 7, 3, 70]
    return packed_attention.PackedPass(lengths, CPU, continues=[None, 0, 0, 1, 1, 1, 2, 2, 2])


def _attend_with_grads(packed, q, k, v, scaling=None, sliding_window=None, softcap=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = packed.attend(torch.nn.Module(), q, k, v, scaling, 0.0, sliding_window, softcap)
    gen = torch.Generator().manual_seed(11)
    (out.float() * torch.randn(out.shape, generator=gen)).sum().backward()
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dim", [64, 128, 24])  # (64 and 128 take the kernel's fixed-width loops)
def test_native_attention_equals_sdpa_over_padded_blocks(native_ops, monkeypatch, dim) -> None:
    """The kernel's attention (outputs, and gradients of q, k and v) is what SDPA computes over the
    gathered, padded blocks, to float32 rounding: with grouped-query heads and chained prefixes."""
    heads, kv_heads = 6, 2
    packed = _chained_pass()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn((1, h, packed.tokens, dim), generator=gen) for h in (heads, kv_heads, kv_heads))
    monkeypatch.setattr(packed_attention, "NATIVE_ATTENTION_ON_CPU", False)
    want = _attend_with_grads(packed, q, k, v, scaling=0.3)
    assert packed._native_plan is None
    monkeypatch.setattr(packed_attention, "NATIVE_ATTENTION_ON_CPU", True)
    got = _attend_with_grads(packed, q, k, v, scaling=0.3)
    assert packed._native_plan is not None  # (the kernel ran: it made its plan)
    assert got[0].shape == want[0].shape == (1, packed.tokens, heads, dim)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-6 * float(w.detach().abs().max()), rtol=1e-5)


def test_native_bf16_attention_is_its_float32_attention_rounded_once(native_ops) -> None:
    """bf16 q, k and v are widened as read and attended in float32: the output is the float32
    attention of the same values rounded once to bf16, and gradients come back in bf16 (those of
    float32 to bf16's rounding: the gradient arriving at a bf16 output is bf16 itself)."""
    packed = _chained_pass()
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn((1, h, packed.tokens, 64), generator=gen).to(torch.bfloat16) for h in (9, 3, 3))
    out, *grads = _attend_with_grads(packed, q, k, v)
    want, *want_grads = _attend_with_grads(packed, q.float(), k.float(), v.float())
    assert packed._native_plan is not None
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    for g, w in zip(grads, want_grads, strict=True):  # (the bf16 pass's gradient arrives rounded to bf16)
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w, atol=2**-8 * float(w.abs().max()), rtol=2**-7)


def test_native_attention_leaves_dropout_to_sdpa() -> None:
    packed = _chained_pass()
    q, k, v = (torch.randn((1, h, packed.tokens, 16)) for h in (4, 2, 2))
    packed.attend(torch.nn.Module(), q, k, v, None, 0.1, None)
    assert packed._native_plan is None


def _attention_in_float64(packed, q, k, v, scaling: float, window: int | None, softcap: float | None,
                          sinks: torch.Tensor | None = None):
    """Each sequence of ``packed`` attended alone, in float64, as transformers' eager attention
    computes it: query at position p sees keys at positions p - window < p' <= p (its prefix's,
    then its own), scores capped as softcap * tanh(score / softcap), each head's sink logit a column
    of the softmax weighing no value (GPT-OSS's); ``(1, tokens, heads, dim)``."""
    groups = q.shape[1] // k.shape[1]
    out = []
    for i, (start, length) in enumerate(zip(packed.starts, packed.lengths, strict=True)):
        rows = torch.tensor(packed.key_rows[i])
        queries = q[0, :, start:start + length].double()
        keys, values = (x[0][:, rows].double().repeat_interleave(groups, 0) for x in (k, v))
        scores = queries @ keys.transpose(-1, -2) * scaling
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(len(rows) - length, len(rows))[:, None]
        k_pos = torch.arange(len(rows))[None]
        seen = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            column = sinks.double().reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
            weights = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            weights = scores.softmax(-1)
        out.append((weights @ values).transpose(0, 1))
    return torch.cat(out)[None]


@pytest.mark.parametrize("dim", [64, 256, 24])  # (64 and 256 take the kernel's fixed-width loops, 24 its generic one)
@pytest.mark.parametrize(("window", "softcap"), [(7, None), (None, 2.0), (16, 3.0), (1, None)])
def test_native_attention_windows_and_caps_as_eager_attention_does_in_float64(native_ops, monkeypatch, dim, window,
                                                                             softcap) -> None:
    """Sliding windows (Mistral's, Gemma's; shorter than most sequences, cutting into the prompts
    they continue) and Gemma 2's capped scores, forward and the gradients of q, k and v: grpo's
    kernel and the gathered blocks (SDPA; the eager formula where capped) both equal float64
    attention written out, to float32's rounding."""
    heads, kv_heads = 6, 2
    packed = _chained_pass()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn((1, h, packed.tokens, dim), generator=gen) for h in (heads, kv_heads, kv_heads))
    q, scaling = q * 3, dim ** -0.5  # (scores of a few units: the caps bite)
    grad = torch.randn((1, packed.tokens, heads, dim), generator=torch.Generator().manual_seed(11))
    wanted = [t.double().requires_grad_() for t in (q, k, v)]
    want_out = _attention_in_float64(packed, *wanted, scaling, window, softcap)
    (want_out * grad).sum().backward()
    want = [want_out.detach(), *(t.grad for t in wanted)]
    for native in (True, False):
        monkeypatch.setattr(packed_attention, "NATIVE_ATTENTION_ON_CPU", native)
        pass_ = _chained_pass()
        got_q, got_k, got_v = (t.clone().requires_grad_() for t in (q, k, v))
        out = pass_.attend(torch.nn.Module(), got_q, got_k, got_v, scaling, 0.0, window, softcap)
        (out * grad).sum().backward()
        assert (pass_._native_plan is not None) == native
        # (a window of 1: q's and k's gradients are 0, float32's of the order of the rounding of the
        # products that cancel there: the allowance scales with the largest of the four)
        scale = max(float(w.abs().max()) for w in want)
        for g, w in zip([out, got_q.grad, got_k.grad, got_v.grad], want, strict=True):
            torch.testing.assert_close(g.detach().double(), w, atol=5e-6 * scale, rtol=1e-5)


def test_values_narrower_than_the_keys_attend_through_the_gathered_blocks(native_ops) -> None:
    """DeepSeek's latent attention hands values of fewer dims than its queries and keys (v_head_dim):
    the kernel, which takes one head dimension, leaves them to SDPA over the gathered blocks, whose
    outputs have the values' width -- equal to float64 attention written out."""
    packed = _chained_pass()
    gen = torch.Generator().manual_seed(6)
    q, k = (torch.randn((1, h, packed.tokens, 24), generator=gen) for h in (4, 2))
    v = torch.randn((1, 2, packed.tokens, 16), generator=gen)
    out = packed.attend(torch.nn.Module(), q, k, v, None, 0.0, None)
    assert packed._native_plan is None and out.shape == (1, packed.tokens, 4, 16)
    want = _attention_in_float64(packed, q.double(), k.double(), v.double(), 24 ** -0.5, None, None)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", [64, 24])
@pytest.mark.parametrize("window", [None, 7])
def test_native_attention_with_sinks_is_gpt_oss_eager_attention_in_float64(native_ops, monkeypatch, dim, window) -> None:
    """GPT-OSS's sinks (a logit a query head beside the keys' in each softmax, weighing no value;
    windows of 128 every other layer): outputs and the gradients of q, k, v and the sinks themselves,
    through grpo's kernel and through the gathered blocks, against float64 attention written out.
    One sink above every score (the kernel rescales its numerators to it) and one far below."""
    heads, kv_heads = 6, 2
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn((1, h, _chained_pass().tokens, dim), generator=gen) for h in (heads, kv_heads, kv_heads))
    sinks = torch.tensor([0.0, 1.5, -2.0, 40.0, -30.0, 0.7])
    grad = torch.randn((1, q.shape[2], heads, dim), generator=gen)
    wanted = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    want_out = _attention_in_float64(_chained_pass(), *wanted[:3], dim ** -0.5, window, None, wanted[3])
    (want_out * grad).sum().backward()
    want = [want_out.detach(), *(t.grad for t in wanted)]
    for native in (True, False):
        monkeypatch.setattr(packed_attention, "NATIVE_ATTENTION_ON_CPU", native)
        pass_ = _chained_pass()
        got = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = pass_.attend(torch.nn.Module(), *got[:3], None, 0.0, window, None, got[3])
        (out * grad).sum().backward()
        assert (pass_._native_plan is not None) == native
        scale = max(float(w.abs().max()) for w in want)
        for g, w in zip([out, *(t.grad for t in got)], want, strict=True):
            torch.testing.assert_close(g.detach().double(), w, atol=5e-6 * scale, rtol=1e-5)
    assert float(want[4].abs().max()) > 0.1  # (the sinks' gradient is checked where it is not nothing)
    # the sink above every score takes nearly all of its head's weight: that head's outputs nearly vanish
    assert float(want[0][0, :, 3].abs().max()) < 1e-6 * float(want[0][0, :, 0].abs().max())


def test_native_attention_refuses_a_negative_window_or_cap(native_ops) -> None:
    ops = native_ops
    q, k, v = torch.randn(5, 4 * 16), torch.randn(5, 2 * 16), torch.randn(5, 2 * 16)
    plan = torch.tensor([[0, 5, 0, 0]]), torch.arange(5)
    with pytest.raises(RuntimeError, match="window must be 0 \\(none\\) or the keys a query sees, got -1"):
        ops.packed_attention(q, k, v, *plan, 4, 2, 0.25, False, -1)
    with pytest.raises(RuntimeError, match="softcap must be 0 \\(none\\) or the scores' cap, got -2"):
        ops.packed_attention(q, k, v, *plan, 4, 2, 0.25, False, 0, -2.0)
    with pytest.raises(RuntimeError, match="sinks must be a contiguous float32 CPU \\[4\\]"):
        ops.packed_attention(q, k, v, *plan, 4, 2, 0.25, False, 0, 0.0, torch.zeros(2))


def test_native_attention_refuses_sequences_out_of_range(native_ops) -> None:
    ops = native_ops
    q, k, v = torch.randn(5, 4 * 16), torch.randn(5, 2 * 16), torch.randn(5, 2 * 16)
    with pytest.raises(RuntimeError, match="sequence 0 is out of range"):
        ops.packed_attention(q, k, v, torch.tensor([[2, 4, 0, 0]]), torch.arange(4), 4, 2, 0.25)
    with pytest.raises(RuntimeError, match="key row out of range"):
        ops.packed_attention(q, k, v, torch.tensor([[0, 2, 0, 0]]), torch.tensor([0, 9]), 4, 2, 0.25)
    with pytest.raises(RuntimeError, match="not a multiple of"):
        ops.packed_attention(q, k[:, :16], v[:, :16], torch.tensor([[0, 2, 0, 0]]), torch.arange(2), 4, 3, 0.25)
    fused = torch.randn(5, 8 * 16)
    with pytest.raises(RuntimeError, match=r"packed_attention: v: expected rows back to back \(row stride 32\)"):
        ops.packed_attention(q, k, fused[:, 6 * 16:], torch.tensor([[0, 5, 0, 0]]), torch.arange(5), 4, 2, 0.25)


def test_native_attention_reads_q_k_v_sliced_from_one_fused_projection(native_ops, monkeypatch) -> None:
    """Phi-3's attention slices q, k and v out of one ``qkv_proj`` output: views whose rows lie the
    fused row's width apart (read as back to back, Phi-4-mini's logprobs were 0.35 off). Outputs
    and the fused tensor's gradient are what SDPA over the gathered blocks computes."""
    heads, kv_heads, dim = 6, 2, 64
    packed = _chained_pass()
    n = packed.tokens
    fused_init = torch.randn((1, n, (heads + 2 * kv_heads) * dim), generator=torch.Generator().manual_seed(4))

    def attend(native: bool):
        monkeypatch.setattr(packed_attention, "NATIVE_ATTENTION_ON_CPU", native)
        fused = fused_init.clone().requires_grad_()
        q, k, v = (part.view(1, n, -1, dim).transpose(1, 2)
                   for part in fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
        out = packed.attend(torch.nn.Module(), q, k, v, 0.3, 0.0, None)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(11))).sum().backward()
        return out, fused.grad

    want = attend(False)
    got = attend(True)
    assert packed._native_plan is not None
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-6 * float(w.abs().max()), rtol=1e-5)


def test_native_attention_gradients_are_the_same_bits_every_call(native_ops) -> None:
    """Keys that several tasks see (the shared prompts, a long answer's first tokens) sum their
    gradients in an order set by the tasks, not by which thread finished first: runs repeat bit
    for bit (tests/test_reproducibility.py), on any number of threads."""
    packed = _chained_pass()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn((1, h, packed.tokens, 64), generator=gen) for h in (9, 3, 3))
    first = _attend_with_grads(packed, q, k, v)
    assert packed._native_plan is not None
    for _ in range(10):
        for a, b in zip(_attend_with_grads(packed, q, k, v), first, strict=True):
            assert torch.equal(a, b)
    _same_bits_on_other_thread_counts(packed, q, k, v, first)


def _same_bits_on_other_thread_counts(packed, q, k, v, want, **rule) -> None:
    """The attention and its gradients on 1 and 3 threads are ``want``, bit for bit: the order of the
    key and value gradients' sums is the tasks', not the threads'."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for a, b in zip(_attend_with_grads(packed, q, k, v, **rule), want, strict=True):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)


def _needs_dot(ops) -> None:
    if not ops.stream_dot_available():
        pytest.skip("grpo's kernels are not built with avx512_bf16 here: no dot product to take the scores by")


@pytest.mark.parametrize(("dim", "window", "softcap"), [(64, None, None), (128, None, None), (256, 7, 2.0)])
def test_native_bf16_attention_by_the_dot_product_is_within_bf16s_rounding_of_float32(native_ops, monkeypatch,
                                                                                     dim, window, softcap) -> None:
    """Where the engine chose it (kernel_probe.training_attention), bf16 attention takes every product
    by avx512_bf16's dot product: the scores from bf16 q, k, v and output gradients, the weighted
    sums and the key/value gradients from the softmax's weights and their gradients rounded to bf16
    (as PyTorch's CPU flash attention does for bf16). Outputs and gradients stay within bf16's
    rounding of the float32 attention's, at most twice the multiply-adds' error (float32 weights);
    in a sliding window, with capped scores, too."""
    _needs_dot(native_ops)
    packed = _chained_pass()
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn((1, h, packed.tokens, dim), generator=gen).to(torch.bfloat16) for h in (9, 3, 3))
    rule = dict(sliding_window=window, softcap=softcap)
    fma = _attend_with_grads(packed, q, k, v, **rule)
    want = _attend_with_grads(packed, q.float(), k.float(), v.float(), **rule)
    monkeypatch.setattr(packed_attention, "_DOT_PRODUCTS", {(9, 3, dim)})
    dot = _attend_with_grads(packed, q, k, v, **rule)
    assert not any(torch.equal(a, b) for a, b in zip(dot, fma, strict=True))  # (the dot products ran)

    def rms(x):
        return float(x.pow(2).mean().sqrt())

    for d, f, w in zip(dot, fma, want, strict=True):
        assert d.dtype == torch.bfloat16
        d, f, w = d.detach().float(), f.detach().float(), w.detach()
        assert rms(d - w) <= 2**-8 * rms(w)
        assert float((d - w).abs().max()) <= 2**-6 * float(w.abs().max())
        assert rms(d - w) <= 2 * rms(f - w)
    for _ in range(3):  # the key and value gradients still summed in the tasks' order: the same bits
        assert all(torch.equal(a, b) for a, b in zip(_attend_with_grads(packed, q, k, v, **rule), dot, strict=True))
    _same_bits_on_other_thread_counts(packed, q, k, v, dot, **rule)


def test_the_dot_product_attention_sees_no_key_after_a_query(native_ops) -> None:
    """The dot product sums two keys (and, for key gradients, two queries) a step: a query's
    outputs and query gradients are the same bits whatever the keys and values after it hold, and a
    key's gradients whatever the output gradients of the queries before it, each parity of key."""
    _needs_dot(native_ops)
    ops = native_ops
    # a 37-token sequence and a 21-token one continuing it (its keys: the first's rows, then its own)
    seqs = torch.tensor([[0, 37, 0, 0], [37, 21, 37, 37]])
    key_rows = torch.cat([torch.arange(37), torch.arange(37), torch.arange(37, 58)])
    gen = torch.Generator().manual_seed(9)
    q, k, v, grad = (torch.randn(58, h * 64, generator=gen).to(torch.bfloat16) for h in (4, 2, 2, 4))

    def attend(k, v, grad):
        out, lse = ops.packed_attention(q, k, v, seqs, key_rows, 4, 2, 0.125, True)
        return out, lse, *ops.packed_attention_backward(grad, q, k, v, out, lse, seqs, key_rows, 4, 2, 0.125, True)

    out, lse, dq, dk, dv = attend(k, v, grad)
    for j in (20, 21, 37 + 8, 37 + 9):  # (rows of the first sequence, then of the second's own)
        first = 0 if j < 37 else 37  # the first row of j's sequence
        k2, v2 = k.clone(), v.clone()
        k2[j], v2[j] = 1000.0, -1000.0
        out2, lse2, dq2, _, _ = attend(k2, v2, grad)
        assert torch.equal(out2[first:j], out[first:j]) and torch.equal(lse2[first:j], lse[first:j])
        assert torch.equal(dq2[first:j], dq[first:j])
        assert not torch.equal(out2[j], out[j])
        grad2 = grad.clone()
        grad2[first:j] = 1000.0
        _, _, _, dk2, dv2 = attend(k, v, grad2)
        assert torch.equal(dk2[j], dk[j]) and torch.equal(dv2[j], dv[j])
        assert not torch.equal(dv2[j - 1], dv[j - 1])


def test_the_dot_product_leaves_float32_and_other_shapes_to_multiply_adds(native_ops, monkeypatch) -> None:
    """Only bf16 of a head dimension the kernel knows when compiling (64, 128, 256) takes it: float32
    asked for it computes as before, bit for bit, as does a head shape the engine did not choose."""
    _needs_dot(native_ops)
    ops = native_ops
    packed = _chained_pass()
    seqs, rows = (torch.tensor(x) for x in ([[0, packed.tokens, 0, 0]], list(range(packed.tokens))))
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(packed.tokens, h * 64, generator=gen) for h in (4, 2, 2, 4))
    plain = ops.packed_attention(q, k, v, seqs, rows, 4, 2, 0.125)
    asked = ops.packed_attention(q, k, v, seqs, rows, 4, 2, 0.125, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, asked, strict=True))
    grads = [ops.packed_attention_backward(grad, q, k, v, *plain, seqs, rows, 4, 2, 0.125, dot) for dot in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    monkeypatch.setattr(packed_attention, "_DOT_PRODUCTS", {(4, 2, 64)})  # another model's heads
    q, k, v = (torch.randn((1, h, packed.tokens, 64), generator=gen).to(torch.bfloat16) for h in (9, 3, 3))
    fma = _attend_with_grads(packed, q, k, v)
    monkeypatch.setattr(packed_attention, "_DOT_PRODUCTS", set())
    assert all(torch.equal(a, b) for a, b in zip(_attend_with_grads(packed, q, k, v), fma, strict=True))


@pytest.mark.parametrize("window", [None, 100])
def test_native_attention_cuts_long_sequences_into_longer_tasks_where_there_are_many(native_ops, monkeypatch,
                                                                                     window) -> None:
    """A pass of many sequences takes a long one in tasks of up to 256 queries (fewer gathers and
    gradient sums per query); its attention is still SDPA's, and the same bits on any number of
    threads (the tasks are chosen from the pass alone). In a window shorter than a task's span, each
    task gathers and sums the keys from its first query's window on."""
    lengths = [20, *[3] * 70, 600]  # a prompt, 70 short answers and a long one continuing it
    packed = packed_attention.PackedPass(lengths, CPU, continues=[None, *[0] * 71])
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn((1, h, packed.tokens, 64), generator=gen) for h in (2, 1, 1))
    want = _attend_with_grads(packed, q, k, v, sliding_window=window)
    assert packed._native_plan is not None
    monkeypatch.setattr(packed_attention, "NATIVE_ATTENTION_ON_CPU", False)
    reference = _attend_with_grads(packed_attention.PackedPass(lengths, CPU, continues=[None, *[0] * 71]), q, k, v,
                                   sliding_window=window)
    for g, w in zip(want, reference, strict=True):
        torch.testing.assert_close(g, w, atol=2e-6 * float(w.detach().abs().max()), rtol=1e-5)
    monkeypatch.setattr(packed_attention, "NATIVE_ATTENTION_ON_CPU", True)
    _same_bits_on_other_thread_counts(packed, q, k, v, want, sliding_window=window)
