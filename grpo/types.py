"""Data types of the Tinker/MinT client API, kept field for field.

Scripts written against ``tinker.types`` or ``mint.types`` run against these unchanged; the
remote backends convert them to the SDK's own classes at the boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import numpy as np

# The SDK's types that grpo carries but does not compute with (non-text chunks, records of
# service calls); re-exported here so that ``grpo.types`` has every name ``tinker.types`` has.
from grpo.type_records import (  # noqa: F401  (re-exports)
    AuditLogEntry,
    AuditLogResponse,
    CopyWeightsResponse,
    DmelChunk,
    ImageAssetPointerChunk,
    ImageChunk,
    RequestErrorCategory,
    RequestID,
    SamplingClientKind,
    SaveWeightsExternalResponse,
)

if TYPE_CHECKING:  # torch is imported lazily so that config validation starts in a blink
    import torch

T = TypeVar("T")

# The SDK's type for the built-in losses; grpo.api.losses.LOSSES is the registry (tests hold them equal).
LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
StopReason = Literal["stop", "length"]


# --------------------------------------------------------------------------- model input


@dataclass
class EncodedTextChunk:
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    def __post_init__(self) -> None:
        # A copy, as the SDK's (pydantic) model makes: the cookbook builds a chunk from a list it
        # then clears and refills for the next chunk (rl/data_processing.py).
        self.tokens = list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class ModelInput:
    """A token sequence, stored as chunks of any of the SDK's kinds; grpo's models read text chunks only."""

    chunks: list[ModelInputChunk] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.chunks = list(self.chunks)  # a copy, as the SDK's model makes (see EncodedTextChunk)

    @classmethod
    def from_ints(cls, tokens: Sequence[int] | Any) -> ModelInput:
        """Token ids as a list, 1-D array/tensor, or a tokenizer output holding ``input_ids``.

        transformers v5's ``apply_chat_template(..., tokenize=True)`` returns a BatchEncoding
        mapping rather than a list; MinT docs pass that straight in, so its ``input_ids`` are used.
        """
        return cls(chunks=[EncodedTextChunk(tokens=_token_list(tokens))])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return text_tokens(self, "ModelInput")

    def append(self, chunk: ModelInputChunk) -> ModelInput:
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=[int(token)]))

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)


# Every chunk kind a ModelInput may hold; only encoded_text runs on grpo's text-only models.
ModelInputChunk = EncodedTextChunk | ImageChunk | ImageAssetPointerChunk | DmelChunk


def non_text_chunk(index: int, kind: str, type_name: str | None = None) -> str:
    """The one line for a chunk the local models cannot read, wherever it is met (in-process, or
    in a request to grpo.serve, JSON or protobuf)."""
    named = f" ({type_name})" if type_name else ""
    return (f"chunk {index} is a {kind!r} chunk{named}; grpo's local models read text only, "
            "so send encoded_text chunks (tokens)")


def text_tokens(model_input: ModelInput, where: str) -> list[int]:
    """The token ids of a text-only input; ``where`` names it (``datum 3``, ``prompt``) in the one-line
    error a non-text chunk gets, since the local models read text only."""
    out: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, EncodedTextChunk):
            kind = getattr(chunk, "type", type(chunk).__name__)
            raise ValueError(f"{where}: {non_text_chunk(i, kind, type(chunk).__name__)}")
        out.extend(chunk.tokens)
    return out


def _token_list(tokens: Any) -> list[int]:
    if isinstance(tokens, Mapping) or (hasattr(tokens, "keys") and hasattr(tokens, "__getitem__")):
        if "input_ids" not in tokens:
            raise TypeError(
                f"ModelInput.from_ints got a mapping with keys {sorted(tokens.keys())}; "
                "expected token ids or a tokenizer output with 'input_ids'"
            )
        tokens = tokens["input_ids"]
    if isinstance(tokens, str):
        raise TypeError("ModelInput.from_ints takes token ids, got a string; tokenize it first")
    if hasattr(tokens, "tolist"):  # numpy array or torch tensor
        tokens = tokens.tolist()
    if isinstance(tokens, int | np.integer):
        raise TypeError(f"ModelInput.from_ints takes a sequence of token ids, got the single int {tokens}")
    tokens = list(tokens)
    if len(tokens) == 1 and isinstance(tokens[0], list | tuple):  # a batch of one sequence
        tokens = list(tokens[0])
    out: list[int] = []
    for t in tokens:
        if isinstance(t, float | np.floating) and float(t).is_integer():
            t = int(t)
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise TypeError(f"ModelInput.from_ints takes integer token ids, got {t!r} ({type(t).__name__})")
        out.append(int(t))
    return out


# --------------------------------------------------------------------------- tensors and datums

_DTYPES = {"int64": np.int64, "float32": np.float32}


@dataclass
class TensorData:
    """A flat list plus dtype and shape: the wire format of loss inputs and outputs."""

    data: list
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        array = array.astype(_DTYPES[dtype])
        return cls(data=array.reshape(-1).tolist(), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        return cls.from_numpy(tensor.detach().cpu().float().numpy() if tensor.is_floating_point() else tensor.detach().cpu().numpy())

    @classmethod
    def coerce(cls, value: Any, key: str = "value") -> TensorData:
        """Accept TensorData, a torch tensor, a numpy array, a (nested) list of numbers or a
        ModelInput (its token ids)."""
        if isinstance(value, TensorData):
            return value
        if isinstance(value, ModelInput):  # Tinker's docs pass target_tokens as a ModelInput
            return cls.from_numpy(np.asarray(value.to_ints(), dtype=np.int64))
        if type(value).__module__.startswith("torch"):
            return cls.from_torch(value)
        if isinstance(value, np.ndarray):
            return cls.from_numpy(value)
        if isinstance(value, (list, tuple)):
            array = np.asarray(value)
            if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
                raise TypeError(f"loss input {key!r} must be a list of numbers, got {value[:5]!r}...")
            if array.size == 0:
                array = array.astype(np.float32)
            return cls.from_numpy(array)
        raise TypeError(
            f"loss input {key!r} must be a list, numpy array, torch tensor or TensorData, got {type(value).__name__}"
        )

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=_DTYPES[self.dtype])
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.to_numpy())

    def tolist(self) -> list:
        return self.to_numpy().tolist()

    def __len__(self) -> int:
        return len(self.data)


@dataclass
class Datum:
    """One training sequence: the model input plus per-token loss inputs of the same length."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model_input, ModelInput):
            raise TypeError(f"Datum.model_input must be a ModelInput, got {type(self.model_input).__name__}")
        self.loss_fn_inputs = {k: TensorData.coerce(v, k) for k, v in dict(self.loss_fn_inputs).items()}
        n = self.model_input.length
        for key, value in self.loss_fn_inputs.items():
            if len(value) != n:
                raise ValueError(
                    f"Datum loss input {key!r} has {len(value)} entries but model_input has {n} tokens; "
                    "every loss input needs one entry per input position"
                )
            if value.dtype == "float32":
                bad = np.flatnonzero(~np.isfinite(value.to_numpy().reshape(-1)))
                if bad.size:
                    raise ValueError(
                        f"Datum loss input {key!r} holds a non-finite value ({value.data[int(bad[0])]}) at "
                        f"position {int(bad[0])}; loss inputs must be finite (use weight 0 to mask a position)"
                    )


# --------------------------------------------------------------------------- parameter bounds

# Sane bounds on the optimizer's and the sampler's numbers: any real run stays far inside them.
MAX_LEARNING_RATE = 10.0
MAX_TEMPERATURE = 1000.0
MAX_TOP_K = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ParamError(ValueError):
    """A parameter out of its bounds; ``field`` names it (``temperature``, ``learning_rate``) so a
    server can answer with the request field (``sampling_params.temperature``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _not_number(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, np.integer))


# --------------------------------------------------------------------------- sampling


@dataclass
class SamplingParams:
    """Sampling limits. ``stop`` takes strings or token ids; ``stop_token_ids`` is an alias."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: str | int | Sequence[str] | Sequence[int] | None = None
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and int(self.max_tokens) <= 0:
            raise ParamError("max_tokens", f"SamplingParams.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if _not_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ParamError("temperature", f"SamplingParams.temperature must be a finite number in [0, {MAX_TEMPERATURE:g}] "
                             f"(0 means greedy), got {self.temperature!r}")
        if _not_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is None:
            self.top_k = -1
        if _not_int(self.top_k) or self.top_k == 0 or not -1 <= self.top_k <= MAX_TOP_K:
            raise ParamError("top_k", f"SamplingParams.top_k must be -1 (off) or an integer in 1..{MAX_TOP_K}, "
                             f"got {self.top_k!r}")
        if self.seed is not None and (_not_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ParamError("seed", f"SamplingParams.seed must be an integer in the int64 range "
                             f"[{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")

    def stop_strings_and_ids(self) -> tuple[list[str], list[int]]:
        """Split ``stop`` (and ``stop_token_ids``) into stop strings and stop token ids."""
        strings: list[str] = []
        ids: list[int] = [int(t) for t in (self.stop_token_ids or [])]
        stop = self.stop
        if stop is None:
            return strings, ids
        for item in [stop] if isinstance(stop, (str, int)) else list(stop):
            if isinstance(item, str):
                if item:
                    strings.append(item)
            elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
                ids.append(int(item))
            else:
                raise TypeError(f"SamplingParams.stop entries must be strings or token ids, got {item!r}")
        return strings, ids


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float] | None = None
    stop_reason: StopReason = "length"
    sequence_id: str | None = None

    @property
    def tokens_np(self) -> np.ndarray:
        return np.asarray(self.tokens, dtype=np.int32)

    @property
    def logprobs_np(self) -> np.ndarray | None:
        return None if self.logprobs is None else np.asarray(self.logprobs, dtype=np.float32)


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    type: Literal["sample"] = "sample"

    @property
    def prompt_logprobs_np(self) -> np.ndarray | None:
        """The prompt logprobs as float32, NaN where there is none (the first token)."""
        if self.prompt_logprobs is None:
            return None
        return np.asarray([np.nan if x is None else x for x in self.prompt_logprobs], dtype=np.float32)


# --------------------------------------------------------------------------- training


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    betas: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.betas is not None:
            self.beta1, self.beta2 = (float(b) for b in self.betas)
        self.betas = (self.beta1, self.beta2)
        # Bounds wide enough for any real run, narrow enough that one step cannot make the weights
        # non-finite (which would make every later forward of the model fail).
        bounds = {"learning_rate": (lambda v: 0 <= v <= MAX_LEARNING_RATE, f"[0, {MAX_LEARNING_RATE:g}]"),
                  "beta1": (lambda v: 0 <= v < 1, "[0, 1)"), "beta2": (lambda v: 0 <= v < 1, "[0, 1)"),
                  "eps": (lambda v: 0 < v <= 1, "(0, 1]"), "weight_decay": (lambda v: 0 <= v <= 1, "[0, 1]"),
                  "grad_clip_norm": (lambda v: v >= 0, "[0, inf) (0: no clipping)")}
        for name, (inside, valid) in bounds.items():
            value = getattr(self, name)
            if _not_number(value) or not math.isfinite(value) or not inside(value):
                raise ParamError(name, f"AdamParams.{name} must be a finite number in {valid}, got {value!r}")
        if self.learning_rate * self.weight_decay > 1:
            raise ParamError("weight_decay", f"AdamParams.weight_decay={self.weight_decay} with learning_rate="
                             f"{self.learning_rate} would scale the weights by {1 - self.learning_rate * self.weight_decay:g} "
                             "per step (learning_rate * weight_decay must be at most 1)")


@dataclass
class ForwardBackwardOutput:
    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


ForwardOutput = ForwardBackwardOutput


@dataclass
class ForwardBackwardInput:
    """A forward_backward call's arguments as one value (the HTTP API's body, grpo.serve reads it)."""

    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


@dataclass
class OptimStepResponse:
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class SaveWeightsResponse:
    path: str
    type: Literal["save_weights"] = "save_weights"


@dataclass
class SaveWeightsForSamplerResponse:
    path: str
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


@dataclass
class LoadWeightsResponse:
    path: str | None = None
    model_id: str | None = None
    type: Literal["load_weights"] = "load_weights"


@dataclass
class AdamOptimizerConfig:
    """Which optimizer a run uses; locally always AdamW."""

    type: Literal["adamw"] = "adamw"


@dataclass
class ModelData:
    arch: str
    model_name: str
    tokenizer_id: str | None = None


@dataclass
class GetInfoResponse:
    model_id: str
    model_data: ModelData
    is_lora: bool = True
    lora_rank: int | None = None
    model_name: str | None = None
    type: Literal["get_info"] = "get_info"
    optimizer_config: AdamOptimizerConfig = field(default_factory=AdamOptimizerConfig)


# --------------------------------------------------------------------------- futures


class APIFuture(Generic[T]):
    """The handle every client call returns: ``.result()`` blocks, ``await fut`` does not."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    @classmethod
    def completed(cls, value: T) -> APIFuture[T]:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(value)
        return cls(fut)

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        wrapped = asyncio.wrap_future(self._future)
        return await (asyncio.wait_for(wrapped, timeout) if timeout else wrapped)

    def done(self) -> bool:
        return self._future.done()

    def __await__(self):
        return self.result_async().__await__()


class _AsyncTwin:
    """Descriptor holding an ``_async`` twin; when its class is created it takes the signature of
    the method it twins, so ``inspect.signature`` shows the SDK's parameter names on both."""

    def __init__(self, fn: Any, name: str):
        self.fn = fn
        self.name = name

    def __set_name__(self, owner: type, attr: str) -> None:
        import inspect

        self.fn.__signature__ = inspect.signature(getattr(owner, self.name))

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        import types as _types

        return self.fn if obj is None else _types.MethodType(self.fn, obj)


def async_twin(name: str, *, awaited: bool = False) -> Any:
    """The ``<name>_async`` method of a client call ``name``, as the SDKs spell them.

    Training calls' twins return the call's future (await it for the result), as Tinker's do;
    with ``awaited=True`` the twin awaits the future and returns its result (``sample_async``).
    """

    async def twin(self, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self, name)(*args, **kwargs)
        return await result if awaited else result

    twin.__name__ = twin.__qualname__ = f"{name}_async"
    twin.__doc__ = f"Async twin of ``{name}``" + (": awaits and returns its result." if awaited else ".")
    return _AsyncTwin(twin, name)


# --------------------------------------------------------------------------- server, runs and checkpoints
# What ServiceClient.get_server_capabilities and the RestClient return, field for field as the
# Tinker SDK (0.38) names them. grpo.api.checkpoint_store builds the checkpoint records.

CheckpointType = Literal["training", "sampler", "external"]
TensorDtype = Literal["int64", "float32"]
ModelID = str  # a training run's id: the model id a client gets is the one in its tinker:// paths
OptimParams = AdamParams  # the only optimizer run locally
OptimizerConfig = AdamOptimizerConfig  # likewise
LossFnInputs = dict[str, TensorData]  # a Datum's loss_fn_inputs
LossFnOutput = dict[str, TensorData]  # one datum's entry of ForwardBackwardOutput.loss_fn_outputs


@dataclass
class LoraConfig:
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True

# tinker://<training_run_id>/<segment>/<name>: the path segment of each checkpoint type.
CHECKPOINT_SEGMENTS: dict[str, str] = {"training": "weights", "sampler": "sampler_weights",
                                       "external": "external_weights"}


@dataclass
class SupportedModel:
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


@dataclass
class GetServerCapabilitiesResponse:
    supported_models: list[SupportedModel]


@dataclass
class Checkpoint:
    checkpoint_id: str  # "<segment>/<name>", e.g. "weights/step_000010"
    checkpoint_type: CheckpointType
    time: datetime.datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime.datetime | None = None


@dataclass
class ParsedCheckpointTinkerPath:
    tinker_path: str
    training_run_id: str
    checkpoint_type: CheckpointType
    checkpoint_id: str

    @classmethod
    def from_tinker_path(cls, tinker_path: str) -> ParsedCheckpointTinkerPath:
        """Split ``tinker://<run>/<weights|sampler_weights|external_weights>/<name>``."""
        parts = tinker_path[len("tinker://"):].split("/") if isinstance(tinker_path, str) else []
        types_by_segment = {seg: kind for kind, seg in CHECKPOINT_SEGMENTS.items()}
        if (not str(tinker_path).startswith("tinker://") or len(parts) != 3 or not all(parts)
                or parts[1] not in types_by_segment):
            raise ValueError(f"invalid tinker path {tinker_path!r}: expected tinker://<training_run_id>/"
                             f"<{'|'.join(CHECKPOINT_SEGMENTS.values())}>/<name>")
        return cls(tinker_path=tinker_path, training_run_id=parts[0],
                   checkpoint_type=types_by_segment[parts[1]], checkpoint_id="/".join(parts[1:]))


@dataclass
class Cursor:
    offset: int
    limit: int
    total_count: int


@dataclass
class CheckpointsListResponse:
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


@dataclass
class TrainingRun:
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    last_request_time: datetime.datetime
    corrupted: bool = False
    lora_rank: int | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


@dataclass
class TrainingRunsResponse:
    training_runs: list[TrainingRun]
    cursor: Cursor


@dataclass
class WeightsInfoResponse:
    base_model: str
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
    optimizer_config: AdamOptimizerConfig = field(default_factory=AdamOptimizerConfig)


@dataclass
class CheckpointArchiveUrlResponse:
    """Earlier SDKs' download: one URL to a tar archive of the checkpoint's files."""

    url: str
    expires: datetime.datetime


@dataclass
class ExternalWeightsUrlsResponse:
    """SDK 0.38's download: one URL per file, keyed by the path inside the checkpoint."""

    urls: dict[str, str]
    expires: datetime.datetime
