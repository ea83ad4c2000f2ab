"""The sampler's decoding step replayed from CUDA graphs.

On a GPU a decoding step of a small model is bound by kernel launches, not by the GPU: SmolLM2-135M
in bf16 on an H100 launched ~2,900 kernels a step (30 layers, LoRA unmerged), 53 ms of host time
for a few ms of GPU work (docs/benchmark.md, issue #40). A CUDA graph records those launches once
and replays them in one call.

A graph replays fixed shapes and fixed addresses, so the step is made static: the batch's rows are
padded up to a bucket (a power of two, at most the cache's slots), attention reads a fixed number
of columns (a power of two of at least 64, at most the slot capacity) and masks the unwritten ones,
and the step's inputs (each row's token and length) are copied into tensors the graph owns. A
padded row decodes a pad token at column 0 of a free slot: that slot is no row's until a prompt is
written into it, which overwrites the column. One graph is captured per (rows, columns) bucket the
call meets, against this call's slot cache and weights, and dropped with them: a graph made for
one sampling call is never replayed against another's buffers or outdated LoRA weights.

Only the lean decoding step (lean_decode.py) is captured: it has no host synchronisation and no
Python decisions that depend on tensor values. Choosing tokens (random draws, stop checks) stays
outside the graph. ``capture=False`` runs the same static step without a graph: what the CPU tests
check the padding and masking with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from grpo.backends.local.kv_cache import SlotCache
from grpo.backends.local.lean_decode import LeanDecoder

MIN_COLUMNS = 64
ENV_SWITCH = "GRPO_CUDA_GRAPHS"  # "0": decode without graphs (an A/B, or a driver that misbehaves)


def enabled(device: torch.device) -> bool:
    """Graphs for decoding on ``device``: CUDA, unless ``$GRPO_CUDA_GRAPHS`` is "0"."""
    return device.type == "cuda" and os.environ.get(ENV_SWITCH, "1") != "0"


def bucket(n: int, floor: int, cap: int) -> int:
    """The smallest power of two >= n and >= floor, but at most cap (cap itself >= n)."""
    size = floor
    while size < n:
        size *= 2
    return min(size, cap)


@dataclass
class _Static:
    tokens: torch.Tensor  # [rows] the token each row feeds in
    lengths: torch.Tensor  # [rows] the column each row writes (its length so far)
    logits: torch.Tensor | None = None  # [rows, vocab] float32, written by the step
    graph: torch.cuda.CUDAGraph | None = None


class StaticDecodeStep:
    """``lean(tokens, mask, positions, cache)`` at bucketed shapes, from a CUDA graph per bucket."""

    def __init__(self, lean: LeanDecoder, cache: SlotCache, pad_id: int, capture: bool = True):
        self.lean, self.cache, self.pad_id = lean, cache, pad_id
        self.capture = capture
        self.buckets: dict[tuple[int, int], _Static] = {}
        self.pool = None  # one memory pool shared by this call's graphs

    def __call__(self, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The next-token logits ``[rows, vocab]`` (float32) of a decode step of ``tokens`` (one
        per row, at column ``lengths[r]`` of slot r), as the lean step would return them."""
        rows = tokens.shape[0]
        step = self.cache.step
        key = (bucket(rows, 1, step.slots), bucket(max(lengths) + 1, MIN_COLUMNS, step.capacity))
        static = self.buckets.get(key)
        fresh = static is None
        if fresh:
            device = tokens.device
            static = self.buckets[key] = _Static(torch.full((key[0],), self.pad_id, dtype=torch.long, device=device),
                                                 torch.zeros(key[0], dtype=torch.long, device=device))
        static.tokens[:rows].copy_(tokens)
        static.tokens[rows:].fill_(self.pad_id)
        static.lengths[:rows].copy_(torch.tensor(lengths))
        static.lengths[rows:].zero_()
        if not self.capture:
            self._run(static, key[1])
        elif fresh:
            try:
                self._capture(static, key[1])
            except Exception as err:  # a driver, kernel or memory refusal: say how to run without
                raise RuntimeError(f"capturing the sampler's decoding step in a CUDA graph failed ({type(err).__name__}: "
                                   f"{err}); set {ENV_SWITCH}=0 to decode without graphs") from err
            static.graph.replay()
        else:
            static.graph.replay()
        return static.logits[:rows].clone()  # the graph's output is overwritten by its next replay

    def _run(self, static: _Static, columns: int) -> None:
        """The step at ``static``'s shapes, its logits into ``static.logits``."""
        step = self.cache.step
        step.lengths_tensor, step.width = static.lengths, columns
        static.logits = self.lean(static.tokens[:, None], self.cache.decode_mask(), static.lengths[:, None], self.cache)

    def _capture(self, static: _Static, columns: int) -> None:
        # Warm-up on a side stream first (cuBLAS and the attention kernels set themselves up
        # outside the capture). It runs the real step: it writes the same keys and values the
        # replay then writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(static, columns)
        torch.cuda.current_stream().wait_stream(side)
        static.graph = torch.cuda.CUDAGraph()
        # thread_local: the engine captures on its computing thread while other threads may
        # touch CUDA (a client building tensors); they are not part of this graph
        with torch.cuda.graph(static.graph, pool=self.pool, capture_error_mode="thread_local"):
            self._run(static, columns)
        self.pool = static.graph.pool()
