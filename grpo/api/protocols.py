"""The client contract the loop is written against: the Tinker SDK's names, as typing.Protocols.

Written down once, as typing.Protocols under the Tinker SDK's names and parameter names, so that
``run_grpo(adapter, cfg, service_client)`` can be typed against them and every backend is held
to them: the in-process clients (grpo.backends.local) and the service clients
(grpo.backends.remote) both conform, checked by tests/test_client_conformance.py (signatures via
``signature_mismatches``, then one short training run on each backend with the same numbers).

The contract is the core of the SDK that both backends offer; the local backend implements
much more of the SDK (forward_backward_custom, the RestClient...: see grpo/api/sdk_parity.py).
Every call returns at once with a ``Future`` (``.result()`` blocks, ``await`` does not); each
has an ``_async`` twin.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from grpo.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)

T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class Future(Protocol[T_co]):
    """What every call returns."""

    def result(self, timeout: float | None = None) -> T_co: ...

    def __await__(self) -> Generator[Any, None, T_co]: ...


@runtime_checkable
class SamplingClient(Protocol):
    def sample(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams,
               include_prompt_logprobs: bool = False) -> Future[SampleResponse]:
        """``num_samples`` completions of ``prompt``; logprobs are the untempered policy's."""
        ...

    async def sample_async(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams,
                           include_prompt_logprobs: bool = False) -> SampleResponse: ...

    def compute_logprobs(self, prompt: ModelInput) -> Future[list[float | None]]:
        """Each prompt token's logprob given the tokens before it (None for the first)."""
        ...

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]: ...

    def get_tokenizer(self) -> Any: ...


@runtime_checkable
class TrainingClient(Protocol):
    def forward(self, data: Sequence[Datum], loss_fn: str,
                loss_fn_config: Mapping[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        """Loss and per-datum target logprobs, without gradients."""
        ...

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        """As forward, and add the gradient of the summed loss to the accumulated gradients."""
        ...

    def optim_step(self, optim_params: AdamParams | None = None, *,
                   adam_params: AdamParams | None = None) -> Future[OptimStepResponse]:
        """Apply the accumulated gradients (one Adam step) and clear them."""
        ...

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> Future[SaveWeightsResponse]:
        """Weights and optimizer state; the response's path resumes training."""
        ...

    def load_state(self, path: str, weights_access_token: str | None = None) -> Future[LoadWeightsResponse]: ...

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None
                                  ) -> Future[LoadWeightsResponse]: ...

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None
                                 ) -> Future[SaveWeightsForSamplerResponse]: ...

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """A sampler of the weights as of every training call submitted so far."""
        ...

    def create_sampling_client(self, model_path: str) -> SamplingClient: ...

    def get_info(self) -> Any: ...

    def get_tokenizer(self) -> Any: ...

    async def forward_async(self, data: Sequence[Datum], loss_fn: str,
                            loss_fn_config: Mapping[str, float] | None = None) -> Future[ForwardBackwardOutput]: ...

    async def forward_backward_async(self, data: Sequence[Datum], loss_fn: str,
                                     loss_fn_config: Mapping[str, float] | None = None
                                     ) -> Future[ForwardBackwardOutput]: ...

    async def optim_step_async(self, optim_params: AdamParams | None = None, *,
                               adam_params: AdamParams | None = None) -> Future[OptimStepResponse]: ...

    async def save_state_async(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                               user_metadata: dict[str, str] | None = None) -> Future[SaveWeightsResponse]: ...

    async def load_state_async(self, path: str, weights_access_token: str | None = None
                               ) -> Future[LoadWeightsResponse]: ...

    async def load_state_with_optimizer_async(self, path: str, weights_access_token: str | None = None
                                              ) -> Future[LoadWeightsResponse]: ...

    async def save_weights_for_sampler_async(self, name: str, ttl_seconds: int | None = None,
                                             user_metadata: dict[str, str] | None = None
                                             ) -> Future[SaveWeightsForSamplerResponse]: ...

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient: ...


@runtime_checkable
class ServiceClient(Protocol):
    def create_lora_training_client(self, base_model: str, rank: int = 16, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True,
                                    train_unembed: bool = True) -> TrainingClient: ...

    def create_training_client_from_state(self, path: str, base_model: str | None = None) -> TrainingClient:
        """A new training client with the weights saved at ``path`` and a fresh optimizer."""
        ...

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None
                                                         ) -> TrainingClient:
        """Resume: the weights and the optimizer state saved at ``path``."""
        ...

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None) -> SamplingClient: ...

    def get_server_capabilities(self) -> Any: ...

    async def create_lora_training_client_async(self, base_model: str, rank: int = 16, seed: int | None = None,
                                                train_mlp: bool = True, train_attn: bool = True,
                                                train_unembed: bool = True) -> TrainingClient: ...

    async def create_training_client_from_state_async(self, path: str, base_model: str | None = None
                                                      ) -> TrainingClient: ...

    async def create_training_client_from_state_with_optimizer_async(self, path: str, base_model: str | None = None
                                                                     ) -> TrainingClient: ...

    async def create_sampling_client_async(self, model_path: str | None = None,
                                           base_model: str | None = None) -> SamplingClient: ...

    async def get_server_capabilities_async(self) -> Any: ...


PROTOCOLS: dict[str, type] = {"ServiceClient": ServiceClient, "TrainingClient": TrainingClient,
                              "SamplingClient": SamplingClient}


def protocol_methods(protocol: type) -> list[str]:
    return sorted(n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_"))


def signature_mismatches(protocol: type, cls: type) -> list[str]:
    """How ``cls`` fails ``protocol``: missing methods, parameters not accepted under the
    contract's names and order, parameters it requires that the contract does not, sync/async."""
    problems = []
    for name in protocol_methods(protocol):
        impl = getattr(cls, name, None)
        if impl is None:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        want = list(inspect.signature(getattr(protocol, name)).parameters.values())[1:]
        have = list(inspect.signature(impl).parameters.values())[1:]
        named = {p.name: p for p in have if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        positional = [p.name for p in have if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        want_positional = [p.name for p in want if p.kind == p.POSITIONAL_OR_KEYWORD]
        if positional[:len(want_positional)] != want_positional:
            problems.append(f"{cls.__name__}.{name}{inspect.signature(impl)}: positional parameters should start "
                            f"with {want_positional}")
        missing = [p.name for p in want if p.name not in named]
        if missing:
            problems.append(f"{cls.__name__}.{name} does not take {missing}")
        required = {p.name for p in want if p.default is p.empty}
        extra = [n for n, p in named.items() if p.default is p.empty and n not in required]
        if extra:
            problems.append(f"{cls.__name__}.{name} requires {extra}, which the contract does not")
        if inspect.iscoroutinefunction(getattr(protocol, name)) != inspect.iscoroutinefunction(impl):
            problems.append(f"{cls.__name__}.{name} should " + ("" if inspect.iscoroutinefunction(
                getattr(protocol, name)) else "not ") + "be async")
    return problems
