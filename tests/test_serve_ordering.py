"""Per-model seq_id ordering (grpo/serve/ordering.py): requests that arrive out of order, as the
SDK's parallel forward_backward chunks do (first chunk last), reach the model in seq_id order."""

from __future__ import annotations

import asyncio
import time

from grpo.serve.ordering import SeqGate


def run_in_arrival_order(gate: SeqGate, arrivals: list[int]) -> list[int]:
    ran: list[int] = []

    async def request(seq_id: int, delay: float) -> None:
        await asyncio.sleep(delay)
        async with gate.turn(seq_id):
            ran.append(seq_id)
            await asyncio.sleep(0.01)  # work that yields: the next one must still wait its turn

    async def main() -> None:
        await asyncio.gather(*(request(s, 0.02 * i) for i, s in enumerate(arrivals)))

    asyncio.run(main())
    return ran


def test_out_of_order_arrivals_run_in_seq_id_order():
    assert run_in_arrival_order(SeqGate(first_seq_id=1), [3, 4, 2, 1, 5]) == [1, 2, 3, 4, 5]


def test_a_skipped_seq_id_only_delays_the_next_by_the_grace_time():
    start = time.monotonic()
    assert run_in_arrival_order(SeqGate(first_seq_id=1, grace_s=0.3), [1, 3, 4]) == [1, 3, 4]  # 2 never comes
    assert 0.25 < time.monotonic() - start < 2.0
