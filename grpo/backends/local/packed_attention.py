"""Training micro-batches as packed sequences: every sequence's real tokens in one row, no padding.

Padding a micro-batch to its longest sequence makes every projection and MLP -- nearly all of a
step's FLOPs -- run on positions nobody reads: 8-32% of the processed tokens on the scaling rows
of docs/benchmark.md (GRPO groups of short answers beside a few long ones). Here the decoder runs on
one row holding every sequence's tokens back to back, each at its own positions (``position_ids``),
so the per-token layers see real tokens only. Attention is the one place sequences meet; it is done
by ``packed_attention``, registered with transformers as an attention implementation. On a CPU,
in float32 or bf16, grpo's native kernel attends each sequence's queries to its own keys in place,
forward and backward, without padding, sliding windows, Gemma 2's capped scores and GPT-OSS's
sinks included (``PackedPass._native_attention``); elsewhere (a GPU, dropout, kernels not built)
each sequence's queries and keys are gathered into small blocks of similar lengths, SDPA runs on
them with a causal mask (capped scores, sinks: the models' eager formula, ``_explicit_attention``),
and the outputs go back in packed order.

A sequence may continue an earlier sequence of the same row (a GRPO group's shared prompt): its
positions go on from there and its attention sees that sequence's keys and values besides its
own, with gradients flowing back through them as through a KV cache. Continuations chain (a
system prompt every group shares, then each group's question, then the group's answers), so a
whole shared micro-batch is one decoder call with every prompt token in it once.

A hybrid's linear-attention layers (Qwen3.5's gated delta rule) read the pass too, through grpo's
functions for their convolution and delta rule (packed_recurrence.py): each sequence from what its
own history left.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from transformers import AttentionInterface

from grpo.backends.local import memory
from grpo.backends.local.trial import trial_run

IMPLEMENTATION = "grpo_packed"
# A block of sequences pads each to the block's longest; a new block starts once a sequence's
# keys are this many times the block's first's, so a long answer is not padded onto short ones.
BLOCK_GROWTH = 1.5
# SDPA's grouped-query path on a CPU (see PackedPass.attend); False copies keys and values per
# query head as on CUDA (for measuring one against the other).
GROUPED_SDPA_ON_CPU = True
# Half-precision (bf16, fp16) attention runs in float32 on a CPU (see PackedPass.attend); False
# keeps the model's dtype (for measuring one against the other).
FP32_ATTENTION_ON_CPU = True
# On a CPU, float32 and bf16 attention through grpo's native kernel (``_NativeAttention``) where it
# is built; False takes SDPA over gathered blocks, as before (for measuring one against the other).
NATIVE_ATTENTION_ON_CPU = True
# Attention shapes (heads, key heads, head dim) whose bf16 attention the native kernel takes by
# avx512_bf16's dot product: set by the engine where kernel_probe.py measured that faster here than
# float32's multiply-adds. The scores' products are exact either way (their sums in another order);
# the weighted sums and key/value gradients then multiply the softmax's weights and their gradients
# rounded to bf16, as PyTorch's CPU flash attention does for bf16, not float32's.
_DOT_PRODUCTS: set[tuple[int, int, int]] = set()


def use_dot_products(heads: int, kv_heads: int, head_dim: int, dot: bool) -> None:
    """Whether bf16 attention of this shape takes its products by avx512_bf16's dot product
    (``dot``) or by float32's multiply-adds, in this process (kernel_probe.training_attention)."""
    (_DOT_PRODUCTS.add if dot else _DOT_PRODUCTS.discard)((heads, kv_heads, head_dim))


def supports(model) -> bool:
    """Whether packing serves this model: attention-only decoders (Gemma 2's capped scores and
    GPT-OSS's sinks included); and hybrids whose linear-attention layers run grpo's delta rule and
    convolution
    (packed_recurrence.py). Others train on padded micro-batches, as does a model whose decoder,
    tried once, does not pack (``packs_as_alone``)."""
    from grpo.backends.local import delta_rule
    from grpo.backends.local.kv_cache import attention_layers

    config = model.config
    try:
        attention_layers(config)
    except ValueError:
        if not delta_rule.packs(model):
            return False
    if model not in _PACKS:
        _PACKS[model] = packs_as_alone(model)
        if not _PACKS[model]:
            causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
            print(f"grpo: {type(causal_lm).__name__}'s decoder does not pack sequences in one row (tried once): "
                  "training on padded micro-batches", file=sys.stderr, flush=True)
    return _PACKS[model]


_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> packs_as_alone(model)


def packs_as_alone(model, lengths: tuple[int, ...] = (5, 3)) -> bool:
    """Whether short random sequences packed in one row come out of ``model``'s decoder as each
    does in a packed pass of its own (the same attention path: bit-equal on SmolLM2 in float32
    and bf16, where against the decoder's own SDPA a bf16 pass is up to 23% off, its attention
    being float32 here). Its attention finds the pass as the thread's running one (``running``),
    whatever keyword arguments its layers pass on (StableLM's pass none); a decoder that attends by
    code of its own once the implementation is not one it knows (Falcon's) fails in a packed pass
    or mixes its sequences: it trains padded."""
    decoder = model.get_decoder()
    parameter = next(model.parameters())
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (sum(lengths),), generator=torch.Generator().manual_seed(0)).to(parameter.device)
    try:
        with trial_run(model):
            packed = PackedPass(list(lengths), parameter.device).run(decoder, ids)
            alone = torch.cat([PackedPass([len(seq)], parameter.device).run(decoder, seq)
                               for seq in torch.split(ids, list(lengths))])
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError):
        return False
    # (room for a matmul that rounds differently at another row count; mixed sequences are ~100% off)
    tolerance = 1e-3 if parameter.dtype == torch.float32 else 0.05
    packed, alone = packed.float(), alone.float()
    scale = torch.maximum(alone.abs(), alone.abs().mean())
    return packed.shape == alone.shape and bool(((packed - alone).abs() <= tolerance * scale).all())


@dataclass
class _Block:
    """Sequences attended together: gather indices for their queries and keys, and the mask."""

    count: int
    q_len: int
    k_len: int
    q_index: torch.Tensor  # (count * q_len,) rows of the packed queries, padding -> the zero row
    k_index: torch.Tensor  # (count * k_len,) rows of the pass's keys (and a zero row for padding)
    q_pos: torch.Tensor  # (count, q_len) absolute positions of the queries
    k_pos: torch.Tensor  # (count, k_len)
    mask: torch.Tensor  # (count, 1, q_len, k_len) causal, within each sequence (and its prefix)
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """The mask, restricted to the last ``sliding_window`` keys of each query where the layer
        has one; made once per window and pass, not once per layer."""
        if sliding_window is None:
            return self.mask
        if sliding_window not in self._windowed:
            near = (self.q_pos[:, :, None] - self.k_pos[:, None, :]) < sliding_window
            mask = self.mask & near[:, None]
            mask[..., 0] |= ~mask.any(-1)  # as for padded queries: never an empty softmax
            self._windowed[sliding_window] = mask
        return self._windowed[sliding_window]


class PackedPass:
    """One decoder call over sequences packed in one row.

    ``lengths[i]`` tokens of sequence i, in order. With ``continues[i] = j`` (an earlier
    sequence of the pass, ``j < i``), sequence i continues sequence j, and so everything j
    continues: its positions start after them and its attention sees all of them.

    One call for a whole shared micro-batch, rather than a pass per level (trunk, prompts,
    answers) chained through recorded keys and values as before: a pass has a fixed cost of ~30
    small operators per layer whatever its rows (forward + backward of SmolLM2-135M with LoRA:
    0.18 s for 8 rows, 0.77 s for 576; bf16, Intel Xeon with AMX, docs/benchmark.md).
    """

    def __init__(self, lengths: Sequence[int], device: torch.device, *,
                 continues: Sequence[int | None] | None = None):
        if continues is not None:
            if len(continues) != len(lengths):
                raise ValueError(f"continues has {len(continues)} entries for {len(lengths)} sequences")
            bad = [(i, j) for i, j in enumerate(continues) if j is not None and not 0 <= j < i]
            if bad:
                raise ValueError(f"continues[{bad[0][0]}] = {bad[0][1]}: a sequence continues an earlier one of the pass")
        self.lengths = [int(n) for n in lengths]
        self.continues: list[int | None] = list(continues) if continues is not None else [None] * len(self.lengths)
        self.calls = 0  # attention layers run (``attend``)
        self.recurrent_calls = 0  # linear-attention layers run (a hybrid's: packed_recurrence.delta_rule)
        self._native_plan: tuple[torch.Tensor, torch.Tensor] | None = None  # _native_attention's, made on first use
        n = sum(self.lengths)
        starts = [0, *accumulate(self.lengths)][:-1]
        self.starts = starts
        self.tokens = n
        # sequence i's keys, as rows of the pass: those of the sequences it continues, then its own
        self.key_rows: list[list[int]] = []
        for i, (s, m) in enumerate(zip(starts, self.lengths, strict=True)):
            before = self.key_rows[continues[i]] if continues is not None and continues[i] is not None else []
            self.key_rows.append([*before, *range(s, s + m)])
        p_lens = [len(rows) - m for rows, m in zip(self.key_rows, self.lengths, strict=True)]
        self.position_ids = torch.cat([torch.arange(p, p + m) for p, m in zip(p_lens, self.lengths, strict=True)]
                                      ).to(device)[None] if n else torch.zeros((1, 0), dtype=torch.long, device=device)
        zero = n  # index of the zero row appended to queries and keys
        order = sorted(range(len(self.lengths)), key=lambda i: (p_lens[i] + self.lengths[i], i))
        self.blocks: list[_Block] = []
        out_rows: list[torch.Tensor] = []
        done = 0
        blocks = _split(order, [p_lens[i] + self.lengths[i] for i in range(len(self.lengths))])
        for members in blocks:
            q_len = max(self.lengths[i] for i in members)
            k_len = max(p_lens[i] + self.lengths[i] for i in members)
            q_index = torch.full((len(members), q_len), zero, dtype=torch.long)
            k_index = torch.full((len(members), k_len), zero, dtype=torch.long)
            q_pos = torch.zeros((len(members), q_len), dtype=torch.long)
            k_pos = torch.arange(k_len).expand(len(members), k_len)
            q_valid = torch.zeros((len(members), q_len), dtype=torch.bool)
            k_valid = torch.zeros((len(members), k_len), dtype=torch.bool)
            for s, i in enumerate(members):
                m, p = self.lengths[i], p_lens[i]
                q_index[s, :m] = torch.arange(starts[i], starts[i] + m)
                q_pos[s] = torch.arange(p, p + q_len)
                k_index[s, :p + m] = torch.tensor(self.key_rows[i], dtype=torch.long)
                q_valid[s, :m] = True
                k_valid[s, :p + m] = True
                out_rows.append(torch.arange(done + s * q_len, done + s * q_len + m))
            mask = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
            mask[:, :, 0] |= ~q_valid  # padded queries look at one key: no empty softmax, output unused
            self.blocks.append(_Block(len(members), q_len, k_len, q_index.reshape(-1).to(device),
                                      k_index.reshape(-1).to(device), q_pos.to(device), k_pos.to(device),
                                      mask[:, None].to(device)))
            done += len(members) * q_len
        # packed position of each block output row -> where it goes: invert the members' order
        flat = torch.cat(out_rows) if out_rows else torch.zeros(0, dtype=torch.long)
        by_sequence = [i for members in blocks for i in members]
        packed_of = torch.cat([torch.arange(starts[i], starts[i] + self.lengths[i]) for i in by_sequence]) \
            if by_sequence else torch.zeros(0, dtype=torch.long)
        out_index = torch.empty(n, dtype=torch.long)
        out_index[packed_of] = flat
        self.out_index = out_index.to(device)

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
               dropout: float, sliding_window: int | None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of this pass's queries ``(1, heads, n, dim)`` over its keys and values;
        returns ``(1, n, heads, dim)`` as transformers' kernels do. ``sliding_window``: each query
        sees its last that many keys; ``softcap``: scores capped as Gemma 2's eager attention caps
        them (``softcap * tanh(score / softcap)``, after the scaling, before the softmax); ``sinks``:
        a logit a query head beside the keys' in each softmax, weighing no value (GPT-OSS's)."""
        self.calls += 1
        heads, dim = query.shape[1], query.shape[3]
        native = self._native_attention(query, key, value, scaling, dropout, sliding_window, softcap, sinks)
        if native is not None:
            return native
        q = query[0].transpose(0, 1)  # (n, heads, dim)
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (n, kv_heads, dim)
        # PyTorch's CPU flash-attention backward in bf16 takes 3-4x its float32 time on these
        # blocks (SmolLM2's, Intel Xeon with AMX: 10.3 against 3.3 ms forward + backward), and the
        # gathers' backward (scatter-adds) is slower in bf16 too; the casts cost a pass over q/k/v.
        # Computing attention in float32 from bf16 inputs is also the more exact of the two.
        out_dtype = q.dtype
        if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and FP32_ATTENTION_ON_CPU:
            q, k, v = q.float(), k.float(), v.float()
        q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
        k = torch.cat([k, k.new_zeros(1, *k.shape[1:])])
        v = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
        groups = heads // k.shape[1]
        # Query head h reads key head h // groups, as transformers' repeat_kv. On a CPU, SDPA's own
        # grouped-query path does that without copying keys and values per query head: a block's
        # forward + backward took half the time (SmolLM2's 9 / 3 heads, AMD EPYC Zen 4, bits equal).
        # On CUDA the copies stay: that path is the one measured there.
        grouped = groups > 1 and q.device.type == "cpu" and GROUPED_SDPA_ON_CPU
        outputs = []
        for b in self.blocks:
            qb = q.index_select(0, b.q_index).view(b.count, b.q_len, heads, dim).transpose(1, 2)
            kb = k.index_select(0, b.k_index).view(b.count, b.k_len, -1, dim).transpose(1, 2)
            # (values may be narrower than queries and keys: DeepSeek's latent attention)
            vb = v.index_select(0, b.k_index).view(b.count, b.k_len, -1, v.shape[-1]).transpose(1, 2)
            if groups > 1 and not grouped:
                kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
            if softcap or sinks is not None:
                out = _explicit_attention(qb, kb, vb, b.mask_for(sliding_window), dropout, scaling, softcap, sinks)
            else:
                out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask_for(sliding_window),
                                                     dropout_p=dropout, scale=scaling, enable_gqa=grouped)
            outputs.append(out.transpose(1, 2).reshape(b.count * b.q_len, heads, v.shape[-1]))
        return torch.cat(outputs).index_select(0, self.out_index)[None].to(out_dtype)

    def _native_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                          dropout: float, sliding_window: int | None, softcap: float | None,
                          sinks: torch.Tensor | None) -> torch.Tensor | None:
        """``attend`` through grpo's kernel (grpo/models/native/packed_attention.cpp): each
        sequence's queries over its own keys, none padded, nothing past a query's last key computed,
        float32 sums, a sliding window's keys before it neither computed nor gathered, Gemma 2's cap
        on the scores, GPT-OSS's sinks; None where it does not apply (off the CPU, another dtype,
        dropout, kernels not built, values of another head dimension than the keys': DeepSeek's
        latent attention). SmolLM2's 30 layers over the bench's packed pass, forward and
        backward: 0.17 against 0.44 s for the gathered blocks through SDPA in bf16, 0.19 against 0.44
        in float32, when it came (AMD EPYC Zen 4, 2 cores); its kernel alone now ~0.08 s there, 1.5x
        faster again at 512-token answers (docs/benchmark.md, scripts/attention_rate.py). bf16 of a
        shape in ``_DOT_PRODUCTS`` takes its products by avx512_bf16's dot product (``use_dot_products``)."""
        if not (NATIVE_ATTENTION_ON_CPU and query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16)
                and key.dtype == value.dtype == query.dtype and dropout == 0.0
                and query.shape[1] % key.shape[1] == 0 and query.shape[3] == key.shape[3] == value.shape[3]):
            return None
        from grpo.models import native_kernels

        ops = native_kernels.kernels()
        if ops is None or not hasattr(ops, "packed_attention"):
            return None
        heads, kv_heads, n, dim = query.shape[1], key.shape[1], query.shape[2], query.shape[3]
        scale = float(scaling) if scaling is not None else dim ** -0.5
        # (n, heads * dim) rows back to back: a model that slices q, k and v out of one fused
        # projection (Phi-3's qkv_proj) hands views whose rows are the fused row's width apart
        flat = [t[0].transpose(0, 1).reshape(n, -1).contiguous() for t in (query, key, value)]
        dot = query.dtype == torch.bfloat16 and (heads, kv_heads, dim) in _DOT_PRODUCTS
        rule = (int(sliding_window or 0), float(softcap or 0.0))
        if sinks is not None:  # (float32, one a query head: the kernel's; its gradient flows back to the model's)
            sinks = sinks.float().contiguous()
        out = _NativeAttention.apply(*flat, sinks, *self.native_plan(), heads, kv_heads, scale, dot, rule, ops)
        return out.view(1, n, heads, dim)

    def native_plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass as grpo's kernel takes it: ``seqs``, a ``[q_start, q_len, prefix, key_offset]`` row
        per sequence, and ``key_rows``, every sequence's key rows back to back; made on first use."""
        if self._native_plan is None:
            seqs, rows = [], []
            for i, (start, length) in enumerate(zip(self.starts, self.lengths, strict=True)):
                seqs.append((start, length, len(self.key_rows[i]) - length, len(rows)))
                rows += self.key_rows[i]
            self._native_plan = (torch.tensor(seqs, dtype=torch.long).reshape(-1, 4), torch.tensor(rows, dtype=torch.long))
        return self._native_plan

    @contextmanager
    def running(self, decoder) -> Iterator[None]:
        """``decoder``'s attention layers (and a hybrid's linear-attention functions) use this pass
        while the block runs, as this thread's running pass (``running_pass``: found whatever keyword
        arguments a layer passes on, where StableLM's pass none); afterwards, checks that every one
        of them did (a model whose attention ignores transformers' attention interface would
        otherwise mix sequences silently)."""
        config = decoder.config
        before, outer = config._attn_implementation, running_pass()
        config._attn_implementation = IMPLEMENTATION
        _RUNNING.packed = self
        try:
            yield
        finally:
            config._attn_implementation = before
            _RUNNING.packed = outer
        recurrent = memory.linear_attention_layers(config)
        attention = int(config.get_text_config(decoder=True).num_hidden_layers) - recurrent
        if self.tokens and self.calls != attention:
            raise RuntimeError(f"packed attention ran in {self.calls} of {attention} layers: this model's attention does "
                               "not go through transformers' attention interface; train it with packing off")
        if self.tokens and self.recurrent_calls != recurrent:
            raise RuntimeError(f"the packed delta rule ran in {self.recurrent_calls} of {recurrent} linear-attention "
                               "layers: this model's layers do not run grpo's delta rule; train it with packing off")

    def run(self, decoder, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states ``(n, hidden)`` for ``input_ids`` ``(n,)``."""
        with self.running(decoder):
            out = decoder(input_ids=input_ids[None], position_ids=self.position_ids, use_cache=False)
        return out.last_hidden_state[0]


class _NativeAttention(torch.autograd.Function):
    """``PackedPass``'s attention through the kernel, forward and backward (the backward recomputes
    the weights from the saved log-sum-exp, as flash attention does)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, seqs, key_rows, heads, kv_heads, scale, dot, rule, ops):
        out, lse = ops.packed_attention(q, k, v, seqs, key_rows, heads, kv_heads, scale, dot, *rule, sinks)
        ctx.save_for_backward(q, k, v, out, lse, seqs, key_rows, sinks)
        ctx.heads, ctx.kv_heads, ctx.scale, ctx.dot, ctx.rule, ctx.ops = heads, kv_heads, scale, dot, rule, ops
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse, seqs, key_rows, sinks = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = ctx.ops.packed_attention_backward(grad, q, k, v, out, lse, seqs, key_rows, ctx.heads,
                                                       ctx.kv_heads, ctx.scale, ctx.dot, *ctx.rule)
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # a sink's logit s_h: d/ds_h = -sum over queries of p_sink * delta, p_sink = exp(s_h - lse),
            # delta = grad . out (the softmax's backward: the sink weighs no value)
            delta = (grad.float() * out.float()).view(out.shape[0], ctx.heads, -1).sum(-1)
            d_sinks = -(torch.exp(sinks[None] - lse) * delta).sum(0)
        return dq, dk, dv, d_sinks, None, None, None, None, None, None, None, None


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout: float,
                        scaling: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """A gathered block's attention with its scores capped (Gemma 2's) or a sink beside its keys
    (GPT-OSS's), which SDPA cannot do: as the models' eager attention computes them, the softmax in
    float32."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = scores.softmax(-1, dtype=torch.float32)
    else:  # (each head's sink a column of its own, dropped after the softmax)
        column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        weights = torch.cat([scores, column], dim=-1).softmax(-1, dtype=torch.float32)[..., :-1]
    return F.dropout(weights.to(q.dtype), p=dropout, training=dropout > 0) @ v


def _split(order: list[int], key_lengths: list[int]) -> list[list[int]]:
    """``order`` (sorted by key length) cut into blocks whose longest is at most BLOCK_GROWTH
    times their first's."""
    blocks: list[list[int]] = []
    for i in order:
        if blocks and key_lengths[i] <= BLOCK_GROWTH * max(1, key_lengths[blocks[-1][0]]):
            blocks[-1].append(i)
        else:
            blocks.append([i])
    return blocks


# the pass running on each thread (PackedPass.running)
_RUNNING = threading.local()


def running_pass() -> PackedPass | None:
    """The packed pass this thread is running (``PackedPass.running``), or None: what its attention
    layers and a hybrid's linear-attention functions read, rather than a keyword argument some
    layers do not pass on."""
    return getattr(_RUNNING, "packed", None)


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, **kwargs):
    packed = running_pass()
    if packed is None:
        raise RuntimeError(f"the {IMPLEMENTATION!r} attention runs only inside PackedPass.run")
    return packed.attend(module, query, key, value, scaling, dropout, sliding_window, kwargs.get("softcap"),
                         kwargs.get("s_aux")), None


AttentionInterface.register(IMPLEMENTATION, packed_attention)
