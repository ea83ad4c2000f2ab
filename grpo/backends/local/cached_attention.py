"""A decoding step's attention through grpo's kernel where a model decodes through its own forward.

Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo2, Granite (native_decode.py), Gemma 2 and 3 (gemma_decode.py)
decode through grpo's native step, whose attention reads the slot cache itself. Every other family -- Gemma
1, OLMo 1, GPT-NeoX, Cohere, StableLM, a hybrid's attention layers (Qwen3.5's, in the lockstep sampler) --
decodes through transformers' forward, where each attention layer calls PyTorch's SDPA with one query
position a row. On a CPU
SDPA runs that through its flash kernel, blocked for long queries: at 32 rows of ~100 columns an
OLMo2 with SmolLM2-135M's sizes (9 heads, each its own keys, of 64 dims) spent 2.2 ms a layer in
it, 8.4 s of a 15 s sampling call, where the arithmetic is a tenth of that (docs/benchmark.md).
Grouped-query models fare better only because transformers folds a head group's queries into
SDPA's query positions.

``routed()`` makes a decoding step's attention on this thread go through
``native/decode_attention.cpp``'s ``cached_attend``: each row's heads over the columns its mask
keeps, in float32, the output rounded once, as SDPA computes it. It stands in for transformers'
"sdpa" attention function (installed once, for the process) and hands every call it does not
take to the function it replaced, unchanged: any other thread, a prefill or any query of several
positions, a GPU, a mask of another kind (float, per head), dropout, or a kwarg SDPA would act on.
A model whose attention does not go through transformers' attention interface never calls it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from grpo.models import native_kernels

_local = threading.local()  # .depth: how many routed() blocks this thread is inside
_install_lock = threading.Lock()
_replaced = None  # transformers' "sdpa" function, as it was when this one took its place


@contextmanager
def routed() -> Iterator[None]:
    """While inside, this thread's CPU decoding steps that call transformers' SDPA attention take
    grpo's kernel instead (where the kernels are built; else nothing changes)."""
    ops = native_kernels.kernels()
    if ops is None or not hasattr(ops, "cached_attend"):
        yield
        return
    _install()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _install() -> None:
    global _replaced
    with _install_lock:
        if _replaced is None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            _replaced = ALL_ATTENTION_FUNCTIONS["sdpa"]
            ALL_ATTENTION_FUNCTIONS["sdpa"] = attention


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [rows, heads, positions, dim]``, ``key``
    and ``value [rows, kv_heads, columns, dim]``; returns ``[rows, positions, heads, dim]``."""
    mask = _kept_columns(query, key, value, attention_mask, dropout, kwargs)
    if mask is False:
        return _replaced(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = native_kernels.kernels().cached_attend(query[:, :, 0], key, value, mask, scale)
    return out[:, None], None


def _kept_columns(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                  dropout: float, kwargs: dict) -> torch.Tensor | None | bool:
    """The ``[rows, columns]`` boolean mask the kernel takes (None: every column) where it computes
    what SDPA would for this call, else False."""
    if getattr(_local, "depth", 0) == 0 or query.device.type != "cpu" or query.dim() != 4 or query.shape[2] != 1:
        return False
    if dropout or any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks")):
        return False
    rows, heads, _, dim = query.shape
    if (query.dtype not in (torch.float32, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype
            or key.dim() != 4 or value.shape != key.shape or key.shape[0] != rows or key.shape[3] != dim
            or heads % key.shape[1] or query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1
            or (key.shape[2] > 1 and (key.stride(2) != dim or value.stride(2) != dim))):
        return False
    if attention_mask is None:
        return None
    if (attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[0] != rows
            or attention_mask.shape[1] != 1 or attention_mask.shape[3] != key.shape[2]):
        return False
    return attention_mask[:, 0, -1]
