"""The CPU decoding step with its non-matmul work in native kernels (native_kernels.py).

A bf16 decoding step of SmolLM2-135M at ~24 rows took ~54 ms on a 2-core Xeon where its Linears
alone take ~21 ms: the rest was ~60 small PyTorch operators per layer (RMSNorms, the rotary
embedding, KV-cache writes, grouped-query attention, SiLU), each costing more in dispatch and
passes over memory than in arithmetic (docs/benchmark.md). ``NativeDecoder`` runs a Llama layer
as its Linears (the modules themselves, LoRA side paths included) plus four native calls: the
residual add with the next RMSNorm, rotary + cache write + attention, SiLU * up, and the next
add + RMSNorm. They round to the model's dtype wherever the eager operators do, so they compute
what the model's own forward computes up to the order of float sums (tests/test_native_decode.py).
Where the kernels are not built (no compiler, switched off), the sampler decodes with
``LeanDecoder``'s PyTorch operators, as before.
"""

from __future__ import annotations

import torch

from grpo.backends.local import native_kernels
from grpo.backends.local.kv_cache import SlotCache
from grpo.backends.local.lean_decode import LeanDecoder

DTYPES = (torch.float32, torch.bfloat16)


class NativeDecoder(LeanDecoder):
    """``LeanDecoder``'s step with each layer's non-matmul work in four native calls."""

    def __init__(self, causal_lm, ops):
        super().__init__(causal_lm)
        self.ops = ops
        self.heads = int(causal_lm.config.num_attention_heads)

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: SlotCache) -> torch.Tensor:
        ops, decoder, layers = self.ops, self.decoder, self.decoder.layers
        hidden = decoder.embed_tokens.forward(input_ids)  # [rows, 1, hidden]
        cos, sin = decoder.rotary_emb(hidden, positions)
        cos, sin = cos[:, 0], sin[:, 0]
        lengths = cache.step.lengths_tensor  # each row's new column: its position
        norm = layers[0].input_layernorm
        hidden, x = ops.add_rms_norm(hidden[:, 0], None, norm.weight, norm.variance_epsilon)
        for index, (layer, (qkv, gate_up)) in enumerate(zip(layers, self.groups, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = qkv.full(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            slot = cache.layers[index]
            out = ops.rope_attend(q, k, v, cos, sin, slot._keys, slot._values, lengths, self.heads, attn.scaling)
            norm = layer.post_attention_layernorm
            hidden, x = ops.add_rms_norm(hidden, attn.o_proj(out), norm.weight, norm.variance_epsilon)
            gate, up = gate_up.full(x) if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
            norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else decoder.norm
            hidden, x = ops.add_rms_norm(hidden, mlp.down_proj(ops.silu_mul(gate, up)), norm.weight,
                                         norm.variance_epsilon)
        return self.causal_lm.lm_head(x).float()


def native_decoder(lean: LeanDecoder | None, device: torch.device) -> LeanDecoder | None:
    """``lean``'s step through the native kernels where they apply (a CPU, float32 or bf16 weights,
    kernels built), else ``lean`` itself."""
    if lean is None or device.type != "cpu" or type(lean) is not LeanDecoder:
        return lean
    dtype = lean.decoder.embed_tokens.weight.dtype
    norms = [lean.decoder.norm] + [n for layer in lean.decoder.layers
                                   for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if dtype not in DTYPES or any(n.weight.dtype != dtype for n in norms):
        return lean  # (a model keeping its norms in float32 beside bf16 weights: the eager step)
    ops = native_kernels.kernels()  # None where switched off or not built
    return lean if ops is None else NativeDecoder(lean.causal_lm, ops)
