"""How much working memory a training micro-batch or the sampler's batch may use, in model terms.

A step's peak memory is the weights plus the largest working set the backend builds at once:
the activations autograd keeps for one training micro-batch, or the KV cache and logits of the
rows the sampler decodes at once. Both are bounded by one budget, turned here into tokens
(training) and rows (sampling) from the model's shapes, so peak memory follows the budget rather
than the batch: eight prompts or 128, responses of 32 tokens or 256.

The default budget is a fixed share of the device's total memory, not of what is free when the
engine starts: micro-batch boundaries and the sampler's batch make-up change float summation
order, so a budget that followed other programs' memory use would make two runs with the same
seed differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from grpo import models

# Share of total memory one working set may take. On a 24 GB CPU machine: 1.5 GB, about the
# activations of 1,000 trained tokens of SmolLM2-135M in fp32; on an 80 GB GPU: 5 GB.
CPU_SHARE = 1 / 16
CUDA_SHARE = 1 / 16
LORA_RANK_COUNTED = 64


def total_memory(device: torch.device) -> int:
    """Bytes of memory on ``device`` (physical RAM for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_budget(device: torch.device) -> int:
    return int(total_memory(device) * (CUDA_SHARE if device.type == "cuda" else CPU_SHARE))


def resolve_budget(setting: int | float | str | None, device: torch.device) -> int | None:
    """``memory_budget_mb`` as bytes: "auto"/None -> the default, 0 -> None (unbounded)."""
    if setting is None or setting == "auto":
        return default_budget(device)
    return _megabytes("memory_budget_mb", setting, "unbounded") or None


def resolve_prefix_cache(setting: int | float | str | None, budget: int | None,
                         device: torch.device | None = None) -> int:
    """``prefix_cache_mb`` as bytes (0: no prefix cache). "auto"/None: as much as the memory budget
    (``budget`` bytes; the default budget where that is unbounded), a second working set's worth
    that a multi-turn step fills with its episodes' contexts. ``device`` None only checks."""
    if setting is None or setting == "auto":
        if device is None:
            return 0
        return budget if budget is not None else default_budget(device)
    return _megabytes("prefix_cache_mb", setting, "off")


def _megabytes(key: str, setting: Any, zero: str) -> int:
    """A number of MB as bytes; anything but a non-negative number is refused naming ``key``."""
    if isinstance(setting, bool) or not isinstance(setting, (int, float)) or setting < 0:
        raise ValueError(f"{key} must be 'auto', 0 ({zero}) or a positive number of MB, got {setting!r}")
    return int(setting * 2**20)


def megabytes_from_text(text: str) -> float | str:
    """A megabytes setting given as text (a flag, an environment variable): "auto" stays a word,
    a number becomes one; anything else is returned as it is for the setting's check to refuse."""
    try:
        return float(text)
    except ValueError:
        return text


def _dims(config: Any) -> tuple[int, int, int, int, int]:
    config = models.text_config(config)
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    return hidden, intermediate, heads * head_dim, kv_heads * head_dim, int(config.num_hidden_layers)


def train_bytes_per_token(config: Any, dtype: torch.dtype, layer_norms: int = 2) -> int:
    """What one processed token costs autograd until backward, in all layers.

    Counted from what a decoder layer saves: the inputs of its seven projections, norms, rotary
    q/k, the attention output, the MLP's gate/up/activation -- about ten hidden-sized and four
    intermediate-sized vectors -- and the LoRA branches' rank-sized inputs (seven, counted at
    rank 64). A saved-tensor hook measures 1.2-1.5 MiB per token for SmolLM2-135M in fp32 (this
    gives 1.5 MiB); tests/test_memory_budget.py checks the estimate against the tiny model. A
    hybrid's linear-attention layer keeps its short convolution's input and output (q, k and v
    side by side) and its gated norm's input, gate and output instead of attention's q/k/v, and
    the attention layers between them (Qwen3.5's, Qwen3-Next's) are gated -- their q projection
    gives the queries and a gate -- and normalise q and k, which keeps ~6 query widths and 3 key
    widths (a hook on the tiny Qwen3.5). A Qwen3.5 of Qwen3.5-0.8B's sizes keeps 1.66 MiB a token
    in a packed bf16 pass, which the attention-only count put at 1.29 (this gives 1.84).

    A mixture of experts' MLP keeps that for each of a token's experts (their input gathered, its
    gate, up and activation) and its shared expert's, and the router's logits: a hook found Mixtral's,
    Qwen2-MoE's and Qwen3-MoE's layers (2 to 8 experts a token) keeping 16-46% more than a dense MLP's
    count of their ``intermediate_size``.

    ``layer_norms``: the norms of a decoder layer's own (``layer_norms_of``): Gemma 2's and 3's four
    (a norm before and after attention and the MLP) keep ~3 hidden widths each beyond a Llama's two,
    which a hook on Gemma-3-1B's and Gemma-2-2B's widths found 8-11% above the two-norm count.
    """
    hidden, intermediate, q_dim, kv_dim, layers = _dims(config)
    linear = linear_attention_layers(config)
    shared = 8 * hidden + _mlp_saved(config, hidden, intermediate) + 7 * LORA_RANK_COUNTED + 3 * hidden * max(0, layer_norms - 2)
    attention = 6 * q_dim + 3 * kv_dim if linear else 2 * q_dim + 2 * kv_dim
    return ((layers - linear) * (shared + attention) + linear * (shared + _linear_attention_saved(config))) * dtype.itemsize


def _mlp_saved(config: Any, hidden: int, intermediate: int) -> int:
    """What a layer's MLP keeps per token, in elements: gate, up, the activation and the down
    projection's input of a dense MLP (four intermediate widths), or of each expert a token is routed
    to (Mixtral's, Qwen-MoE's, DeepSeek's ``num_experts_per_tok``) with its gathered input, and of the
    shared experts, and the router's logits. ``hidden``, ``intermediate``: the widths ``_dims`` read."""
    text = models.text_config(config)
    routed = int(getattr(text, "num_experts_per_tok", None) or 0)
    if routed <= 0:
        return 4 * intermediate
    expert = int(getattr(text, "moe_intermediate_size", None) or intermediate)
    shared = int(getattr(text, "shared_expert_intermediate_size", None)
                 or (getattr(text, "n_shared_experts", None) or 0) * expert)
    experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
                  or getattr(text, "n_routed_experts", None) or 0)
    return routed * (4 * expert + hidden) + 4 * shared + experts


def layer_norms_of(model: Any) -> int:
    """How many norms a decoder layer of ``model`` applies itself (its attention's own q/k norms not
    counted): the modules named ``*Norm*`` among its first decoder layer's children; 2 where no
    module is named ``*DecoderLayer``."""
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            return sum("Norm" in type(child).__name__ for child in module.children())
    return 2


def _linear_attention_saved(config: Any) -> int:
    """What a gated-delta-rule layer keeps per token beside the MLP and norms, in elements: the
    convolution's input and output (two key widths and the value width each), and the gated norm's
    input, gate and output (the value width each)."""
    key_heads, value_heads, key_dim, value_dim = _linear_attention_heads(config)
    return 2 * (2 * key_heads * key_dim + value_heads * value_dim) + 3 * value_heads * value_dim


def sample_bytes_per_row(config: Any, dtype: torch.dtype, length: int) -> int:
    """A sampling row of ``length`` positions: its KV cache slot (allocated whole when sampling
    starts, kv_cache.py), the grouped-query expansion of one layer's K and V that attention
    makes, and its float32 logits, softmax and float64 CDF over the vocabulary; a hybrid's
    linear-attention layers hold a recurrent state instead of keys and values."""
    hidden, _, q_dim, kv_dim, layers = _dims(config)
    linear = linear_attention_layers(config)
    kv = 2 * kv_dim * (layers - linear) * length * dtype.itemsize
    expanded = 2 * q_dim * length * dtype.itemsize
    vocab = int(models.text_config(config).vocab_size)
    return kv + expanded + vocab * (4 + 4 + 4 + 8) + linear * _recurrent_state_bytes(config, dtype)


def linear_attention_layers(config: Any) -> int:
    """How many of the decoder's layers are a hybrid's gated-delta-rule layers (Qwen3.5, Qwen3-Next),
    which keep a recurrent state per row instead of keys and values."""
    text = models.text_config(config)
    kinds = (getattr(text, "layer_types", None) or [])[:int(text.num_hidden_layers)]
    return sum(kind == "linear_attention" for kind in kinds)


def _linear_attention_heads(config: Any) -> tuple[int, int, int, int]:
    """A gated-delta-rule layer's key heads, value heads, key dim and value dim (0s for a model
    without such layers)."""
    text = models.text_config(config)
    return tuple(int(getattr(text, name, 0) or 0) for name in (  # type: ignore[return-value]
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))


def _recurrent_state_bytes(config: Any, dtype: torch.dtype) -> int:
    """One row's state in one gated-delta-rule layer: the float32 recurrent state (value heads x
    key dim x value dim) twice -- a batch that sheds finished rows copies it, and rows that join a
    running batch are prefilled beside it (recurrent_sampler.py) -- and the short convolution's
    window of q, k and v."""
    key_heads, heads, key_dim, value_dim = _linear_attention_heads(config)
    kernel = int(getattr(models.text_config(config), "linear_conv_kernel_dim", 0) or 0)
    conv = (2 * key_heads * key_dim + heads * value_dim) * kernel * dtype.itemsize
    return 2 * heads * key_dim * value_dim * 4 + conv


@dataclass(frozen=True)
class Budget:
    """The budget in the two units the backend splits work by."""

    bytes: int | None  # None: unbounded
    train_token_bytes: int
    config: Any
    dtype: torch.dtype

    @classmethod
    def for_model(cls, setting: int | float | str | None, model: Any, device: torch.device) -> Budget:
        dtype = next(model.parameters()).dtype
        per_token = train_bytes_per_token(model.config, dtype, layer_norms_of(model))
        return cls(resolve_budget(setting, device), per_token, model.config, dtype)

    def train_tokens(self) -> int | None:
        """Processed tokens (padding included, where micro-batches are padded) per training
        micro-batch; None: no limit."""
        if self.bytes is None:
            return None
        return max(1, self.bytes // self.train_token_bytes)

    def row_bytes(self, length: int) -> int:
        return sample_bytes_per_row(self.config, self.dtype, length)
