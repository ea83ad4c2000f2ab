"""How much one request may ask of the server, checked before any work is done.

A client with a valid key is still one of several sharing this machine: without these bounds one
request could hold the sampler for minutes (a huge prompt), try a 100 GB allocation (``max_tokens``
of 10^9, a tensor whose declared shape is vast) or fill memory with a body. Each refusal is a 4xx
whose message names the field, the value and the limit, and how to raise it (a server flag).

The defaults admit everything the Tinker SDK's own loops send; ``python -m grpo.serve --help``
lists them (``add_arguments`` below is the one declaration of flag, default and meaning).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields


class LimitError(ValueError):
    """A request beyond a limit; ``field`` names the request field, ``status`` the HTTP code."""

    def __init__(self, field: str, message: str, status: int = 422):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


@dataclass(frozen=True)
class Limits:
    max_body_mb: float = 256.0  # request body; checked against Content-Length and while reading
    max_prompt_tokens: int = 32768  # per sample prompt and per datum (and never beyond the model's context)
    max_new_tokens: int = 16384  # sampling_params.max_tokens (and prompt + it within the model's context)
    max_num_samples: int = 128  # completions per sample request
    max_tensor_elements: int = 1 << 24  # declared elements of one loss_fn_inputs tensor, dense or sparse
    max_datums: int = 4096  # datums per forward / forward_backward request
    max_request_elements: int = 1 << 22  # declared loss_fn_inputs elements summed over a whole request
    max_request_tokens: int = 1 << 20  # model_input tokens summed over a whole request
    max_json_depth: int = 32  # nesting of arrays and objects in a JSON body
    client_timeout_s: float = 120.0  # a session silent this long has its queued sampling dropped
    session_timeout_s: float = 600.0  # a session silent this long is finished: its models leave memory

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    def check_sample(self, prompt_len: int, max_tokens: int | None, num_samples: int, context: int | None) -> None:
        _at_most("prompt", "tokens", prompt_len, self.max_prompt_tokens, "--max-prompt-tokens")
        _at_most("num_samples", "", num_samples, self.max_num_samples, "--max-num-samples")
        if max_tokens is not None:
            _at_most("sampling_params.max_tokens", "", max_tokens, self.max_new_tokens, "--max-new-tokens")
        if context is not None:
            total = prompt_len + (max_tokens or 1)
            if total > context:
                raise LimitError("sampling_params.max_tokens", f"the prompt's {prompt_len} tokens + max_tokens="
                                 f"{max_tokens} exceed the model's context of {context} tokens")

    def check_datums(self, lengths: Iterable[int], context: int | None) -> None:
        lengths = list(lengths)
        _at_most("data", "datums", len(lengths), self.max_datums, "--max-datums")
        cap = min(self.max_prompt_tokens, context or self.max_prompt_tokens)
        for i, n in enumerate(lengths):
            if n > cap:
                raise LimitError(f"data[{i}].model_input", f"{n} tokens is more than the limit of {cap} "
                                 "(the model's context, or --max-prompt-tokens)")

    def check_shape(self, shape: Iterable[int], field: str) -> list[int]:
        """A declared tensor shape as ints, refused before anything of that size is allocated.
        Each dimension is bounded too: [0, 2**70] declares no elements but no array has it."""
        shape = list(shape)
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in shape):
            raise LimitError(f"{field}.shape", f"{shape} is invalid: dimensions must be non-negative integers")
        if len(shape) > MAX_DIMS:
            raise LimitError(f"{field}.shape", f"{len(shape)} dimensions is more than {MAX_DIMS}")
        for s in shape:
            _at_most(f"{field}.shape", "elements in one dimension", s, self.max_tensor_elements, "--max-tensor-elements")
        _at_most(f"{field}.shape", "elements", math.prod(shape), self.max_tensor_elements, "--max-tensor-elements")
        return shape

    def json_items(self, carries_data: bool) -> tuple[int, str]:
        """How many array items and object members a JSON body may hold, and what sets that:
        checked while the body arrives (grpo.serve.guard), so that no parser builds more. A body
        of datums holds their tokens and tensor elements; any other, at most one prompt."""
        if carries_data:
            return (self.max_request_elements + self.max_request_tokens + JSON_SLACK_PER_DATUM * self.max_datums,
                    "--max-request-elements + --max-request-tokens")
        return self.max_prompt_tokens + JSON_SLACK, "--max-prompt-tokens"

    def proto_fields(self) -> tuple[int, str]:
        """How many protobuf fields (at any depth) a forward / forward_backward body may hold, and
        what sets that: counted on the wire before protobuf builds a message (grpo.serve.wire). A
        datum's tokens and tensor values travel as packed bytes, a few fields each; a body of
        empty datums or chunks would otherwise become millions of objects in a few megabytes."""
        return PROTO_FIELDS_PER_DATUM * self.max_datums + self.max_request_tokens, "--max-datums + --max-request-tokens"

    def budget(self) -> RequestBudget:
        """A tally of one request's declared sizes, each added before anything of it is built."""
        return RequestBudget(self)


JSON_SLACK = 1 << 20  # keys, stop strings, metadata beside a prompt: a parse of at most ~30 MB
JSON_SLACK_PER_DATUM = 64  # a datum's keys and shapes beside its tokens and tensor elements
PROTO_FIELDS_PER_DATUM = 64  # a datum's chunks, inputs, dtypes and shapes (its tokens: a chunk each at most)
MAX_DIMS = 8  # a loss input is one entry per position, at most with a few trailing dimensions


class RequestBudget:
    """Tensor elements and tokens declared so far by one request, against the whole-request
    limits: a request is refused at the first field that takes it over, before that field (or any
    later one) is made into an array."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.elements = 0
        self.tokens = 0

    def add_elements(self, n: int, field: str) -> None:
        self.elements += n
        _over_request(field, "tensor elements", self.elements, self.limits.max_request_elements,
                      "--max-request-elements")

    def add_tokens(self, n: int, field: str) -> None:
        self.tokens += n
        _over_request(field, "tokens", self.tokens, self.limits.max_request_tokens, "--max-request-tokens")


def _over_request(field: str, unit: str, total: int, limit: int, flag: str) -> None:
    if total > limit:
        raise LimitError(field, f"brings the request to {total} {unit}, more than this server's limit of {limit} "
                         f"for a whole request (set by {flag}); send fewer or shorter datums per request")


def _at_most(field: str, unit: str, value: int, limit: int, flag: str) -> None:
    if value > limit:
        what = f"{value} {unit}".strip()
        raise LimitError(field, f"{what} is more than this server's limit of {limit} (set by {flag})")


_HELP = {
    "max_body_mb": "largest request body in MiB; larger is refused with 413 before it is read",
    "max_prompt_tokens": "longest sample prompt or datum in tokens (also never beyond the model's context)",
    "max_new_tokens": "largest sampling_params.max_tokens (prompt + max_tokens must also fit the model's context)",
    "max_num_samples": "most completions one sample request may ask for",
    "max_tensor_elements": "most elements a loss_fn_inputs tensor may declare (dense or sparse)",
    "max_datums": "most datums in one forward / forward_backward request",
    "max_request_elements": "most loss_fn_inputs elements (declared, dense or sparse) summed over all datums of "
                            "one request; a JSON body may hold at most this many plus --max-request-tokens numbers",
    "max_request_tokens": "most model_input tokens summed over all datums of one request",
    "max_json_depth": "deepest nesting of arrays and objects a JSON body may have",
    "client_timeout_s": "seconds a session may go without a request (a poll, a heartbeat) before its "
                        "queued sampling work is dropped; finishing a session drops it at once",
    "session_timeout_s": "seconds a session may go without a request (the SDK heartbeats every 10 s while its "
                         "process runs) before it is finished: its training and sampling models leave memory, "
                         "saved checkpoints stay; finishing a session (the SDK's close) does it at once",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits (each refusal is a 4xx naming the field and the limit)")
    for f in fields(Limits):
        group.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                           help=f"{_HELP[f.name]} (default {f.default})")


def from_args(args: argparse.Namespace) -> Limits:
    values = {f.name: getattr(args, f.name) for f in fields(Limits)}
    for name, value in values.items():
        if value <= 0:
            raise SystemExit(f"grpo serve: --{name.replace('_', '-')}={value} is invalid: must be positive")
    return Limits(**values)
