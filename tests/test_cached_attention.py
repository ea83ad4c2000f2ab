"""A decoding step's attention over a model's own cache through grpo's kernel (cached_attention.py):
the kernel computes softmax attention over each row's kept columns as float64 does, to float32's
rounding (bf16: to the output's one rounding); ``routed()`` takes only the calls it computes as SDPA
would, on its own thread; and models that decode through their own forward -- an attention-only
family grpo has no native step for, a hybrid in the lockstep sampler -- draw through it what they
drew through SDPA."""

from __future__ import annotations

import threading
import types

import pytest
import torch
import transformers
from backend_helpers import (
    ULP,
    assert_logprobs_of_a_plain_forward,
    tiny_qwen3_5,
    worst_relative_error,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from grpo import models
from grpo.backends.local import cached_attention, sampler
from grpo.types import SamplingParams

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def ops(native_ops):
    return native_ops


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention in float64: q [rows, heads, dim], k and v [rows, kv_heads, columns, dim]."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = torch.einsum("rhd,rhcd->rhc", q.double(), keys) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("rhc,rhcd->rhd", torch.softmax(scores, -1), values)


def _within(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: sums in another order; bf16: the output's one rounding, which may land either way
    worst = worst_relative_error(got, want.to(dtype) if dtype == torch.bfloat16 else want)
    assert worst <= (64 if dtype == torch.float32 else 1) * ULP[dtype], f"{worst:.3g} for {dtype}"


def _masks(rows: int, columns: int) -> torch.Tensor:
    """Row 0 keeps every column; row 1 sits behind 5 columns of left padding (a lockstep batch's
    shorter prompt); row 2 has a gap (a prompt restored from the prefix cache behind padding, then
    its new tokens); the others keep a random half and their last column."""
    mask = torch.rand(rows, columns, generator=torch.Generator().manual_seed(1)) > 0.5
    mask[0] = True
    mask[1] = torch.arange(columns) >= 5
    mask[2] = (torch.arange(columns) < 7) | (torch.arange(columns) >= 12)
    mask[:, -1] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 80, 96, 128, 256, 40])  # (the widths compiled in, and any other)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_the_kernel_is_softmax_attention_over_each_rows_kept_columns(ops, dtype, dim, heads, kv_heads) -> None:
    torch.manual_seed(0)
    rows, columns = 5, 37
    q = torch.randn(rows, heads, dim).to(dtype)
    k, v = (torch.randn(rows, kv_heads, columns, dim).to(dtype) for _ in range(2))
    scale = dim ** -0.5
    for mask in (None, _masks(rows, columns)):
        _within(ops.cached_attend(q, k, v, mask, scale), _reference(q, k, v, mask, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_reads_views_as_the_caches_hand_them(ops, dtype) -> None:
    """A slot cache's keys are the first rows and columns of a larger buffer, queries a transposed
    projection and a mask the last query row of a broadcast 4-d one: read where they lie."""
    torch.manual_seed(0)
    rows, heads, kv_heads, dim, columns = 3, 4, 2, 64, 20
    buffers = [torch.randn(6, kv_heads, 50, dim).to(dtype) for _ in range(2)]
    k, v = (b[:rows, :, :columns] for b in buffers)
    q = torch.randn(rows, 1, heads, dim).to(dtype).transpose(1, 2)[:, :, 0]
    mask4 = _masks(rows, columns)[:, None, None, :].expand(rows, 1, 1, columns)
    got = ops.cached_attend(q, k, v, mask4[:, 0, -1], 0.125)
    _within(got, _reference(q, k.contiguous(), v.contiguous(), _masks(rows, columns), 0.125), dtype)
    assert torch.equal(got, ops.cached_attend(q.contiguous(), k.contiguous(), v.contiguous(),
                                              _masks(rows, columns), 0.125))


def test_a_row_with_no_column_to_attend_to_is_zeros(ops) -> None:
    q, k, v = torch.randn(2, 2, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1] = False
    out = ops.cached_attend(q, k, v, mask, 0.125)
    assert torch.equal(out[1], torch.zeros(2, 64))
    _within(out[:1], _reference(q[:1], k[:1], v[:1], None, 0.125), torch.float32)


def test_the_kernel_refuses_bad_input_with_what_was_expected(ops) -> None:
    q, k, v = torch.randn(2, 4, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    with pytest.raises(RuntimeError, match=r"mask must be a bool CPU \[rows, columns\] tensor \(\[2, 9\]\)"):
        ops.cached_attend(q, k, v, torch.ones(2, 8, dtype=torch.bool), 0.125)
    with pytest.raises(RuntimeError, match="heads a multiple of kv_heads"):
        ops.cached_attend(torch.randn(2, 3, 64), k, v, None, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.cached_attend(q, k.bfloat16(), v, None, 0.125)
    with pytest.raises(RuntimeError, match="contiguous"):
        columns_last = torch.randn(2, 2, 64, 9).transpose(2, 3)  # ([2, 2, 9, 64] with a head's dims 9 apart)
        ops.cached_attend(q, columns_last, columns_last, None, 0.125)


def _step_inputs(dtype: torch.dtype, rows: int = 4, heads: int = 4, kv_heads: int = 2, dim: int = 32, columns: int = 11):
    torch.manual_seed(0)
    query = torch.randn(rows, 1, heads, dim).to(dtype).transpose(1, 2)  # ([rows, heads, 1, dim], as a layer hands it)
    key, value = (torch.randn(rows, kv_heads, columns, dim).to(dtype) for _ in range(2))
    mask = _masks(rows, columns)[:, None, None, :]
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    return module, query, key, value, mask


@pytest.fixture
def counted(ops, monkeypatch):
    """The kernel's calls through cached_attention, counted."""
    calls = []

    class Counting:
        def cached_attend(self, *args):
            calls.append(args[0].shape)
            return ops.cached_attend(*args)

    monkeypatch.setattr(cached_attention, "native_kernels",
                        types.SimpleNamespace(kernels=lambda: Counting()))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_routed_a_decoding_step_takes_the_kernel_and_computes_what_sdpa_computes(counted, dtype) -> None:
    module, query, key, value, mask = _step_inputs(dtype)
    want = sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)[0]
    with cached_attention.routed():
        got, weights = cached_attention.attention(module, query, key, value, mask, scaling=0.2)
    assert len(counted) == 1 and weights is None and got.shape == want.shape == (4, 1, 4, 32)
    # SDPA's bf16 path rounds the softmax's weights to bf16 before the values' products; the kernel keeps them
    # float32: both are within a few of bf16's units of the exact attention
    exact = _reference(query[:, :, 0], key, value, mask[:, 0, 0], 0.2)
    _within(got[:, 0], exact, dtype)
    assert worst_relative_error(want[:, 0], exact) <= 4 * ULP[dtype] * (64 if dtype == torch.float32 else 1)


def test_everything_else_is_sdpas_own_call(counted) -> None:
    """Outside ``routed()``, on another thread while this one is inside, for a prefill's several
    query positions, a float mask or dropout: SDPA's own result, bit for bit, and no kernel call."""
    module, query, key, value, mask = _step_inputs(torch.float32)
    want = sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)[0]
    assert cached_attention._replaced is None or cached_attention._replaced is sdpa_attention_forward
    with cached_attention.routed():
        pass  # (installed)
    assert torch.equal(cached_attention.attention(module, query, key, value, mask, scaling=0.2)[0], want)
    with cached_attention.routed():
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(
            cached_attention.attention(module, query, key, value, mask, scaling=0.2)[0]))
        thread.start()
        thread.join()
        assert torch.equal(elsewhere[0], want)
        prefill = query.expand(-1, -1, 3, -1)  # (three query positions)
        assert torch.equal(cached_attention.attention(module, prefill, key, value, None, scaling=0.2)[0],
                           sdpa_attention_forward(module, prefill, key, value, None, scaling=0.2)[0])
        additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        assert torch.equal(cached_attention.attention(module, query, key, value, additive, scaling=0.2)[0],
                           sdpa_attention_forward(module, query, key, value, additive, scaling=0.2)[0])
    assert counted == []


def _cohere(directory) -> str:
    """A tiny random Cohere (attention and MLP side by side on one LayerNorm's output, every head its own
    keys): a family grpo has no native decoding step for, so the sampler runs its own forward. (OLMo2, then
    Granite, were this test's model until grpo's step took them.)"""
    tokenizer = models.load_tokenizer("tiny")
    config = transformers.CohereConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                       **models.TINY_CONFIG)
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(0)
    transformers.CohereForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


PROMPTS = [[1, 504, 3458, 314, 253, 1345, 28], [1, 9906], [1, *range(42, 52)]]


def _requests() -> list[sampler.GenerationRequest]:
    return [sampler.GenerationRequest(p, 3, SamplingParams(max_tokens=6 + 4 * i, temperature=1.0, seed=11 + i))
            for i, p in enumerate(PROMPTS)]


def _drawn(model, tokenizer) -> list[tuple[tuple[int, ...], list[float]]]:
    done = _requests()
    sampler.generate(model, done, tokenizer, torch.device("cpu"))
    return [(tuple(s.tokens), s.logprobs) for r in done for s in r.sequences]


@pytest.mark.parametrize("family", ["cohere", "qwen3_5"])
def test_a_model_decoding_through_its_own_forward_draws_through_the_kernel_what_sdpa_drew(
        counted, monkeypatch, tmp_path, family) -> None:
    if family == "cohere":
        model, tokenizer = models.load_model(_cohere(tmp_path / "cohere")), models.load_tokenizer("tiny")
    else:
        model, tokenizer = tiny_qwen3_5()
    through_kernel = _drawn(model, tokenizer)
    steps = len(counted)
    layers = sum(kind == "full_attention" for kind in getattr(model.config, "layer_types", None)
                 or ["full_attention"] * model.config.num_hidden_layers)
    assert steps > 0 and steps % layers == 0  # (every attention layer of every decoding step)
    kept = cached_attention._kept_columns
    monkeypatch.setattr(cached_attention, "_kept_columns", lambda *args: False)
    through_sdpa = _drawn(model, tokenizer)
    assert len(counted) == steps
    assert [tokens for tokens, _ in through_kernel] == [tokens for tokens, _ in through_sdpa]
    for (_, got), (_, want) in zip(through_kernel, through_sdpa, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    monkeypatch.setattr(cached_attention, "_kept_columns", kept)
    done = _requests()
    sampler.generate(model, done, tokenizer, torch.device("cpu"))
    assert_logprobs_of_a_plain_forward(model, done)
