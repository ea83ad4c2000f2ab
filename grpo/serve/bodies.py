"""JSON request bodies of the Tinker HTTP API, as pydantic models.

FastAPI validates each body against these before a handler runs, so a malformed request gets
a 422 whose ``detail`` names the field (``loc``) and what was wrong. Fields the SDK sends that
the local backend does not use are accepted and ignored (``extra="allow"``), so newer SDKs
adding fields keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path as InPath
from fastapi import Query as InQuery
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from grpo.api import names
from grpo.types import CHECKPOINT_SEGMENTS, non_text_chunk

# Every string a client sends is one of these kinds, written into the schema as ``x-grpo-field`` so
# that tests/test_serve_names.py can walk every route and fail on a string field nobody classified.
# The kinds that reach the file system pass the one name rule (grpo.api.names) at the door.
FIELD_KIND = "x-grpo-field"


def _kind(kind: str, *checks: Any) -> Any:
    return Annotated[str, *checks, Field(json_schema_extra={FIELD_KIND: kind})]


# A checkpoint name of the store (save_weights' ``path``): one path component, never a directory.
Name = _kind("name", AfterValidator(lambda v, info: names.check_name(v, info.field_name)))
# A tinker:// path of a saved checkpoint, each part checked.
TinkerPath = _kind("tinker_path", AfterValidator(lambda v, info: names.parse_path(v, info.field_name) and v))
# A base model: a packaged name, a hub id or a model directory of the server's host (read only).
ModelName = _kind("model")
# An id this server issued (session, model, sampler, future): looked up in its tables, never a file.
Ref = _kind("ref")
# Free text that names nothing (tags, versions, metadata, a loss's name checked against the registry).
Text = _kind("text")


def _in_path(kind: str, *checks: Any) -> Any:
    return Annotated[str, InPath(json_schema_extra={FIELD_KIND: kind}), *checks]


# The same kinds as parts of a route's URL (the RestClient's routes).
RunIdInPath = _in_path("run_id", AfterValidator(lambda v: names.check_run_id(v, "run_id")))
CheckpointIdInPath = _in_path("checkpoint_id", AfterValidator(lambda v: names.check_checkpoint_id(v)))
NameInPath = _in_path("name", AfterValidator(lambda v: names.check_name(v, "name")))
RefInPath = _in_path("ref")  # also a file of a checkpoint by its name there, looked up, never joined
TextInQuery = Annotated[str, InQuery(json_schema_extra={FIELD_KIND: "text"})]
Segment = Literal[tuple(CHECKPOINT_SEGMENTS.values())]


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class CreateSession(Body):
    tags: list[Text] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: Text | None = None


class SessionRef(Body):
    session_id: Ref


class LoraConfig(Body):
    rank: int = Field(16, ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: Literal["adamw", "adam"] = "adamw"


class CreateModel(Body):
    session_id: Ref
    model_seq_id: int = 0
    base_model: Annotated[ModelName, Field(min_length=1)]
    lora_config: LoraConfig = LoraConfig()
    optimizer_config: OptimizerConfig | None = None
    user_metadata: dict[str, Any] | None = None


class ModelRef(Body):
    model_id: Ref


class EncodedTextChunk(Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int]


class ModelInput(Body):
    chunks: list[EncodedTextChunk]

    @field_validator("chunks", mode="before")
    @classmethod
    def _text_only(cls, chunks: Any) -> Any:
        """An image (or other non-text) chunk is valid SDK input that this server's text-only
        models cannot read: say so, naming the chunk, rather than "type: should be encoded_text"."""
        for i, chunk in enumerate(chunks if isinstance(chunks, list) else []):
            kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
            if kind not in (None, "encoded_text"):
                raise ValueError(non_text_chunk(i, kind))
        return chunks


class TensorData(Body):
    data: list[float] | list[int]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None


class Datum(Body):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = {}


class ForwardBackwardInput(Body):
    data: list[Datum]
    loss_fn: Text = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None


class ForwardBackward(Body):
    model_id: Ref
    seq_id: int | None = None
    forward_backward_input: ForwardBackwardInput


class Forward(Body):
    model_id: Ref
    seq_id: int | None = None
    forward_input: ForwardBackwardInput


class AdamParams(Body):
    # Bounds live in grpo.types.AdamParams; the route answers adam_params.<field> for its ParamError.
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(Body):
    model_id: Ref
    seq_id: int | None = None
    adam_params: AdamParams


class SaveWeights(Body):
    model_id: Ref
    path: Name | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, Text] | None = None
    overwrite: bool = True


class SaveWeightsExternal(SaveWeights):
    age_encryption_recipients: list[Text] | None = None


class LoadWeights(Body):
    path: TinkerPath
    model_id: Ref | None = None  # load into an existing model
    session_id: Ref | None = None  # or create a new one from the checkpoint
    model_seq_id: int | None = None
    seq_id: int | None = None
    optimizer: bool = False


class CreateSamplingSession(Body):
    session_id: Ref
    sampling_session_seq_id: int = 0
    model_path: TinkerPath | None = None
    base_model: ModelName | None = None


class SamplingParams(Body):
    # Bounds live in grpo.types.SamplingParams (one declaration, in-process too); the route turns
    # its ParamError into a 422 naming sampling_params.<field>.
    max_tokens: int | None = None
    seed: int | None = None
    stop: Text | list[Text] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Sample(Body):
    sampling_session_id: Ref | None = None
    base_model: ModelName | None = None
    model_path: TinkerPath | None = None
    seq_id: int | None = None
    num_samples: int = Field(1, ge=1, le=1024)
    prompt: ModelInput
    sampling_params: SamplingParams = SamplingParams()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


class RetrieveFuture(Body):
    request_id: Ref


class WeightsInfo(Body):
    tinker_path: TinkerPath


class SetTtl(Body):
    ttl_seconds: int | None = None
