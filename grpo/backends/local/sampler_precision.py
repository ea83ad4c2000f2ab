"""The sampler's own copy of the base model in ``sample_dtype``: bf16 sampling on a CPU.

When ``sample_dtype`` differs from ``train_dtype`` (say bf16 sampling, fp32 training), and for any
bf16 sampling on a CPU, the sampler runs a second copy of the base model converted once to
``sample_dtype`` (half the bytes streamed per decoding step in bf16) and kept only in a packed
layout (oneDNN's, or the streaming one where it measured faster: cpu_linear.py), and the trainer
keeps its own weights and the fp32 master LoRA weights.
The copy carries the adapter being sampled as an *unmerged* LoRA side path,
``base(x) + scaling * B(A(x))`` in ``sample_dtype``, refreshed whenever the adapter's weights
change (a new version or a sampling snapshot).

Why unmerged rather than folded (folded_lora.py folds only in fp32): bf16 keeps 8 bits of mantissa,
so early in training a LoRA delta ``scaling * B @ A`` is smaller than half a bf16 step of most base
weights and ``bf16(W + delta)`` would round back to ``bf16(W)`` at every step of the same weight,
the sampler drawing from the base policy while the trainer moves on. Kept as its own product, the
delta reaches the activations at its own scale (the usual bf16 LoRA inference of vLLM and peft).
The remaining sampler/trainer gap is bf16 rounding, which the loop measures
(``kl/sample_train``, ``logprob/max_abs_diff``) and ``tis_cap`` corrects (grpo/api/losses.py).

Sibling Linears (q/k/v, gate/up) are stacked into one packed weight each with their LoRA side
paths stacked too (fused_projections.py): a decoding step's matmul calls, not their arithmetic,
were what made this copy slower than the folded fp32 sampler on CPUs with fast bf16 units.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from grpo.backends.local.folded_lora import lora_layers
from grpo.models.cpu_linear import pack_for_inference
from grpo.models.fused_projections import FusedProjections, fuse_siblings
from grpo.models.lora_linear import LoraSidePath


class SamplerCopy:
    """The base model in ``dtype`` with at most one adapter's LoRA side paths installed."""

    def __init__(self, base_model: nn.Module, dtype: torch.dtype, layout: str = "onednn"):
        """``layout``: how the weights are packed (cpu_linear.pack_weight), LoRA's side paths too."""
        # Called before any adapter is injected, so the copy is the plain transformers model; tied
        # embeddings stay tied (deepcopy keeps shared Parameters shared). Only the parameters take
        # ``dtype``, as when transformers loads a model in it: buffers keep theirs -- rotary
        # embeddings' float32 frequencies rounded to bf16 put every position's angle off, and the
        # sampler's logprobs up to 1.4 nats from the trainer's on SmolLM2.
        self.model = copy.deepcopy(base_model)
        for p in self.model.parameters():
            p.data = p.data.to(dtype)
        self.model.eval()
        # never trained: siblings stacked, every Linear packed (cpu_linear.py)
        self._groups: dict[tuple[str, ...], FusedProjections] = fuse_siblings(self.model, layout)
        pack_for_inference(self.model, layout)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.dtype = dtype
        self.key: tuple | None = None
        self.weights = None  # held so that an id() in ``key`` cannot be reused while installed
        self._installed: dict[str, nn.Module] = {}  # module path -> the original module

    def install(self, causal_lm: nn.Module, adapter: str | None, weights: dict[str, torch.Tensor] | None,
                key: tuple) -> nn.Module:
        """The copy with ``adapter``'s LoRA (from ``weights``, a snapshot keyed by peft's names, or
        the live adapter) as side paths; None: the bare base model. Rebuilt only when ``key`` changes."""
        if self.key == key:
            return self.model
        self.key, self.weights = None, None  # a failure half way must not leave a stale key behind
        self._restore()
        if adapter is not None:
            layers = lora_layers(causal_lm, adapter)
            loras = {}
            for name, module in layers:
                a = _snapshot_tensor(weights, name, "lora_A", adapter) if weights else module.lora_A[adapter].weight
                b = _snapshot_tensor(weights, name, "lora_B", adapter) if weights else module.lora_B[adapter].weight
                loras[name] = (a, b, module.scaling[adapter])
            for paths, group in self._groups.items():
                if any(p in loras for p in paths):  # a sibling without LoRA gets a rank-0 part
                    group.set_lora([loras.pop(p) if p in loras else _no_lora(self.model.get_submodule(p))
                                    for p in paths])
            for name, (a, b, scaling) in loras.items():
                original = self._installed[name] = self.model.get_submodule(name)
                self.model.set_submodule(name, LoraSidePath(original, a, b, scaling, self.dtype))
        self.key, self.weights = key, weights
        return self.model

    def forget(self) -> None:
        """Drop the installed adapter (its side paths and the weights they came from)."""
        self.key, self.weights = None, None
        self._restore()

    def _restore(self) -> None:
        for group in self._groups.values():
            group.set_lora(None)
        for name, original in self._installed.items():
            self.model.set_submodule(name, original)
        self._installed = {}


def takes_adapter(peft_model: nn.Module, adapter: str) -> bool:
    """Whether every LoRA layer of ``adapter`` is one a side path computes: peft's LoRA on a Linear,
    without DoRA. LoRA on an MoE's fused expert weights (peft's ParamWrapper, which peft adds for
    Qwen3-Next's experts) is not; such an adapter samples through the trainer's model."""
    from peft.tuners.lora import Linear as LoraLinear

    return all(type(m) is LoraLinear and isinstance(m.base_layer, nn.Linear) and not m.use_dora.get(adapter, False)
               for _, m in lora_layers(peft_model, adapter))


def _no_lora(member: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float]:
    return torch.zeros(0, member.in_features), torch.zeros(member.out_features, 0), 1.0


def _snapshot_tensor(weights: dict[str, torch.Tensor], name: str, which: str, adapter: str) -> torch.Tensor:
    # Snapshots are keyed by the peft model's parameter names ("base_model.model." + the causal
    # LM's module path); lora_layers() here walks the causal LM itself.
    for key in (f"base_model.model.{name}.{which}.{adapter}.weight", f"{name}.{which}.{adapter}.weight"):
        if key in weights:
            return weights[key]
    raise KeyError(f"adapter snapshot has no {which} weights for {name}")
