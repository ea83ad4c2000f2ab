"""LoRA's forward with its scaling on the rank side and its update accumulated into the base output.

peft's ``lora.Linear`` computes ``result + lora_B(lora_A(x)) * scaling``: the scale multiplies a
``[tokens, out_features]`` tensor and the sum writes another, two passes over the layer's whole
output for what is a rank-16 correction. Here the scale multiplies ``x @ A.T``
(``[tokens, rank]``) and ``torch.addmm`` adds ``(x @ A.T) @ B.T`` into the base output inside the
matmul: the same sum, with one pass over the output instead of three. Measured on SmolLM2-135M's
training step the two elementwise ops were 7% of a fp32 ``forward_backward`` (AMD EPYC Zen 4,
docs/benchmark.md). For a plain (or oneDNN) base Linear the sum is made in place, into the base
output itself: ``addmm`` out of place copies that output first.

When the base weights are bf16 (and LoRA's, as peft keeps them, fp32), peft casts every
activation to fp32 for the LoRA product and the sum back to bf16: three more passes over
activations, and the LoRA matmuls in fp32. Here A and B are cast to the activations' dtype
instead (a ``rank x features`` copy), as ``torch.autocast`` would: the product runs in bf16, the
gradients still reach the fp32 master weights through the cast. The sampler's bf16 copy computes
its LoRA side path the same way (``LoraSidePath`` below, sampler_precision.py; the scale put into
B once), so bf16 training and bf16 sampling agree.

``fuse_lora_linears(model)`` gives every peft ``lora.Linear`` of ``model`` this forward. It takes
the layer's own path (peft's) for anything it does not cover: adapters disabled or merged, mixed
adapter batches, several active adapters, dropout, or a LoRA variant (DoRA).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from grpo.models.cpu_linear import LoraSideProduct, OneDNNLinear, PackedLinear, packed_product

MARK = "_grpo_fused_lora"


def fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's ``lora.Linear.forward``, one active vanilla adapter without dropout made cheaper."""
    active = self.active_adapters
    adapter = active[0] if len(active) == 1 else None
    if (args or kwargs or self.disable_adapters or self.merged or adapter is None or adapter not in self.lora_A
            or adapter in self.lora_variant or not isinstance(self.lora_dropout[adapter], nn.Identity)):
        return type(self).forward(self, x, *args, **kwargs)
    a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
    if a.dtype != x.dtype:  # fp32 master weights, bf16 activations: compute in bf16 (see above)
        a, b = a.to(x.dtype), b.to(x.dtype)
    if type(self.base_layer) in _KEEPS_NO_OUTPUT:
        # rows flattened first: the base's output is then a tensor of its own, not a view, and the
        # LoRA product is added into it in place (an in-place write to a view would have autograd
        # clone the whole gradient in the backward instead)
        rows = x.reshape(-1, x.shape[-1])
        out = lora_side_path(self.base_layer(rows), rows, a, b, self.scaling[adapter], in_place=True)
        return out.view(*x.shape[:-1], out.shape[-1])
    return lora_side_path(self.base_layer(x), x, a, b, self.scaling[adapter])


def lora_side_path(base_out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   scaling: float, in_place: bool = False) -> torch.Tensor:
    """``base_out + scaling * (x @ a.T) @ b.T``, the scale on the rank side, the sum in the matmul.

    ``in_place``: written into ``base_out``, 2-d rows that are no view and that their producer's
    backward does not need. Out of place, ``addmm`` first copies the whole base output: 50-63 ms
    of a 1.0-1.1 s fp32 training forward of SmolLM2 (Intel Xeon with AMX, docs/benchmark.md)."""
    down = nn.functional.linear(x, a) * scaling
    if in_place:
        return base_out.addmm_(down, b.t())
    flat = torch.addmm(base_out.reshape(-1, base_out.shape[-1]), down.reshape(-1, down.shape[-1]), b.t())
    return flat.view(base_out.shape)


class LoraSidePath(nn.Module):
    """``base(x) + (x @ A.T) @ (scaling * B).T``, all in the base's dtype, without gradients: the
    scale is put into B once (exact for LoRA's usual power-of-two ``alpha / r``) rather than
    multiplied into every step's activations, and the sum is made inside the matmul, in place."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype):
        super().__init__()
        self.base = base
        # (packed in the base's layout, where the base is a PackedLinear: cpu_linear.py)
        self.product = LoraSideProduct(a.detach().to(dtype).clone(), (b.detach().float() * scaling).to(dtype),
                                       getattr(base, "layout", "onednn"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.base) is PackedLinear:  # (in the streaming layout, one product: cpu_linear.py)
            return packed_product(x, self.base.packed, self.base.bias, self.product)
        return self.product.add_to(self.base(x), x)


# Base layers whose backward keeps their input and weight, never their output: the LoRA product may
# be added into that output in place.
_KEEPS_NO_OUTPUT = (nn.Linear, OneDNNLinear)


def fuse_lora_linears(model: nn.Module) -> int:
    """Give every peft ``lora.Linear`` in ``model`` the fused forward; the number of layers changed."""
    from peft.tuners.lora import Linear as LoraLinear

    changed = 0
    for module in model.modules():
        if type(module) is LoraLinear and not getattr(module, MARK, False):
            # an instance attribute: nn.Module.__call__ looks ``forward`` up on the instance first,
            # and the class's own forward stays reachable for the cases the fused one hands back
            module.forward = types.MethodType(fused_forward, module)
            setattr(module, MARK, True)
            changed += 1
    return changed
