"""A model's RMSNorms, gated MLPs (SiLU, Gemma's GELU), rotary embeddings and loss head through
grpo's native kernels, forward and backward.

In a training pass of SmolLM2-135M (bench shape, ~800 packed tokens, Intel Xeon with AMX) each
RMSNorm is eight small operators forward and about as many backward (in bf16 two of them copies to
float32 and back), each MLP's ``act_fn(gate) * up`` three forward and three backward, the rotary
embedding of q and k ten each way, and the loss head (log_softmax at the targets, the entropy,
their backward) sweeps a chunk of logits about eight times: each a pass over a large tensor.
``install`` routes every module that computes those through one native call each way
(grpo/models/native/layers.cpp), and ``target_logprobs`` does the loss head in three passes; in one process,
alternating, a bf16 ``forward_backward`` took 1.64 s against 1.88 s, fp32 2.63 against 2.74
(docs/benchmark.md). Norms other than Llama's have kernels of their own
(grpo/models/native/zero_centred_norms.cpp): the zero-centred one that scales by ``1 + weight`` in
float32 (Qwen3.5's, Qwen3-Next's, Gemma's) and Qwen3.5's gated norm after its delta rule (times SiLU
of a gate). The Linears stay the modules' own (LoRA included); the kernels round to the
model's dtype where the eager operators do, so outputs are the eager ones up to the order of float
sums; autograd saves the norm's input in the model's dtype, not a float32 copy, and the MLP's gate
and up, not its activation as well.

A module class is taken only after its first instance computed the same as the kernel on a random
input (a Llama-named norm that scales by ``1 + weight``, an MLP with another activation, an
attention that normalises q and k, as Qwen3's, keep their own forward), and each call falls back
to the module's own forward where the kernel does not apply: a norm whose weight is trained, mixed
dtypes, a tensor off the CPU, an attention call with a KV cache (the sampler's prefill). A routed
attention hands transformers' attention interface what its own forward hands it (its sliding
window, a soft-cap, sinks: ``interface_kwargs``, recorded per layer at ``install``).
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from grpo.models import native_kernels

DTYPES = (torch.float32, torch.bfloat16)
# how far from the module's own forward a class's first instance may be (relative to the output's
# scale): float sums in another order move float32's last bits, and flip bf16's rounding now and then
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}

_ops = None  # torch.ops.grpo_native, set by install()


class _RMSNorm(torch.autograd.Function):
    """An RMSNorm through the kernels: Llama's (``_llama_norm``, ``rms_norm_backward``) or the
    zero-centred one (``zero_centred_rms_norm`` and its backward), the weight not trained."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, norm, norm_backward) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.norm_backward = eps, norm_backward
        return norm(x, weight, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return ctx.norm_backward(grad.contiguous(), x, weight, ctx.eps), None, None, None, None


def _llama_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ops.add_rms_norm(x, None, weight, eps)[1]


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, gate, weight)
        ctx.eps = eps
        return _ops.gated_rms_norm(x, gate, weight, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, gate, weight = ctx.saved_tensors
        d_x, d_gate = _ops.gated_rms_norm_backward(grad.contiguous(), x, gate, weight, ctx.eps)
        return (d_x if ctx.needs_input_grad[0] else None), (d_gate if ctx.needs_input_grad[1] else None), None, None


class _ActivationMul(torch.autograd.Function):
    """``act(gate) * up`` through a kernel and its backward (``silu_mul``, ``gelu_tanh_mul``): gate
    and up saved, not the activation as well."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, kernel, kernel_backward) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.kernel_backward = kernel_backward
        return kernel(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_gate, d_up = ctx.kernel_backward(grad.contiguous(), gate, up)
        return (d_gate if ctx.needs_input_grad[0] else None), (d_up if ctx.needs_input_grad[1] else None), None, None


class _TargetLogprobs(torch.autograd.Function):
    """trainer._TargetLogprobs through the kernels: log_softmax at the targets and the entropies in
    two reads of the logits, in their own dtype (a bf16 model's logits are not copied to float32);
    the backward written over the logits, in that dtype. With ``softcap`` (Gemma 2's logits) the
    logits are capped first, in place, and the backward goes back through the cap."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, softcap: float,
                ops) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, entropy, stats = ops.target_logprobs(logits, targets, softcap)
        ctx.save_for_backward(logits, targets, stats)
        ctx.softcap, ctx.ops = softcap, ops
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, targets, stats = ctx.saved_tensors
        return (ctx.ops.target_logprobs_backward_(grad.float().contiguous(), logits, targets, stats, ctx.softcap),
                None, None, None)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                    softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Float32 ``log_softmax(logits)[target]`` (differentiable) and entropy (not) of each row of a
    chunk of the unembedding's output, through the kernels; None where they do not apply (not
    built or switched off, not on a CPU, another dtype). The logits' memory is taken over -- capped
    in place where ``softcap`` is given (``softcap * tanh(logits / softcap)``, as ``soft_cap_``
    caps the sampler's), then written over with the gradient: they must be a tensor nothing else
    reads (a Linear's output)."""
    if not takes_logits(logits) or logits.dim() != 2 or not logits.is_contiguous():
        return None
    return _TargetLogprobs.apply(logits, targets.contiguous(), float(softcap or 0.0), native_kernels.kernels())


def logit_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and the log of its sum of exp(logit - max), float32, by the pass
    ``target_logprobs`` makes (float64 across blocks): a row's logprob of token t is then
    ``(logits[t] - max) - log_total``, the same bits as ``target_logprobs`` gives for t. For logits
    ``takes_logits`` accepts; no gradient."""
    zeros = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    stats = native_kernels.kernels().target_logprobs(logits, zeros)[2]
    return stats[:, 0], stats[:, 1]


def takes_logits(like: torch.Tensor) -> bool:
    """Whether ``target_logprobs`` computes the loss head of logits of ``like``'s device and dtype."""
    return like.device.type == "cpu" and like.dtype in DTYPES and native_kernels.kernels() is not None


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.heads = heads
        return _ops.rope(x, cos, sin, heads, False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _ops.rope(grad.contiguous(), cos, sin, ctx.heads, True), None, None, None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous [rows, last dim]."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def _native(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in DTYPES
            and all(t.dtype == first.dtype and t.device == first.device for t in tensors))


def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's forward, through the kernels where they apply (bound by ``install``)."""
    weight = self.weight
    if weight.requires_grad or not _native(hidden_states, weight):
        return type(self).forward(self, hidden_states)
    return _native_rms_norm(self, hidden_states)


def _native_rms_norm(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _normed(hidden_states, self.weight, self.variance_epsilon, _llama_norm, _ops.rms_norm_backward)


def _normed(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float, norm, norm_backward) -> torch.Tensor:
    """``hidden_states`` through an RMSNorm's kernels (``_RMSNorm``), its shape kept."""
    x = _rows(hidden_states)
    if torch.is_grad_enabled() and x.requires_grad:
        out = _RMSNorm.apply(x, weight, eps, norm, norm_backward)
    else:
        out = norm(x, weight, eps)
    return out.view(hidden_states.shape)


def zero_centred_rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A zero-centred RMSNorm's forward (``x r (1 + weight)``: Qwen3.5's, Gemma's), through the kernels
    where they apply (bound by ``install``)."""
    if self.weight.requires_grad or not _native(hidden_states, self.weight):
        return type(self).forward(self, hidden_states)
    return _native_zero_centred_rms_norm(self, hidden_states)


def _native_zero_centred_rms_norm(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _normed(hidden_states, self.weight, self.eps, _ops.zero_centred_rms_norm, _ops.zero_centred_rms_norm_backward)


def gated_rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's gated RMSNorm's forward (the norm, its weight, times SiLU of the gate), through the
    kernels where they apply (bound by ``install``)."""
    if (self.weight.requires_grad or gate.shape != hidden_states.shape
            or not _native(hidden_states, gate, self.weight)):
        return type(self).forward(self, hidden_states, gate)
    return _native_gated_rms_norm(self, hidden_states, gate)


def _native_gated_rms_norm(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    x, z = _rows(hidden_states), _rows(gate)
    if torch.is_grad_enabled() and (x.requires_grad or z.requires_grad):
        out = _GatedRMSNorm.apply(x, z, self.weight, self.variance_epsilon)
    else:
        out = _ops.gated_rms_norm(x, z, self.weight, self.variance_epsilon)
    return out.view(hidden_states.shape)


def silu_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, the activation and product through the
    kernels where they apply (bound by ``install``)."""
    return _gated_mlp(self, x, _ops.silu_mul, _ops.silu_mul_backward)


def gelu_tanh_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`` (Gemma's MLP), the same way."""
    return _gated_mlp(self, x, _ops.gelu_tanh_mul, _ops.gelu_tanh_mul_backward)


def _gated_mlp(self: nn.Module, x: torch.Tensor, kernel, kernel_backward) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.shape != up.shape or not _native(gate, up):
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(_native_activation_mul(gate, up, kernel, kernel_backward))


def _native_activation_mul(gate: torch.Tensor, up: torch.Tensor, kernel, kernel_backward) -> torch.Tensor:
    g, u = _rows(gate), _rows(up)
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _ActivationMul.apply(g, u, kernel, kernel_backward).view(gate.shape)
    return kernel(g, u).view(gate.shape)


def _native_silu_mlp(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_native_activation_mul(self.gate_proj(x), self.up_proj(x), _ops.silu_mul,
                                                 _ops.silu_mul_backward))


def _native_gelu_tanh_mlp(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_native_activation_mul(self.gate_proj(x), self.up_proj(x), _ops.gelu_tanh_mul,
                                                 _ops.gelu_tanh_mul_backward))


def rotary_attention_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings=None,
                             attention_mask=None, cache=None, **kwargs):
    """transformers' Llama attention with the rotary embedding of q and k through the kernels, for
    passes without a KV cache (training's); any other call takes the module's own forward."""
    if cache is not None or "past_key_values" in kwargs or position_embeddings is None \
            or not _native(hidden_states, position_embeddings[0]):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    return _native_rotary_attention(self, hidden_states, position_embeddings, attention_mask, **kwargs)


def _native_rotary_attention(self: nn.Module, hidden_states: torch.Tensor, position_embeddings, attention_mask,
                             **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    dim = self.head_dim
    # one row of angles per position of the input (a padded batch shares one set across its rows)
    cos, sin = (_rows(t.expand(*input_shape, t.shape[-1])) for t in position_embeddings)
    q, k = self.q_proj(hidden_states), self.k_proj(hidden_states)
    value = self.v_proj(hidden_states).view(*input_shape, -1, dim).transpose(1, 2)
    rotated = []
    for x in (q, k):
        rows = _rows(x)
        heads = rows.shape[-1] // dim
        grad = torch.is_grad_enabled() and rows.requires_grad
        out = _Rope.apply(rows, cos, sin, heads) if grad else _ops.rope(rows, cos, sin, heads, False)
        rotated.append(out.view(*input_shape, heads, dim).transpose(1, 2))
    query, key = rotated
    eager = sys.modules[type(self).__module__].eager_attention_forward
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    own = vars(self).get(INTERFACE_KWARGS, {})  # (its sliding window, soft-cap, sinks: as its forward passes them)
    out, weights = attention(self, query, key, value, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                             **{**own, **kwargs})
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


# The attention implementation ``interface_kwargs`` records calls with, and the attribute where
# ``install`` keeps each routed attention's record.
_RECORDER = "grpo_record_kwargs"
INTERFACE_KWARGS = "_grpo_interface_kwargs"


def interface_kwargs(module: nn.Module, inputs: tuple) -> dict | None:
    """The keyword arguments ``module``'s own forward hands transformers' attention interface
    besides dropout and scaling -- a sliding window (Mistral's read from its config, Qwen2's per
    layer), Gemma 2's soft-cap, GPT-OSS's sinks -- recorded from one call on ``inputs``; None
    where it makes no such call, or more than one. The routed forward hands the same, so that a
    window the trial's few positions cannot show is not dropped (Mistral's, Mixtral's and
    Starcoder2's windows were, in training, before)."""
    from transformers import AttentionInterface

    calls: list[dict] = []

    def record(_module, query, key, value, attention_mask, **kwargs):
        calls.append(kwargs)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    AttentionInterface.register(_RECORDER, record)
    config = module.config
    before = config._attn_implementation
    config._attn_implementation = _RECORDER
    try:
        with torch.no_grad():
            type(module).forward(module, *inputs)
    except (RuntimeError, TypeError, ValueError, AttributeError):
        return None
    finally:
        config._attn_implementation = before
    if len(calls) != 1:
        return None
    return {name: value for name, value in calls[0].items() if name not in ("dropout", "scaling")}


def _is_rotary_attention(module: nn.Module) -> bool:
    """Llama's attention layout: four projections, rotary q and k with nothing else applied to them
    (Qwen3's q_norm / k_norm is not), and transformers' attention interface to call."""
    own = sys.modules.get(type(module).__module__)
    return (all(isinstance(getattr(module, name, None), nn.Module) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and isinstance(getattr(module.q_proj, "in_features", None), int)
            and isinstance(getattr(module, "head_dim", None), int) and hasattr(module, "scaling")
            and hasattr(module, "config") and not hasattr(module, "q_norm") and not hasattr(module, "k_norm")
            and callable(getattr(own, "eager_attention_forward", None)))


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _is_zero_centred_rms_norm(module: nn.Module) -> bool:
    """A norm with a 1-d weight and ``eps`` (Qwen3.5's, Gemma's name it so; Llama's ``variance_epsilon``):
    whether it scales by ``1 + weight`` the trial decides."""
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1 and isinstance(getattr(module, "eps", None), float)
            and not hasattr(module, "variance_epsilon"))


def _is_gated_rms_norm(module: nn.Module) -> bool:
    """An RMSNorm whose forward takes a gate beside the hidden states (Qwen3.5's after its delta rule)."""
    if not _is_rms_norm(module):
        return False
    try:
        parameters = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return parameters[1:] == ["hidden_states", "gate"] and getattr(module, "activation", None) == "silu"


def _gated_mlp_activation(module: nn.Module) -> str | None:
    """"silu" or "gelu_tanh" for an MLP of gate, up and down projections with that activation
    (Llama's, Gemma's), else None."""
    from transformers.activations import SiLUActivation

    if not (all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj"))
            and isinstance(getattr(module.gate_proj, "in_features", None), int)):
        return None
    act = getattr(module, "act_fn", None)
    if type(act) in (SiLUActivation, nn.SiLU):
        return "silu"
    return "gelu_tanh" if is_gelu_tanh(act) else None


def is_gelu_tanh(act) -> bool:
    """Whether ``act`` is PyTorch's GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    from transformers.activations import GELUTanh

    inner = getattr(act, "act", None)  # (GELUTanh's partial of F.gelu)
    return (type(act) is GELUTanh and getattr(inner, "func", None) is torch.nn.functional.gelu
            and getattr(inner, "keywords", None) == {"approximate": "tanh"})


def _route(module: nn.Module):
    """The forward ``install`` would give ``module`` (None: it is none of the three)."""
    if _is_rotary_attention(module):
        return rotary_attention_forward
    if _is_gated_rms_norm(module):
        return gated_rms_norm_forward
    if _is_rms_norm(module):
        return rms_norm_forward
    if _is_zero_centred_rms_norm(module):
        return zero_centred_rms_norm_forward
    activation = _gated_mlp_activation(module)
    if activation is not None:
        return silu_mlp_forward if activation == "silu" else gelu_tanh_mlp_forward
    return None


FORWARDS = (rms_norm_forward, zero_centred_rms_norm_forward, gated_rms_norm_forward, silu_mlp_forward,
            gelu_tanh_mlp_forward, rotary_attention_forward)


def _trial(module: nn.Module, forward, dtype: torch.dtype) -> tuple:
    """A random input for ``forward``'s module: hidden states, and for an attention random rotary
    angles (no mask: causal, as transformers' SDPA takes it)."""
    generator = torch.Generator().manual_seed(0)
    if forward in (rms_norm_forward, zero_centred_rms_norm_forward):
        return ((torch.randn(1, 3, module.weight.shape[0], generator=generator) * 2).to(dtype),)
    if forward is gated_rms_norm_forward:
        return tuple((torch.randn(1, 3, module.weight.shape[0], generator=generator) * 2).to(dtype) for _ in range(2))
    if forward in (silu_mlp_forward, gelu_tanh_mlp_forward):
        return ((torch.randn(1, 3, module.gate_proj.in_features, generator=generator) * 2).to(dtype),)
    x = torch.randn(1, 4, module.q_proj.in_features, generator=generator).to(dtype)
    angles = torch.rand(1, 4, module.head_dim // 2, generator=generator) * 6
    angles = torch.cat([angles, angles], dim=-1)
    return x, (angles.cos().to(dtype), angles.sin().to(dtype)), None


# each routed forward -> its kernel path alone, which a class's first instance is checked on
_KERNEL_PATH = {rms_norm_forward: _native_rms_norm, zero_centred_rms_norm_forward: _native_zero_centred_rms_norm,
                gated_rms_norm_forward: _native_gated_rms_norm, silu_mlp_forward: _native_silu_mlp,
                gelu_tanh_mlp_forward: _native_gelu_tanh_mlp,
                rotary_attention_forward: _native_rotary_attention}


def _computes_the_same(module: nn.Module, forward) -> bool:
    """Whether ``forward``'s kernel path gives what the module's own forward gives on a random
    input (``_trial``), within ``TOLERANCE`` of the module's dtype (an attention's interface
    arguments recorded first: ``interface_kwargs``)."""
    parameter = next(module.parameters())
    if parameter.dtype not in DTYPES or parameter.device.type != "cpu":
        return False
    inputs = _trial(module, forward, parameter.dtype)
    if forward is rotary_attention_forward and not _record_interface_kwargs(module):
        return False
    try:  # a module that only looks like one (its forward wants more, or other shapes) keeps its own
        with torch.no_grad():
            want = type(module).forward(module, *inputs)
            got = _KERNEL_PATH[forward](module, *inputs)
    except (RuntimeError, TypeError, ValueError, AttributeError):
        return False
    if forward is rotary_attention_forward:  # (output, attention weights)
        want, got = want[0], got[0]
    if not isinstance(want, torch.Tensor):
        return False
    tolerance = TOLERANCE[parameter.dtype]
    if forward is rotary_attention_forward and parameter.dtype != torch.float32:
        tolerance *= 4  # bf16: a flipped rounding of q or k moves the scores, so a few bf16 steps of the output
    return close_to(got, want, tolerance)


def close_to(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    """Whether ``got`` has ``want``'s shape and is within ``tolerance`` of it, relative to each value's
    magnitude or, where that is smaller, to ``want``'s mean magnitude (a kernel's trial against the
    module it would replace)."""
    if got.shape != want.shape:
        return False
    want, got = want.float(), got.float()
    scale = want.abs().clamp_min(want.abs().mean().item() + 1e-12)
    return bool((((got - want).abs() / scale) <= tolerance).all())


def _record_interface_kwargs(module: nn.Module) -> bool:
    """Keep on ``module`` what its forward hands the attention interface (``interface_kwargs``);
    False where that could not be recorded (the module keeps its own forward)."""
    parameter = next(module.parameters())
    recorded = interface_kwargs(module, _trial(module, rotary_attention_forward, parameter.dtype))
    if recorded is None:
        return False
    setattr(module, INTERFACE_KWARGS, recorded)
    return True


def install(model: nn.Module) -> int:
    """Route ``model``'s RMSNorms, SiLU MLPs and Llama-layout attentions through the native kernels
    (on a CPU, where they are built and not switched off); returns how many modules now use them. A
    module class is taken when its first instance computes what the kernel computes; ``uninstall``
    undoes this."""
    global _ops
    ops = native_kernels.kernels()
    if ops is None:
        return 0
    _ops = ops
    verdicts: dict[tuple[type, object], bool] = {}
    count = 0
    for module in model.modules():
        if "forward" in vars(module):
            continue  # already routed (or patched by someone else: theirs stays)
        forward = _route(module)
        if forward is None:
            continue
        key = (type(module), forward)
        if key not in verdicts:
            verdicts[key] = _computes_the_same(module, forward)
        if verdicts[key] and (forward is not rotary_attention_forward or INTERFACE_KWARGS in vars(module)
                              or _record_interface_kwargs(module)):  # (each layer's own: windows differ by layer)
            module.forward = types.MethodType(forward, module)
            count += 1
    return count


def uninstall(model: nn.Module) -> None:
    """Every module ``install`` routed back to its own forward."""
    for module in model.modules():
        bound = vars(module).get("forward")
        if isinstance(bound, types.MethodType) and bound.__func__ in FORWARDS:
            del module.forward
            vars(module).pop(INTERFACE_KWARGS, None)
