"""grpo: GRPO training for language models with LoRA, behind the Tinker/MinT client API.

``import grpo as tinker`` (or ``as mint``) runs a program written for the Tinker SDK in this
process: the clients (``ServiceClient``, ``TrainingClient``, ``SamplingClient``, ``RestClient``),
the types a program builds or reads (``Datum``, ``ModelInput``, ``TensorData``, ``AdamParams``...)
and ``grpo.types`` mirror the SDK's top level. What of the SDK has no local meaning is listed,
with the reason, in grpo/api/sdk_parity.py.
"""

from grpo import types
from grpo.api.errors import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    BillingError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestFailedError,
    TinkerError,
    UnprocessableEntityError,
)
from grpo.mint_run import RLConfig
from grpo.rl.adapter import RLAdapter
from grpo.types import (
    AdamOptimizerConfig,
    AdamParams,
    APIFuture,
    Checkpoint,
    CheckpointType,
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoraConfig,
    ModelID,
    ModelInput,
    ModelInputChunk,
    OptimParams,
    OptimStepResponse,
    ParsedCheckpointTinkerPath,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
    TensorData,
    TensorDtype,
    TrainingRun,
)

# Clients load torch and transformers, so they are imported on first use (see __getattr__).
_CLIENTS = {
    "ServiceClient": "grpo.backends.local.clients",
    "TrainingClient": "grpo.backends.local.clients",
    "SamplingClient": "grpo.backends.local.clients",
    # The SDK's creation calls return these "client futures"; a local client is its own future.
    "BackcompatTrainingClientFuture": "grpo.backends.local.clients:TrainingClient",
    "BackcompatSamplingClientFuture": "grpo.backends.local.clients:SamplingClient",
    "RestClient": "grpo.api.rest_client",
    "run_grpo": "grpo.mint_run",  # the loop, plus MinT demos' run_grpo(adapter, RLConfig)
    "AgentAdapter": "grpo.rl.agent",
}

__all__ = [
    "as_tinker", "RLAdapter", "RLConfig", "AgentAdapter", "types", "run_grpo", "ServiceClient", "TrainingClient", "SamplingClient", "RestClient",
    "BackcompatTrainingClientFuture", "BackcompatSamplingClientFuture", "APIFuture",
    "AdamOptimizerConfig", "AdamParams", "Checkpoint", "CheckpointType", "Datum", "DmelChunk", "EncodedTextChunk",
    "ForwardBackwardOutput", "LoraConfig", "ModelID", "ModelInput", "ModelInputChunk", "OptimParams",
    "OptimStepResponse", "ParsedCheckpointTinkerPath", "SampledSequence", "SampleResponse", "SamplingParams",
    "StopReason", "TensorData", "TensorDtype", "TrainingRun",
    # the SDK's error classes (grpo/api/errors.py)
    "APIConnectionError", "APIError", "APIResponseValidationError", "APIStatusError", "APITimeoutError",
    "AuthenticationError", "BadRequestError", "BillingError", "ConflictError", "InternalServerError",
    "NotFoundError", "PermissionDeniedError", "RateLimitError", "RequestFailedError", "TinkerError",
    "UnprocessableEntityError",
]
__version__ = "0.1.0"


def as_tinker():
    """Make ``import tinker`` give grpo in this process, submodules included, so a program or a
    library written for the Tinker SDK (the tinker-cookbook) runs in-process unchanged::

        import grpo; grpo.as_tinker()
        from tinker_cookbook.supervised import train   # its `import tinker` is grpo now

    Returns grpo. See grpo/api/tinker_alias.py for what is routed where."""
    from grpo.api import tinker_alias

    return tinker_alias.install()


def __getattr__(name: str):
    # Heavy imports (torch models, the loop) only when asked for, so `import grpo` stays cheap
    # and config validation can fail fast before any of them load.
    if name in _CLIENTS:
        import importlib

        module, _, attr = _CLIENTS[name].partition(":")
        return getattr(importlib.import_module(module), attr or name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
