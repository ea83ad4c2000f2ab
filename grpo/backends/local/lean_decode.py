"""The sampler's decoding step for Llama-shaped decoders, without transformers' per-call machinery.

A decoding step of SmolLM2-135M in bf16 on a 2-core CPU costs ~62 ms, of which the matmuls and
attention are about half; the rest is ~60 small operators per layer and the Python around them.
transformers' forward wraps the model, the decoder and every layer in generic Python (output
capturing, gradient checkpointing, kwarg deprecation, the attention-interface lookup, mask and
cache dispatch) that a gradient-free step at one position per row never needs. ``LeanDecoder``
calls the same modules and operators, in the same order and dtypes, straight through: its logits
are bit-equal to the model's own forward (tests/test_lean_decode.py), only Python is left out.
Where the sampler stacked q/k/v and gate/up (fused_projections.py), it takes the siblings'
outputs from one call rather than one member lookup each.

It takes a model only when every part is what it was written against -- transformers'
``LlamaForCausalLM`` (as such or under peft) with SDPA attention, full-attention layers and SiLU
MLPs, on a CPU or a CUDA GPU -- and returns None otherwise: the sampler then calls the model's own
forward. On CUDA the sampler takes it only to capture it in CUDA graphs (graph_decode.py: it makes
no host synchronisation and no decision on a tensor's value); run eagerly there it saved nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from grpo.backends.local.kv_cache import SlotCache
from grpo.models.fused_projections import FusedMember, FusedProjections


class LeanDecoder:
    """``model(input_ids=[rows, 1], attention_mask=mask, position_ids=positions, cache=cache)``
    of a decoding step, as plain calls; returns the float32 next-token logits ``[rows, vocab]``."""

    def __init__(self, causal_lm: nn.Module):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.sdpa = sdpa_attention_forward
        self.rotary = apply_rotary_pos_emb
        self.causal_lm = causal_lm
        self.decoder = causal_lm.model
        self.head_dim = self.decoder.layers[0].self_attn.head_dim
        # each layer's stacked q/k/v and gate/up groups (None: its own Linears), fixed for the
        # sampling call this decoder is made for
        self.groups = [(_stacked(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                        _stacked(layer.mlp.gate_proj, layer.mlp.up_proj)) for layer in self.decoder.layers]

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: SlotCache) -> torch.Tensor:
        # Modules' ``forward`` is called directly where their ``__call__`` would only add hooks
        decoder = self.decoder
        hidden = decoder.embed_tokens.forward(input_ids)
        cos, sin = decoder.rotary_emb(hidden, positions)
        rows, dim = hidden.shape[0], self.head_dim
        for index, (layer, (qkv, gate_up)) in enumerate(zip(decoder.layers, self.groups, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            x = layer.input_layernorm.forward(hidden)
            q, k, v = qkv.full(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            q = q.view(rows, 1, -1, dim).transpose(1, 2)
            k = k.view(rows, 1, -1, dim).transpose(1, 2)
            v = v.view(rows, 1, -1, dim).transpose(1, 2)
            q, k = self.rotary(q, k, cos, sin)
            k, v = cache.layers[index].update(k, v)
            dropout = attn.attention_dropout if attn.training else 0.0  # as LlamaAttention.forward
            out, _ = self.sdpa(attn, q, k, v, mask, dropout=dropout, scaling=attn.scaling)
            hidden = residual + attn.o_proj(out.reshape(rows, 1, -1).contiguous())
            residual = hidden
            x = layer.post_attention_layernorm.forward(hidden)
            gate, up = gate_up.full(x) if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
            hidden = residual + mlp.down_proj(mlp.act_fn(gate) * up)
        hidden = decoder.norm.forward(hidden)
        return self.causal_lm.lm_head(hidden)[:, -1].float()


def _stacked(*members: nn.Module) -> FusedProjections | None:
    """The group whose members these siblings are, all of them in order; else None."""
    first = members[0]
    if (type(first) is FusedMember and len(first.group.sizes) == len(members)
            and all(type(m) is FusedMember and m.group is first.group and m.index == i for i, m in enumerate(members))):
        return first.group
    return None


def lean_decoder(model: nn.Module) -> LeanDecoder | None:
    """A ``LeanDecoder`` for ``model`` (a causal LM, or a peft model around one) where it computes
    exactly what the model's own forward does, else None."""
    try:
        from transformers.activations import SiLUActivation
        from transformers.models.llama import modeling_llama as llama
    except ImportError:
        return None
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if type(causal_lm) is not llama.LlamaForCausalLM or causal_lm.config._attn_implementation != "sdpa":
        return None
    decoder = causal_lm.model
    if type(decoder) is not llama.LlamaModel or type(decoder.norm) is not llama.LlamaRMSNorm:
        return None
    if decoder.embed_tokens.weight.device.type not in ("cpu", "cuda"):
        return None
    kinds = getattr(causal_lm.config, "layer_types", None) or ["full_attention"] * len(decoder.layers)
    if any(kind != "full_attention" for kind in kinds):
        return None
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (type(layer) is llama.LlamaDecoderLayer and type(attn) is llama.LlamaAttention
                and type(mlp) is llama.LlamaMLP and type(mlp.act_fn) in (SiLUActivation, nn.SiLU)
                and type(layer.input_layernorm) is llama.LlamaRMSNorm
                and type(layer.post_attention_layernorm) is llama.LlamaRMSNorm):
            return None
    return LeanDecoder(causal_lm)
