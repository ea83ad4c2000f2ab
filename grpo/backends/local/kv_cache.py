"""The sampler's KV cache: a fixed number of row slots, each decoding at its own position.

Continuous batching needs rows of different ages side by side: a row admitted while others are
200 tokens into their answers starts at its own prompt length. So each slot holds one row's
sequence from column 0 (``[slots, heads, capacity, head_dim]`` per layer, allocated once per
``generate`` call, sized by the memory budget), ``lengths[r]`` says how many columns row ``r``
has filled, and a decode step writes every row's new key and value at that row's own column.
Attention reads the columns up to the longest row and a boolean mask hides each row's unused
ones (``decode_mask``), so transformers' own mask construction is bypassed.

Rows that finish leave by having a surviving row copied into their slot (``keep``), so a finish
costs one row's copy, not a copy of every row behind it. Every attention layer, sliding-window
ones too (their window is a mask, ``decode_mask``), uses a slot layer; a model whose decoder has
layers of another kind (linear attention, state-space) is refused by ``attention_layers``.

The rows a prompt is fanned out to (a GRPO group's samples) each hold a copy of its columns. The
cache remembers which rows hold copies of one prompt (``write_prompt``'s ``copy_of``), and each
decode step names them (``set_step``: ``StepState.shared_from`` and ``shared``) to the native
attention kernel, which then reads those columns once for all of the rows rather than once a row.
"""

from __future__ import annotations

import itertools

import torch
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_layers(config) -> tuple[list[str], int | None]:
    """Each decoder layer's kind as transformers' own caches read it from ``config``, and the
    sliding window of the sliding-attention ones. Refuses kinds a slot cannot hold."""
    kinds, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = sorted(set(kinds) - set(ATTENTION_LAYER_TYPES))
    if other:
        raise ValueError(f"the local sampler decodes attention-only models (layer types {list(ATTENTION_LAYER_TYPES)}); "
                         f"{getattr(config, 'model_type', 'this model')} has {other} layers")
    windows = {kw["sliding_window"] for kind, kw in zip(kinds, kwargs, strict=True) if kind == "sliding_attention"}
    if len(windows) > 1:
        raise ValueError(f"the local sampler takes one sliding window per model; this one has {sorted(windows)}")
    return list(kinds), next(iter(windows), None)


def attention_only(config) -> bool:
    """Whether every decoder layer is one a slot holds (``attention_layers`` takes the config):
    a hybrid's linear-attention or state-space layers keep a recurrent state instead."""
    try:
        attention_layers(config)
    except ValueError:
        return False
    return True


class StepState:
    """What every layer of one cache reads during a decode step, set by ``SlotCache.set_step``.

    Layers hold this, not their cache: a layer pointing back at the cache that lists it would be
    a reference cycle, and the slot buffers (a gigabyte or more at a full budget) would outlive
    ``generate`` until Python's cycle collector happened to run -- into the training step that
    follows, on top of its own working set.
    """

    def __init__(self, slots: int, capacity: int, device: torch.device):
        self.slots, self.capacity = slots, capacity
        self.row_index = torch.arange(slots, device=device)
        self.lengths_tensor = self.row_index[:0]
        self.width = 0
        # for each row, the row whose copy of their common prompt attention reads, and its columns;
        # None where no two rows hold copies of one prompt
        self.shared_from: torch.Tensor | None = None
        self.shared: torch.Tensor | None = None


class SlotLayer(DynamicLayer):
    """One attention layer's keys and values, ``[slots, heads, capacity, head_dim]``."""

    def __init__(self, step: StepState):
        super().__init__()
        self.step = step
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def _allocate(self, like_keys: torch.Tensor, like_values: torch.Tensor) -> None:
        # Zeros, not empty memory: attention weighs a masked column by 0, and 0 * NaN left over
        # in an unwritten column would still be NaN.
        slots, capacity = self.step.slots, self.step.capacity
        self._keys = like_keys.new_zeros((slots, like_keys.shape[1], capacity, like_keys.shape[-1]))
        self._values = like_values.new_zeros((slots, like_values.shape[1], capacity, like_values.shape[-1]))
        self.dtype, self.device = like_keys.dtype, like_keys.device
        self.is_initialized = True

    def write_prompt(self, first: int, count: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows ``first .. first+count-1`` start with the prompt whose ``[1, heads, length, dim]``
        keys and values are given (one prompt, fanned out to its group's rows)."""
        if self._keys is None:
            self._allocate(keys, values)
        length = keys.shape[-2]
        self._keys[first:first + count, :, :length] = keys
        self._values[first:first + count, :, :length] = values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """A decode step: row r's one new position goes to column ``lengths[r]``; returns every
        row's columns up to the longest row's new one."""
        if key_states.shape[-2] != 1:
            raise ValueError("a slot cache takes one new position per row; prompts are written with write_prompt")
        rows = key_states.shape[0]
        index = self.step.row_index[:rows]
        at = self.step.lengths_tensor
        self._keys[index, :, at] = key_states[:, :, 0]
        self._values[index, :, at] = value_states[:, :, 0]
        width = self.step.width
        self.keys, self.values = self._keys[:rows, :, :width], self._values[:rows, :, :width]
        return self.keys, self.values

    def move(self, sources: torch.Tensor, targets: torch.Tensor, width: int) -> None:
        if self._keys is not None:
            self._keys[targets, :, :width] = self._keys[sources, :, :width]
            self._values[targets, :, :width] = self._values[sources, :, :width]

    def get_seq_length(self) -> int:
        return self.step.width

    def get_max_cache_shape(self) -> int:
        return self.step.capacity


class SlotCache(Cache):
    """Every decoder layer's slot buffers, and where each row in the batch stands.

    ``lengths`` (a list, in batch order) is what the sampler keeps up to date: the columns each
    row has filled. Before a decode step ``set_step`` turns it into the device tensors the
    layers read."""

    def __init__(self, config, slots: int, capacity: int, device: torch.device):
        self.kinds, self.window = attention_layers(config)
        # eager attention adds its mask to the scores (0 or the dtype's lowest value), as
        # transformers' eager masks do; SDPA takes booleans
        self.additive_mask = getattr(config.get_text_config(decoder=True), "_attn_implementation", None) == "eager"
        self.device = device
        self.step = StepState(slots, capacity, device)
        super().__init__(layers=[SlotLayer(self.step) for _ in self.kinds])
        self.lengths: list[int] = []
        # for each row (batch order, as lengths): which prompt copy its first columns are, and how
        # many columns that prompt has; rows with the same copy hold the same keys and values there
        self.prompts: list[tuple[int, int]] = []
        self._copies = itertools.count()
        self._columns = torch.arange(capacity, device=device)

    def new_copy(self) -> int:
        """An id for ``write_prompt``'s ``copy_of``: one per prompt's keys and values written."""
        return next(self._copies)

    def write_prompt(self, first: int, count: int, prompt_cache: Cache, source_row: int, start: int,
                     end: int | None = None, copy_of: int | None = None) -> None:
        """Rows ``first .. first+count-1`` take row ``source_row`` of a prefill cache, columns
        ``start`` to ``end`` (its padding dropped; ``end`` None: to the last column). Rows written
        with the same ``copy_of`` (``new_copy``), here or in another call, hold the very same keys
        and values in those columns: attention reads them once for all of them."""
        for ours, theirs in zip(self.layers, prompt_cache.layers, strict=True):
            ours.write_prompt(first, count, theirs.keys[source_row:source_row + 1, :, start:end],
                              theirs.values[source_row:source_row + 1, :, start:end])
        length = (prompt_cache.layers[0].keys.shape[-2] if end is None else end) - start
        self.lengths[first:first + count] = [length] * count
        self.prompts[first:first + count] = [(self.new_copy() if copy_of is None else copy_of, length)] * count

    def read_row(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of slot ``slot``'s first ``length`` columns, per layer ``[1, heads, length, dim]``
        keys and values (for the prefix cache: the slot itself is reused by the next row)."""
        return [(layer._keys[slot:slot + 1, :, :length].clone(), layer._values[slot:slot + 1, :, :length].clone())
                for layer in self.layers]

    def keep(self, survivors: list[int]) -> list[int]:
        """Keep the rows at batch positions ``survivors`` (ascending) and return the new batch
        order as old positions. Survivors already inside the first ``len(survivors)`` slots stay
        where they are; the others fill the slots of rows that left, so only they are copied."""
        n = len(survivors)
        staying = {p for p in survivors if p < n}
        holes = [k for k in range(n) if k not in staying]
        movers = [p for p in survivors if p >= n]
        if movers:
            width = max(self.lengths[p] for p in movers)
            sources = torch.tensor(movers, device=self.device)
            targets = torch.tensor(holes, device=self.device)
            for layer in self.layers:
                layer.move(sources, targets, width)
        order = list(range(n))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        self.lengths = [self.lengths[p] for p in order]
        self.prompts = [self.prompts[p] for p in order]
        return order

    def set_step(self, mask: bool = True) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor] | None]:
        """Prepare a decode step of the rows in ``lengths``: their position ids and attention mask
        (None with ``mask=False``: a step that reads the rows' lengths instead)."""
        self.step.lengths_tensor = torch.tensor(self.lengths, device=self.device)
        self.step.width = max(self.lengths) + 1
        self.step.shared_from, self.step.shared = self._sharing()
        return self.step.lengths_tensor[:, None], self.decode_mask() if mask else None

    def _sharing(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """For each row, the first row holding the same prompt copy (itself if none before it) and
        that prompt's columns; (None, None) where every row's copy is its own."""
        first: dict[int, int] = {}
        shared_from = [first.setdefault(copy, r) for r, (copy, _) in enumerate(self.prompts)]
        if len(first) == len(shared_from):
            return None, None
        shared = [columns for _, columns in self.prompts]
        return torch.tensor(shared_from), torch.tensor(shared)

    def decode_mask(self) -> torch.Tensor | dict[str, torch.Tensor]:
        """``[rows, 1, 1, width]`` booleans: row r's query (at column ``lengths[r]``) sees columns
        ``0 .. lengths[r]``, and a sliding-window layer only the last ``window`` of them (for eager
        attention as 0 and the dtype's lowest value, which it adds to the scores). Models
        with both kinds of layer take a mask per kind (transformers' ``causal_mask_mapping``); a
        model of one kind takes its one mask: Mistral's forward, every layer windowed, reads a
        tensor, not a mapping (and a mapping model takes a ready 4D mask as it is)."""
        columns = self._columns[None, : self.step.width]
        at = self.step.lengths_tensor[:, None]
        masks = {"full_attention": (columns <= at)[:, None, None, :]}
        if "sliding_attention" in self.kinds:
            masks["sliding_attention"] = ((columns <= at) & (columns > at - self.window))[:, None, None, :]
        if self.additive_mask:
            dtype = self.layers[0]._keys.dtype
            masks = {kind: torch.zeros((), dtype=dtype, device=self.device).masked_fill(~seen, torch.finfo(dtype).min)
                     for kind, seen in masks.items()}
        if "sliding_attention" not in self.kinds:
            return masks["full_attention"]
        if "full_attention" not in self.kinds:
            return masks["sliding_attention"]
        return masks
