"""A hybrid's linear-attention layers over a packed training pass (packed_attention.PackedPass).

A packed pass holds every sequence of a micro-batch back to back in one row: no padding, one
decoder call for a GRPO group's prompt and its answers. Attention keeps the sequences apart by
itself (``PackedPass.attend``); a linear-attention layer (Qwen3.5's gated delta rule) carries
state along the row instead -- its short convolution reads the positions before each one, its
recurrence a state from all of them -- so over a packed row each sequence must start from what
its own history left: nothing for a sequence that continues none, the continued sequence's last
positions and final state for an answer after its prompt.

``conv`` runs the short convolution over the row with each sequence's window behind it (the
``taps - 1`` positions its history ends with, zeros where it has fewer), as one convolution over
those windows and the sequences laid end to end. ``delta_rule`` runs the chunked delta rule
through the native kernel's segments, a call per level of continuation (prompts, then the answers
that continue them from their final states), each segment in chunks fitted to its own length.
Autograd carries each answer's state gradient back into its prompt's final state, as through a
padded pass's fanned-out cache (``trainer.run_decoder_shared``), which is the reference these
equal up to float summation order (tests/test_packed_recurrence.py).
"""

from __future__ import annotations

import torch


class RecurrencePlan:
    """What a pass's linear-attention layers need of its layout, made once per pass: the levels of
    continuation the delta rule runs in, and the convolution's windows per filter length."""

    def __init__(self, packed):
        self.packed = packed
        # the sequence each one starts from: the one it continues, past any without tokens of its own
        source: list[int | None] = []
        for parent in packed.continues:
            while parent is not None and packed.lengths[parent] == 0:
                parent = packed.continues[parent]
            source.append(parent)
        depth: list[int] = []
        for parent in source:
            depth.append(0 if parent is None else depth[parent] + 1)
        continued = {parent for parent in source if parent is not None}
        # the sequences (with tokens) by level of continuation; the final states kept (those of the
        # sequences others start from), indexed level by level
        self.levels: list[list[int]] = [[] for _ in range(max(depth, default=-1) + 1)]
        for i, d in enumerate(depth):
            if packed.lengths[i] > 0:
                self.levels[d].append(i)
        self.source = source
        self.final_index: dict[int, int] = {}
        for level in self.levels:
            for i in level:
                if i in continued:
                    self.final_index[i] = len(self.final_index)
        self._windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._segments: dict[object, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def windows(self, taps: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``gather``: rows of the pass (its length: a zero row) laid out as each sequence's
        ``taps - 1`` history rows, then its own; ``keep``: where each row of the pass lies in that."""
        if taps not in self._windows:
            packed, zero, behind = self.packed, self.packed.tokens, taps - 1
            gather: list[int] = []
            keep: list[int] = []
            for i, (start, length) in enumerate(zip(packed.starts, packed.lengths, strict=True)):
                history = packed.key_rows[i][:len(packed.key_rows[i]) - length][-behind:] if behind else []
                gather += [zero] * (behind - len(history)) + history
                keep += range(len(gather), len(gather) + length)
                gather += range(start, start + length)
            self._windows[taps] = (torch.tensor(gather, dtype=torch.long, device=device),
                                   torch.tensor(keep, dtype=torch.long, device=device))
        return self._windows[taps]

    def segments(self, chunk_of) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per level, the kernel's segments ``[row, start, length, chunk, state]`` (``chunk_of(length)``
        the chunk) and which of them keep their final state (for the sequences that continue them)."""
        if chunk_of not in self._segments:
            packed = self.packed
            tables = []
            for level in self.levels:
                rows = [(0, packed.starts[i], packed.lengths[i], chunk_of(packed.lengths[i]),
                         self.final_index[self.source[i]] if self.source[i] is not None else -1) for i in level]
                kept = [k for k, i in enumerate(level) if i in self.final_index]
                tables.append((torch.tensor(rows, dtype=torch.long).reshape(-1, 5), torch.tensor(kept, dtype=torch.long)))
            self._segments[chunk_of] = tables
        return self._segments[chunk_of]


def plan_of(packed) -> RecurrencePlan:
    """The pass's plan, made on first use."""
    plan = getattr(packed, "recurrence_plan", None)
    if plan is None:
        plan = packed.recurrence_plan = RecurrencePlan(packed)
    return plan


def conv(packed, hidden_states: torch.Tensor, weight: torch.Tensor, convolve) -> torch.Tensor:
    """The short convolution over a packed pass: ``hidden_states`` ``(1, channels, positions)`` as the
    layer hands it (a view of channels-last memory); ``convolve(x)`` the layer's causal convolution of
    one row, activation included. Returns the same layout."""
    if hidden_states.shape[0] != 1 or hidden_states.shape[2] != packed.tokens:
        raise ValueError(f"a packed pass of {packed.tokens} positions in one row, got {tuple(hidden_states.shape)}")
    gather, keep = plan_of(packed).windows(weight.shape[-1], hidden_states.device)
    # (squeeze, not [0]: a select's backward writes the gradient into a zeroed copy of the input's
    # shape, ~0.2 s of a hybrid's bench-shaped forward_backward; a squeeze's is a view)
    rows = hidden_states.squeeze(0).transpose(0, 1)  # positions x channels
    laid_out = torch.cat([rows, rows.new_zeros(1, rows.shape[1])]).index_select(0, gather)
    out = convolve(laid_out.transpose(0, 1)[None])  # (1, channels, windows and sequences)
    return out.squeeze(0).transpose(0, 1).index_select(0, keep).transpose(0, 1)[None]


def delta_rule(packed, query, key, value, g, beta, l2norm: bool, chunk_of, run_segments) -> torch.Tensor:
    """The chunked delta rule over a packed pass: ``query``, ``key`` ``(1, positions, key heads, dim)``,
    ``value`` ``(1, positions, value heads, dim)``, ``g`` and ``beta`` ``(1, positions, value heads)``.
    ``run_segments(q, k, v, g, beta, initial, segments, final, l2norm)`` runs one level's segments
    through the kernel and returns its output (zeros off its segments) and the segments' final states."""
    if query.shape[:2] != (1, packed.tokens):
        raise ValueError(f"a packed pass of {packed.tokens} positions in one row, got {tuple(query.shape)}")
    plan = plan_of(packed)
    packed.recurrent_calls += 1
    out = None
    states = None  # the final states kept so far, in plan.final_index's order
    for segments, kept in plan.segments(chunk_of):
        if not len(segments):
            continue
        keeps_final = len(kept) > 0  # (some sequence of the next level starts from one of these)
        level_out, final = run_segments(query, key, value, g, beta, states, segments, keeps_final, l2norm)
        out = level_out if out is None else out + level_out
        if keeps_final:
            final = final.index_select(0, kept) if len(kept) < len(segments) else final
            states = final if states is None else torch.cat([states, final])
    if out is None:  # (an empty pass)
        out = value.new_zeros(value.shape)
    return out
