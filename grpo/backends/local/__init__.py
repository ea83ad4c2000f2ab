"""The local backend: the Tinker client API on torch + transformers + peft in this process."""

from grpo.backends.local.clients import SamplingClient, ServiceClient, TrainingClient

__all__ = ["SamplingClient", "ServiceClient", "TrainingClient"]
