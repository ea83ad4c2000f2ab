"""The backend's named sections: a profiler range where a profiler records, wall time while recording."""

from __future__ import annotations

import time

from torch.profiler import ProfilerActivity, profile

from grpo.backends.local import sections


def test_a_section_is_a_profiler_range_while_a_profiler_records_on_its_thread():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with sections.section("grpo.test.inside"):
            time.sleep(0.001)
    assert "grpo.test.inside" in {event.name for event in prof.events()}
    with sections.section("grpo.test.unprofiled"):  # (no profiler: nothing to record it, nothing fails)
        pass


def test_recorded_sections_sum_their_wall_time_and_calls():
    with sections.recording() as (seconds, calls):
        for _ in range(2):
            with sections.section("grpo.test.timed"):
                time.sleep(0.01)
    assert calls["grpo.test.timed"] == 2 and seconds["grpo.test.timed"] >= 0.02
