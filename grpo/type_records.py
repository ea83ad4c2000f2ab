"""The Tinker SDK's data types that grpo's clients carry but do not compute with.

``grpo.types`` re-exports everything here, so ``tinker.types.ImageChunk`` & co. exist for a
program run with ``import grpo as tinker`` (the cookbook annotates its renderers with them, so a
missing name fails at import). The fields are the SDK's (tests/tinker_manifest.json holds them).

Non-text chunks are real values a program can build and put in a ModelInput; the local backend
runs text-only models, so the call that meets one (forward_backward, sample) refuses it in one
line naming the datum and the chunk (see ``grpo.types.text_tokens``), never here at import.
This module imports nothing from grpo, so grpo.types can import it without a circle.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

ImageFormat = Literal["png", "jpeg"]


def _chunk_length(kind: str, expected_tokens: int | None) -> int:
    # The service's image encoder decides how many positions an image takes; a program states it
    # in expected_tokens. Without it no length exists to lay out the sequence, so say so.
    if expected_tokens is None:
        raise ValueError(f"{kind} chunk has no expected_tokens, so its length is unknown: set expected_tokens")
    return int(expected_tokens)


@dataclass
class ImageChunk:
    data: bytes
    format: ImageFormat
    expected_tokens: int | None = None
    type: Literal["image"] = "image"

    @property
    def length(self) -> int:
        return _chunk_length("image", self.expected_tokens)


@dataclass
class ImageAssetPointerChunk:
    format: ImageFormat
    location: str
    expected_tokens: int | None = None
    type: Literal["image_asset_pointer"] = "image_asset_pointer"

    @property
    def length(self) -> int:
        return _chunk_length("image_asset_pointer", self.expected_tokens)


@dataclass
class DmelChunk:
    dmel: bytes
    type: Literal["dmel"] = "dmel"

    @property
    def length(self) -> int:
        raise ValueError("a dmel (audio) chunk's length is set by the service's audio encoder; grpo runs "
                         "text-only models, so use encoded_text chunks")


# --------------------------------------------------------------------------- results a program reads


@dataclass
class SaveWeightsExternalResponse:
    path: str
    type: Literal["save_weights_external"] | None = "save_weights_external"


@dataclass
class CopyWeightsResponse:
    tinker_path: str


@dataclass
class AuditLogEntry:
    """One account action on the service (RestClient.get_audit_log, which grpo does not offer:
    the type exists because the cookbook's scripts import it)."""

    timestamp: datetime.datetime
    event: str
    event_details: dict[str, Any] = field(default_factory=dict)
    model_id: str | None = None
    tinker_path: str | None = None
    purpose: str | None = None


@dataclass
class AuditLogResponse:
    entries: list[AuditLogEntry]


class RequestErrorCategory(StrEnum):
    """Who a failed request's error is down to; grpo.serve puts it in a failed future's body."""

    unknown = "unknown"
    server = "server"
    user = "user"


# --------------------------------------------------------------------------- names for literal sets

RequestID = str
SamplingClientKind = Literal["snapshot", "inflight"]
