"""The CPU decoding step with its non-matmul work in native kernels (native_kernels.py).

A bf16 decoding step of SmolLM2-135M at ~24 rows took ~54 ms on a 2-core Xeon where its Linears
alone take ~21 ms: the rest was ~60 small PyTorch operators per layer (RMSNorms, the rotary
embedding, KV-cache writes, grouped-query attention, SiLU), each costing more in dispatch and
passes over memory than in arithmetic (docs/benchmark.md). ``NativeDecoder`` runs a Llama layer
(or Qwen2's, Qwen3's, Phi-3's, Granite's -- its residual multiplier in the adds: lean_decode.py --,
SmolLM3's, whose no-rope layers rotate no dims) as
its Linears (the modules themselves, LoRA side paths included) plus four native calls: the residual
add with the next RMSNorm, rotary + cache write + attention (for Qwen3 with each head of q and k
normalised first), SiLU * up, and the next add + RMSNorm. OLMo2's layer normalises each sublayer's
output before the residual add (``post_norm_add``) and q and k whole (rope_attend, given norms as
wide as q and k), each norm rounded once. They round to the model's dtype wherever the eager
operators do, so they compute what the model's own forward computes up to the order of float sums
(tests/test_native_decode.py).
Where every layer has the sampler's packed layout (q/k/v and gate/up stacked, each Linear a packed
weight in oneDNN's layout or the streaming one, LoRA -- if any -- as a side path packed with it),
the whole loop over layers is one native
call (``decode_layers``), which makes the same calls in the same order from C++: the ~8 calls a
layer from Python, and the modules' own calls between them, were ~12% of an fp32 step at 24 rows
(docs/benchmark.md). Other layouts take the loop below.
Where the kernels are not built (no compiler, switched off), the sampler decodes with
``LeanDecoder``'s PyTorch operators, as before.
"""

from __future__ import annotations

import torch

from grpo.backends.local.kv_cache import SlotCache
from grpo.backends.local.lean_decode import Layout, LeanDecoder, OneProduct, head_norms, layer_norms
from grpo.models import native_kernels
from grpo.models.cpu_linear import PackedLinear
from grpo.models.fused_projections import FusedProjections
from grpo.models.lora_linear import LoraSidePath

DTYPES = (torch.float32, torch.bfloat16)
# The layers in one native call where they have the packed layout; False keeps the Python loop
# (for measuring one against the other: both make the same kernel calls, so they agree bit for bit).
ONE_CALL = True


class NativeDecoder(LeanDecoder):
    """``LeanDecoder``'s step with each layer's non-matmul work in four native calls. Its logits are
    the unembedding's own, bf16 for a bf16 model: the sampler's token choice widens them as it reads
    them (sample_tokens.cpp), where a float32 copy wrote 34 MB a step at 32 rows of a 262,144-token
    vocabulary (~1.3 ms of a Gemma-3-270M-shaped step of ~56 ms; the same tokens, docs/benchmark.md)."""

    reads_mask = False  # (its attention takes each row's length from the slot cache's step)

    def __init__(self, causal_lm, ops, layout: Layout = Layout()):
        super().__init__(causal_lm, layout)
        self.ops = ops
        self.heads = int(causal_lm.config.num_attention_heads)
        # the norms' rounding (native/common.h's NormKind): OLMo2's round once, after the weight
        self.norms = "once" if layout.post_norms else "llama"
        self.eps = float(self.decoder.norm.variance_epsilon)
        # Granite's scalings (native_decoder checked its layers share one residual multiplier)
        self.residual_multiplier = float(self.decoder.layers[0].residual_multiplier) if layout.multipliers else 1.0
        self.plan = _one_call_plan(self) if ONE_CALL else None
        self._rotary_table = RotaryTable(self.decoder.rotary_emb)

    def __call__(self, input_ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
                 cache: SlotCache) -> torch.Tensor:
        ops, decoder, layers = self.ops, self.decoder, self.decoder.layers
        hidden = decoder.embed_tokens.forward(input_ids)  # [rows, 1, hidden]
        if self.layout.multipliers:
            hidden = hidden * decoder.embedding_multiplier
        cos, sin = self._cos_sin(hidden, positions, cache.step.capacity)
        lengths = cache.step.lengths_tensor  # each row's new column: its position
        if self.plan is not None:
            plan = self.plan
            x = ops.decode_layers(hidden[:, 0], cos, sin, lengths, plan.weights, plan.extras, plan.norms,
                                  [slot._keys for slot in cache.layers], [slot._values for slot in cache.layers],
                                  plan.qkv_sizes, self.heads, plan.scale, plan.eps, plan.head_norms,
                                  cache.step.shared_from, cache.step.shared, post_norms=self.layout.post_norms,
                                  residual_multiplier=self.residual_multiplier,
                                  unrotated=[i for i, rotates in enumerate(self.rotates) if not rotates])
            return self._logits(x)
        if self.layout.post_norms:
            return self._logits(self._post_norm_layers(hidden[:, 0], cos, sin, lengths, cache))
        norm = layers[0].input_layernorm
        hidden, x = ops.add_rms_norm(hidden[:, 0], None, norm.weight, norm.variance_epsilon)
        for index, (layer, (qkv, gate_up)) in enumerate(zip(layers, self.groups, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = qkv.full(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            norms = head_norms(attn)  # (Qwen3: each head of q and k normalised as rope_attend rotates it)
            slot = cache.layers[index]
            # (scores by the dot product where the weights stream in pairs for it, as decode_layers decides;
            # a layer that rotates nothing takes cos and sin of no dims)
            rotary = (cos, sin) if self.rotates[index] else (cos[:, :0], sin[:, :0])
            out = ops.rope_attend(q, k, v, *rotary, slot._keys, slot._values, lengths, self.heads, attn.scaling,
                                  cache.step.shared_from, cache.step.shared,
                                  qkv is not None and qkv.layout == "stream_dot",
                                  *((norms[0].weight, norms[1].weight, norms[0].variance_epsilon) if norms else ()))
            norm = layer.post_attention_layernorm
            hidden, x = ops.add_rms_norm(hidden, attn.o_proj(out), norm.weight, norm.variance_epsilon,
                                         self.residual_multiplier)
            gate, up = gate_up.full(x) if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
            norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else decoder.norm
            hidden, x = ops.add_rms_norm(hidden, mlp.down_proj(ops.silu_mul(gate, up)), norm.weight,
                                         norm.variance_epsilon, self.residual_multiplier)
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The unembedding of the final norm's output (Granite's divided by its logits_scaling, in place:
        the bits of its forward's division)."""
        logits = self.causal_lm.lm_head(x)
        return logits.div_(self.causal_lm.config.logits_scaling) if self.layout.multipliers else logits

    def _post_norm_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: torch.Tensor,
                          cache: SlotCache) -> torch.Tensor:
        """OLMo2's layers (each sublayer's output normalised, then added; q and k normalised whole
        by rope_attend), then its final norm: ``[rows, hidden]``."""
        ops, eps = self.ops, self.eps
        for index, (layer, (qkv, gate_up)) in enumerate(zip(self.decoder.layers, self.groups, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = qkv.full(hidden) if qkv is not None else (attn.q_proj(hidden), attn.k_proj(hidden),
                                                                  attn.v_proj(hidden))
            slot = cache.layers[index]
            out = ops.rope_attend(q, k, v, cos, sin, slot._keys, slot._values, lengths, self.heads, attn.scaling,
                                  cache.step.shared_from, cache.step.shared,
                                  qkv is not None and qkv.layout == "stream_dot", attn.q_norm.weight,
                                  attn.k_norm.weight, eps, norms=self.norms)
            hidden = ops.post_norm_add(attn.o_proj(out), layer.post_attention_layernorm.weight, eps, self.norms, hidden)
            gate, up = gate_up.full(hidden) if gate_up is not None else (mlp.gate_proj(hidden), mlp.up_proj(hidden))
            hidden = ops.post_norm_add(mlp.down_proj(ops.silu_mul(gate, up)), layer.post_feedforward_layernorm.weight,
                                       eps, self.norms, hidden)
        return ops.post_norm_add(hidden, self.decoder.norm.weight, eps, self.norms)

    def _cos_sin(self, hidden: torch.Tensor, positions: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's rotary cos and sin ``[rows, head_dim]``: rows of a table the model's own rotary
        embedding computed once for every column of the cache, the same values bit for bit (each is a
        function of its position alone: tests/test_native_decode.py). A step's ~10 operators of the
        embedding become one lookup: on a CPU each operator of a step runs after its weight stream has
        evicted the interpreter from the caches, ~0.1 ms of a one-row bf16 step of ~11 ms (AMD EPYC).
        Rotary scalings that depend on the sequence's length ("dynamic", "longrope") are computed a
        step at a time, as before."""
        rotary = self.decoder.rotary_emb
        kind = str(getattr(rotary, "rope_type", "default"))
        if "dynamic" in kind or kind == "longrope":
            cos, sin = rotary(hidden, positions)
            return cos[:, 0], sin[:, 0]
        return self._rotary_table.rows(hidden, positions[:, 0], capacity)


class RotaryTable:
    """Rows' rotary cos and sin as rows of a table ``rotary(hidden, positions, *args)`` computed once
    for every column of the sampling call's cache (a model's rotary embedding, and for Gemma 3 the
    layer kind whose frequencies it takes): valid for embeddings whose cos and sin are a function of
    the position alone, which the decoders check."""

    def __init__(self, rotary, *args):
        self.rotary, self.args = rotary, args
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.made_for: torch.dtype | None = None  # (hidden's dtype; OLMo2's table is float32 whatever it is)

    def rows(self, hidden: torch.Tensor, positions: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[rows, rotary dims]`` at ``positions`` ``[rows]``, in the dtype the rotary
        embedding hands for ``hidden``'s; the table is made again where it is shorter than
        ``capacity`` or was made for another dtype."""
        table = self.table
        if table is None or table[0].shape[0] < capacity or self.made_for != hidden.dtype:
            cos, sin = self.rotary(hidden[:1], torch.arange(capacity, device=hidden.device)[None], *self.args)
            table = self.table = (cos[0], sin[0])
            self.made_for = hidden.dtype
        return table[0].index_select(0, positions), table[1].index_select(0, positions)


class OneCallPlan:
    """What ``decode_layers`` (and ``decode_gemma_layers``: gemma_decode.py) takes: per layer 4 packed
    weights (q/k/v, o, gate/up, down), 3 optional tensors a weight (bias, LoRA's packed A and B), the
    norms' weights in order, each layer's norms of q's and k's heads where it has them (Qwen3, OLMo2,
    Gemma 3), and the constants every layer shares."""

    def __init__(self):
        self.weights: list[torch.Tensor] = []
        self.extras: list[torch.Tensor | None] = []
        self.norms: list[torch.Tensor] = []
        self.head_norms: list[torch.Tensor] = []
        self.qkv_sizes: list[int] = []
        self.scale = self.eps = 0.0
        self.kinds: list[int] = []  # (Gemma's: each layer's rotary kind and window)
        self.windows: list[int] = []

    def add(self, module) -> bool:
        """One Linear of the step: a stacked group, a packed Linear, or a packed Linear with a packed
        LoRA side path (as such or as a model's own fused Linear: Phi-3's); False for anything else."""
        lora = None
        if isinstance(module, OneProduct):
            module = module.module
        if isinstance(module, FusedProjections):
            weight, bias, lora = module.packed, module.bias, module.lora
        elif type(module) is PackedLinear:
            weight, bias = module.packed, module.bias
        elif type(module) is LoraSidePath and type(module.base) is PackedLinear:
            weight, bias, lora = module.base.packed, module.base.bias, module.product
        else:
            return False
        if isinstance(module, torch.nn.Module) and (module._forward_hooks or module._forward_pre_hooks):
            return False  # (a hook someone registered runs when the loop calls the module)
        if lora is not None and lora.packed is None:
            return False
        self.weights.append(weight)
        self.extras += [bias, *(lora.packed if lora is not None else (None, None))]
        return True


def _one_call_plan(step: NativeDecoder) -> OneCallPlan | None:
    """``step``'s layers as ``decode_layers`` takes them, or None where any layer is laid out
    otherwise (a sibling not stacked, a Linear not packed, a side path not packed) or the layers
    differ in their attention scale, norm epsilon or q/k/v widths."""
    plan, decoder = OneCallPlan(), step.decoder
    for layer, (qkv, gate_up) in zip(decoder.layers, step.groups, strict=True):
        if qkv is None or gate_up is None or len(gate_up.sizes) != 2 or gate_up.sizes[0] != gate_up.sizes[1]:
            return None
        if not all(plan.add(m) for m in (qkv, layer.self_attn.o_proj, gate_up, layer.mlp.down_proj)):
            return None
    # each layer's two norms in the order they apply (before each sublayer, or OLMo2's after), then the final one
    norms = [n for layer in decoder.layers for n in layer_norms(layer, step.layout)]
    norms.append(decoder.norm)
    per_head = [head_norms(layer.self_attn) for layer in decoder.layers]
    if len({len(pair) for pair in per_head}) != 1:
        return None  # (every layer normalises q's and k's heads, or none does)
    shared = ({tuple(qkv.sizes) for qkv, _ in step.groups}, {float(layer.self_attn.scaling) for layer in decoder.layers},
              {float(n.variance_epsilon) for n in [*norms, *(n for pair in per_head for n in pair)]})
    if any(len(values) != 1 for values in shared):
        return None
    (qkv_sizes,), (plan.scale,), (plan.eps,) = shared
    plan.qkv_sizes, plan.norms = list(qkv_sizes), [n.weight for n in norms]
    plan.head_norms = [n.weight for pair in per_head for n in pair]
    return plan


def native_decoder(lean: LeanDecoder | None, device: torch.device) -> LeanDecoder | None:
    """``lean``'s step through the native kernels where they apply (a CPU, float32 or bf16 weights,
    kernels built), else ``lean`` itself."""
    if lean is None or device.type != "cpu" or type(lean) is not LeanDecoder:
        return lean
    dtype = lean.decoder.embed_tokens.weight.dtype
    norms = [lean.decoder.norm] + [n for layer in lean.decoder.layers
                                   for n in (*layer_norms(layer, lean.layout), *head_norms(layer.self_attn))]
    if dtype not in DTYPES or any(n.weight.dtype != dtype for n in norms):
        return lean  # (a model keeping its norms in float32 beside bf16 weights: the eager step)
    if any(len({n.variance_epsilon for n in head_norms(layer.self_attn)}) > 1 for layer in lean.decoder.layers):
        return lean  # (rope_attend normalises q's and k's heads with one epsilon)
    if lean.layout.post_norms and len({float(n.variance_epsilon) for n in norms}) > 1:
        return lean  # (OLMo2's step takes one epsilon for every norm)
    if lean.layout.multipliers and len({float(layer.residual_multiplier) for layer in lean.decoder.layers}) > 1:
        return lean  # (the kernels take one residual multiplier)
    ops = native_kernels.kernels()  # None where switched off or not built
    return lean if ops is None else NativeDecoder(lean.causal_lm, ops, lean.layout)
