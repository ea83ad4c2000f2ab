"""A model's RMSNorms and SiLU-gated MLPs through grpo's native kernels, forward and backward.

In a training pass of SmolLM2-135M (bench shape, ~800 packed tokens, Intel Xeon with AMX) each
RMSNorm is eight small operators forward and about as many backward (in bf16 two of them copies to
float32 and back), and each MLP's ``act_fn(gate) * up`` three forward and three backward, each a
pass over a [tokens, 1536] tensor. ``install`` routes every module that computes those through one
native call each way (native_kernels.cpp): bf16 training 1.58 -> 1.43 s a ``forward_backward``,
fp32 2.61 -> 2.59 s (docs/benchmark.md). The Linears stay the modules' own (LoRA included); the
kernels round to the model's dtype where the eager operators do, so outputs are the eager ones up
to the order of float sums; autograd saves the norm's input in the model's dtype, not a float32
copy, and the MLP's gate and up, not its activation as well.

A module class is taken only after its first instance computed the same as the kernel on a random
input (a norm that scales by ``1 + weight``, as Gemma's, or an MLP with another activation, keeps its
own forward), and each call falls back to the module's own forward where the kernel does not apply:
a norm whose weight is trained, mixed dtypes, a tensor off the CPU.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from grpo.backends.local import native_kernels

DTYPES = (torch.float32, torch.bfloat16)
# how far from the module's own forward a class's first instance may be (relative to the output's
# scale): float sums in another order move float32's last bits, and flip bf16's rounding now and then
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}

_ops = None  # torch.ops.grpo_native, set by install()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _ops.add_rms_norm(x, None, weight, eps)[1]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return _ops.rms_norm_backward(grad.contiguous(), x, weight, ctx.eps), None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _ops.silu_mul(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_gate, d_up = _ops.silu_mul_backward(grad.contiguous(), gate, up)
        return (d_gate if ctx.needs_input_grad[0] else None), (d_up if ctx.needs_input_grad[1] else None)


class _TargetLogprobs(torch.autograd.Function):
    """trainer._TargetLogprobs through the kernels: log_softmax at the targets and the entropies in
    two reads of the logits, in their own dtype (a bf16 model's logits are not copied to float32);
    the backward written over the logits, in that dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, entropy, stats = ops.target_logprobs(logits, targets)
        ctx.save_for_backward(logits, targets, stats)
        ctx.ops = ops
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, targets, stats = ctx.saved_tensors
        return ctx.ops.target_logprobs_backward_(grad.float().contiguous(), logits, targets, stats), None, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Float32 ``log_softmax(logits)[target]`` (differentiable) and entropy (not) of each row of a
    chunk of the unembedding's output, through the kernels; None where they do not apply (not
    built or switched off, not on a CPU, another dtype). The logits' memory is taken over for the
    gradient: they must be a tensor nothing else reads after the backward (a Linear's output)."""
    if logits.device.type != "cpu" or logits.dtype not in DTYPES or logits.dim() != 2 or not logits.is_contiguous():
        return None
    ops = native_kernels.kernels()
    return None if ops is None else _TargetLogprobs.apply(logits, targets.contiguous(), ops)


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
    x = _rows(hidden_states)
    if torch.is_grad_enabled() and x.requires_grad:
        out = _RMSNorm.apply(x, self.weight, self.variance_epsilon)
    else:
        out = _ops.add_rms_norm(x, None, self.weight, self.variance_epsilon)[1]
    return out.view(hidden_states.shape)


def silu_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, the activation and product through the
    kernels where they apply (bound by ``install``)."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.shape != up.shape or not _native(gate, up):
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(_native_silu_mul(gate, up))


def _native_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = _rows(gate), _rows(up)
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _SiluMul.apply(g, u).view(gate.shape)
    return _ops.silu_mul(g, u).view(gate.shape)


def _native_silu_mlp(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_native_silu_mul(self.gate_proj(x), self.up_proj(x)))


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _is_silu_mlp(module: nn.Module) -> bool:
    from transformers.activations import SiLUActivation

    return (all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(module, "act_fn", None)) in (SiLUActivation, nn.SiLU))


# each installed forward -> its kernel path alone, which a class's first instance is checked on
_KERNEL_PATH = {rms_norm_forward: _native_rms_norm, silu_mlp_forward: _native_silu_mlp}


def _computes_the_same(module: nn.Module, forward, width: int) -> bool:
    """Whether ``forward``'s kernel path gives what the module's own forward gives on a random
    input of ``width`` features, within ``TOLERANCE`` of the module's dtype."""
    parameter = next(module.parameters())
    if parameter.dtype not in DTYPES or parameter.device.type != "cpu":
        return False
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 3, width, generator=generator) * 2).to(parameter.dtype)
    with torch.no_grad():
        want = type(module).forward(module, x).float()
        got = _KERNEL_PATH[forward](module, x).float()
    scale = want.abs().clamp_min(want.abs().mean().item() + 1e-12)
    return got.shape == want.shape and bool((((got - want).abs() / scale) <= TOLERANCE[parameter.dtype]).all())


def install(model: nn.Module) -> int:
    """Route ``model``'s RMSNorms and SiLU MLPs through the native kernels (on a CPU, where they are
    built and not switched off); returns how many modules now use them. A module class is taken
    when its first instance computes what the kernel computes; ``uninstall`` undoes this."""
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
        if _is_rms_norm(module):
            forward, width = rms_norm_forward, module.weight.shape[0]
        elif _is_silu_mlp(module):
            forward, width = silu_mlp_forward, getattr(module.gate_proj, "in_features", None)
            if not isinstance(width, int):
                continue
        else:
            continue
        key = (type(module), forward)
        if key not in verdicts:
            verdicts[key] = _computes_the_same(module, forward, width)
        if verdicts[key]:
            module.forward = types.MethodType(forward, module)
            count += 1
    return count


def uninstall(model: nn.Module) -> None:
    """Every module ``install`` routed back to its own forward."""
    for module in model.modules():
        bound = vars(module).get("forward")
        if isinstance(bound, types.MethodType) and bound.__func__ in (rms_norm_forward, silu_mlp_forward):
            del module.forward
