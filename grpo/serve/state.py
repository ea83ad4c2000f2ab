"""What the server's routes share: the state of one server process (sessions, models, samplers,
futures, the checkpoint store) and the small helpers every section of routes uses to answer.

The routes themselves are in grpo/serve/routes/, one module per section; grpo/serve/app.py
assembles them. Nothing here trains: it translates.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from grpo import models
from grpo import types as g
from grpo.backends.local.clients import SamplingClient, ServiceClient, TrainingClient
from grpo.serve import bodies, wire
from grpo.serve.futures import FutureStore
from grpo.serve.ordering import SeqGate

API_PREFIX = "/api/v1"
PROTOBUF = "application/x-protobuf"


def fail(status: int, field_path: str, message: str) -> HTTPException:
    """A 4xx in FastAPI's own validation shape, so every client error names its field."""
    return HTTPException(status, detail=[{"loc": ["body", *field_path.split(".")], "msg": message}])


@dataclass
class Model:
    model_id: str
    base_model: str
    client: TrainingClient
    gate: SeqGate = field(default_factory=SeqGate)
    sampler_ids: itertools.count = field(default_factory=itertools.count)


@dataclass
class Sampler:
    sampler_id: str
    base_model: str
    client: SamplingClient
    model_path: str | None = None


class ServerState:
    """Sessions, models, samplers and futures of one server process."""

    def __init__(self, service: ServiceClient, long_poll_s: float):
        self.service = service
        self.store = service.store  # the in-process clients save into it; listings read it
        self.rest = service.create_rest_client()  # the same store, under the RestClient's calls
        self.futures = FutureStore(long_poll_s)
        self.sessions: dict[str, dict[str, Any]] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self.base_samplers: dict[str, SamplingClient] = {}
        # Loading a base model takes seconds to minutes: done off the event loop.
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="grpo-serve")

    def seen(self, session_id: str | None) -> None:
        """The session's client is alive (it polls or sends heartbeats)."""
        if session_id in self.sessions:
            self.sessions[session_id]["heartbeat"] = time.time()

    def session(self, session_id: str) -> dict[str, Any]:
        if session_id not in self.sessions:
            raise fail(404, "session_id", f"unknown session_id {session_id!r}; create_session first "
                       "(sessions do not survive a server restart)")
        return self.sessions[session_id]

    def model(self, model_id: str) -> Model:
        if model_id not in self.models:
            raise fail(404, "model_id", f"unknown model_id {model_id!r}; create_model first (models do not "
                       "survive a server restart: resume with create_training_client_from_state)")
        return self.models[model_id]

    def sampler(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise fail(404, "sampling_session_id", f"unknown sampling_session_id {sampler_id!r}")
        return self.samplers[sampler_id]

    def local_path(self, path: str, field_name: str = "path") -> Path:
        """The directory of a saved checkpoint; 4xx naming the field when there is none."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise fail(422, field_name, f"{path!r} is not a tinker:// path; pass one returned by save_state "
                       "or save_weights_for_sampler")
        try:
            return self.store.resolve(path)
        except ValueError as err:
            raise fail(422, field_name, self.public(err)) from err
        except FileNotFoundError as err:
            raise fail(404, field_name, self.public(err)) from err

    def public(self, err: BaseException | str) -> str:
        """An error as one line for a client: where the store and the home directory lie on this
        host is none of its business (and helps an attacker aim)."""
        text = one_line(err) if isinstance(err, BaseException) else err
        for place, shown in ((str(self.store.root.resolve()), "<checkpoint store>"),
                             (str(self.store.root), "<checkpoint store>"), (str(Path.home()), "~")):
            if len(place) > 1:
                text = text.replace(place, shown)
        return text

    def register_model(self, model_id: str, base_model: str, client: TrainingClient) -> None:
        self.models[model_id] = Model(model_id, base_model, client)

    def submit(self, fn, render=None) -> str:
        return self.futures.add(self.executor.submit(fn), render)


def tokenizer_id(base_model: str) -> str:
    """Where the SDK's ``get_tokenizer()`` can load this model's tokenizer without the hub: the
    local directory the engine loaded it from (the SDK cuts the id at ':', so none may occur)."""
    spec = models.resolve(base_model)
    return str(Path(spec.path).resolve()) if spec.kind != "hub" else base_model


def api_future(value: g.APIFuture) -> concurrent.futures.Future:
    return value._future  # grpo's APIFuture wraps a concurrent future; the store waits on it directly


def record(value: Any) -> dict[str, Any]:
    """A checkpoint-store record (dataclass) as JSON-ready data, datetimes as ISO strings."""
    return json.loads(json.dumps(asdict(value), default=str))


def chain(source: concurrent.futures.Future, transform) -> concurrent.futures.Future:
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        try:
            out.set_result(transform(f.result()))
        except BaseException as err:  # delivered to the poller as an error result
            out.set_exception(err)

    source.add_done_callback(done)
    return out


def render_fwdbwd(value: g.ForwardBackwardOutput, want_proto: bool) -> dict[str, Any] | bytes:
    return wire.forward_backward_to_proto(value) if want_proto else wire.forward_backward_to_json(value)


def render_sample(value: g.SampleResponse, want_proto: bool) -> dict[str, Any] | bytes:
    return wire.sample_to_proto(value) if want_proto else wire.sample_to_json(value)


def context_of(engine: Any) -> int | None:
    """The model's context length in tokens, where its config states one."""
    value = getattr(engine.model.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def one_line(err: BaseException) -> str:
    """An exception as one line of at most 300 characters, for an error body."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def parse_json(raw: bytes, model: type[bodies.Body]) -> bodies.Body:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as err:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from err

