"""Qwen3.5's gated-delta-rule decoding step through the native kernel (delta_rule.py,
native/delta_rule.cpp), against transformers' own step."""

from __future__ import annotations

import pytest
import torch
import transformers
from backend_helpers import assert_logprobs_of_a_plain_forward, reference_function, tiny_qwen3_5
from transformers import DynamicCache
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

from grpo.backends.local import delta_rule, recurrent_sampler, sampler
from grpo.types import SamplingParams


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "v_dim"), [(16, 16), (128, 128), (64, 128)])
def test_the_kernel_steps_the_state_as_transformers_does(native_ops, dtype, dim, v_dim) -> None:
    """Grouped heads (4 value heads over 2 key heads), q/k/v as views of one row, in place; value
    heads of 128 (Qwen3.5's) by the path that holds a state row's sums in registers, where built."""
    generator = torch.Generator().manual_seed(0)
    rows, k_heads, v_heads = 3, 2, 4
    mixed = torch.randn(rows, 1, 2 * k_heads * dim + v_heads * v_dim, generator=generator).to(dtype)
    q, k, v = torch.split(mixed, [k_heads * dim, k_heads * dim, v_heads * v_dim], dim=-1)
    q, k, v = q.view(rows, 1, k_heads, dim), k.view(rows, 1, k_heads, dim), v.view(rows, 1, v_heads, v_dim)
    g = -torch.rand(rows, 1, v_heads, generator=generator) * 2
    beta = torch.rand(rows, 1, v_heads, generator=generator).to(dtype)
    state = torch.randn(rows, v_heads, dim, v_dim, generator=generator)
    want, want_state = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state.clone(),
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    got = native_ops.gated_delta_step_(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    assert torch.allclose(state, want_state, rtol=1e-5, atol=1e-6)  # (float32 in both: the state is)
    # transformers rounds its output to the inputs' dtype; the kernel's is float32, rounded by its caller
    assert torch.allclose(got.to(dtype).float(), want[:, 0].float(), rtol=1e-5 if dtype == torch.float32 else 2**-7,
                          atol=1e-6 if dtype == torch.float32 else 2**-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kernel", [4, 3])
@pytest.mark.parametrize("channels", [40, 43])
def test_the_convolution_steps_as_transformers_does(native_ops, dtype, with_bias, kernel, channels) -> None:
    """The short convolution's step: the window shifted in place, its output (SiLU after) as
    transformers' ``causal_conv1d_update`` rounds it, from a row of a wider tensor (bf16 windows
    of 4, Qwen3.5's, are shifted as one 64-bit word, eight channels at a time with avx512 and the
    rest -- 43's last 3 -- one at a time; others one value at a time)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    generator = torch.Generator().manual_seed(0)
    rows = 3
    state = torch.randn(rows, channels, kernel, generator=generator).to(dtype)
    wide = torch.randn(rows, 1, channels + 8, generator=generator).to(dtype)
    x = wide[:, :, :channels]
    weight = torch.randn(channels, kernel, generator=generator).to(dtype)
    bias = torch.randn(channels, generator=generator).to(dtype) if with_bias else None
    want_state = state.clone()
    want = causal_conv1d_update(x.transpose(1, 2), want_state, weight, bias, "silu")[:, :, 0]
    got = native_ops.causal_conv_step_(state, x[:, 0], weight, bias, True)
    assert torch.equal(state, want_state)
    ulp = 2**-23 if dtype == torch.float32 else 2**-7
    assert ((got.float() - want.float()).abs() <= 4 * ulp * want.float().abs().clamp_min(1)).all()


def test_the_kernel_names_what_is_wrong(native_ops) -> None:
    state = torch.zeros(2, 4, 16, 16, dtype=torch.bfloat16)
    q = torch.zeros(2, 2, 16)
    with pytest.raises(RuntimeError, match="state must be a contiguous float32"):
        native_ops.gated_delta_step_(state, q, q, torch.zeros(2, 4, 16), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="4 value heads over 3 key heads"):
        q = torch.zeros(2, 3, 16)
        native_ops.gated_delta_step_(state.float(), q, q, torch.zeros(2, 4, 16), torch.zeros(2, 4), torch.zeros(2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_layers_decode_as_the_model_does_and_get_their_forward_back(native_ops, dtype) -> None:
    model, _ = tiny_qwen3_5(dtype)
    prompt, step = torch.tensor([[1, 504, 3458, 314, 253]] * 2), torch.tensor([[28], [9906]])

    def two_steps() -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, cache=cache, use_cache=True)
            first = model(input_ids=step, cache=cache, use_cache=True).logits
            return torch.cat([first, model(input_ids=step.flip(0), cache=cache, use_cache=True).logits])

    want = two_steps()
    with delta_rule.routed(model) as routed:
        assert routed == 3  # (the three linear-attention layers)
        got = two_steps()
    assert not any("forward" in vars(m) for m in model.modules())
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert (got.float() - want.float()).abs().max().item() < tolerance * want.float().abs().max().item()


def test_a_hybrid_samples_its_steps_through_the_kernel_with_the_logprobs_of_a_plain_forward(native_ops,
                                                                                            monkeypatch) -> None:
    model, tokenizer = tiny_qwen3_5()
    kernel_steps = []
    monkeypatch.setattr(delta_rule, "_verdicts", {})  # (the class's trial runs here: one step of its first layer)
    real = delta_rule._step_states
    monkeypatch.setattr(delta_rule, "_step_states",
                        lambda *a: (lambda s: kernel_steps.append(s is not None) or s)(real(*a)))
    requests = [sampler.GenerationRequest(p, 2, SamplingParams(max_tokens=5, temperature=1.0, seed=i))
                for i, p in enumerate([[1, 504, 3458], [1, *range(42, 50)]])]
    stats = recurrent_sampler.generate_lockstep(model, requests, tokenizer, torch.device("cpu"))
    # the trial's step, then the prefill through each layer's own forward, then every decoding step the kernel's
    assert kernel_steps == [True] + [False] * 3 + [True] * (3 * stats.decode_steps)
    assert_logprobs_of_a_plain_forward(model, requests)


def test_a_layer_the_kernel_would_compute_otherwise_keeps_its_own_forward(native_ops) -> None:
    """float16 is not a precision the step was checked in: nothing is routed."""
    model, _ = tiny_qwen3_5(torch.float16)
    with delta_rule.routed(model) as routed:
        assert routed == 0


def test_chunks_are_fitted_to_the_sequence() -> None:
    """As few chunks of at most 64 positions as the sequence needs, as even as can be."""
    assert [delta_rule.fitted_chunk(n) for n in (1, 20, 32, 64, 65, 70, 128, 129, 200)] == \
        [1, 20, 32, 64, 33, 35, 64, 43, 50]


@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("positions", [1, 20, 70, 130])
def test_fitted_chunks_compute_the_reference_chunks_sums(positions, kernels, monkeypatch) -> None:
    """Outputs, final state and every input's gradient within float32 rounding of the reference's
    chunks of 64 (grouped heads: 4 value heads over 2 key heads; a state carried in): through the
    native kernel (tests/test_chunked_delta_rule.py) and, without it, the reference in fitted chunks."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    monkeypatch.setenv("GRPO_NATIVE_KERNELS", kernels)
    reference = reference_function(modeling_qwen3_5, "torch_chunk_gated_delta_rule")
    fitted = delta_rule._fitted_chunks(reference)
    generator = torch.Generator().manual_seed(positions)
    rows, k_heads, v_heads, dim = 2, 2, 4, 16
    inputs = [torch.randn(rows, positions, k_heads, dim, generator=generator),
              torch.randn(rows, positions, k_heads, dim, generator=generator),
              torch.randn(rows, positions, v_heads, dim, generator=generator),
              -torch.rand(rows, positions, v_heads, generator=generator),
              torch.rand(rows, positions, v_heads, generator=generator),
              torch.randn(rows, v_heads, dim, dim, generator=generator)]
    results = []
    for function in (reference, fitted):
        leaves = [x.clone().requires_grad_() for x in inputs]
        q, k, v, g, beta, state = leaves
        out, final = function(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        ((out * weights).sum() + final.square().sum()).backward()
        results.append([out, final] + [x.grad for x in leaves])
    for want, got in zip(*results, strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (want - got).abs().max()


@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 20, 11, 4), (2, 300, 2, 4), (2, 40, 9, 3)], ids=lambda s: "x".join(map(str, s)))
def test_the_left_padded_convolution_computes_the_references_bits(dtype, with_bias, kernels, shape,
                                                                  monkeypatch) -> None:
    """Output and gradients (input, taps, bias), SiLU after or none. In bfloat16: without the native
    kernel (PyTorch's convolution padded on the left) bit for bit the reference's; through it
    (short_conv.cpp: channels in blocks of 256, a filter of 4 taps unrolled, others not; fewer
    positions than taps) bit for bit the exact values rounded where the reference rounds
    (``_rounded_convolution``) -- which are the reference's own where oneDNN's bf16 convolution sums
    in float32 (AVX-512 CPUs), while its avx2 backward parts from them in the last bit. In float32
    within its rounding of the reference's (SiLU's vectorized loop, on contiguous values, and its
    strided one, on the reference's slice, part in the last bit now and then, and the taps' gradient
    sums the positions in another order). The input is the layer's: a rows x channels x positions
    view of channels-last memory."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    monkeypatch.setenv("GRPO_NATIVE_KERNELS", kernels)
    rows, channels, positions, taps = shape
    reference = reference_function(modeling_qwen3_5, "causal_conv1d_fn")
    padded = delta_rule._left_padded(reference)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, positions, channels, generator=generator).to(dtype).transpose(1, 2)
    weight = torch.randn(channels, taps, generator=generator).to(dtype)
    bias = torch.randn(channels, generator=generator).to(dtype) if with_bias else None
    for activation in ("silu", None):
        results = []
        for function in (reference, padded):
            leaves = [t.detach().clone().requires_grad_() for t in (x, weight) + ((bias,) if with_bias else ())]
            out = function(leaves[0], leaves[1], leaves[2] if with_bias else None, activation=activation)
            (out.float() * _upstream(out)).sum().backward()
            results.append([out] + [t.grad for t in leaves])
        if dtype == torch.bfloat16 and kernels == "on":
            results[0] = _rounded_convolution(x, weight, bias, activation)
        for want, got in zip(*results, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            if dtype == torch.bfloat16:
                assert torch.equal(got, want)
            else:
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)  # (float32 rounding, summed)


def _upstream(out: torch.Tensor) -> torch.Tensor:
    """The gradient the convolution tests give its output."""
    return torch.linspace(-1, 1, out.numel()).view(out.shape)


def _rounded_convolution(x, weight, bias, activation) -> list[torch.Tensor]:
    """The bf16 convolution's output and gradients of ``x``, ``weight`` (and ``bias``) under
    ``_upstream``, computed in float64 and rounded to bf16 where the reference stores bf16: the
    convolution's output, SiLU's, SiLU's gradient, and each gradient."""
    import torch.nn.functional as F

    leaves = [t.detach().double().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
    pre = F.conv1d(F.pad(leaves[0], (weight.shape[1] - 1, 0)), leaves[1].unsqueeze(1),
                   leaves[2] if bias is not None else None, groups=x.shape[1])
    rounded = pre.detach().bfloat16().double()
    upstream = _upstream(pre).bfloat16().double()  # (the output's gradient, cast to its dtype by autograd)
    if activation is None:
        out, d_pre = rounded, upstream
    else:
        sigmoid = torch.sigmoid(rounded)
        out = rounded * sigmoid
        d_pre = (upstream * (sigmoid * (1 + rounded * (1 - sigmoid)))).bfloat16().double()
    grads = torch.autograd.grad(pre, leaves, d_pre)
    return [out.bfloat16()] + [g.bfloat16() for g in grads]


def test_the_sequence_convolution_kernel_names_what_is_wrong(native_ops) -> None:
    x, weight = torch.zeros(2, 5, 8), torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match="channels contiguous"):
        native_ops.short_conv(x.transpose(1, 2), weight, None, True)
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous \[8, kernel\]"):
        native_ops.short_conv(x, torch.zeros(6, 4), None, True)
    with pytest.raises(RuntimeError, match="x and weight differ in dtype"):
        native_ops.short_conv(x, weight.bfloat16(), None, True)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \[8\]"):
        native_ops.short_conv(x, weight, torch.zeros(3), True)
    with pytest.raises(RuntimeError, match="grad must be a Float"):
        native_ops.short_conv_backward(x[:, :2], x, weight, None, True, False)


def test_a_convolution_kernel_that_fails_its_trial_is_not_taken(native_ops, monkeypatch, capsys) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    reference, calls = reference_function(modeling_qwen3_5, "causal_conv1d_fn"), []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return reference(*args, **kwargs)

    monkeypatch.setattr(delta_rule, "_conv_verdicts", {})
    real = delta_rule._sequence_conv
    monkeypatch.setattr(delta_rule, "_sequence_conv", lambda *args: real(*args) * 1.01)
    x, weight = torch.randn(2, 5, 8).transpose(1, 2), torch.randn(8, 4)
    out = delta_rule._left_padded(spy)(x, weight, None, activation="silu")
    assert calls == [(3, 24, 9)]  # (the trial's; the call itself: PyTorch's convolution, padded on the left)
    assert "native short convolution did not compute the reference's values" in capsys.readouterr().err
    assert torch.allclose(out, reference(x, weight, None, activation="silu"), rtol=1e-5, atol=1e-6)


def test_fit_prefill_takes_only_transformers_references(monkeypatch) -> None:
    """Which functions are taken, and the chunks the reference is given where the native kernel
    does not take the call (here: switched off)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    monkeypatch.setenv("GRPO_NATIVE_KERNELS", "off")
    model, _ = tiny_qwen3_5()
    chunked = reference_function(modeling_qwen3_5, "torch_chunk_gated_delta_rule")
    conv = reference_function(modeling_qwen3_5, "causal_conv1d_fn")
    for name, function in (("torch_chunk_gated_delta_rule", chunked), ("causal_conv1d_fn", conv)):
        monkeypatch.setattr(modeling_qwen3_5, name, function)  # (put back after)
    assert delta_rule.fit_prefill(model) == 2 and delta_rule.fit_prefill(model) == 2
    for name, function in (("torch_chunk_gated_delta_rule", chunked), ("causal_conv1d_fn", conv)):
        taken = getattr(modeling_qwen3_5, name)
        assert taken.fitted_by_grpo and taken.__wrapped__ is function  # (once, not wrapped again)
    chunks = []

    def spy(query, key, value, g, beta, chunk_size=64, *args, **kwargs):
        chunks.append(chunk_size)
        return chunked(query, key, value, g, beta, chunk_size, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", delta_rule._fitted_chunks(spy))
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, *range(40, 109)]]))  # (70 positions: two chunks of 35)
    assert chunks == [35] * 3
    q = torch.randn(1, 70, 2, 16)
    beta, g = torch.rand(1, 70, 2), -torch.rand(1, 70, 2)
    for named in ({"chunk_size": 16}, {}):  # (a chunk size named by keyword or position is the caller's)
        chunks.clear()
        if named:
            modeling_qwen3_5.torch_chunk_gated_delta_rule(q, q, q, g=g, beta=beta, **named)
        else:
            modeling_qwen3_5.torch_chunk_gated_delta_rule(q, q, q, g, beta, 16)
        assert chunks == [16]

    def users_kernel(*args, **kwargs):
        return chunked(*args, **kwargs)

    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", users_kernel)
    monkeypatch.setattr(modeling_qwen3_5, "causal_conv1d_fn", conv)
    monkeypatch.setattr(delta_rule.importlib.util, "find_spec",  # (as where causal-conv1d is installed)
                        lambda name, real=delta_rule.importlib.util.find_spec: object() if name == "causal_conv1d" else real(name))
    assert delta_rule.fit_prefill(model) == 0
    assert modeling_qwen3_5.torch_chunk_gated_delta_rule is users_kernel and modeling_qwen3_5.causal_conv1d_fn is conv


def test_fit_prefill_takes_qwen3_next_too(monkeypatch) -> None:
    """Qwen3-Next's module has the same reference functions (scripts/check_families.py samples and trains it)."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        monkeypatch.setattr(modeling_qwen3_next, name, reference_function(modeling_qwen3_next, name))  # (put back after)
    config = transformers.Qwen3NextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16)
    assert delta_rule.fit_prefill(transformers.Qwen3NextForCausalLM(config)) == 2
    assert modeling_qwen3_next.torch_chunk_gated_delta_rule.fitted_by_grpo
    assert modeling_qwen3_next.causal_conv1d_fn.fitted_by_grpo
