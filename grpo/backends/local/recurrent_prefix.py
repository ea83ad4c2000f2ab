"""A hybrid's next turn after its cached prefix: the rows' states restored, only the new tokens run.

A multi-turn episode's turn k+1 is turn k's context, its sampled tokens and an observation. The
slot-cache sampler reads the keys and values of what it has seen from the prefix cache
(prefix_cache.py); a hybrid's linear-attention layers (Qwen3.5's, Qwen3-Next's gated delta rule)
keep instead a recurrent state and a short convolution's window, valid only at the end of the
sequence that made them. So the prefix cache keeps, per sequence, its attention layers' keys and
values and those layers' states after its last token (``row_entry``); a turn restores them
(``restored_cache``) and runs only what follows, every prompt of a batch in one forward.

Padding is the difficulty. The rows' new parts differ in length, and a hybrid's rows must end
together (each decoding step feeds every row one token), so the new parts are left-padded: the
padding sits between a row's restored state and its new tokens. transformers zeroes a pad's inputs,
which keeps a zero state zero (a fresh prompt's) but not a restored one: the gate still decays it
at each pad, and the convolution's window would see zeros where the restored window belongs.
``neutral_left_padding`` makes every pad a no-op: its decay and its write strength are set to zero
(the layer's ``a`` and ``b`` projections read -inf there: softplus(-inf) = 0 is no decay,
sigmoid(-inf) = 0 writes nothing), and the cached window is placed right before each row's first
new token. A row's outputs and states are then those of its whole sequence run alone, within the
float rounding of another grouping (tests/test_recurrent_prefix.py).

Only the layers named in ``NEUTRAL_PROJECTIONS`` are known to compute their decay and write
strength that way; a model with any other linear or state-space layer keeps prefilling every
prompt whole (``continuable``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from grpo.backends.local.prefix_cache import KV, States, left_padded

# a gated-delta-rule layer's projections whose outputs are its ``a`` (g = -exp(A) * softplus(a +
# dt_bias)) and ``b`` (beta = sigmoid(b)): -inf there makes a position leave the state as it was
NEUTRAL_PROJECTIONS = {"Qwen3_5GatedDeltaNet": ("in_proj_a", "in_proj_b"),
                       "Qwen3_5MoeGatedDeltaNet": ("in_proj_a", "in_proj_b"),
                       "Qwen3NextGatedDeltaNet": ("in_proj_ba",)}


def continuable(model: nn.Module) -> bool:
    """Whether ``model``'s turns can start from a restored state: each linear-attention layer of its
    cache belongs to a module whose padding ``neutral_left_padding`` neutralises (no other module
    keeps a state), and every other layer is plain keys and values."""
    names = [type(m).__name__ for m in model.modules()]
    neutral = sum(name in NEUTRAL_PROJECTIONS for name in names)
    if not neutral or any("Mamba" in name for name in names):
        return False
    layers = DynamicCache(config=model.config).layers
    return (all(type(layer) in (DynamicLayer, LinearAttentionLayer) for layer in layers)
            and sum(type(layer) is LinearAttentionLayer for layer in layers) == neutral)


def row_entry(cache: DynamicCache, row: int, columns: torch.Tensor) -> tuple[KV, States]:
    """Row ``row`` of a batch cache as a prefix-cache entry, copied: its attention layers' keys and
    values at ``columns`` (the row's tokens, padding left out), its linear layers' states."""
    kv, states = [], []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            states.append((layer.conv_states[0][row:row + 1].clone(), layer.recurrent_states[0][row:row + 1].clone()))
        else:
            kv.append((layer.keys[row:row + 1, :, columns], layer.values[row:row + 1, :, columns]))
    return kv, states


def restored_cache(model: nn.Module, entries: Sequence[tuple[int, KV, States] | None]) -> tuple[DynamicCache, torch.Tensor]:
    """A batch cache whose row j holds ``entries[j]`` (its cached length, keys and values, states;
    None: nothing, a fresh prompt's zero state), the keys and values left-padded to the longest;
    and the attention mask of those columns (rows x the longest cached length)."""
    like = next(e for e in entries if e is not None)
    width = max(e[0] if e is not None else 0 for e in entries)
    rows = len(entries)
    cache = DynamicCache(config=model.config)
    mask = torch.zeros((rows, width), dtype=torch.long, device=like[2][0][0].device)
    for j, e in enumerate(entries):
        if e is not None:
            mask[j, width - e[0]:] = 1
    kv_index = state_index = 0
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionLayer):
            conv = _stacked([e[2][state_index][0] if e else None for e in entries], like[2][state_index][0])
            recurrent = _stacked([e[2][state_index][1] if e else None for e in entries], like[2][state_index][1])
            set_states(layer, 0, conv, recurrent)
            state_index += 1
        else:
            cache.update(*left_padded([e[1][kv_index] if e is not None else None for e in entries], width), i)
            kv_index += 1
    return cache, mask


def set_states(layer: LinearAttentionLayer, index: int, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> None:
    """Make ``conv`` and ``recurrent`` (None: a state the layer does not keep) the empty ``layer``'s
    state ``index``, as a prefill would have left them: the tensors themselves, not copies
    (transformers' ``lazy_initialization`` would allocate a zeroed state of their size first)."""
    for name, state in (("conv", conv), ("recurrent", recurrent)):
        if state is not None:
            getattr(layer, f"{name}_states")[index] = state
            getattr(layer, f"is_{name}_states_initialized")[index] = True
    like = conv if conv is not None else recurrent  # (transformers' takes them from the conv state first)
    if like is not None:
        layer.dtype, layer.device = like.dtype, like.device
    if conv is not None:
        layer.conv_kernel_size[index] = conv.shape[-1]
    layer.has_previous_state[index] = True


def _stacked(states: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """One batch tensor of each row's ``[1, ...]`` state (zeros for None)."""
    out = like.new_zeros((len(states), *like.shape[1:]))
    for j, state in enumerate(states):
        if state is not None:
            out[j] = state[0]
    return out


@contextlib.contextmanager
def neutral_left_padding(model: nn.Module, cache: DynamicCache, pads: Sequence[int], width: int) -> Iterator[None]:
    """While inside, a forward of ``width`` new positions on ``cache`` leaves each row's restored
    states as they were over its ``pads[j]`` left pads (see the module's docstring)."""
    device = next(model.parameters()).device
    is_pad = torch.arange(width, device=device)[None, :] < torch.tensor(list(pads), device=device)[:, None]

    def at_pads_minus_inf(_module, _args, out: torch.Tensor) -> torch.Tensor:
        return out.masked_fill(is_pad[:, :, None], float("-inf")) if out.shape[1] == width else out

    hooks = [getattr(m, name).register_forward_hook(at_pads_minus_inf)
             for m in model.modules() for name in NEUTRAL_PROJECTIONS.get(type(m).__name__, ())]
    layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]
    for layer in layers:
        layer.update_conv_state = types.MethodType(_window_before_first_new_token, layer)
        layer.left_pads = list(pads)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for layer in layers:
            del layer.update_conv_state, layer.left_pads


def _window_before_first_new_token(layer: LinearAttentionLayer, conv_states: torch.Tensor, state_idx: int = 0,
                                   **kwargs) -> torch.Tensor:
    """``update_conv_state`` for a forward after restored states: what the layer convolves is its
    cached window followed by the new positions (as the layer's own), with each row's window moved
    to just before its first new token, over its left pads (whose outputs nobody reads). The cache
    keeps the last window, as the layer's own does: every row ends at the last position."""
    window = layer.conv_states[state_idx]
    taps = window.shape[-1]
    full = torch.cat([window, conv_states.to(window.dtype)], dim=-1)
    for row, pad in enumerate(layer.left_pads):
        if pad:
            full[row, :, pad:pad + taps] = window[row]
    layer.conv_states[state_idx] = full[..., -taps:].clone()
    return full
