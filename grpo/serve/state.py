"""What the server's routes share: the state of one server process (sessions, models, samplers,
futures, the checkpoint store) and the small helpers every section of routes uses to answer.

The routes themselves are in grpo/serve/routes/, one module per section; grpo/serve/app.py
assembles them. Nothing here trains: it translates.
"""

from __future__ import annotations

import collections
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
        # sessions finished (closed, or silent past --session-timeout-s), newest last: their
        # clients are told so rather than that they never existed
        self.finished: collections.OrderedDict[str, str] = collections.OrderedDict()
        # Loading a base model takes seconds to minutes: done off the event loop.
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="grpo-serve")

    def seen(self, session_id: str | None) -> None:
        """The session's client is alive (it polls, sends heartbeats or uses its models)."""
        if session_id in self.sessions:
            self.sessions[session_id]["heartbeat"] = time.time()

    def session(self, session_id: str) -> dict[str, Any]:
        if session_id not in self.sessions:
            if session_id in self.finished:
                raise fail(410, "session_id", f"session {session_id!r} has finished ({self.finished[session_id]}); "
                           "create a new session")
            raise fail(404, "session_id", f"unknown session_id {session_id!r}; create_session first "
                       "(sessions do not survive a server restart)")
        self.seen(session_id)
        return self.sessions[session_id]

    def model(self, model_id: str) -> Model:
        if model_id not in self.models:
            raise fail(404, "model_id", f"unknown model_id {model_id!r}; {self._gone(model_id) or 'create_model first'} "
                       "(models do not survive a server restart either: resume with create_training_client_from_state)")
        self.seen(_session_of(model_id))
        return self.models[model_id]

    def sampler(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise fail(404, "sampling_session_id", f"unknown sampling_session_id {sampler_id!r}"
                       + (f"; {self._gone(sampler_id)}" if self._gone(sampler_id) else ""))
        self.seen(_session_of(sampler_id))
        return self.samplers[sampler_id]

    def _gone(self, client_id: str) -> str | None:
        session_id = _session_of(client_id)
        if session_id in self.finished:
            return f"its session {session_id!r} has finished ({self.finished[session_id]}) and its models were unloaded"
        return None

    # ------------------------------------------------------------------ finishing sessions

    def finish(self, session_id: str, reason: str) -> None:
        """End a session: its queued work is dropped, its models and samplers are forgotten at once
        and unloaded from memory in the background, after any work of theirs already running (a
        loaded adapter costs every later one: peft's per-adapter operations walk them all)."""
        if self.sessions.pop(session_id, None) is None:
            return
        self.finished[session_id] = reason
        while len(self.finished) > MAX_FINISHED_REMEMBERED:
            self.finished.popitem(last=False)
        self.futures.drop_session(session_id)
        mine = [k for k in self.models if _session_of(k) == session_id]
        clients: list[TrainingClient | SamplingClient] = [self.models.pop(k).client for k in mine]
        mine = [k for k in self.samplers if _session_of(k) == session_id]
        clients += [self.samplers.pop(k).client for k in mine]
        for client in clients:
            self.executor.submit(self._unload, client)

    def finish_silent(self, timeout_s: float) -> None:
        """Finish every session no request has named for ``timeout_s`` (its process is gone: the
        SDK heartbeats every 10 s while it runs). Checked when a client arrives or polls."""
        cutoff = time.time() - timeout_s
        for session_id, info in list(self.sessions.items()):
            if info["heartbeat"] < cutoff:
                self.finish(session_id, f"silent for more than {timeout_s:g} s")

    def _unload(self, client: TrainingClient | SamplingClient) -> None:
        try:
            self.service.unload(client)
        except Exception as err:  # a closed service, a model already gone: nothing left to free
            print(f"grpo serve: unloading a finished session's model failed: {one_line(err)}", flush=True)

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
        self._unless_finished(model_id, self.models)

    def register_sampler(self, sampler: Sampler) -> None:
        self.samplers[sampler.sampler_id] = sampler
        self._unless_finished(sampler.sampler_id, self.samplers)

    def _unless_finished(self, client_id: str, registry: dict) -> None:
        """A model that finished loading after its session did goes the same way as the others."""
        if _session_of(client_id) not in self.sessions:
            self.executor.submit(self._unload, registry.pop(client_id).client)

    def submit(self, fn, render=None) -> str:
        return self.futures.add(self.executor.submit(fn), render)


# Finished session ids remembered for a clear 410 (ids are random; old ones are forgotten)
MAX_FINISHED_REMEMBERED = 10_000


def _session_of(client_id: str) -> str:
    """The session a model or sampler id belongs to: ids are ``{session}:train:{n}``,
    ``{session}:sample:{n}`` and ``{session}:train:{n}:sample:{m}``."""
    return client_id.split(":", 1)[0]


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

