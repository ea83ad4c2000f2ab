"""Moved to ``grpo.models.computing`` (the precision and kernel probes, a floor below the backends,
measure on that thread too); kept so that programs written against this path keep working."""

from grpo.models.computing import executor, on_computing_thread, run

__all__ = ["executor", "on_computing_thread", "run"]
