"""JSON request bodies of the Tinker HTTP API, as pydantic models.

FastAPI validates each body against these before a handler runs, so a malformed request gets
a 422 whose ``detail`` names the field (``loc``) and what was wrong. Fields the SDK sends that
the local backend does not use are accepted and ignored (``extra="allow"``), so newer SDKs
adding fields keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from grpo.types import non_text_chunk


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class CreateSession(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None


class SessionRef(Body):
    session_id: str


class LoraConfig(Body):
    rank: int = Field(16, ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: Literal["adamw", "adam"] = "adamw"


class CreateModel(Body):
    session_id: str
    model_seq_id: int = 0
    base_model: str = Field(min_length=1)
    lora_config: LoraConfig = LoraConfig()
    optimizer_config: OptimizerConfig | None = None
    user_metadata: dict[str, Any] | None = None


class ModelRef(Body):
    model_id: str


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
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None


class ForwardBackward(Body):
    model_id: str
    seq_id: int | None = None
    forward_backward_input: ForwardBackwardInput


class Forward(Body):
    model_id: str
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
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams


class SaveWeights(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    overwrite: bool = True


class SaveWeightsExternal(SaveWeights):
    age_encryption_recipients: list[str] | None = None


class LoadWeights(Body):
    path: str
    model_id: str | None = None  # load into an existing model
    session_id: str | None = None  # or create a new one from the checkpoint
    model_seq_id: int | None = None
    seq_id: int | None = None
    optimizer: bool = False


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int = 0
    model_path: str | None = None
    base_model: str | None = None


class SamplingParams(Body):
    # Bounds live in grpo.types.SamplingParams (one declaration, in-process too); the route turns
    # its ParamError into a 422 naming sampling_params.<field>.
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Sample(Body):
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: int | None = None
    num_samples: int = Field(1, ge=1, le=1024)
    prompt: ModelInput
    sampling_params: SamplingParams = SamplingParams()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


class RetrieveFuture(Body):
    request_id: str


class WeightsInfo(Body):
    tinker_path: str


class SetTtl(Body):
    ttl_seconds: int | None = None
