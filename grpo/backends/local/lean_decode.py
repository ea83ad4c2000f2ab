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
MLPs, on a CPU -- and returns None otherwise: the sampler then calls the model's own forward.
(On CUDA the same calls would save kernel-launch latency too; not measured, so not taken there.)
"""

from __future__ import annotations

import torch
from torch import nn

from grpo.backends.local.kv_cache import SlotCache
from grpo.models.fused_projections import FusedMember


class LeanDecoder:
    """``model(input_ids=[rows, 1], attention_mask=mask, position_ids=positions, cache=cache)``
    of a decoding step, as plain calls; returns the float32 next-token logits ``[rows, vocab]``."""

    def __init__(self, causal_lm: nn.Module):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.llama.modeling_llama import rotate_half

        self.sdpa = sdpa_attention_forward
        self.rotate_half = rotate_half
        self.causal_lm = causal_lm
        decoder = causal_lm.model
        self.decoder = decoder
        self.head_dim = decoder.layers[0].self_attn.head_dim

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: SlotCache) -> torch.Tensor:
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)
        cos, sin = decoder.rotary_emb(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # as apply_rotary_pos_emb
        rows, dim = hidden.shape[0], self.head_dim
        for index, layer in enumerate(decoder.layers):
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            x = _rms_norm(layer.input_layernorm, hidden)
            if _stacked(attn.q_proj, attn.k_proj, attn.v_proj):
                q, k, v = attn.q_proj.group.full(x)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = q.view(rows, 1, -1, dim).transpose(1, 2)
            k = k.view(rows, 1, -1, dim).transpose(1, 2)
            v = v.view(rows, 1, -1, dim).transpose(1, 2)
            # apply_rotary_pos_emb, its operators inline
            q, k = (q * cos) + (self.rotate_half(q) * sin), (k * cos) + (self.rotate_half(k) * sin)
            k, v = cache.layers[index].update(k, v)
            dropout = attn.attention_dropout if attn.training else 0.0  # as LlamaAttention.forward
            out, _ = self.sdpa(attn, q, k, v, mask, dropout=dropout, scaling=attn.scaling)
            hidden = residual + attn.o_proj(out.reshape(rows, 1, -1).contiguous())
            residual = hidden
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            if _stacked(mlp.gate_proj, mlp.up_proj):
                gate, up = mlp.gate_proj.group.full(x)
            else:
                gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            hidden = residual + mlp.down_proj(mlp.act_fn(gate) * up)
        hidden = _rms_norm(decoder.norm, hidden)
        return self.causal_lm.lm_head(hidden)[:, -1].float()


def _stacked(*members: nn.Module) -> bool:
    """Siblings that are, in order, all the members of one stacked group."""
    first = members[0]
    return (type(first) is FusedMember and len(first.group.sizes) == len(members)
            and all(type(m) is FusedMember and m.group is first.group and m.index == i for i, m in enumerate(members)))


def _rms_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm.forward, operator for operator
    dtype = hidden.dtype
    h = hidden.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


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
    if decoder.embed_tokens.weight.device.type != "cpu":
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
