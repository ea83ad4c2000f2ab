"""Running a model once at load to check how it computes (logit_head.py, packed_attention.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def trial_run(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout: two passes compared must compute the same thing) and
    without gradients, each module's own mode put back after, whatever mix of modes it had."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training
