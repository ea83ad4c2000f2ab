"""Sampling through LoRA folded into the base weights.

An unmerged LoRA layer costs two extra matmuls, a scale and an add on every decode step, for
every adapted Linear (210 of them on SmolLM2 with all-linear LoRA): on a CPU that is ~10% of a
decode step. For sampling, where no gradient is needed, each adapted Linear is swapped for a plain
``nn.Linear`` whose weight is ``W + scaling * B @ A``, built once per set of adapter weights. On a
CPU with oneDNN it is kept only in a packed layout (``PackedLinear``, cpu_linear.py: oneDNN's, or
the streaming one where the engine measured it faster): the folding pays one reorder per layer,
and every decoding step multiplies without one. Sibling
projections sharing an input (q/k/v, gate/up) are folded into one stacked packed weight
(fused_projections.py): at a decoding step's ~24 rows each oneDNN call has a fixed cost, and the
stacked products of SmolLM2's 30 layers took 28.9-30.4 ms against 32.9-34.0 ms one by one
(float32, Intel Xeon with AMX, docs/benchmark.md).

The swap replaces modules in the tree and puts the originals back afterwards; the base weights
themselves are never written to, so nothing drifts (peft's merge/unmerge adds and subtracts the
delta in place, which does not restore ``W`` exactly). Folding is only done in float32: in bf16
a small LoRA delta rounds away against the base weight, and the sampler would draw from a policy
that is not the trainer's.

Where the base weights cannot take the fold and the sampler has no copy of its own (bf16 on a
GPU: sampler_precision.py makes its copy on a CPU only), ``SidePathAdapter`` swaps each adapted
Linear for its own base Linear plus the LoRA product as a side path (``LoraSidePath``): A cast to
the base's dtype and the scale put into B once per set of adapter weights, where the trainer's
LoRA layer casts both and scales the rank-side product again at every call. On a GPU a small
model's decoding step is bound by its kernels (~2,900 a step for SmolLM2-135M, each LoRA layer six
of them), and the side path is three: the base product, ``x @ A.T``, and ``addmm_`` into the output.
The base weights are shared, not copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from grpo.models.cpu_linear import OneDNNLinear, PackedLinear, can_pack
from grpo.models.fused_projections import FusedMember, FusedProjections, sibling_sets, stackable
from grpo.models.lora_linear import LoraSidePath


class FoldedAdapter:
    """Plain Linears carrying one adapter's weights folded into the base weights."""

    def __init__(self, peft_model: nn.Module, adapter: str, weights: dict[str, torch.Tensor] | None, key: tuple,
                 recycle: FoldedAdapter | None = None, layout: str = "onednn"):
        """``recycle``: an outdated FoldedAdapter whose tensors are overwritten rather than
        allocated afresh (a new 400 MB on SmolLM2 every step costs more than the folding).
        ``layout``: the packed weights' (cpu_linear.pack_weight)."""
        self.key = key
        self.weights = weights  # held so that an id() in ``key`` cannot be reused while cached
        self.replacements: dict[str, nn.Linear] = {}
        old = recycle.replacements if recycle is not None else {}
        for name in [n for n, m in old.items() if isinstance(m, PackedLinear | FusedMember)]:
            del old[name]  # packed weights are not rewritten in place: free them before packing anew
        scratch: dict[tuple, torch.Tensor] = {}  # one dense buffer per weight shape, for packing
        layers = dict(lora_layers(peft_model, adapter))

        def fold(name: str, out: torch.Tensor) -> None:
            """W + scaling * B @ A of layer ``name``, in one kernel, into ``out``."""
            module = layers.pop(name)
            a, b = lora_weights(name, module, adapter, weights)
            base = module.base_layer
            torch.addmm(base.weight, b.to(base.weight.dtype), a.to(base.weight.dtype), alpha=module.scaling[adapter],
                        out=out)

        def buffer(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
            if (shape, dtype) not in scratch:
                scratch[shape, dtype] = torch.empty(shape, dtype=dtype)
            return scratch[shape, dtype]

        with torch.no_grad():
            # Sibling projections (q/k/v, gate/up) folded into one stacked, packed weight: one
            # oneDNN call where there were three or two, each with a fixed cost at a decoding
            # step's few rows (fused_projections.py, as the bf16 sampler's copy has them).
            for paths in sibling_sets(peft_model):
                if not all(p in layers for p in paths):
                    continue
                bases = [layers[p].base_layer for p in paths]
                if not stackable(bases):
                    continue
                sizes = [base.out_features for base in bases]
                stacked = buffer((sum(sizes), bases[0].in_features), bases[0].weight.dtype)
                for path, rows in zip(paths, stacked.split(sizes), strict=True):
                    fold(path, rows)
                biases = None if bases[0].bias is None else torch.cat([base.bias.detach() for base in bases])
                group = FusedProjections(stacked, biases, sizes, layout)
                for index, (path, base) in enumerate(zip(paths, bases, strict=True)):
                    self.replacements[path] = FusedMember(group, index, base.in_features)
            for name in list(layers):
                base = layers[name].base_layer
                if can_pack(base.weight, layout):
                    # Folded into a scratch buffer, then kept only in its packed layout
                    # (cpu_linear.py): the decoding steps multiply by it without a reorder each.
                    folded_weight = buffer(tuple(base.weight.shape), base.weight.dtype)
                    fold(name, folded_weight)
                    self.replacements[name] = PackedLinear(folded_weight, base.bias, layout)
                    continue
                folded = old.get(name)
                if not isinstance(folded, nn.Linear) or folded.weight.shape != base.weight.shape:
                    # the base's own class: a OneDNNLinear stays one (cpu_linear.py)
                    folded = type(base)(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
                    folded.weight = nn.Parameter(torch.empty_like(base.weight), requires_grad=False)
                fold(name, folded.weight)
                folded.bias = base.bias
                self.replacements[name] = folded

    def installed(self, peft_model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        """The model with the folded Linears in place of the LoRA layers, restored on exit."""
        return _swapped(peft_model, self.replacements)


class SidePathAdapter:
    """One adapter's LoRA layers as their base Linears with the LoRA product beside them
    (``LoraSidePath``, in the base's dtype), for sampling where the fold is not exact (see above)."""

    def __init__(self, peft_model: nn.Module, adapter: str, weights: dict[str, torch.Tensor] | None, key: tuple):
        self.key = key
        self.weights = weights  # held so that an id() in ``key`` cannot be reused while cached
        self.replacements: dict[str, LoraSidePath] = {}
        with torch.no_grad():
            for name, module in lora_layers(peft_model, adapter):
                a, b = lora_weights(name, module, adapter, weights)
                base = module.base_layer
                self.replacements[name] = LoraSidePath(base, a, b, module.scaling[adapter], base.weight.dtype)

    def installed(self, peft_model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        """The model with the side paths in place of the LoRA layers, restored on exit."""
        return _swapped(peft_model, self.replacements)


@contextlib.contextmanager
def _swapped(peft_model: nn.Module, replacements: dict[str, nn.Module]) -> Iterator[nn.Module]:
    originals: dict[str, nn.Module] = {}
    try:
        for name, replacement in replacements.items():
            originals[name] = peft_model.get_submodule(name)
            peft_model.set_submodule(name, replacement)
        yield peft_model
    finally:
        for name, original in originals.items():
            peft_model.set_submodule(name, original)


def lora_weights(name: str, module: nn.Module, adapter: str, weights: dict[str, torch.Tensor] | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B of ``adapter`` at the LoRA layer ``name`` (a path in the peft model): from the
    snapshot ``weights`` (keyed by the peft model's parameter names) where given, else the live ones."""
    if weights:
        return weights[f"{name}.lora_A.{adapter}.weight"], weights[f"{name}.lora_B.{adapter}.weight"]
    return module.lora_A[adapter].weight, module.lora_B[adapter].weight


def lora_layers(peft_model: nn.Module, adapter: str) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in peft_model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer") and adapter in m.lora_A]


def can_fold(peft_model: nn.Module, adapter: str) -> bool:
    """True when every layer of ``adapter`` is a plain LoRA on a float32 ``nn.Linear``.

    Half-precision bases take side paths instead (``can_side_path``); anything else (DoRA,
    fan-in-fan-out Conv1D, quantised bases, LoRA on an embedding) is sampled through peft's own layers.
    """
    layers = lora_layers(peft_model, adapter)
    return bool(layers) and all(_plain(m, adapter) and m.base_layer.weight.dtype == torch.float32 for _, m in layers)


def can_side_path(peft_model: nn.Module, adapter: str) -> bool:
    """True when every layer of ``adapter`` is a plain LoRA on an ``nn.Linear`` of any float dtype:
    what ``SidePathAdapter`` computes."""
    layers = lora_layers(peft_model, adapter)
    return bool(layers) and all(_plain(m, adapter) for _, m in layers)


def _plain(m: nn.Module, adapter: str) -> bool:
    from peft.tuners.lora import Linear as LoraLinear

    return (type(m) is LoraLinear
            and type(m.base_layer) in (nn.Linear, OneDNNLinear)
            and not m.fan_in_fan_out
            and not m.use_dora.get(adapter, False)
            and m.lora_B[adapter].bias is None)
