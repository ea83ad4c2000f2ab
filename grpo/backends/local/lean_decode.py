"""The sampler's decoding step for Llama-shaped decoders (Llama, Mistral, Qwen2, Qwen3; on a CPU also
Phi-3, OLMo2, Granite and SmolLM3), without transformers' per-call machinery.

A decoding step of SmolLM2-135M in bf16 on a 2-core CPU costs ~62 ms, of which the matmuls and
attention are about half; the rest is ~60 small operators per layer and the Python around them.
transformers' forward wraps the model, the decoder and every layer in generic Python (output
capturing, gradient checkpointing, kwarg deprecation, the attention-interface lookup, mask and
cache dispatch) that a gradient-free step at one position per row never needs. ``LeanDecoder``
calls the same modules and operators, in the same order and dtypes, straight through: its logits
are bit-equal to the model's own forward (tests/test_lean_decode.py), only Python is left out.
Where the sampler stacked q/k/v and gate/up (fused_projections.py), it takes the siblings'
outputs from one call rather than one member lookup each.

Four families differ from Llama's layer in ways the step follows (``Layout``): Phi-3 (and Phi-4-mini)
computes q/k/v and gate/up as one Linear each, and may rotate only part of each head (its own
``apply_rotary_pos_emb``); OLMo2 normalises each sublayer's output rather than its input
(``post_attention_layernorm``, ``post_feedforward_layernorm``), q and k over all their heads, and
rotates in float32 (its rotary embedding hands float32 cos and sin); Granite scales the embedding, each
sublayer's output before the residual add, and the logits; SmolLM3 rotates q and k in three layers of
four and not in the fourth (``no_rope_layers``: its attention's ``use_rope``).

It takes a model only when every part is what it was written against -- transformers'
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (as such or
under peft) with SDPA attention and SiLU MLPs, on a CPU or a CUDA GPU, its sliding windows (Mistral-7B-v0.1's
4,096 tokens, a Qwen2's upper layers) no shorter than the sampling call's slots, so that no query has a
key outside its window; ``Phi3ForCausalLM``, ``Olmo2ForCausalLM``, ``GraniteForCausalLM`` and
``SmolLM3ForCausalLM`` alike, on a CPU
(not yet run under CUDA graphs) -- and returns None otherwise:
the sampler then calls the model's own forward (a Qwen model's, on a CPU before Qwen was taken here:
1.5-2.2x the time of the native step built on this one, docs/benchmark.md). On CUDA the sampler takes
it only to capture it in CUDA graphs (graph_decode.py: it makes no host synchronisation and no
decision on a tensor's value); run eagerly there it saved nothing.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
from torch import nn

from grpo.backends.local.kv_cache import SlotCache, attention_layers
from grpo.models.fused_projections import FusedMember, FusedProjections


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a family's layer departs from Llama's (whose is all False)."""

    fused: bool = False  # q/k/v one Linear (``qkv_proj``), gate/up one (``gate_up_proj``): Phi-3's
    post_norms: bool = False  # a norm after each sublayer, none before (OLMo2's), q and k normalised whole
    # the embedding, each sublayer's output and the logits scaled (Granite's embedding_multiplier,
    # residual_multiplier, logits_scaling; its attention_multiplier is its attention's own scaling)
    multipliers: bool = False
    unrotated: bool = False  # some layers' attention skips the rotary embedding (SmolLM3's ``use_rope``)


class LeanDecoder:
    """``model(input_ids=[rows, 1], attention_mask=mask, position_ids=positions, cache=cache)``
    of a decoding step, as plain calls; returns the float32 next-token logits ``[rows, vocab]``."""

    reads_mask = True  # (SDPA over the slot cache's columns, through its decode mask)

    def __init__(self, causal_lm: nn.Module, layout: Layout = Layout()):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.sdpa = sdpa_attention_forward
        self.causal_lm = causal_lm
        self.layout = layout
        # the family's own rotary function (Phi-3's rotates a head's first cos-width dims)
        self.rotary = importlib.import_module(type(causal_lm).__module__).apply_rotary_pos_emb
        self.decoder = causal_lm.model
        self.head_dim = self.decoder.layers[0].self_attn.head_dim
        # each layer's kind, to read its mask where the cache hands one per kind
        self.kinds = attention_layers(causal_lm.config)[0]
        # each layer's q/k/v and gate/up as one product where stacked or fused (None: its own Linears),
        # fixed for the sampling call this decoder is made for
        self.groups = fused_groups(self.decoder.layers) if layout.fused else stacked_groups(self.decoder.layers)
        self.activations = [mlp_activation(layer.mlp) for layer in self.decoder.layers]
        # whether each layer rotates q and k (all but SmolLM3's no-rope layers)
        self.rotates = [bool(getattr(layer.self_attn, "use_rope", True)) for layer in self.decoder.layers]

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: SlotCache) -> torch.Tensor:
        # Modules' ``forward`` is called directly where their ``__call__`` would only add hooks
        decoder = self.decoder
        hidden = decoder.embed_tokens.forward(input_ids)
        if self.layout.multipliers:
            hidden = hidden * decoder.embedding_multiplier
        cos, sin = decoder.rotary_emb(hidden, positions)
        rows, dim, post_norms = hidden.shape[0], self.head_dim, self.layout.post_norms
        for index, (layer, (qkv, gate_up)) in enumerate(zip(decoder.layers, self.groups, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            layer_mask = mask[self.kinds[index]] if isinstance(mask, dict) else mask
            residual = hidden
            x = hidden if post_norms else layer.input_layernorm.forward(hidden)
            q, k, v = qkv.full(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            norms = head_norms(attn)
            if norms and post_norms:  # (OLMo2: q and k normalised whole, before they are split into heads)
                q, k = norms[0].forward(q), norms[1].forward(k)
            q, k = q.view(rows, 1, -1, dim), k.view(rows, 1, -1, dim)
            if norms and not post_norms:  # (Qwen3: each head of q and k normalised, before the rotary embedding)
                q, k = norms[0].forward(q), norms[1].forward(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(rows, 1, -1, dim).transpose(1, 2)
            if self.rotates[index]:
                q, k = self.rotary(q, k, cos, sin)
            k, v = cache.layers[index].update(k, v)
            dropout = attn.attention_dropout if attn.training else 0.0  # as LlamaAttention.forward
            out, _ = self.sdpa(attn, q, k, v, layer_mask, dropout=dropout, scaling=attn.scaling)
            attended = attn.o_proj(out.reshape(rows, 1, -1).contiguous())
            if self.layout.multipliers:
                attended = attended * layer.residual_multiplier
            hidden = residual + (layer.post_attention_layernorm.forward(attended) if post_norms else attended)
            residual = hidden
            x = hidden if post_norms else layer.post_attention_layernorm.forward(hidden)
            gate, up = gate_up.full(x) if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
            # (Phi-3 multiplies up * act(gate): the same product, bit for bit)
            mixed = mlp.down_proj(self.activations[index](gate) * up)
            if self.layout.multipliers:
                mixed = mixed * layer.residual_multiplier
            hidden = residual + (layer.post_feedforward_layernorm.forward(mixed) if post_norms else mixed)
        hidden = decoder.norm.forward(hidden)
        logits = self.causal_lm.lm_head(hidden)[:, -1]
        if self.layout.multipliers:
            logits = logits / self.causal_lm.config.logits_scaling
        return logits.float()


def stacked_groups(layers) -> list[tuple[FusedProjections | None, FusedProjections | None]]:
    """Each decoder layer's stacked q/k/v and gate/up groups (None: its own Linears), as the
    sampler stacked them (fused_projections.py)."""
    return [(_stacked(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
             _stacked(layer.mlp.gate_proj, layer.mlp.up_proj)) for layer in layers]


class OneProduct:
    """A layer's siblings that the model itself computes as one Linear (Phi-3's ``qkv_proj``,
    ``gate_up_proj``), seen as ``FusedProjections`` are: ``full(x)`` each sibling's output, in order."""

    def __init__(self, module: nn.Module, sizes: list[int]):
        self.module, self.sizes = module, sizes

    def full(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.module(x).split(self.sizes, dim=-1)

    @property
    def layout(self) -> str | None:
        """The packed weight's layout (cpu_linear.py), under a LoRA side path or not; None where unpacked."""
        base = getattr(self.module, "base", self.module)
        return getattr(base, "layout", None)


def fused_groups(layers) -> list[tuple[OneProduct, OneProduct]]:
    """Each Phi-3 layer's ``qkv_proj`` and ``gate_up_proj`` as its q/k/v and gate/up groups."""
    groups = []
    for layer in layers:
        attn, config = layer.self_attn, layer.self_attn.config
        kv = config.num_key_value_heads * attn.head_dim
        inter = config.intermediate_size
        groups.append((OneProduct(attn.qkv_proj, [config.num_attention_heads * attn.head_dim, kv, kv]),
                       OneProduct(layer.mlp.gate_up_proj, [inter, inter])))
    return groups


def mlp_activation(mlp: nn.Module) -> nn.Module:
    """The MLP's activation of the gate (``act_fn``; Phi-3's ``activation_fn``)."""
    return mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn


def layer_norms(layer: nn.Module, layout: Layout) -> tuple[nn.Module, nn.Module]:
    """A layer's two norms in the order its step applies them: before attention and before the MLP
    (Llama's), or after each (OLMo2's)."""
    if layout.post_norms:
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return layer.input_layernorm, layer.post_attention_layernorm


def _stacked(*members: nn.Module) -> FusedProjections | None:
    """The group whose members these siblings are, all of them in order; else None."""
    first = members[0]
    if (type(first) is FusedMember and len(first.group.sizes) == len(members)
            and all(type(m) is FusedMember and m.group is first.group and m.index == i for i, m in enumerate(members))):
        return first.group
    return None


def _families() -> dict[type, tuple[type, ...]]:
    """The causal LMs whose decoding step ``LeanDecoder`` computes, each with the classes its parts
    must be: (decoder, layer, attention, MLP, RMSNorm). Mistral's layer is Llama's, windowed or not;
    Qwen2's is Llama's with biases on q/k/v (the Linears carry them); Qwen3's attention normalises
    each head of q and k before the rotary embedding (``q_norm`` / ``k_norm``, applied as its
    forward does). Phi-3's, OLMo2's, Granite's and SmolLM3's (``LAYOUTS``): taken on a CPU only."""
    from transformers.models.granite import modeling_granite as granite
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.olmo2 import modeling_olmo2 as olmo2
    from transformers.models.phi3 import modeling_phi3 as phi3
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3
    from transformers.models.smollm3 import modeling_smollm3 as smollm3

    return {
        llama.LlamaForCausalLM: (llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP,
                                 llama.LlamaRMSNorm),
        mistral.MistralForCausalLM: (mistral.MistralModel, mistral.MistralDecoderLayer, mistral.MistralAttention,
                                     mistral.MistralMLP, mistral.MistralRMSNorm),
        qwen2.Qwen2ForCausalLM: (qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP,
                                 qwen2.Qwen2RMSNorm),
        qwen3.Qwen3ForCausalLM: (qwen3.Qwen3Model, qwen3.Qwen3DecoderLayer, qwen3.Qwen3Attention, qwen3.Qwen3MLP,
                                 qwen3.Qwen3RMSNorm),
        phi3.Phi3ForCausalLM: (phi3.Phi3Model, phi3.Phi3DecoderLayer, phi3.Phi3Attention, phi3.Phi3MLP,
                               phi3.Phi3RMSNorm),
        olmo2.Olmo2ForCausalLM: (olmo2.Olmo2Model, olmo2.Olmo2DecoderLayer, olmo2.Olmo2Attention, olmo2.Olmo2MLP,
                                 olmo2.Olmo2RMSNorm),
        granite.GraniteForCausalLM: (granite.GraniteModel, granite.GraniteDecoderLayer, granite.GraniteAttention,
                                     granite.GraniteMLP, granite.GraniteRMSNorm),
        smollm3.SmolLM3ForCausalLM: (smollm3.SmolLM3Model, smollm3.SmolLM3DecoderLayer, smollm3.SmolLM3Attention,
                                     smollm3.SmolLM3MLP, smollm3.SmolLM3RMSNorm),
    }


# The families whose layer is not Llama's, by their causal LM's class name (``Layout``)
LAYOUTS = {"Phi3ForCausalLM": Layout(fused=True), "Olmo2ForCausalLM": Layout(post_norms=True),
           "GraniteForCausalLM": Layout(multipliers=True), "SmolLM3ForCausalLM": Layout(unrotated=True)}


def lean_decoder(model: nn.Module, capacity: int | None = None) -> LeanDecoder | None:
    """A ``LeanDecoder`` for ``model`` (a causal LM, or a peft model around one) where it computes
    exactly what the model's own forward does, else None. ``capacity``: the most positions a row
    of the sampling call holds; a model with sliding-window layers is taken only where their window
    is at least that (None: not taken), since the native step attends to every key of a row."""
    try:
        from transformers.activations import SiLUActivation

        families = _families()
    except ImportError:
        return None
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    parts = families.get(type(causal_lm))
    if parts is None or causal_lm.config._attn_implementation != "sdpa":
        return None
    model_class, layer_class, attention_class, mlp_class, norm_class = parts
    decoder = causal_lm.model
    if type(decoder) is not model_class or type(decoder.norm) is not norm_class:
        return None
    layout = LAYOUTS.get(type(causal_lm).__name__, Layout())
    device = decoder.embed_tokens.weight.device.type
    if device not in ("cpu", "cuda") or (layout != Layout() and device != "cpu"):
        return None
    try:
        kinds, window = attention_layers(causal_lm.config)
    except ValueError:  # (layers a slot cannot hold)
        return None
    if len(kinds) != len(decoder.layers) or (window is not None and (capacity is None or capacity > window)):
        return None
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (type(layer) is layer_class and type(attn) is attention_class
                and type(mlp) is mlp_class and type(mlp_activation(mlp)) in (SiLUActivation, nn.SiLU)
                and all(type(n) is norm_class for n in (*layer_norms(layer, layout), *head_norms(attn)))):
            return None
        if layout.fused and layer.training and layer.resid_attn_dropout.p > 0:
            return None  # (Phi-3's dropout on each sublayer's output, which the step leaves out)
    return LeanDecoder(causal_lm, layout)


def head_norms(attention: nn.Module) -> tuple[nn.Module, ...]:
    """An attention's norms of each head of q and k (Qwen3's ``q_norm``, ``k_norm``), or none."""
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return (q_norm, k_norm) if q_norm is not None and k_norm is not None else ()
