"""grpo: GRPO training for language models with LoRA, behind the Tinker/MinT client API.

``import grpo as mint`` gives a drop-in for the MinT SDK's entry points on this machine:
``grpo.ServiceClient``, ``grpo.types``.
"""

from grpo import types
from grpo.adapter import RLAdapter
from grpo.mint_compat import RLConfig

__all__ = ["RLAdapter", "RLConfig", "ServiceClient", "types", "run_grpo"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Heavy imports (torch models, the loop) only when asked for, so `import grpo` stays cheap
    # and config validation can fail fast before any of them load.
    if name == "ServiceClient":
        from grpo.backends.local import ServiceClient

        return ServiceClient
    if name == "run_grpo":
        from grpo.loop import run_grpo

        return run_grpo
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
