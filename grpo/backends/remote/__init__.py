"""The remote backends: the same client API on a MinT or Tinker service, through their SDKs.

``backend=mint`` uses the MinT SDK (``pip install -e '.[mint]'``, $MINT_API_KEY,
$MINT_BASE_URL); ``backend=tinker`` the Tinker SDK (``pip install -e '.[tinker]'``,
$TINKER_API_KEY, $TINKER_BASE_URL). See docs/remote.md.
"""

from grpo.backends.remote.clients import (
    RemoteSamplingClient,
    RemoteServiceClient,
    RemoteTrainingClient,
)
from grpo.backends.remote.resilience import (
    RemoteConnectionError,
    RemoteRequestError,
    RemoteStepError,
    RemoteTimeoutError,
)
from grpo.backends.remote.sdk import SDKS, RemoteConfigError

__all__ = [
    "SDKS",
    "RemoteConfigError",
    "RemoteConnectionError",
    "RemoteRequestError",
    "RemoteSamplingClient",
    "RemoteServiceClient",
    "RemoteStepError",
    "RemoteTimeoutError",
    "RemoteTrainingClient",
]
