"""Gemma 3's and Gemma 2's decoding step through grpo's kernels (gemma_decode.py) computes what
transformers' Gemma layers compute, and the sampler takes it exactly where it applies.

Each new kernel is checked against the eager operators it replaces (Gemma3RMSNorm twice with the
residual add between; GELU's tanh approximation times up; rope_attend's zero-centred norms of q's
and k's heads), in float32 to float rounding and in bf16 to a unit in the last place; the whole
step against the model's own forward through real sampling calls.
"""

from __future__ import annotations

import pytest
import torch
from backend_helpers import (
    DECODE_PROMPTS,
    ROUNDING_ULPS,
    assert_greedy_alike,
    assert_within_ulps,
    greedy_rows,
    perturb_adapter,
    rotary_rows,
    sample_each,
)
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3ForCausalLM, Gemma3RMSNorm

from grpo.backends.local import ServiceClient, gemma_decode, native_decode
from grpo.models import native_kernels
from grpo.models.cpu_linear import packing_works
from grpo.types import ModelInput

DTYPES = [torch.float32, torch.bfloat16]
CPU = torch.device("cpu")


def _norm(dim: int, dtype: torch.dtype, seed: int) -> Gemma3RMSNorm:
    """A Gemma 3 norm whose weight is not zero (a fresh one's is: 1 + 0 would hide the weight)."""
    norm = Gemma3RMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * 0.5)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_zero_centred_norms_is_gemmas_post_norm_the_residual_add_and_the_next_pre_norm(native_ops, dtype) -> None:
    torch.manual_seed(0)
    post, pre = _norm(48, dtype, 1), _norm(48, dtype, 2)
    residual = torch.randn(5, 48, dtype=dtype) * 3
    wide = torch.randn(5, 96, dtype=dtype) * 20  # x as the rows of a wider tensor (a row stride), large
    x = wide[:, 48:]
    with torch.no_grad():
        want_hidden = residual + post(x)
        want_normed = pre(want_hidden)
    hidden, normed = native_ops.add_zero_centred_norms(residual, x, post.weight, pre.weight, 1e-6)
    assert_within_ulps(hidden, want_hidden, dtype, ulps=ROUNDING_ULPS[dtype])
    assert_within_ulps(normed, want_normed, dtype, ulps=2 * ROUNDING_ULPS[dtype])  # (two norms' roundings)
    assert not torch.equal(normed, Gemma3RMSNorm(48, eps=1e-6).to(dtype)(hidden))  # (the weight is used)
    with pytest.raises(RuntimeError, match=r"add_zero_centred_norms: weight must be a contiguous \[48\]"):
        native_ops.add_zero_centred_norms(residual, x, post.weight[:24], pre.weight, 1e-6)
    with pytest.raises(RuntimeError, match=r"add_zero_centred_norms: x: expected \[5, 48\]"):
        native_ops.add_zero_centred_norms(residual, wide, post.weight, pre.weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_is_gemmas_activation_times_up(native_ops, dtype) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(6, 2 * 80, dtype=dtype) * 4
    gate_up[0, :8] = torch.tensor([-30.0, -12.0, -1e-3, 0.0, 1e-3, 2.0, 12.0, 30.0])  # the tails and around 0
    gate, up = gate_up[:, :80], gate_up[:, 80:]
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    # (x sigmoid(2u) for 0.5 x (1 + tanh(u)): a few float ulps; a bf16 rounding lands the other way now and then)
    assert_within_ulps(native_ops.gelu_tanh_mul(gate, up), want, dtype, ulps=2 if dtype == torch.bfloat16 else 64)
    with pytest.raises(RuntimeError, match="gelu_tanh_mul: gate and up differ in dtype"):
        native_ops.gelu_tanh_mul(gate, up.double())


@pytest.mark.parametrize("dim", [40, 256])  # 256: Gemma 3's, compiled as a fixed length; 40 the general loops
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_attend_normalises_each_head_of_q_and_k_as_gemmas_norms_do(native_ops, dtype, dim) -> None:
    """Gemma 3's q_norm and k_norm scale by 1 + weight in float32 and round once (Qwen3's round
    before the weight): rope_attend told so writes the keys the zero-centred norm kernel's heads
    rotate to, to the bit, and those are Gemma3RMSNorm's to rounding."""
    torch.manual_seed(3)
    rows, heads, kv_heads, capacity = 3, 4, 1, 24
    lengths = torch.tensor([5, 0, 23])
    q = torch.randn(rows, heads * dim, dtype=dtype) * 3
    k, v = torch.randn(rows, kv_heads * dim, dtype=dtype) * 3, torch.randn(rows, kv_heads * dim, dtype=dtype)
    cos, sin = rotary_rows(lengths, dim, dtype)
    q_norm, k_norm = _norm(dim, dtype, 4), _norm(dim, dtype, 5)
    kernel_q = native_ops.zero_centred_rms_norm(q.view(-1, dim), q_norm.weight.detach(), 1e-6).view(rows, -1)
    kernel_k = native_ops.zero_centred_rms_norm(k.view(-1, dim), k_norm.weight.detach(), 1e-6).view(rows, -1)
    with torch.no_grad():
        assert_within_ulps(kernel_q, q_norm(q.view(rows, heads, dim)).reshape(rows, -1), dtype, ulps=ROUNDING_ULPS[dtype])
    keys = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    values = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    theirs_k, theirs_v, ours_k, ours_v = keys.clone(), values.clone(), keys.clone(), values.clone()
    want = native_ops.rope_attend(kernel_q, kernel_k, v, cos, sin, theirs_k, theirs_v, lengths, heads, 256**-0.5)
    got = native_ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, 256**-0.5, q_norm=q_norm.weight.detach(),
                          k_norm=k_norm.weight.detach(), norm_eps=1e-6, norms="zero_centred")
    assert torch.equal(ours_k, theirs_k) and torch.equal(ours_v, theirs_v) and not torch.equal(ours_k, keys)
    assert torch.equal(got, want)
    qwen3s = native_ops.rope_attend(q, k, v, cos, sin, keys.clone(), values.clone(), lengths, heads, 256**-0.5,
                             q_norm=q_norm.weight.detach(), k_norm=k_norm.weight.detach(), norm_eps=1e-6)
    assert not torch.equal(qwen3s, got)  # (the flag is what makes them Gemma's)


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("dim", [40, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_attend_with_a_window_attends_each_rows_last_columns_only(native_ops, dtype, dim, dot) -> None:
    """A sliding layer's row sees its last ``window`` columns: the same outputs, to the bit, as the
    call without a window on a cache holding only those columns (the rotation comes from cos and sin,
    not the column), and the columns before them are never mixed in (they hold huge values here)."""
    torch.manual_seed(6)
    rows, heads, kv_heads, capacity, window = 4, 4, 1, 40, 7
    lengths = torch.tensor([3, 6, 17, 39])  # the first two inside their window, the others past it
    q = torch.randn(rows, heads * dim, dtype=dtype)
    k, v = torch.randn(rows, kv_heads * dim, dtype=dtype), torch.randn(rows, kv_heads * dim, dtype=dtype)
    cos, sin = rotary_rows(lengths, dim, dtype)
    keys = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    values = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    first = (lengths + 1 - window).clamp(min=0)  # each row's first column in its window
    for r in range(rows):
        keys[r, :, :first[r]], values[r, :, :first[r]] = 1e4, 1e4
    shifted_k, shifted_v = torch.zeros_like(keys), torch.zeros_like(values)
    for r in range(rows):  # the window's columns (the new one's included) from column 0
        shifted_k[r, :, :lengths[r] - first[r]] = keys[r, :, first[r]:lengths[r]]
        shifted_v[r, :, :lengths[r] - first[r]] = values[r, :, first[r]:lengths[r]]
    want = native_ops.rope_attend(q, k, v, cos, sin, shifted_k, shifted_v, lengths - first, heads, dim**-0.5, dot=dot)
    got = native_ops.rope_attend(q, k, v, cos, sin, keys, values, lengths, heads, dim**-0.5, dot=dot, window=window)
    assert torch.equal(got, want)
    assert torch.equal(keys[torch.arange(rows), :, lengths], shifted_k[torch.arange(rows), :, lengths - first])
    unwindowed = native_ops.rope_attend(q, k, v, cos, sin, keys.clone(), values.clone(), lengths, heads, dim**-0.5, dot=dot)
    assert torch.equal(unwindowed[:2], got[:2]) and not torch.equal(unwindowed[2:], got[2:])
    with pytest.raises(RuntimeError, match="rope_attend: window must be 0 \\(none\\) or the number of columns"):
        native_ops.rope_attend(q, k, v, cos, sin, keys, values, lengths, heads, 1.0, window=-1)


def _tiny_gemma3(vocab: int, dtype: torch.dtype, head_dim: int = 256, window: int = 512) -> Gemma3ForCausalLM:
    """Two layers, a sliding one and a full one (each its own rotary base), 4 query heads over 1 key
    head as Gemma-3-270M's, random non-zero norm weights."""
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim, sliding_window=window,
                              query_pre_attn_scalar=head_dim, layer_types=["sliding_attention", "full_attention"])
    return _random(Gemma3ForCausalLM, config, "sdpa", dtype)


def _random(model_class, config, attention: str, dtype: torch.dtype, qk_scale: float = 1.0):
    """``model_class(config)`` with ``attention`` as its implementation, seeded, every norm's weight drawn
    away from zero (Gemma's 1 + 0 would hide the weight), q's and k's weights times ``qk_scale``."""
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(-0.5, 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(qk_scale)
    return model.to(dtype).eval()


@pytest.mark.parametrize(("head_dim", "window"), [(256, 512), (16, 512), (256, 6), (16, 6)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sampler_decodes_gemma3_through_the_kernels_as_through_its_own_forward(tokenizer, monkeypatch, native_ops,
                                                                                   dtype, head_dim, window) -> None:
    """Greedy, rows stopping at different steps (riding along after), a group's prompt shared; with
    a window of 512 no row reaches, and of 6, which every row outgrows (prompts of 3-19 tokens, 16
    sampled): the tokens and logprobs of the model's own forward (the kernels switched off) up to
    near-ties."""
    model = _tiny_gemma3(len(tokenizer), dtype, head_dim, window)
    decoders: list = []
    found = gemma_decode.gemma_decoder
    monkeypatch.setattr(gemma_decode, "gemma_decoder", lambda *a: decoders.append(found(*a)) or decoders[-1])
    native = greedy_rows(model, tokenizer)
    assert decoders and all(type(d) is gemma_decode.GemmaDecoder for d in decoders)
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    eager = greedy_rows(model, tokenizer)
    assert decoders[-1] is None
    assert len({len(tokens) for tokens, *_ in eager}) > 1  # rows finished at different steps
    assert_greedy_alike(native, eager, bound=1e-4 if dtype == torch.float32 else 0.1)


def _tiny_gemma2(vocab: int, dtype: torch.dtype, window: int = 512) -> Gemma2ForCausalLM:
    """Two layers, a sliding one and a full one (one rotary embedding), 4 query heads over 2 key heads,
    scores capped at 5 and logits at 3 (Gemma 2's caps are 50 and 30, for its scores' and logits'
    sizes: a tiny random model's are small, and caps it never reached would not be tested), random
    non-zero norm weights; transformers' eager attention, the one that applies the cap."""
    config = Gemma2Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                          query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                          layer_types=["sliding_attention", "full_attention"])
    return _random(Gemma2ForCausalLM, config, "eager", dtype, qk_scale=8.0)  # (q and k scaled: scores past the cap)


@pytest.mark.parametrize("window", [512, 6])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sampler_decodes_gemma2_through_the_kernels_as_through_its_own_forward(tokenizer, monkeypatch, native_ops,
                                                                                   dtype, window) -> None:
    """As for Gemma 3, through Gemma 2's eager attention with its scores capped; the cap is applied
    (left out, the greedy rows would differ)."""
    model = _tiny_gemma2(len(tokenizer), dtype, window)
    decoders: list = []
    found = gemma_decode.gemma_decoder
    monkeypatch.setattr(gemma_decode, "gemma_decoder", lambda *a: decoders.append(found(*a)) or decoders[-1])
    native = greedy_rows(model, tokenizer)
    assert decoders and all(type(d) is gemma_decode.GemmaDecoder and d.attention_softcap == 5.0 for d in decoders)
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    eager = greedy_rows(model, tokenizer)
    assert decoders[-1] is None
    assert len({len(tokens) for tokens, *_ in eager}) > 1  # rows finished at different steps
    assert_greedy_alike(native, eager, bound=1e-4 if dtype == torch.float32 else 0.1)
    monkeypatch.delenv(native_kernels.ENV_SWITCH)

    def uncapped(*args):
        decoder = found(*args)
        decoder.attention_softcap = 0.0
        return decoder

    monkeypatch.setattr(gemma_decode, "gemma_decoder", uncapped)
    assert [row[1] for row in greedy_rows(model, tokenizer)] != [row[1] for row in native]  # (the cap matters)


def _client_whose_decoders_are_kept(tmp_path, monkeypatch, tokenizer, model, train_dtype: str, sample_dtype: str):
    """``model`` saved and loaded as a LoRA training client (its adapter perturbed), and the list each
    sampling call's ``gemma_decoder`` result is appended to: (service, client, decoders)."""
    directory = tmp_path / "gemma"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    decoders: list = []
    found = gemma_decode.gemma_decoder
    monkeypatch.setattr(gemma_decode, "gemma_decoder", lambda *a: decoders.append(found(*a)) or decoders[-1])
    service = ServiceClient(checkpoint_dir=tmp_path / "checkpoints", device="cpu", train_dtype=train_dtype,
                            sample_dtype=sample_dtype)
    tc = service.create_lora_training_client(str(directory), rank=4, seed=0)
    perturb_adapter(tc, seed=3)
    return service, tc, decoders


@pytest.mark.parametrize(("train_dtype", "sample_dtype"), [("fp32", "fp32"), ("fp32", "bf16")])
def test_a_gemma3_through_the_client_samples_logprobs_the_trainer_computes(tmp_path, monkeypatch, tokenizer,
                                                                           train_dtype, sample_dtype) -> None:
    """Through the client: fp32, the trainer's model with LoRA folded; bf16, the sampler's copy
    (stacked projections, LoRA side paths). At temperature 1 the sampled logprobs are the trainer's
    (fp32: to float rounding; bf16: to the precisions' gap), and the step was Gemma's."""
    service, tc, decoders = _client_whose_decoders_are_kept(tmp_path, monkeypatch, tokenizer,
                                                            _tiny_gemma3(len(tokenizer), torch.float32), train_dtype,
                                                            sample_dtype)
    drawn = sample_each(tc, temperature=1.0, seed=7)
    assert decoders and all(type(d) is gemma_decode.GemmaDecoder for d in decoders)
    sampling = tc.save_weights_and_get_sampling_client("weights")
    bound = 1e-5 if sample_dtype == "fp32" else 0.15
    for i, (tokens, logprobs) in enumerate(drawn):  # (three samples a prompt)
        prompt = DECODE_PROMPTS[i // 3]
        computed = sampling.compute_logprobs(ModelInput.from_ints(prompt + tokens)).result()[len(prompt):]
        assert computed == pytest.approx(logprobs, abs=bound)
    assert len({tuple(tokens) for tokens, _ in drawn}) > 3
    service.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_gemma2_through_the_client_samples_logprobs_the_trainer_computes(tmp_path, monkeypatch, tokenizer,
                                                                           dtype) -> None:
    """Gemma 2 loaded, sampled and scored in one precision (bf16 too: its logits' cap rounds once
    where the model's forward rounds three times, which the load's check of the logit head allows):
    the sampled logprobs are the trainer's, its scores' and logits' caps both applied; the trainer
    packs it (its capped scores through grpo's kernel)."""
    from grpo.backends.local import packed_attention

    service, tc, decoders = _client_whose_decoders_are_kept(tmp_path, monkeypatch, tokenizer,
                                                            _tiny_gemma2(len(tokenizer), torch.float32, window=6),
                                                            dtype, dtype)
    assert packed_attention.supports(tc.engine.model)
    drawn = sample_each(tc, temperature=1.0, seed=7)
    assert decoders and all(type(d) is gemma_decode.GemmaDecoder for d in decoders)
    sampling = tc.save_weights_and_get_sampling_client("weights")
    bound = 1e-5 if dtype == "fp32" else 0.15
    for i, (tokens, logprobs) in enumerate(drawn):
        prompt = DECODE_PROMPTS[i // 3]
        computed = sampling.compute_logprobs(ModelInput.from_ints(prompt + tokens)).result()[len(prompt):]
        assert computed == pytest.approx(logprobs, abs=bound)
    assert len({tuple(tokens) for tokens, _ in drawn}) > 3
    service.close()


@pytest.mark.parametrize("version", [3, 2])
@pytest.mark.parametrize(("train_dtype", "sample_dtype"), [("fp32", "fp32"), pytest.param("fp32", "bf16", marks=(
    pytest.mark.skipif(not packing_works(torch.bfloat16), reason="this CPU packs no bf16 weights: no packed layout")))])
def test_gemmas_layers_in_one_native_call_sample_bit_for_bit_what_the_per_layer_loop_samples(
        tmp_path, monkeypatch, tokenizer, train_dtype, sample_dtype, version) -> None:
    """``decode_gemma_layers`` makes the Python loop's kernel calls in its order, from C++: the same
    tokens and logprobs, to the bit, at temperature 1 (fp32: LoRA folded into packed weights; bf16:
    the sampler's copy with packed LoRA side paths), Gemma 3's norms of q's and k's heads and its two
    rotary kinds, Gemma 2's capped scores, and windows every row outgrows included."""
    model = _tiny_gemma3(len(tokenizer), torch.float32, head_dim=16, window=6) if version == 3 else \
        _tiny_gemma2(len(tokenizer), torch.float32, window=6)
    service, tc, decoders = _client_whose_decoders_are_kept(tmp_path, monkeypatch, tokenizer, model, train_dtype,
                                                            sample_dtype)
    one_call = sample_each(tc, temperature=1.0, seed=11)
    assert decoders and all(d.plan is not None for d in decoders)
    assert len(decoders[-1].plan.head_norms) == (4 if version == 3 else 0)
    assert decoders[-1].plan.windows == [6, 0]
    monkeypatch.setattr(native_decode, "ONE_CALL", False)
    per_layer = sample_each(tc, temperature=1.0, seed=11)
    assert decoders[-1].plan is None
    assert one_call == per_layer
    assert len({tuple(tokens) for tokens, _ in one_call}) > 3
    service.close()


def test_models_outside_what_the_step_computes_keep_the_models_own_forward(tokenizer, monkeypatch, native_ops) -> None:
    vocab = len(tokenizer)
    model = _tiny_gemma3(vocab, torch.bfloat16, head_dim=16, window=64)
    assert type(gemma_decode.gemma_decoder(model, CPU)) is gemma_decode.GemmaDecoder
    assert gemma_decode.gemma_decoder(model.double(), CPU) is None  # float64: not a sampler precision
    mixed = _tiny_gemma3(vocab, torch.bfloat16, head_dim=16)
    mixed.model.norm.float()  # a norm kept in float32 beside bf16 weights
    assert gemma_decode.gemma_decoder(mixed, CPU) is None
    other_eps = _tiny_gemma3(vocab, torch.float32, head_dim=16)
    other_eps.model.layers[1].self_attn.k_norm.eps = 1e-5  # (the kernels take one epsilon)
    assert gemma_decode.gemma_decoder(other_eps, CPU) is None
    capped = _tiny_gemma3(vocab, torch.float32, head_dim=16)
    capped.config.attn_logit_softcapping = 50.0  # (Gemma 2's; SDPA would leave it out)
    assert gemma_decode.gemma_decoder(capped, CPU) is None
    assert gemma_decode.gemma_decoder(_tiny_gemma3(vocab, torch.float32, head_dim=16), torch.device("meta")) is None
    from transformers import LlamaConfig, LlamaForCausalLM

    gemma2 = _tiny_gemma2(vocab, torch.float32)
    assert type(gemma_decode.gemma_decoder(gemma2, CPU)) is gemma_decode.GemmaDecoder
    gemma2.config._attn_implementation = "sdpa"  # (which leaves its scores' cap out: its own forward, as it is)
    assert gemma_decode.gemma_decoder(gemma2, CPU) is None
    assert gemma_decode.gemma_decoder(LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)),
        CPU) is None
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    assert gemma_decode.gemma_decoder(model, CPU) is None
