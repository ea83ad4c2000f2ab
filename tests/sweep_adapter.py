"""ToyAdapter that logs wall-clock time, so a sweep's metrics files show when each run trained.

Every scored response reports ``wall`` (seconds since the epoch) as a sample metric; the loop logs
their mean per step as ``adapter/wall``. Runs trained at the same time have overlapping
[first, last] ``adapter/wall`` spans; runs one after the other do not.

With ``rendezvous=DIR`` and ``parties=N`` the first reward call of each run waits (at most
``wait_s``) until N runs have reached theirs: runs that really are concurrent then train side by
side whatever their start-up skew, while runs launched one after the other wait out ``wait_s``
alone and still do not overlap, so a concurrency test built on this can fail.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from toy_adapter import ToyAdapter


class ClockAdapter(ToyAdapter):
    def __init__(self, rendezvous: str | None = None, parties: int = 1, wait_s: float = 30.0, **kwargs):
        super().__init__(**kwargs)
        self.rendezvous = Path(rendezvous) if rendezvous else None
        self.parties = parties
        self.wait_s = wait_s
        self.arrived = False

    def compute_reward(self, response, sample):
        if self.rendezvous is not None and not self.arrived:
            self.arrived = True
            self.rendezvous.mkdir(parents=True, exist_ok=True)
            (self.rendezvous / str(os.getpid())).touch()
            deadline = time.time() + self.wait_s
            while len(list(self.rendezvous.iterdir())) < self.parties and time.time() < deadline:
                time.sleep(0.05)
        return super().compute_reward(response, sample)

    def sample_metrics(self, response, sample):
        return {**super().sample_metrics(response, sample), "wall": time.time()}
