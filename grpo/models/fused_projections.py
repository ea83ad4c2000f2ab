"""Sibling projections -- q/k/v, gate/up -- computed as one matmul in gradient-free sampling.

A decoder layer calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden state, and
``gate_proj`` and ``up_proj`` on the same input of its MLP. At a decoding step's few rows every
oneDNN call costs a fixed 20-30 us beside its arithmetic (docs/benchmark.md), and with LoRA as an
unmerged side path each adapted Linear is three calls: SmolLM2's 30 layers make 630 of them a step.
Here the siblings' weights are stacked into one packed weight, and their LoRA into one side path
(the A matrices stacked, the B matrices block-diagonal), so that q/k/v is three calls instead of
nine and gate/up three instead of six; without LoRA (weights folded, folded_lora.py) one call each.

The model's own modules stay in charge of the order: each sibling is replaced by a
``FusedMember`` that asks its ``FusedProjections`` for its slice. The first member called with an
input computes every sibling's output; the others take theirs from it while the input is the same
tensor, unchanged (identity, and the version counter where the tensor keeps one). Called in any other way -- another input, a
member twice -- it computes again, so the result is always the member's own product.
"""

from __future__ import annotations

import torch
from torch import nn

from grpo.models.cpu_linear import LoraSideProduct, can_pack, layout_of, pack_weight, packed_product

# Sibling Linears by their names under one parent, as Llama, Mistral, Qwen2/3, Gemma and most
# decoder families in transformers name them.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjections:
    """One packed weight ``[W_1; W_2; ...]`` (and optional stacked LoRA) for siblings sharing an input."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int], layout: str = "onednn"):
        self.packed = pack_weight(weight, layout)
        self.layout = layout_of(self.packed)  # (a weight it cannot take: oneDNN's)
        self.bias = None if bias is None else bias.detach()
        self.sizes = sizes
        self.dtype = weight.dtype
        # A stacked [sum of ranks, in_features], B block-diagonal [sum of out_features, sum of ranks], scaled
        self.lora: LoraSideProduct | None = None
        self._input: torch.Tensor | None = None
        self._version = -1
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._unserved: set[int] = set()

    def set_lora(self, loras: list[tuple[torch.Tensor, torch.Tensor, float]] | None) -> None:
        """Each sibling's ``(A, B, scaling)`` in order, or None for no side path. The scaling goes
        into B before the cast (exact for LoRA's usual power-of-two ``alpha / r``)."""
        self._forget()
        if loras is None:
            self.lora = None
            return
        self.lora = LoraSideProduct(
            torch.cat([a.detach().float() for a, _, _ in loras]).to(self.dtype),
            torch.block_diag(*[b.detach().float() * scaling for _, b, scaling in loras]).to(self.dtype), self.layout)

    def full(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every sibling's output for ``x``, in order (views of one product)."""
        return packed_product(x, self.packed, self.bias, self.lora).split(self.sizes, dim=-1)

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if not (x is self._input and _version(x) == self._version and index in self._unserved):
            self._forget()
            self._outputs = self.full(x)
            self._input, self._version, self._unserved = x, _version(x), set(range(len(self.sizes)))
        self._unserved.discard(index)
        result = self._outputs[index]
        if not self._unserved:
            self._forget()  # every sibling has its output: hold no activations between layers
        return result

    def _forget(self) -> None:
        self._input, self._version, self._outputs, self._unserved = None, -1, (), set()


def _version(x: torch.Tensor) -> int:
    # Inference tensors (made under torch.inference_mode, as the sampler's are)
    # keep no version counter; for them the identity alone says "the same input", as nothing writes
    # a layer's input in place between its projections.
    return -1 if x.is_inference() else x._version


class FusedMember(nn.Module):
    """One sibling's Linear: its slice of the group's product."""

    def __init__(self, group: FusedProjections, index: int, in_features: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = in_features, group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"member {self.index} of {len(self.group.sizes)}, packed")


def sibling_sets(model: nn.Module) -> list[list[str]]:
    """Module paths of sibling Linears in ``model`` (each set in SIBLINGS order)."""
    modules = dict(model.named_modules())
    found = []
    for parent in modules:
        for set_ in SIBLINGS:
            paths = [f"{parent}.{child}" if parent else child for child in set_]
            if all(p in modules for p in paths):
                found.append(paths)
    return found


def stackable(linears: list[nn.Module], layout: str = "onednn") -> bool:
    """Plain Linears packable (in ``layout`` or oneDNN's) of one input width, dtype and bias-ness."""
    first = linears[0]
    return all(
        isinstance(m, nn.Linear) and can_pack(m.weight, layout) and m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype and (m.bias is None) == (first.bias is None)
        for m in linears)


def fuse(model: nn.Module, paths: list[str], weights: list[torch.Tensor],
         biases: list[torch.Tensor] | None, layout: str = "onednn") -> FusedProjections:
    """Replace the modules at ``paths`` by members of one group over the stacked ``weights``,
    packed in ``layout`` (cpu_linear.pack_weight)."""
    group = FusedProjections(torch.cat(weights), None if biases is None else torch.cat(biases),
                             [w.shape[0] for w in weights], layout)
    for index, path in enumerate(paths):
        model.set_submodule(path, FusedMember(group, index, weights[index].shape[1]))
    return group


def fuse_siblings(model: nn.Module, layout: str = "onednn") -> dict[tuple[str, ...], FusedProjections]:
    """Every stackable set of sibling Linears of a gradient-free ``model`` replaced by one group
    (packed in ``layout``); the groups by their members' paths."""
    groups = {}
    for paths in sibling_sets(model):
        linears = [model.get_submodule(p) for p in paths]
        if stackable(linears, layout):
            biases = None if linears[0].bias is None else [m.bias.detach() for m in linears]
            groups[tuple(paths)] = fuse(model, paths, [m.weight.detach() for m in linears], biases, layout)
    return groups
