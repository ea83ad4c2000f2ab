"""The native decoding kernels compute what the eager operators compute, and the sampler decodes
with them on a CPU -- or, where they cannot be built, says so once and decodes without them.

Each kernel is checked against the operators it replaces (transformers' own RMSNorm, rotary
embedding and SDPA attention), in float32 to float rounding and in bf16 to a unit in the last
place; the whole step against ``LeanDecoder``'s through real sampling calls.
"""

from __future__ import annotations

import pytest
import torch
from backend_helpers import (
    ROUNDING_ULPS,
    assert_greedy_alike,
    assert_within_ulps,
    greedy_rows,
    perturb_adapter,
    rotary_rows,
    sample_each,
)
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from grpo.backends.local import ServiceClient, native_decode, sampler
from grpo.models import native_kernels
from grpo.models.cpu_linear import packing_works, stream_dot_available

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def ops(native_ops):
    return native_ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_residual_add_and_llamas_rms_norm(ops, dtype) -> None:
    torch.manual_seed(0)
    norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    residual, x = torch.randn(5, 48, dtype=dtype) * 3, torch.randn(5, 48, dtype=dtype)
    hidden, normed = ops.add_rms_norm(residual, x, norm.weight, norm.variance_epsilon)
    assert torch.equal(hidden, residual + x)  # one rounding of the sum either way
    assert_within_ulps(normed, norm(residual + x), dtype, ulps=ROUNDING_ULPS[dtype])
    same, alone = ops.add_rms_norm(residual, None, norm.weight, norm.variance_epsilon)
    assert same is residual  # no add: the residual is returned as it is
    assert_within_ulps(alone, norm(residual), dtype, ulps=ROUNDING_ULPS[dtype])
    # Granite's layer scales the sublayer's output before the add: T(residual + T(x m))
    scaled, normed = ops.add_rms_norm(residual, x, norm.weight, norm.variance_epsilon, 0.22)
    assert torch.equal(scaled, residual + x * 0.22)
    assert_within_ulps(normed, norm(residual + x * 0.22), dtype, ulps=ROUNDING_ULPS[dtype])
    # rows of a wider tensor (a view with a row stride), as a stacked projection's slice
    wide = torch.randn(5, 96, dtype=dtype)
    assert_within_ulps(ops.add_rms_norm(wide[:, 48:], None, norm.weight, 1e-5)[1], norm(wide[:, 48:]), dtype, ulps=ROUNDING_ULPS[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_post_norm_add_is_olmo2s_norm_of_a_sublayers_output_then_the_residual_add(ops, dtype) -> None:
    """OLMo2 normalises a sublayer's output (its norm: the weight times the float32 norm, rounded once)
    and then adds the residual; its final norm has no residual."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    torch.manual_seed(0)
    norm = Olmo2RMSNorm(48, eps=1e-6).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    residual, x = torch.randn(5, 48, dtype=dtype) * 3, torch.randn(5, 96, dtype=dtype)[:, 48:]  # (a row stride)
    with torch.no_grad():
        want_norm, want = norm(x), residual + norm(x)
    assert_within_ulps(ops.post_norm_add(x, norm.weight, 1e-6, "once"), want_norm, dtype, ulps=ROUNDING_ULPS[dtype])
    assert_within_ulps(ops.post_norm_add(x, norm.weight, 1e-6, "once", residual), want, dtype,
                       ulps=ROUNDING_ULPS[dtype])
    if dtype == torch.bfloat16:  # (Llama's rounding of the same norm is another)
        assert not torch.equal(ops.post_norm_add(x, norm.weight, 1e-6, "llama"), ops.post_norm_add(x, norm.weight, 1e-6,
                                                                                                 "once"))
    with pytest.raises(RuntimeError, match="norms must be 'llama', 'zero_centred' or 'once'"):
        ops.post_norm_add(x, norm.weight, 1e-6, "t5")
    with pytest.raises(RuntimeError, match=r"residual must be a contiguous CPU .*\[5, 48\]"):
        ops.post_norm_add(x, norm.weight, 1e-6, "once", residual[:4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_llamas_activation_times_up(ops, dtype) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(6, 2 * 80, dtype=dtype) * 4
    gate, up = gate_up[:, :80], gate_up[:, 80:]
    assert_within_ulps(ops.silu_mul(gate, up), torch.nn.functional.silu(gate) * up, dtype, ulps=ROUNDING_ULPS[dtype])


def _eager_step(q, k, v, cos, sin, keys, values, lengths, heads, scale):
    """What LeanDecoder does for one layer's attention: rotary, the slot cache's writes, SDPA with
    transformers' grouped-query packing and the decode mask."""
    rows, dim = lengths.shape[0], keys.shape[-1]
    q = q.view(rows, 1, heads, dim).transpose(1, 2)
    k = k.view(rows, 1, -1, dim).transpose(1, 2)
    v = v.view(rows, 1, -1, dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos[:, None], sin[:, None])
    index = torch.arange(rows)
    keys[index, :, lengths] = k[:, :, 0]
    values[index, :, lengths] = v[:, :, 0]
    width = int(lengths.max()) + 1
    mask = (torch.arange(width)[None] <= lengths[:, None])[:, None, None, :]

    class Module:
        num_key_value_groups = heads // keys.shape[1]
        is_causal = True

    out, _ = sdpa_attention_forward(Module(), q, keys[:rows, :, :width], values[:rows, :, :width], mask, scaling=scale)
    return out.reshape(rows, heads * dim)


# 64 and 128 are compiled as fixed lengths of their own; 40 leaves a part of 16 dims. `dot`: bf16 scores by
# avx512_bf16's dot product where the kernels have it (64 and 128 dims; elsewhere the flag changes nothing)
@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("dim", [16, 40, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [6, 10])  # 3 or 5 query heads a key head (4 at a time)
def test_rope_attend_is_rotary_cache_write_and_grouped_query_attention(ops, dtype, dim, heads, dot) -> None:
    torch.manual_seed(2)
    rows, kv_heads, capacity = 4, 2, 40
    lengths = torch.tensor([3, 0, 17, 39])  # each row's new column (columns 16 at a time); 39: the cache's last
    q = torch.randn(rows, heads * dim, dtype=dtype)
    kv = torch.randn(rows, 2 * kv_heads * dim, dtype=dtype)  # k and v side by side, as a stacked product
    k, v = kv[:, :kv_heads * dim], kv[:, kv_heads * dim:]
    cos, sin = rotary_rows(lengths, dim, dtype)
    keys = torch.randn(rows + 1, kv_heads, capacity, dim, dtype=dtype)  # a spare slot beyond the rows
    values = torch.randn(rows + 1, kv_heads, capacity, dim, dtype=dtype)
    ours_k, ours_v = keys.clone(), values.clone()
    want = _eager_step(q, k, v, cos, sin, keys, values, lengths, heads, dim**-0.5)
    got = ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, dim**-0.5, dot=dot)
    assert torch.equal(ours_k, keys) and torch.equal(ours_v, values)  # the same writes, the same rounding
    assert_within_ulps(got, want, dtype, ulps=2 if dtype == torch.bfloat16 else 64)


@pytest.mark.parametrize("dim", [40, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_attend_normalises_each_head_of_q_and_k_as_qwen3s_norms_do(ops, dtype, dim) -> None:
    """Qwen3's attention normalises each head of q and k (an RMSNorm over the head, its own weight)
    before the rotary embedding: rope_attend given those weights writes the same keys, to the bit, as
    transformers' Qwen3RMSNorm followed by the step without them, and attends alike."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(3)
    rows, heads, kv_heads, capacity = 3, 6, 2, 24
    lengths = torch.tensor([5, 0, 23])
    q = torch.randn(rows, heads * dim, dtype=dtype) * 3
    k, v = torch.randn(rows, kv_heads * dim, dtype=dtype) * 3, torch.randn(rows, kv_heads * dim, dtype=dtype)
    cos, sin = rotary_rows(lengths, dim, dtype)
    q_norm, k_norm = Qwen3RMSNorm(dim, eps=1e-6).to(dtype), Qwen3RMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
        normed_q = q_norm(q.view(rows, heads, dim)).reshape(rows, -1)
        normed_k = k_norm(k.view(rows, kv_heads, dim)).reshape(rows, -1)
    keys = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    values = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    theirs_k, theirs_v, ours_k, ours_v = keys.clone(), values.clone(), keys.clone(), values.clone()
    want = ops.rope_attend(normed_q, normed_k, v, cos, sin, theirs_k, theirs_v, lengths, heads, dim**-0.5)
    got = ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, dim**-0.5, q_norm=q_norm.weight.detach(),
                          k_norm=k_norm.weight.detach(), norm_eps=1e-6)
    assert torch.equal(ours_v, theirs_v) and not torch.equal(ours_k, keys)  # (the rows' new columns written)
    # the kernel's sum of squares in another order than PyTorch's mean, and 1 / sqrt for rsqrt: float32's
    # last bits move, and now and then a bf16 rounding lands the other way
    assert_within_ulps(ours_k, theirs_k, dtype, ulps=ROUNDING_ULPS[dtype])
    assert_within_ulps(got, want, dtype, ulps=2 if dtype == torch.bfloat16 else 64)
    with pytest.raises(RuntimeError, match="q_norm and k_norm go together"):
        ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, 1.0, q_norm=q_norm.weight.detach())
    with pytest.raises(RuntimeError, match=rf"q_norm and k_norm must be contiguous CPU tensors .* a head's \[{dim}\]"):
        ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, 1.0, q_norm=torch.ones(dim + 1, dtype=dtype),
                        k_norm=torch.ones(dim + 1, dtype=dtype))


def _attend_written(q, keys, values, lengths, heads, scale, softcap=None):
    """Attention over the caches as rope_attend left them (the new columns written), in float64: each
    query head of the rotated ``q`` over its row's columns 0..length through its key head, Gemma 2's
    soft-cap on the scores where given; rounded to q's dtype."""
    rows, dim = lengths.shape[0], keys.shape[-1]
    group = heads // keys.shape[1]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        n = int(lengths[r]) + 1
        qr = q[r].double().view(heads, dim)
        for h in range(heads):
            scores = keys[r, h // group, :n].double() @ qr[h] * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[r, h] = scores.softmax(-1) @ values[r, h // group, :n].double()
    return out.reshape(rows, -1).to(q.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_attend_normalises_all_heads_together_and_rotates_in_float32_as_olmo2_does(ops, dtype) -> None:
    """OLMo2's attention normalises q (all its heads: one RMSNorm over q_proj's output) and k alike,
    its norm the weight times the float32 norm rounded once, and its rotary embedding's cos and sin are
    float32, so each rotated head is a float32 sum rounded once: given q_norm/k_norm as wide as q and k,
    norms="once" and float32 cos/sin, rope_attend writes transformers' keys (up to the order of the
    norm's sum) and attends to them."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import apply_rotary_pos_emb as olmo2_rotary

    torch.manual_seed(4)
    rows, heads, kv_heads, dim, capacity = 3, 6, 2, 64, 24
    lengths = torch.tensor([5, 0, 23])
    q = torch.randn(rows, heads * dim, dtype=dtype) * 3
    k, v = torch.randn(rows, kv_heads * dim, dtype=dtype) * 3, torch.randn(rows, kv_heads * dim, dtype=dtype)
    cos, sin = rotary_rows(lengths, dim, torch.float32)  # (OLMo2's rotary embedding hands float32)
    q_norm, k_norm = Olmo2RMSNorm(heads * dim, eps=1e-6).to(dtype), Olmo2RMSNorm(kv_heads * dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
        normed_q = q_norm(q).view(rows, heads, 1, dim)
        normed_k = k_norm(k).view(rows, kv_heads, 1, dim)
        want_q, want_k = olmo2_rotary(normed_q, normed_k, cos[:, None], sin[:, None])
    keys = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    values = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    ours_k, ours_v = keys.clone(), values.clone()
    got = ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, dim**-0.5, q_norm=q_norm.weight.detach(),
                          k_norm=k_norm.weight.detach(), norm_eps=1e-6, norms="once")
    index = torch.arange(rows)
    assert_within_ulps(ours_k[index, :, lengths], want_k[:, :, 0], dtype, ulps=ROUNDING_ULPS[dtype])
    assert torch.equal(ours_v[index, :, lengths], v.view(rows, kv_heads, dim))
    want = _attend_written(want_q.reshape(rows, -1), ours_k, ours_v, lengths, heads, dim**-0.5)
    assert_within_ulps(got, want, dtype, ulps=2 if dtype == torch.bfloat16 else 64)
    if dtype == torch.bfloat16:  # the norms' kind decides the keys: Llama's rounding of the same weights differs
        other_k = keys.clone()
        ops.rope_attend(q, k, v, cos, sin, other_k, values.clone(), lengths, heads, dim**-0.5,
                        q_norm=q_norm.weight.detach(), k_norm=k_norm.weight.detach(), norm_eps=1e-6, norms="llama")
        assert not torch.equal(other_k, ours_k)
    with pytest.raises(RuntimeError, match="norms must be 'llama', 'zero_centred' or 'once', got 'olmo'"):
        ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, 1.0, q_norm=q_norm.weight.detach(),
                        k_norm=k_norm.weight.detach(), norms="olmo")
    with pytest.raises(RuntimeError, match=r"q's \[384\] and k's \[128\]"):  # (q's norm wide, k's a head's)
        ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, 1.0, q_norm=q_norm.weight.detach(),
                        k_norm=torch.ones(dim, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 96])
def test_rope_attend_rotates_only_cos_width_of_each_head_as_phi4_minis_partial_rotary(ops, dtype, dim) -> None:
    """Phi-4-mini rotates the first 3/4 of each head's dims (its cos and sin are that wide) and passes
    the rest through: rope_attend given the narrow cos and sin writes the keys of Phi-3's
    apply_rotary_pos_emb to the bit and attends to them."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rotary

    torch.manual_seed(5)
    rows, heads, kv_heads, capacity = 4, 6, 2, 40
    lengths = torch.tensor([3, 0, 17, 39])
    q = torch.randn(rows, heads * dim, dtype=dtype)
    k, v = torch.randn(rows, kv_heads * dim, dtype=dtype), torch.randn(rows, kv_heads * dim, dtype=dtype)
    cos, sin = rotary_rows(lengths, dim * 3 // 4, dtype)
    want_q, want_k = phi3_rotary(q.view(rows, heads, 1, dim), k.view(rows, kv_heads, 1, dim), cos[:, None], sin[:, None])
    keys = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    values = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    ours_k, ours_v = keys.clone(), values.clone()
    got = ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, dim**-0.5)
    index = torch.arange(rows)
    assert torch.equal(ours_k[index, :, lengths], want_k[:, :, 0])
    want = _attend_written(want_q.reshape(rows, -1), ours_k, ours_v, lengths, heads, dim**-0.5)
    assert_within_ulps(got, want, dtype, ulps=2 if dtype == torch.bfloat16 else 64)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[rows, r\] with r even and at most"):
        ops.rope_attend(q, k, v, cos[:, :-1], sin[:, :-1], ours_k, ours_v, lengths, heads, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_attend_soft_caps_the_scores_as_gemma2_does(ops, dtype) -> None:
    """Gemma 2 caps each attention score at cap * tanh(score / cap) before the softmax: with softcap,
    rope_attend's outputs are float64 attention's with the cap, and far from those without (the scores
    here reach a few times the cap)."""
    torch.manual_seed(6)
    rows, heads, kv_heads, dim, capacity, cap = 4, 6, 2, 64, 40, 5.0
    lengths = torch.tensor([3, 0, 17, 39])
    q = torch.randn(rows, heads * dim, dtype=dtype) * 2
    k, v = torch.randn(rows, kv_heads * dim, dtype=dtype) * 2, torch.randn(rows, kv_heads * dim, dtype=dtype)
    cos, sin = rotary_rows(lengths, dim, dtype)
    keys = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype) * 2
    values = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    ours_k, ours_v = keys.clone(), values.clone()
    got = ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, 0.5, softcap=cap)
    rotated_q, _ = apply_rotary_pos_emb(q.view(rows, heads, 1, dim), k.view(rows, kv_heads, 1, dim), cos[:, None],
                                        sin[:, None])
    rotated_q = rotated_q.reshape(rows, -1)
    want = _attend_written(rotated_q, ours_k, ours_v, lengths, heads, 0.5, softcap=cap)
    assert_within_ulps(got, want, dtype, ulps=2 if dtype == torch.bfloat16 else 256)
    uncapped = _attend_written(rotated_q, ours_k, ours_v, lengths, heads, 0.5)
    assert (got.double() - uncapped.double()).abs().max() > 0.1
    with pytest.raises(RuntimeError, match="softcap must be 0"):
        ops.rope_attend(q, k, v, cos, sin, ours_k, ours_v, lengths, heads, 1.0, softcap=-1.0)


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_sharing_their_first_columns_attend_bit_for_bit_as_each_alone(ops, dtype, dot) -> None:
    """Rows told that another row holds their first columns (a group's copies of one prompt) read
    those columns there -- their own copies are never read -- and attend to the bit as they do
    reading their own: sets of any size (more than the 8 attended together), rows at different
    lengths, a source at any position, rows sharing nothing beside them."""
    torch.manual_seed(4)
    heads, kv_heads, dim, capacity = 6, 2, 64, 48
    # rows 0-3 read row 2's first 10 columns, rows 4-13 row 13's first 7 (ten rows: a run of 8,
    # then 2), rows 14 and 15 their own
    shared_from = torch.tensor([2] * 4 + [13] * 10 + [14, 15])
    shared = torch.tensor([10] * 4 + [7] * 10 + [0, 0])
    lengths = torch.tensor([12, 15, 10, 20, 7, 9, 30, 8, 7, 40, 11, 12, 13, 7, 0, 5])
    rows = len(lengths)
    keys = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    values = torch.randn(rows, kv_heads, capacity, dim, dtype=dtype)
    for r in range(rows):  # the copies
        f, n = shared_from[r], shared[r]
        keys[r, :, :n], values[r, :, :n] = keys[f, :, :n], values[f, :, :n]
    q = torch.randn(rows, heads * dim, dtype=dtype)
    k, v = torch.randn(rows, kv_heads * dim, dtype=dtype), torch.randn(rows, kv_heads * dim, dtype=dtype)
    cos, sin = torch.randn(rows, dim, dtype=dtype), torch.randn(rows, dim, dtype=dtype)
    own_k, own_v = keys.clone(), values.clone()
    alone = ops.rope_attend(q, k, v, cos, sin, own_k, own_v, lengths, heads, dim**-0.5, dot=dot)
    readers = shared_from != torch.arange(rows)
    for r in readers.nonzero()[:, 0].tolist():  # spoil the copies the readers must not read
        keys[r, :, :shared[r]] = float("nan")
        values[r, :, :shared[r]] = float("nan")
    together = ops.rope_attend(q, k, v, cos, sin, keys, values, lengths, heads, dim**-0.5, shared_from, shared,
                               dot=dot)
    assert torch.equal(together, alone)
    for r in range(rows):  # each row's new key and value written as before
        at = lengths[r]
        assert torch.equal(keys[r, :, at], own_k[r, :, at]) and torch.equal(values[r, :, at], own_v[r, :, at])


@pytest.mark.skipif(not stream_dot_available(), reason="kernels built without avx512_bf16's dot product")
def test_bf16_scores_by_the_dot_product_are_that_instructions(ops) -> None:
    """With ``dot`` the scores are avx512_bf16's dot products, which take a denormal input as zero (its
    definition): a query's denormal dim against a huge key moves the float32 multiply-adds' score
    (1e-39 * 1e38 = 0.1), not the dot product's -- so the flag is seen to choose the instruction."""
    dim = 64
    q = torch.zeros(1, dim, dtype=torch.bfloat16)
    q[0, 0] = 1e-39  # (a bf16 denormal: float32's exponent range, 7 bits of fraction)
    keys = torch.zeros(1, 1, 4, dim, dtype=torch.bfloat16)
    keys[0, 0, 0, 0] = 1e38  # column 0 scores 0.1 by multiply-adds, 0 by the dot product; the new column 0
    values = torch.zeros(1, 1, 4, dim, dtype=torch.bfloat16)
    values[0, 0, 0] = 1.0  # column 0's value ones, the new column's zeros
    cos, sin = torch.ones(1, dim, dtype=torch.bfloat16), torch.zeros(1, dim, dtype=torch.bfloat16)
    k, v = torch.zeros(1, dim, dtype=torch.bfloat16), torch.zeros(1, dim, dtype=torch.bfloat16)

    def attend(dot):
        return ops.rope_attend(q, k, v, cos, sin, keys.clone(), values.clone(), torch.tensor([1]), 1, 1.0, dot=dot)

    # softmax over scores (0.1, 0) or (0, 0): column 0's weight, every output dim
    assert torch.equal(attend(True), torch.full((1, dim), 0.5, dtype=torch.bfloat16))
    assert torch.allclose(attend(False).float(), torch.full((1, dim), 1 / (1 + torch.e**-0.1)), rtol=4e-3)


def test_shared_columns_are_refused_unless_every_row_can_read_them(ops) -> None:
    keys = torch.zeros(3, 1, 8, 8)
    q, k, cs = torch.zeros(3, 8), torch.zeros(3, 8), torch.zeros(3, 8)
    lengths = torch.tensor([4, 4, 2])

    def attend(shared_from, shared):
        return ops.rope_attend(q, k, k, cs, cs, keys, keys.clone(), lengths, 1, 1.0, torch.tensor(shared_from),
                               torch.tensor(shared))

    attend([0, 0, 2], [3, 3, 0])
    with pytest.raises(RuntimeError, match=r"row 1 reads its first 3 columns from row 2: that row must read its own"):
        attend([0, 2, 2], [3, 3, 3])
    with pytest.raises(RuntimeError, match=r"row 1 reads its first 3 columns from row 0: .*share as many columns"):
        attend([0, 0, 2], [2, 3, 0])
    with pytest.raises(RuntimeError, match=r"both must have written them \(lengths 4, 4\)"):
        attend([0, 0, 2], [5, 5, 0])
    with pytest.raises(RuntimeError, match=r"row 2 reads its first 0 columns from row 3"):
        attend([0, 0, 3], [3, 3, 0])
    with pytest.raises(RuntimeError, match=r"one value a row \(3\), got Long \[2\]"):
        attend([0, 0], [3, 3])
    with pytest.raises(RuntimeError, match="shared_from and shared go together"):
        ops.rope_attend(q, k, k, cs, cs, keys, keys.clone(), lengths, 1, 1.0, torch.tensor([0, 1, 2]), None)


def test_kernels_refuse_bad_input_with_what_was_expected(ops) -> None:
    keys = torch.zeros(2, 1, 4, 8)
    q, k = torch.zeros(2, 8), torch.zeros(2, 8)
    cs = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="row 1 is at column 4 of a cache with 4 columns"):
        ops.rope_attend(q, k, k, cs, cs, keys, keys.clone(), torch.tensor([0, 4]), 1, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 tensors only"):
        ops.silu_mul(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"x: expected \[2, 3\]"):
        ops.add_rms_norm(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(3), 1e-5)
    with pytest.raises(RuntimeError, match="decode_layers: for 1 layers: 4 weights, 12 extras and 2 norms a layer"):
        ops.decode_layers(q, cs, cs, torch.tensor([0, 0]), [q] * 4, [None] * 12, [cs] * 2, [keys], [keys], [8, 8, 8],
                          1, 1.0, 1e-5, [])
    weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(24, 8), 2)
    with pytest.raises(RuntimeError, match="a LoRA side path needs both A and B"):
        ops.decode_layers(q, cs, cs, torch.tensor([0, 0]), [weight] * 4, [None, weight, None] + [None] * 9,
                          [torch.ones(8)] * 3, [keys], [keys.clone()], [8, 8, 8], 1, 1.0, 1e-5, [])
    with pytest.raises(RuntimeError, match=r"head_norms must be empty or 2 a layer \(q's, k's\) for 1 layers, got 1"):
        ops.decode_layers(q, cs, cs, torch.tensor([0, 0]), [weight] * 4, [None] * 12, [torch.ones(8)] * 3, [keys],
                          [keys.clone()], [8, 8, 8], 1, 1.0, 1e-5, [torch.ones(8)])
    with pytest.raises(RuntimeError, match="decode_layers: unrotated layer 1 is not one of the 1 layers"):
        ops.decode_layers(q, cs, cs, torch.tensor([0, 0]), [weight] * 4, [None] * 12, [torch.ones(8)] * 3, [keys],
                          [keys.clone()], [8, 8, 8], 1, 1.0, 1e-5, [], unrotated=[1])
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[rows, r\] with r even"):
        ops.rope_attend(q, k, k, cs[:, :3], cs[:, :3], keys, keys.clone(), torch.tensor([0, 0]), 1, 1.0)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "phi4_mini", "olmo2",
                                    "granite", "smollm3"])
@pytest.mark.parametrize(("train_dtype", "sample_dtype"), [("fp32", "fp32"), ("fp32", "bf16")])
def test_the_sampler_decodes_through_the_kernels_as_it_does_without_them(tmp_path, monkeypatch, ops, tiny_of,
                                                                         train_dtype, sample_dtype, family):
    """fp32: the trainer's model with LoRA folded; bf16: the sampler's copy with stacked projections
    and LoRA side paths. Greedy tokens equal up to near-ties; logprobs within float (fp32) or bf16
    rounding. Each family the kernels take: Llama, Mistral (windowed, the window longer than the
    rows), Qwen2 (biases on q/k/v), Qwen3 (q's and k's heads normalised), Phi-3 (q/k/v and gate/up
    one Linear each; Phi-4-mini rotating 3/4 of a head), OLMo2 (norms after each sublayer, q and k
    normalised whole, rotated in float32), Granite (its multipliers), SmolLM3 (a layer rotating nothing)."""
    tc, decoders = _client_whose_decoders_are_kept(tmp_path, monkeypatch, train_dtype, sample_dtype, tiny_of(family))
    native = sample_each(tc, temperature=0.0)
    assert decoders and all(type(d) is native_decode.NativeDecoder for d in decoders)
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    eager = sample_each(tc, temperature=0.0)
    assert type(decoders[-1]) is not native_decode.NativeDecoder
    assert_greedy_alike(native, eager, bound=1e-5 if sample_dtype == "fp32" else 0.05)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "phi4_mini", "olmo2",
                                    "granite", "smollm3"])
@pytest.mark.parametrize(("train_dtype", "sample_dtype"), [("fp32", "fp32"), pytest.param("fp32", "bf16", marks=(
    pytest.mark.skipif(not packing_works(torch.bfloat16), reason="this CPU packs no bf16 weights: no packed layout")))])
def test_the_layers_in_one_native_call_sample_bit_for_bit_what_the_per_layer_loop_samples(
        tmp_path, monkeypatch, ops, tiny_of, train_dtype, sample_dtype, family):
    """``decode_layers`` makes the Python loop's kernel calls in its order, from C++: the same
    tokens and the same logprobs, to the bit, at temperature 1 (fp32: LoRA folded into packed
    weights; bf16: the sampler's copy with packed LoRA side paths), Qwen3's norms of q's and k's
    heads, Qwen2's biases, Phi-3's fused Linears and OLMo2's norms after each sublayer included."""
    tc, decoders = _client_whose_decoders_are_kept(tmp_path, monkeypatch, train_dtype, sample_dtype, tiny_of(family))
    one_call = sample_each(tc, temperature=1.0, seed=11)
    assert decoders and all(d.plan is not None for d in decoders)
    assert len(decoders[-1].plan.head_norms) == (4 if family in ("qwen3", "olmo2") else 0)  # (2 layers, q's and k's)
    if family == "qwen2":
        assert decoders[-1].plan.extras[0] is not None  # q/k/v's stacked biases travel in the plan
    if sample_dtype == "bf16":  # the side paths travel in the plan
        assert any(e is not None for e in decoders[-1].plan.extras)
    monkeypatch.setattr(native_decode, "ONE_CALL", False)
    per_layer = sample_each(tc, temperature=1.0, seed=11)
    assert decoders[-1].plan is None
    assert one_call == per_layer


@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize(("train_dtype", "sample_dtype"), [("fp32", "fp32"), ("fp32", "bf16")])
def test_a_groups_prompt_read_once_samples_bit_for_bit_what_each_rows_own_copy_samples(
        tmp_path, monkeypatch, ops, train_dtype, sample_dtype, one_call):
    """Each prompt's three samples hold copies of its columns; attention reads one copy for the
    three (kv_cache.SlotCache's sharing): the same tokens and logprobs, to the bit, as reading
    each row's own copy, at temperature 1, through the one native call and the per-layer loop."""
    from grpo.backends.local import kv_cache

    monkeypatch.setattr(native_decode, "ONE_CALL", one_call)
    tc, decoders = _client_whose_decoders_are_kept(tmp_path, monkeypatch, train_dtype, sample_dtype)
    told, real = [], kv_cache.SlotCache._sharing

    def recorded(cache):
        told.append(real(cache))
        return told[-1]

    monkeypatch.setattr(kv_cache.SlotCache, "_sharing", recorded)
    together = sample_each(tc, temperature=1.0, seed=11)
    assert decoders and all(type(d) is native_decode.NativeDecoder for d in decoders)
    assert any(shared_from is not None and len(set(shared_from.tolist())) < len(shared_from)
               for shared_from, _ in told)  # (rows left alone once their group's others finish)
    monkeypatch.setattr(kv_cache.SlotCache, "_sharing", lambda cache: (None, None))
    assert sample_each(tc, temperature=1.0, seed=11) == together


@pytest.mark.parametrize(("train_dtype", "sample_dtype"), [("fp32", "fp32"), ("fp32", "bf16")])
def test_rotary_rows_from_the_table_are_the_rotary_embeddings_own(tmp_path, monkeypatch, ops, train_dtype,
                                                                  sample_dtype):
    """The step looks each row's cos and sin up in a table the rotary embedding computed once for
    every cache column: the values it computes a step at a time, to the bit, and so the same samples."""
    tc, decoders = _client_whose_decoders_are_kept(tmp_path, monkeypatch, train_dtype, sample_dtype)
    from_table = sample_each(tc, temperature=1.0, seed=5)
    step = decoders[-1]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sample_dtype]
    hidden = torch.zeros(7, 1, step.decoder.config.hidden_size, dtype=dtype)
    positions = torch.tensor([[0], [3], [17], [4], [40], [63], [1]])
    cos, sin = step._cos_sin(hidden, positions, capacity=64)
    want_cos, want_sin = step.decoder.rotary_emb(hidden, positions)
    assert step._rotary_table.table[0].shape[0] == 64
    assert torch.equal(cos, want_cos[:, 0]) and torch.equal(sin, want_sin[:, 0])

    def each_step(self, hidden, positions, capacity):
        cos, sin = self.decoder.rotary_emb(hidden, positions)
        return cos[:, 0], sin[:, 0]

    monkeypatch.setattr(native_decode.NativeDecoder, "_cos_sin", each_step)
    assert sample_each(tc, temperature=1.0, seed=5) == from_table


def _client_whose_decoders_are_kept(tmp_path, monkeypatch, train_dtype: str, sample_dtype: str, model: str = "tiny"):
    """A training client of the tiny model (or ``model``) with a nonzero adapter, and the list every
    sampling call's decoding step (as ``native_decoder`` returns it) is appended to."""
    service = ServiceClient(checkpoint_dir=tmp_path, device="cpu", train_dtype=train_dtype, sample_dtype=sample_dtype)
    tc = service.create_lora_training_client(model, rank=4, seed=0)
    perturb_adapter(tc, seed=3)
    decoders, real = [], native_decode.native_decoder

    def kept(lean, device):
        decoders.append(real(lean, device))
        return decoders[-1]

    monkeypatch.setattr(native_decode, "native_decoder", kept)
    return tc, decoders


def test_layers_the_one_call_does_not_compute_keep_the_per_layer_loop(ops) -> None:
    """A Linear that is not packed (another kernel, a hook of the user's) or layers that differ
    from each other leave the step to the Python loop, which calls the modules themselves."""
    from transformers import LlamaForCausalLM

    from grpo.backends.local.lean_decode import lean_decoder
    from grpo.models.cpu_linear import pack_for_inference
    from grpo.models.fused_projections import fuse_siblings

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"

    def packed_model():
        model = LlamaForCausalLM(config).eval().requires_grad_(False)
        fuse_siblings(model)
        pack_for_inference(model)
        return model

    def plan(model):
        return native_decode.native_decoder(lean_decoder(model), torch.device("cpu")).plan

    assert plan(packed_model()) is not None
    model = packed_model()
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(64, 32, bias=False)
    assert plan(model) is None
    model = packed_model()
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda module, args, out: None)
    assert plan(model) is None
    model = packed_model()
    model.model.layers[1].self_attn.scaling *= 2
    assert plan(model) is None
    model = packed_model()
    model.model.layers[0].post_attention_layernorm.variance_epsilon = 1e-3
    assert plan(model) is None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_with_smollm2s_head_shapes_samples_alike_with_and_without_the_kernels(tokenizer, monkeypatch, ops,
                                                                                       dtype, family):
    """Head dim 64, 9 query heads over 3 key heads, as SmolLM2 (the tiny model's heads are 8 wide,
    which the kernels take on their general path), and a Qwen3 of 128-wide heads (as Qwen3-0.6B's:
    q wider than the hidden state) whose norms of q's and k's heads are not ones: random weights,
    greedy (a bf16 draw at temperature 1 may land on a neighbouring token), rows stopping at
    different steps."""
    from transformers import LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class, extra = {"llama": (LlamaConfig, LlamaForCausalLM, {}),
                                        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 128})}[family]
    config = config_class(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    model = model.to(dtype).eval()

    from grpo.backends.local.lean_decode import lean_decoder

    assert type(native_decode.native_decoder(lean_decoder(model), torch.device("cpu"))) is native_decode.NativeDecoder
    native = greedy_rows(model, tokenizer)
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    eager = greedy_rows(model, tokenizer)
    assert len({len(tokens) for tokens, *_ in eager}) > 1  # rows finished at different steps, riding along after
    assert_greedy_alike(native, eager, bound=1e-4 if dtype == torch.float32 else 0.1)


def test_where_the_kernels_do_not_build_the_sampler_says_so_once_and_decodes_without(tmp_path, monkeypatch, capsys):
    def no_compiler():
        raise RuntimeError("Error building extension 'grpo_native': c++: error: command not found")

    monkeypatch.setattr(native_kernels, "_loaded", {})
    monkeypatch.setattr(native_kernels, "_load", no_compiler)
    service = ServiceClient(checkpoint_dir=tmp_path, device="cpu", dtype="fp32")
    tc = service.create_lora_training_client("tiny", rank=4, seed=0)
    first, second = sample_each(tc, temperature=0.0), sample_each(tc, temperature=0.0)
    assert first == second and all(tokens for tokens, _ in first)
    err = capsys.readouterr().err
    assert err.count("native kernels unavailable") == 1
    assert "c++: error: command not found" in err and "GRPO_NATIVE_KERNELS=off" in err


def test_models_outside_what_the_kernels_compute_keep_the_eager_step(monkeypatch) -> None:
    from transformers import LlamaForCausalLM

    from grpo.backends.local.lean_decode import lean_decoder

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    assert type(native_decode.native_decoder(lean_decoder(model), torch.device("cpu"))) is native_decode.NativeDecoder
    assert type(native_decode.native_decoder(lean_decoder(model.double()), torch.device("cpu"))) is not \
        native_decode.NativeDecoder  # float64: not a sampler precision
    mixed = LlamaForCausalLM(config).to(torch.bfloat16)
    mixed.model.norm.float()  # norms kept in float32 beside bf16 weights
    assert type(native_decode.native_decoder(lean_decoder(mixed), torch.device("cpu"))) is not \
        native_decode.NativeDecoder
    monkeypatch.setenv(native_kernels.ENV_SWITCH, "off")
    assert type(native_decode.native_decoder(lean_decoder(model), torch.device("cpu"))) is not \
        native_decode.NativeDecoder
    assert sampler.native_decode is native_decode
