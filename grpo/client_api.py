"""The client contract the loop is written against: the Tinker SDK's names, as typing.Protocols.

Both backends (grpo.backends.local and grpo.backends.remote) satisfy these; the loop and the
evaluation type their clients with them, so what the loop may call is written down here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from grpo.types import (
    AdamParams,
    APIFuture,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)


@runtime_checkable
class SamplingClient(Protocol):
    def sample(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams,
               include_prompt_logprobs: bool = False) -> APIFuture[SampleResponse]: ...

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]: ...


@runtime_checkable
class TrainingClient(Protocol):
    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: dict[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]: ...

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]: ...

    def save_state(self, name: str) -> APIFuture[SaveWeightsResponse]: ...

    def load_state_with_optimizer(self, path: str) -> APIFuture[Any]: ...

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsForSamplerResponse]: ...

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient: ...

    def get_tokenizer(self) -> Any: ...


@runtime_checkable
class ServiceClient(Protocol):
    def create_lora_training_client(self, base_model: str, rank: int = 16, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True,
                                    train_unembed: bool = True) -> TrainingClient: ...

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None) -> SamplingClient: ...
