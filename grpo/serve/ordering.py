"""Per-model request ordering by the SDK's ``seq_id``.

A TrainingClient numbers its requests 1, 2, 3... (forward_backward, optim_step, save, load
share one counter), but sends them over separate connections: a big batch goes out as chunks
in parallel, the first chunk last. Work must still reach the model in seq_id order, else an
optim_step could run before the gradients it is meant to apply.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

# A client may skip a number (a request it failed to build locally); after this long the next
# request goes ahead instead of stalling the model for good.
SKIPPED_SEQ_GRACE_S = 5.0


class SeqGate:
    def __init__(self, first_seq_id: int = 1, grace_s: float = SKIPPED_SEQ_GRACE_S):
        self.next_seq_id = first_seq_id
        self.grace_s = grace_s
        self._cond = asyncio.Condition()

    @asynccontextmanager
    async def turn(self, seq_id: int | None) -> AsyncIterator[None]:
        """Hold the model exclusively once every smaller seq_id has had its turn."""
        async with self._cond:
            if seq_id is not None and seq_id > self.next_seq_id:
                try:
                    await asyncio.wait_for(self._cond.wait_for(lambda: self.next_seq_id >= seq_id), self.grace_s)
                except TimeoutError:
                    pass
            try:
                yield
            finally:
                if seq_id is not None:
                    self.next_seq_id = max(self.next_seq_id, seq_id + 1)
                self._cond.notify_all()
