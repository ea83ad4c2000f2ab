"""A decode KV cache that is allocated once per sampling wave and written in place.

transformers' ``DynamicCache`` grows each layer's keys and values by concatenation: every decode
step allocates a block one position longer than the last and copies the whole cache into it,
leaving freed blocks a little smaller than the next request. Here each layer's buffer holds the
wave's longest possible sequence from the start (what the memory budget counts for the wave
anyway); a step writes one position, and attention reads a view of the filled part. Measured on
SmolLM2-135M on a 2-core CPU: the same speed as DynamicCache (the copies are cheap next to the
matmuls) and 2.5-4% lower peak RSS, with the same tokens and logprobs.

Rows that finish leave by moving the survivors to the front of the same buffer.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One attention layer's keys and values in a ``[rows, heads, capacity, head_dim]`` buffer."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.rows = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._allocate(key_states.shape[0], key_states, value_states)
        self.is_initialized = True

    def _allocate(self, rows: int, like_keys: torch.Tensor, like_values: torch.Tensor) -> None:
        _, heads, _, dim = like_keys.shape
        self._keys = like_keys.new_empty((rows, heads, self.capacity, dim))
        self._values = like_values.new_empty((rows, like_values.shape[1], self.capacity, like_values.shape[-1]))
        self.rows = rows

    def _expose(self) -> None:
        self.keys = self._keys[: self.rows, :, : self.length]
        self.values = self._values[: self.rows, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot hold {end}; the wave's "
                             "capacity must cover its longest prompt plus max_tokens")
        self._keys[: self.rows, :, self.length:end] = key_states
        self._values[: self.rows, :, self.length:end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (in that order). Repeated indices (a prompt fanned out to its
        group) allocate a buffer for the new row count; a subset (finished rows leaving) is
        moved to the front of the buffer that is already there."""
        if not self.is_initialized:
            return
        filled_keys = self._keys[: self.rows, :, : self.length]
        filled_values = self._values[: self.rows, :, : self.length]
        kept_keys, kept_values = filled_keys[indices], filled_values[indices]
        rows = int(indices.shape[0])
        if rows > self._keys.shape[0]:
            self._allocate(rows, self._keys, self._values)
        self.rows = rows
        self._keys[:rows, :, : self.length] = kept_keys
        self._values[:rows, :, : self.length] = kept_values
        self._expose()


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose full-attention layers hold ``capacity`` positions in place.

    Layers of other kinds (sliding window, linear attention) keep transformers' own classes."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
