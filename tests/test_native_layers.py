"""The trainer's RMSNorms, gated MLPs (SiLU, GELU-tanh), rotary embeddings and loss head through the native kernels
compute what transformers' modules and the trainer's PyTorch path compute, forward and backward,
and only where they apply.

Each backward kernel against autograd through the operators it replaces (float32 to a few ulps,
bf16 to one rounding step); ``install`` on random Llama and Qwen2 models, routed and unrouted, each
against a float64 run of the same weights (outputs and every gradient); modules that compute
something else keep their own forward; and a ``forward_backward`` through the local backend
matches one with the kernels switched off.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from backend_helpers import ULP, worst_relative_error
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
)

from grpo.backends.local import ServiceClient, native_layers
from grpo.models import native_kernels
from grpo.types import Datum, ModelInput, TensorData

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [48, 576])
def test_rms_norm_backward_is_autograds_through_llamas_norm(native_ops, dtype, dim) -> None:
    torch.manual_seed(0)
    norm = LlamaRMSNorm(dim, eps=1e-5).to(dtype).requires_grad_(False)
    norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(37, dim) * 3).to(dtype).requires_grad_()
    grad = torch.randn(37, dim).to(dtype)
    norm(x).backward(grad)
    got = native_ops.rms_norm_backward(grad, x.detach(), norm.weight, norm.variance_epsilon)
    # float32: sums in another order; bf16: the eager backward rounds more of its steps to bf16
    assert worst_relative_error(got, x.grad) <= (16 if dtype == torch.float32 else 2) * ULP[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_backward_is_autograds_through_llamas_activation(native_ops, dtype) -> None:
    torch.manual_seed(0)
    gate = (torch.randn(29, 96) * 4).to(dtype).requires_grad_()
    up = torch.randn(29, 96).to(dtype).requires_grad_()
    grad = torch.randn(29, 96).to(dtype)
    (nn.functional.silu(gate) * up).backward(grad)
    d_gate, d_up = native_ops.silu_mul_backward(grad, gate.detach(), up.detach())
    assert worst_relative_error(d_gate, gate.grad) <= 8 * ULP[dtype]
    assert worst_relative_error(d_up, up.grad) <= 8 * ULP[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_backward_is_autograds_through_gemmas_activation(native_ops, dtype) -> None:
    """Gemma's MLP (gelu_pytorch_tanh): the kernel's derivative, s + 2 x s (1 - s) u' with
    s = sigmoid(2u), is PyTorch's 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u' in other float steps."""
    torch.manual_seed(0)
    gate = (torch.randn(29, 96) * 4).to(dtype)
    gate[0, :6] = torch.tensor([-30.0, -0.7518, -1e-3, 0.0, 1e-3, 30.0])  # the tails, the slope's zero, around 0
    gate.requires_grad_()
    up = torch.randn(29, 96).to(dtype).requires_grad_()
    grad = torch.randn(29, 96).to(dtype)
    (nn.functional.gelu(gate, approximate="tanh") * up).backward(grad)
    d_gate, d_up = native_ops.gelu_tanh_mul_backward(grad, gate.detach(), up.detach())
    ulps = 64 if dtype == torch.float32 else 2
    assert worst_relative_error(d_gate, gate.grad) <= ulps * ULP[dtype]
    assert worst_relative_error(d_up, up.grad) <= ulps * ULP[dtype]
    with pytest.raises(RuntimeError, match="gelu_tanh_mul_backward: grad, gate and up must be contiguous"):
        native_ops.gelu_tanh_mul_backward(grad, gate.detach(), torch.randn(96, 29).to(dtype).t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [8, 64])
def test_rope_is_transformers_rotary_embedding_forward_and_backward(native_ops, dtype, dim) -> None:
    """q and k of 13 positions, 3 heads, through apply_rotary_pos_emb and autograd against the
    kernel, both ways: the same roundings, so float32 to float rounding, bf16 to one step."""
    gen = torch.Generator().manual_seed(0)
    angles = torch.rand(13, dim // 2, generator=gen) * 20
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = torch.randn(13, 3 * dim, generator=gen).to(dtype)
    grad = torch.randn(13, 3 * dim, generator=gen).to(dtype)
    eager_in = x.clone().requires_grad_()
    heads_first = eager_in.view(1, 13, 3, dim).transpose(1, 2)
    rotated, _ = apply_rotary_pos_emb(heads_first, heads_first, cos[None], sin[None])
    rotated.transpose(1, 2).reshape(13, 3 * dim).backward(grad)
    want = rotated.transpose(1, 2).reshape(13, 3 * dim)
    ulps = 4 if dtype == torch.float32 else 1
    assert worst_relative_error(native_ops.rope(x, cos, sin, 3, False), want) <= ulps * ULP[dtype]
    assert worst_relative_error(native_ops.rope(grad, cos, sin, 3, True), eager_in.grad) <= ulps * ULP[dtype]


def test_an_attention_with_query_and_key_norms_keeps_its_own_forward(native_ops) -> None:
    """Qwen3 normalises q and k per head before the rotary embedding: not Llama's attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Qwen3ForCausalLM(config)
    native_layers.install(model)
    attentions = [m for m in model.modules() if type(m).__name__ == "Qwen3Attention"]
    assert attentions and not any("forward" in vars(m) for m in attentions)
    assert any("forward" in vars(m) for m in model.modules())  # its norms and MLPs are Llama's


def test_the_backward_kernels_refuse_bad_input_with_what_was_expected(native_ops) -> None:
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match=r"rms_norm_backward: grad and x must be contiguous \[4, 8\]"):
        native_ops.rms_norm_backward(torch.randn(4, 9), x, w, 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm_backward: grad, x and weight must share one dtype"):
        native_ops.rms_norm_backward(x.double(), x.double(), w, 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul_backward: grad, gate and up must be contiguous and of one shape"):
        native_ops.silu_mul_backward(x, x, torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="float32 or bfloat16 tensors only"):
        native_ops.silu_mul_backward(x.double(), x.double(), x.double())
    with pytest.raises(RuntimeError, match=r"rope: cos and sin must be contiguous \[4, 4\]"):
        native_ops.rope(x, torch.ones(4, 8), torch.ones(4, 8), 2, False)
    with pytest.raises(RuntimeError, match="rope: x must be"):
        native_ops.rope(x, torch.ones(4, 8), torch.ones(4, 8), 3, False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_loss_head_is_the_trainers_log_softmax_entropy_and_gradient(native_ops, dtype) -> None:
    """native_layers.target_logprobs against trainer._TargetLogprobs (PyTorch's operators) run in
    float64 on the same logits: logprobs, entropies, and the logits' gradient in the logits' dtype."""
    from grpo.backends.local.trainer import _TargetLogprobs

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(19, 3001, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 3001, (19,), generator=gen)
    targets[3] = logits[3].float().argmax()  # a target holding most of the mass: 1 - p near 0
    weights = torch.randn(19, generator=gen)
    want_in = logits.double().clone().requires_grad_()
    want_lp, want_ent = _TargetLogprobs.apply(want_in, targets)
    (want_lp * weights.double()).sum().backward()
    got_in = logits.detach().clone().requires_grad_()
    got_lp, got_ent = native_layers.target_logprobs(got_in * 1, targets)  # (a non-leaf: its memory is taken)
    (got_lp * weights).sum().backward()
    assert got_lp.dtype == got_ent.dtype == torch.float32
    assert (got_lp - want_lp).abs().max() < 2e-5
    assert (got_ent - want_ent).abs().max() < 2e-5
    assert got_in.grad.dtype == dtype
    # Any float32 softmax rounds exp()'s argument (a logit less the log-sum-exp, up to ~30 here):
    # each probability then carries that many ulps of relative error (PyTorch's own float32 path:
    # 0.8-3.4e-6 here, by CPU); bf16 rounds the gradient once more.
    argument = (want_in - want_in.logsumexp(-1, keepdim=True)).abs().max().item()
    bound = (argument + 8) * ULP[torch.float32] + (ULP[dtype] if dtype != torch.float32 else 0.0)
    assert worst_relative_error(got_in.grad, want_in.grad.to(dtype)) <= bound


def test_the_loss_head_takes_only_what_it_computes(native_ops) -> None:
    assert native_layers.target_logprobs(torch.zeros(3, 5, dtype=torch.float64), torch.zeros(3, dtype=torch.long)) \
        is None
    assert native_layers.target_logprobs(torch.zeros(5, 3).t(), torch.zeros(3, dtype=torch.long)) is None
    with pytest.raises(RuntimeError, match="target_logprobs: row 1 targets token 9 of 5"):
        native_layers.target_logprobs(torch.zeros(3, 5), torch.tensor([0, 9, 1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_loss_head_caps_gemma2s_logits_and_takes_the_gradient_through_the_cap(native_ops, dtype) -> None:
    """With Gemma 2's cap (softcap * tanh(logits / softcap), 30 in its checkpoints) the loss head caps
    each row in its pass over it: logprobs, entropies and the raw logits' gradient against float64
    autograd through the formula; the capped logits rounded once to bf16 in bf16 (an ulp at 30 is
    0.125: the logprobs within that); the cap matters at these logits (up to ~70: most of them where
    its derivative is neither 1 nor 0)."""
    from grpo.backends.local.trainer import _TargetLogprobs

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(19, 3001, generator=gen) * 15).to(dtype)
    targets = torch.randint(0, 3001, (19,), generator=gen)
    targets[3] = logits[3].float().argmax()
    weights = torch.randn(19, generator=gen)
    want_in = logits.double().clone().requires_grad_()
    want_lp, want_ent = _TargetLogprobs.apply(torch.tanh(want_in / 30.0) * 30.0, targets)
    (want_lp * weights.double()).sum().backward()
    got_in = logits.detach().clone().requires_grad_()
    got_lp, got_ent = native_layers.target_logprobs(got_in * 1, targets, 30.0)
    (got_lp * weights).sum().backward()
    bound = 2e-5 if dtype == torch.float32 else 0.15
    assert (got_lp - want_lp).abs().max() < bound
    assert (got_ent - want_ent).abs().max() < bound
    assert got_in.grad.dtype == dtype
    grad_bound = 1e-5 if dtype == torch.float32 else 0.02
    assert (got_in.grad.double() - want_in.grad).abs().max() <= grad_bound * want_in.grad.abs().max()
    uncapped, _ = native_layers.target_logprobs(logits.clone(), targets)
    assert (uncapped - want_lp).abs().max() > 10.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_cap_caps_in_place_each_value_rounded_once(native_ops, dtype) -> None:
    """The sampler's cap on Gemma 2's logits: float32's to a few ulps of the formula in float64, and
    bf16's that float32 result rounded once (PyTorch's three operators round three times)."""
    gen = torch.Generator().manual_seed(1)
    raw = (torch.randn(5, 1003, generator=gen) * 40).to(dtype)
    logits = raw.clone()
    out = native_ops.soft_cap_(logits, 30.0)
    assert out.data_ptr() == logits.data_ptr()  # (in place)
    want = torch.tanh(raw.double() / 30.0) * 30.0
    if dtype == torch.float32:
        assert (out.double() - want).abs().max() <= 8 * ULP[torch.float32] * 30
    else:
        assert torch.equal(out, native_ops.soft_cap_(raw.float(), 30.0).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="soft_cap_: softcap must be positive, got 0"):
        native_ops.soft_cap_(raw.clone(), 0.0)
    with pytest.raises(RuntimeError, match="soft_cap_: logits must be a contiguous CPU tensor"):
        native_ops.soft_cap_(raw.t(), 30.0)
    with pytest.raises(RuntimeError, match="target_logprobs: softcap must be 0 \\(none\\) or the logits' cap"):
        native_ops.target_logprobs(raw.clone(), torch.zeros(5, dtype=torch.long), -1.0)


def _llama(dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    for module in model.modules():  # norms away from 1, so that a wrong weight would show
        if isinstance(module, LlamaRMSNorm):
            module.weight.data.uniform_(0.5, 1.5)
    return model


def _forward_backward(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=tokens).logits.float()
    (logits.square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_as_exact_as_its_own_forward(reference, eager, routed) -> None:
    """The routed model is no further from a float64 run of the same weights than the unrouted
    one, give or take the unrouted model's own float error: each tensor's error at most the eager
    error on it plus the eager model's worst. Measured against each other instead, the two paths'
    errors add (float32 on an Intel Xeon without AMX: 1.2e-5 apart, each ~8e-6 from float64, on
    an embedding's gradient), and a fixed bound set on one CPU fails on the next."""
    names = ["logits", *reference[1]]
    assert sorted(routed[1]) == sorted(eager[1]) == sorted(reference[1]) and len(names) > 10

    def errors(got):
        return [worst_relative_error(got[0], reference[0])] + [
            worst_relative_error(got[1][n], reference[1][n]) for n in names[1:]]

    eager_errors, routed_errors = errors(eager), errors(routed)
    slack = max(eager_errors)
    for name, eager_error, routed_error in zip(names, eager_errors, routed_errors, strict=True):
        assert routed_error <= eager_error + slack, (name, routed_error, eager_error, slack)


@pytest.mark.parametrize("dtype", DTYPES)
def test_installed_a_models_outputs_and_gradients_are_its_own(native_ops, dtype) -> None:
    """Every parameter trained but the norms' (as LoRA leaves them): the input gradients flow
    through the native backward of every norm and MLP into every Linear's weight gradient."""
    model = _llama(dtype)
    for module in model.modules():
        if isinstance(module, LlamaRMSNorm):
            module.weight.requires_grad_(False)
    tokens = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    reference = _forward_backward(copy.deepcopy(model).double(), tokens)
    eager = _forward_backward(model, tokens)
    # two norms a layer and the final one; two MLPs; two attentions
    assert native_layers.install(model) == 2 * 2 + 1 + 2 + 2
    assert all(type(vars(m).get("forward")) is types.MethodType for m in model.modules()
               if isinstance(m, (LlamaMLP, LlamaAttention)))
    _assert_as_exact_as_its_own_forward(reference, eager, _forward_backward(model, tokens))
    native_layers.uninstall(model)
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(_forward_backward(model, tokens)[0], eager[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma3s_norms_and_gelu_mlps_are_taken_and_compute_the_same(native_ops, dtype) -> None:
    """Gemma 3 (270M, 1B): its four zero-centred norms a layer, q's and k's, the final one and its
    GELU-tanh MLPs are routed (its attention, which normalises q and k, keeps its own forward); the
    outputs and every gradient stay its own."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm

    config = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(dtype)
    for module in model.modules():
        if isinstance(module, Gemma3RMSNorm):  # (a fresh one's weight is zero: 1 + 0 would hide it)
            module.weight.data.uniform_(-0.5, 0.5)
            module.weight.requires_grad_(False)
    tokens = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    reference = _forward_backward(copy.deepcopy(model).double(), tokens)
    eager = _forward_backward(model, tokens)
    assert native_layers.install(model) == 2 * (4 + 2) + 1 + 2
    assert all(type(vars(m).get("forward")) is types.MethodType for m in model.modules() if isinstance(m, Gemma3MLP))
    _assert_as_exact_as_its_own_forward(reference, eager, _forward_backward(model, tokens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen2s_modules_with_their_biases_are_taken_and_compute_the_same(native_ops, dtype) -> None:
    """Qwen2 (the family most GRPO runs start from) has biases on q/k/v: its attention, norms and
    MLPs are routed, and outputs and gradients stay its own."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype)
    for module in model.modules():
        if type(module).__name__ == "Qwen2RMSNorm":
            module.weight.data.uniform_(0.5, 1.5)
            module.weight.requires_grad_(False)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    tokens = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    reference = _forward_backward(copy.deepcopy(model).double(), tokens)
    eager = _forward_backward(model, tokens)
    assert native_layers.install(model) == 2 * 2 + 1 + 2 + 2
    assert {type(m).__name__ for m in model.modules() if "forward" in vars(m)} == {
        "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"}
    _assert_as_exact_as_its_own_forward(reference, eager, _forward_backward(model, tokens))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_windowed_attention_is_routed_with_the_window_its_own_forward_passes(native_ops, family) -> None:
    """Mistral's window (read from its config) and a Qwen2's windowed upper layer's (its own) reach
    the attention the routed forward calls, as the interface arguments its own forward passes:
    a packed pass of sequences longer than the window computes through the kernels what it
    computes without (the window dropped, as before: every key attended, logits ~0.2 apart)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from grpo.backends.local.packed_attention import PackedPass

    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, sliding_window=3)
    if family == "mistral":
        model, windows = MistralForCausalLM(MistralConfig(**sizes)), [3, 3]
    else:
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, max_window_layers=1, **sizes))
        windows = [None, 3]
    model.config._attn_implementation = "sdpa"
    lengths = [9, 6]
    ids = torch.randint(0, 97, (sum(lengths),), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = PackedPass(lengths, torch.device("cpu")).run(model.model, ids)
        assert native_layers.install(model) == 2 * 2 + 1 + 2 + 2
        recorded = [vars(layer.self_attn)[native_layers.INTERFACE_KWARGS] for layer in model.model.layers]
        assert [r.get("sliding_window") for r in recorded] == windows
        got = PackedPass(lengths, torch.device("cpu")).run(model.model, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    native_layers.uninstall(model)
    assert not any(native_layers.INTERFACE_KWARGS in vars(m) for m in model.modules())


def test_a_norm_whose_weight_trains_or_whose_input_is_another_dtype_runs_its_own_forward(native_ops) -> None:
    model = _llama(torch.float32)
    native_layers.install(model)
    norm = model.model.norm
    x = torch.randn(2, 5, 64, requires_grad=True)
    norm(x).sum().backward()  # the weight trains (a fresh model's do): autograd's own path
    assert norm.weight.grad is not None and x.grad is not None
    want = LlamaRMSNorm.forward(norm, x.double())
    assert torch.equal(norm(x.double()), want)  # float64: not a kernel dtype


def test_modules_that_compute_something_else_keep_their_own_forward(native_ops) -> None:
    class OnePlusWeightNorm(LlamaRMSNorm):  # Gemma's convention: scaled by 1 + weight
        def forward(self, hidden_states):
            variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
            normed = hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon)
            return (normed * (1.0 + self.weight.float())).to(hidden_states.dtype)

    class GeluMLP(LlamaMLP):
        def __init__(self, config):
            super().__init__(config)
            self.act_fn = nn.GELU()

    model = _llama(torch.float32)
    layer = model.model.layers[0]
    layer.input_layernorm = OnePlusWeightNorm(64, eps=1e-5)
    layer.input_layernorm.weight.data.uniform_(-0.5, 0.5)
    layer.mlp = GeluMLP(model.config)
    routed = native_layers.install(model)
    assert "forward" not in vars(layer.input_layernorm) and "forward" not in vars(layer.mlp)
    assert routed == 2 * 2 + 1 + 2 + 2 - 2


def test_a_module_that_only_looks_like_a_norm_or_an_mlp_keeps_its_forward_and_the_model_loads(native_ops) -> None:
    """Attribute names match, the forward does not (it wants a second argument, or returns a tuple):
    install leaves them alone instead of failing the model's load."""
    class ScaledNorm(LlamaRMSNorm):
        def forward(self, hidden_states, scale):
            return super().forward(hidden_states) * scale

    class TupleMLP(LlamaMLP):
        def forward(self, x):
            return super().forward(x), None

    model = _llama(torch.float32)
    model.model.layers[0].input_layernorm = ScaledNorm(64, eps=1e-5)
    model.model.layers[1].mlp = TupleMLP(model.config)
    native_layers.install(model)
    assert "forward" not in vars(model.model.layers[0].input_layernorm)
    assert "forward" not in vars(model.model.layers[1].mlp)


def test_switched_off_nothing_is_installed(monkeypatch) -> None:
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    model = _llama(torch.float32)
    assert native_layers.install(model) == 0
    assert not any("forward" in vars(m) for m in model.modules())


def _datums(vocab: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for n in (9, 14, 6):
        tokens = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
        weights = [0.0] * 3 + [1.0] * (n - 3)
        out.append(Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": TensorData.from_torch(torch.tensor(tokens[1:])),
            "weights": TensorData.from_torch(torch.tensor(weights)),
        }))
    return out


@pytest.mark.parametrize("train_dtype", ["fp32", "bf16"])
def test_the_trainer_computes_through_the_kernels_what_it_computes_without(tmp_path, monkeypatch, native_ops,
                                                                          train_dtype) -> None:
    """The local backend installs them on its CPU model; a ``forward_backward`` (packed micro-batch,
    LoRA on every Linear) gives the loss and LoRA gradients it gives with the modules' own forwards
    and PyTorch's loss head."""
    service = ServiceClient(checkpoint_dir=tmp_path, device="cpu", train_dtype=train_dtype, sample_dtype=train_dtype)
    tc = service.create_lora_training_client("tiny", rank=4, seed=0)
    model = tc.engine.model
    assert any(type(vars(m).get("forward")) is types.MethodType for m in model.modules())
    state = tc.engine.adapter_state(tc.adapter)
    gen = torch.Generator().manual_seed(3)
    for name, tensor in state.items():  # LoRA B away from zero: every A gradient nonzero
        if "lora_B" in name:
            state[name] = torch.randn(tensor.shape, generator=gen) * 0.05
    tc.engine.load_adapter_state(tc.adapter, state)
    datums = _datums(tc.engine.vocab_size)
    parameters = tc.engine.adapter_parameters(tc.adapter)

    def run() -> tuple[float, dict[str, torch.Tensor]]:
        for p in parameters.values():
            p.grad = None
        loss = tc.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"]
        return loss, {n: p.grad.clone() for n, p in parameters.items()}

    loss, grads = run()
    native_layers.uninstall(model)
    monkeypatch.setattr(native_layers, "target_logprobs", lambda *args: None)  # the loss head's too
    want_loss, want_grads = run()
    bound = 1e-5 if train_dtype == "fp32" else 0.03
    assert abs(loss - want_loss) <= bound * abs(want_loss)
    for name, want in want_grads.items():
        assert want.abs().max() > 0, name
        assert worst_relative_error(grads[name], want) <= bound * (1 if train_dtype == "fp32" else 4), name


def test_the_samplers_own_copy_keeps_them_bound_to_its_own_modules(tmp_path, native_ops) -> None:
    """A bf16 sampler beside an fp32 trainer runs a deep copy of the model (sampler_precision.py):
    its routed modules must call their own weights, not the trainer's."""
    service = ServiceClient(checkpoint_dir=tmp_path, device="cpu", train_dtype="fp32", sample_dtype="bf16")
    tc = service.create_lora_training_client("tiny", rank=4, seed=0)
    copy = tc.engine._sampler_copy.model
    routed = [m for m in copy.modules() if "forward" in vars(m)]
    assert routed and all(m.forward.__self__ is m for m in routed)
    norm = copy.model.norm
    assert norm.weight.dtype == torch.bfloat16
    x = torch.randn(2, 3, norm.weight.shape[0]).to(torch.bfloat16)
    with torch.no_grad():
        assert worst_relative_error(norm(x), LlamaRMSNorm.forward(norm, x)) <= ULP[torch.bfloat16]


def _qwen3_5_norms(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    torch.manual_seed(0)
    plain, gated = Qwen3_5RMSNorm(96, eps=1e-6), Qwen3_5RMSNormGated(96, eps=1e-6)
    for norm in (plain, gated):
        norm.weight.data.uniform_(-0.5, 1.5)
    return plain.to(dtype).requires_grad_(False), gated.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_5s_zero_centred_and_gated_norms_are_autograds_through_their_modules(native_ops, dtype) -> None:
    """Outputs and gradients (the input's; the gate's too) through the kernels against the modules'
    own forward and autograd through it: bit for bit in bf16 (the kernels round where the eager
    operators store bf16), within float32 rounding otherwise."""
    plain, gated = _qwen3_5_norms(dtype)
    generator = torch.Generator().manual_seed(1)
    inputs = {plain: [(torch.randn(5, 7, 96, generator=generator) * 3).to(dtype)],
              gated: [(torch.randn(37, 96, generator=generator) * 3).to(dtype) for _ in range(2)]}
    for norm, xs in inputs.items():
        results = []
        for routed in (False, True):
            if routed:
                assert native_layers.install(norm) == 1 and "forward" in vars(norm)
            leaves = [x.clone().requires_grad_() for x in xs]
            out = norm(*leaves)
            (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
            results.append([out] + [x.grad for x in leaves])
        native_layers.uninstall(norm)
        for want, got in zip(*results, strict=True):
            if dtype == torch.bfloat16:
                assert torch.equal(got, want), type(norm).__name__
            else:
                assert worst_relative_error(got, want) <= 16 * ULP[dtype], type(norm).__name__


def test_qwen3_5s_norms_take_the_kernels_only_where_they_apply(native_ops) -> None:
    """A norm whose weight trains runs its own forward (the kernels give no weight gradient), and
    a gated norm given a gate of another shape too; the kernels say what a wrong input was."""
    plain, gated = _qwen3_5_norms(torch.float32)
    assert native_layers.install(plain) == 1 and native_layers.install(gated) == 1
    plain.weight.requires_grad_(True)
    plain(torch.randn(2, 96)).sum().backward()
    assert plain.weight.grad is not None
    x, one_gate = torch.randn(4, 96), torch.randn(1, 96)  # (broadcast by the module's own forward)
    assert torch.equal(gated(x, one_gate), type(gated).forward(gated, x, one_gate))
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous \[96\]"):
        native_ops.zero_centred_rms_norm(x, torch.zeros(95), 1e-6)
    with pytest.raises(RuntimeError, match=r"gate must be a contiguous Float \[4, 96\]"):
        native_ops.gated_rms_norm(x, torch.zeros(4, 95), gated.weight, 1e-6)
