"""The CPU decoding step for Gemma 3's text decoders (Gemma-3-270M, -1B; the language model of the
larger ones) and Gemma 2's, without transformers' per-call machinery.

Llama-shaped layers (Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo2, Granite's) decode through grpo's own step
(lean_decode.py, native_decode.py); every other family decodes through transformers' forward, where
a Gemma-3-270M-shaped model's bf16 step at 32 rows spent ~18 ms of ~47 in Python and small
operators beside ~24 ms of products (docs/benchmark.md): per layer the rotary embedding (~10
operators), the slot cache's writes, the attention interface and the wrappers around each module.
``GemmaDecoder`` calls the layer's projections (stacked where the sampler stacked them) and does
the rest in three native calls a layer: ``rope_attend`` (each head of q and k through Gemma's
zero-centred norm, the rotary embedding, the cache write and the attention over each row's columns,
a GRPO group's prompt read once, as for Llama's shape), ``add_zero_centred_norms`` twice (a
sublayer's post-norm, the residual add and the next sublayer's pre-norm) and ``gelu_tanh_mul``.
Each rounds to the model's dtype where the eager operators do; the attention sums in float32 in its
own order and GELU's tanh is computed otherwise, so the logits agree with the model's forward to
rounding, not bit for bit (tests/test_gemma_decode.py).

A sliding layer (five of six; a window of 512 tokens in Gemma-3-270M and -1B) attends to each
row's last ``window`` columns, as the slot cache's mask for that kind says.

Gemma 2's layer is Gemma 3's without the norms of q's and k's heads, with one rotary embedding for
both kinds of layer (windows of 4,096, every other layer), and with its attention's scores capped
(``attn_logit_softcapping``: cap * tanh(score / cap), 50 in its checkpoints), which rope_attend
applies before the softmax; transformers runs it through its eager attention only (SDPA has no cap).
Its logits are capped too (30 in its checkpoints), by ``soft_cap_`` in place: as the trainer's loss
head caps them (logit_head.py), each value in float32 rounded once, in one pass.
A Gemma-2-2B-shaped bf16 step (SmolLM2-135M's sizes, its layer) took 1.8-2x Llama's through the
model's forward (docs/benchmark.md).

It takes a model only when every part is what it was written against -- ``Gemma3ForCausalLM``
(as such or under peft) with SDPA attention, causal, no attention soft-cap; ``Gemma2ForCausalLM``
with its eager attention; float32 or bf16 throughout, one epsilon for every norm, rotary embeddings
that depend on the position alone -- and returns None otherwise: the sampler then calls the model's
own forward.
"""

from __future__ import annotations

import torch
from torch import nn

from grpo.backends.local import native_decode
from grpo.backends.local.kv_cache import SlotCache, attention_layers
from grpo.backends.local.lean_decode import stacked_groups
from grpo.backends.local.native_decode import OneCallPlan, RotaryTable
from grpo.backends.local.native_layers import is_gelu_tanh
from grpo.models import native_kernels

DTYPES = (torch.float32, torch.bfloat16)


class GemmaDecoder:
    """``model(input_ids=[rows, 1], position_ids=positions, cache=cache)`` of a decoding step on the
    slot cache, as plain calls; returns the next-token logits ``[rows, vocab]`` in the unembedding's
    dtype (as ``NativeDecoder``: the token choice widens bf16 as it reads it)."""

    reads_mask = False  # (each row attends to its columns 0..its length: the slot cache's step says which)

    def __init__(self, causal_lm: nn.Module, ops, version: int = 3):
        self.causal_lm, self.ops = causal_lm, ops
        self.decoder = causal_lm.model
        self.heads = int(causal_lm.config.num_attention_heads)
        self.kinds = attention_layers(causal_lm.config)[0]  # each layer's kind: its rotary table
        self.softcap = causal_lm.config.final_logit_softcapping
        # Gemma 2's cap on the attention's scores (0: none); Gemma 3 normalises q's and k's heads instead
        self.attention_softcap = float(causal_lm.config.attn_logit_softcapping or 0.0) if version == 2 else 0.0
        self.head_norms = version == 3
        self.groups = stacked_groups(self.decoder.layers)  # (q/k/v, gate/up: one product each where stacked)
        # each kind's rotary rows (Gemma 3's sliding and full layers rotate by their own frequencies; Gemma 2's
        # by one embedding's)
        if version == 3:
            self.rotary = {kind: RotaryTable(self.decoder.rotary_emb, kind) for kind in set(self.kinds)}
        else:
            self.rotary = {"all": RotaryTable(self.decoder.rotary_emb)}
            self.kinds = ["all"] * len(self.kinds)
        self.eps = float(causal_lm.config.rms_norm_eps)  # (every norm's: gemma_decoder checked)
        # GELU's tanh approximation through the kernel (every Gemma 3 checkpoint's); another activation eager
        self.gelu_tanh = all(is_gelu_tanh(layer.mlp.act_fn) for layer in self.decoder.layers)
        self.kind_order = sorted(set(self.kinds))  # (the one call's cos and sin: one row of each kind's)
        self.plan = self._one_call_plan() if native_decode.ONE_CALL else None

    def __call__(self, input_ids: torch.Tensor, mask, positions: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        ops, decoder, layers = self.ops, self.decoder, self.decoder.layers
        # Modules' ``forward`` is called directly where their ``__call__`` would only add hooks
        hidden = decoder.embed_tokens.forward(input_ids)[:, 0]  # [rows, hidden], scaled by sqrt(hidden)
        lengths = cache.step.lengths_tensor  # each row's new column: its position
        rotary = {kind: table.rows(hidden, positions[:, 0], cache.step.capacity) for kind, table in self.rotary.items()}
        if self.plan is not None:  # (every layer in one native call: the same calls in the same order)
            plan = self.plan
            cos = torch.stack([rotary[kind][0] for kind in self.kind_order])
            sin = torch.stack([rotary[kind][1] for kind in self.kind_order])
            x = ops.decode_gemma_layers(hidden, cos, sin, lengths, plan.weights, plan.extras, plan.norms,
                                        [slot._keys for slot in cache.layers], [slot._values for slot in cache.layers],
                                        plan.qkv_sizes, self.heads, plan.scale, self.eps, plan.head_norms, plan.kinds,
                                        plan.windows, self.attention_softcap, cache.step.shared_from,
                                        cache.step.shared)
            return self._capped(self.causal_lm.lm_head(x))
        x = ops.zero_centred_rms_norm(hidden, layers[0].input_layernorm.weight, self.eps)
        for index, (layer, (qkv, gate_up)) in enumerate(zip(layers, self.groups, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = qkv.full(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            cos, sin = rotary[self.kinds[index]]
            slot = cache.layers[index]
            # each head of q and k normalised (Gemma's norm: rounded once, after its 1 + weight), rotated,
            # written to the cache; then attended
            norms = (attn.q_norm.weight, attn.k_norm.weight, self.eps) if self.head_norms else (None, None, 0.0)
            out = ops.rope_attend(q, k, v, cos, sin, slot._keys, slot._values, lengths, self.heads, attn.scaling,
                                  cache.step.shared_from, cache.step.shared,
                                  qkv is not None and qkv.layout == "stream_dot", *norms, norms="zero_centred",
                                  window=attn.sliding_window or 0, softcap=self.attention_softcap)
            hidden, x = ops.add_zero_centred_norms(hidden, attn.o_proj(out), layer.post_attention_layernorm.weight,
                                                   layer.pre_feedforward_layernorm.weight, self.eps)
            gate, up = gate_up.full(x) if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
            act = ops.gelu_tanh_mul(gate, up) if self.gelu_tanh else mlp.act_fn(gate) * up
            norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else decoder.norm
            hidden, x = ops.add_zero_centred_norms(hidden, mlp.down_proj(act), layer.post_feedforward_layernorm.weight,
                                                   norm.weight, self.eps)
        return self._capped(self.causal_lm.lm_head(x))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is not None:  # (in place, as the trainer's loss head caps them: logit_head.py)
            logits = self.ops.soft_cap_(logits, self.softcap)
        return logits

    def _one_call_plan(self) -> OneCallPlan | None:
        """The layers as ``decode_gemma_layers`` takes them, or None where any layer is laid out
        otherwise (a sibling not stacked, a Linear or a side path not packed), its activation is not
        GELU's tanh approximation, or the layers differ in their attention scale or q/k/v widths."""
        plan, layers = OneCallPlan(), self.decoder.layers
        if not self.gelu_tanh:
            return None
        for layer, (qkv, gate_up) in zip(layers, self.groups, strict=True):
            if qkv is None or gate_up is None or len(gate_up.sizes) != 2 or gate_up.sizes[0] != gate_up.sizes[1]:
                return None
            if not all(plan.add(m) for m in (qkv, layer.self_attn.o_proj, gate_up, layer.mlp.down_proj)):
                return None
        if len({tuple(qkv.sizes) for qkv, _ in self.groups}) != 1 or len({float(layer.self_attn.scaling)
                                                                          for layer in layers}) != 1:
            return None
        plan.qkv_sizes, plan.scale = list(self.groups[0][0].sizes), float(layers[0].self_attn.scaling)
        plan.norms = [n.weight for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                                            layer.pre_feedforward_layernorm,
                                                            layer.post_feedforward_layernorm)] + [self.decoder.norm.weight]
        plan.head_norms = [n.weight for layer in layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)] \
            if self.head_norms else []
        plan.kinds = [self.kind_order.index(kind) for kind in self.kinds]
        plan.windows = [layer.self_attn.sliding_window or 0 for layer in layers]
        return plan


def gemma_decoder(model: nn.Module, device: torch.device) -> GemmaDecoder | None:
    """A ``GemmaDecoder`` for ``model`` (a causal LM, or a peft model around one) where it computes
    what the model's own forward does and the native kernels are built, else None."""
    if device.type != "cpu":
        return None
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    version, classes = _version(causal_lm)
    if version is None:
        return None
    model_class, embedding_class, layer_class, attention_class, mlp_class, norm_class, rotary_class = classes
    config, decoder = causal_lm.config, causal_lm.model
    if version == 3 and (config._attn_implementation != "sdpa" or config.attn_logit_softcapping is not None):
        return None
    if version == 2 and config._attn_implementation != "eager":
        return None  # (its scores' cap is applied by its eager attention alone: SDPA would leave it out)
    if (getattr(config, "use_bidirectional_attention", False) or type(decoder) is not model_class
            or type(decoder.embed_tokens) is not embedding_class):
        return None
    dtype = decoder.embed_tokens.weight.dtype
    if dtype not in DTYPES or decoder.embed_tokens.weight.device.type != "cpu":
        return None
    try:
        kinds, window = attention_layers(config)
    except ValueError:
        return None
    if len(kinds) != len(decoder.layers):
        return None
    rotary = decoder.rotary_emb
    rope_types = getattr(rotary, "rope_type", {})
    if type(rotary) is not rotary_class or any(
            "dynamic" in str(kind) or kind == "longrope"
            for kind in (rope_types.values() if isinstance(rope_types, dict) else [rope_types])):
        return None  # (cos and sin that depend on the sequence's length, not only the position)
    norms = [decoder.norm]
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (type(layer) is layer_class and type(attn) is attention_class
                and type(mlp) is mlp_class and attn.layer_type in ("full_attention", "sliding_attention")
                and attn.sliding_window == (window if attn.layer_type == "sliding_attention" else None)):
            return None  # (the window each layer applies is the one the slot cache masks for its kind)
        norms += [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                  layer.post_feedforward_layernorm, *((attn.q_norm, attn.k_norm) if version == 3 else ())]
    if any(type(n) is not norm_class or n.weight.dtype != dtype or n.eps != config.rms_norm_eps for n in norms):
        return None  # (the kernels take one epsilon for every norm)
    ops = native_kernels.kernels()  # None where switched off or not built
    return None if ops is None else GemmaDecoder(causal_lm, ops, version)


def _version(causal_lm: nn.Module) -> tuple[int | None, tuple[type, ...]]:
    """Which Gemma ``causal_lm`` is (3, 2, or None: neither), with the classes its parts must be:
    (decoder, embedding, layer, attention, MLP, RMSNorm, rotary embedding)."""
    try:
        from transformers.models.gemma2 import modeling_gemma2 as gemma2
        from transformers.models.gemma3 import modeling_gemma3 as gemma3
    except ImportError:
        return None, ()
    if type(causal_lm) is gemma3.Gemma3ForCausalLM:
        return 3, (gemma3.Gemma3TextModel, gemma3.Gemma3TextScaledWordEmbedding, gemma3.Gemma3DecoderLayer,
                   gemma3.Gemma3Attention, gemma3.Gemma3MLP, gemma3.Gemma3RMSNorm, gemma3.Gemma3RotaryEmbedding)
    if type(causal_lm) is gemma2.Gemma2ForCausalLM:
        return 2, (gemma2.Gemma2Model, gemma2.Gemma2TextScaledWordEmbedding, gemma2.Gemma2DecoderLayer,
                   gemma2.Gemma2Attention, gemma2.Gemma2MLP, gemma2.Gemma2RMSNorm, gemma2.Gemma2RotaryEmbedding)
    return None, ()
