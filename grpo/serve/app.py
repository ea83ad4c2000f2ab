"""The Tinker HTTP API over grpo's in-process local backend.

Every handler validates its request, hands the work to the local ServiceClient / TrainingClient
/ SamplingClient (which queue training per base model and batch sampling), and answers with a
future id; results are fetched through ``/retrieve_future`` (see futures.py). Nothing here
trains: it translates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import itertools
import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import ValidationError

from grpo import models
from grpo import types as g
from grpo.api import losses, names
from grpo.backends.local.clients import SamplingClient, ServiceClient, TrainingClient
from grpo.serve import bodies, file_urls, wire
from grpo.serve.futures import FutureStore, cancelled_result, error_result
from grpo.serve.guard import Guard
from grpo.serve.limits import LimitError, Limits
from grpo.serve.ordering import SeqGate

API_PREFIX = "/api/v1"
PROTOBUF = "application/x-protobuf"
TESTED_SDKS = ("0.22.0", "0.38.0")  # tinker SDK versions tests/test_serve*.py run against this server


def _fail(status: int, field_path: str, message: str) -> HTTPException:
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
            raise _fail(404, "session_id", f"unknown session_id {session_id!r}; create_session first "
                        "(sessions do not survive a server restart)")
        return self.sessions[session_id]

    def model(self, model_id: str) -> Model:
        if model_id not in self.models:
            raise _fail(404, "model_id", f"unknown model_id {model_id!r}; create_model first (models do not "
                        "survive a server restart: resume with create_training_client_from_state)")
        return self.models[model_id]

    def sampler(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise _fail(404, "sampling_session_id", f"unknown sampling_session_id {sampler_id!r}")
        return self.samplers[sampler_id]

    def local_path(self, path: str, field_name: str = "path") -> Path:
        """The directory of a saved checkpoint; 4xx naming the field when there is none."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise _fail(422, field_name, f"{path!r} is not a tinker:// path; pass one returned by save_state "
                        "or save_weights_for_sampler")
        try:
            return self.store.resolve(path)
        except ValueError as err:
            raise _fail(422, field_name, self.public(err)) from err
        except FileNotFoundError as err:
            raise _fail(404, field_name, self.public(err)) from err

    def public(self, err: BaseException | str) -> str:
        """An error as one line for a client: where the store and the home directory lie on this
        host is none of its business (and helps an attacker aim)."""
        text = one_line(err) if isinstance(err, BaseException) else err
        for place, shown in ((str(self.store.root.resolve()), "<checkpoint store>"),
                             (str(self.store.root), "<checkpoint store>"), (str(Path.home()), "~")):
            if len(place) > 1:
                text = text.replace(place, shown)
        return text

    def submit(self, fn, render=None) -> str:
        return self.futures.add(self.executor.submit(fn), render)


def _grpo_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("grpo")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def tokenizer_id(base_model: str) -> str:
    """Where the SDK's ``get_tokenizer()`` can load this model's tokenizer without the hub: the
    local directory the engine loaded it from (the SDK cuts the id at ':', so none may occur)."""
    spec = models.resolve(base_model)
    return str(Path(spec.path).resolve()) if spec.kind != "hub" else base_model


def _api_future(value: g.APIFuture) -> concurrent.futures.Future:
    return value._future  # grpo's APIFuture wraps a concurrent future; the store waits on it directly


def _record(value: Any) -> dict[str, Any]:
    """A checkpoint-store record (dataclass) as JSON-ready data, datetimes as ISO strings."""
    return json.loads(json.dumps(asdict(value), default=str))


def _chain(source: concurrent.futures.Future, transform) -> concurrent.futures.Future:
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        try:
            out.set_result(transform(f.result()))
        except BaseException as err:  # delivered to the poller as an error result
            out.set_exception(err)

    source.add_done_callback(done)
    return out


def _render_fwdbwd(value: g.ForwardBackwardOutput, want_proto: bool) -> dict[str, Any] | bytes:
    return wire.forward_backward_to_proto(value) if want_proto else wire.forward_backward_to_json(value)


def _render_sample(value: g.SampleResponse, want_proto: bool) -> dict[str, Any] | bytes:
    return wire.sample_to_proto(value) if want_proto else wire.sample_to_json(value)


def context_of(engine: Any) -> int | None:
    """The model's context length in tokens, where its config states one."""
    value = getattr(engine.model.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def one_line(err: BaseException) -> str:
    """An exception as one line of at most 300 characters, for an error body."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _parse_json(raw: bytes, model: type[bodies.Body]) -> bodies.Body:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as err:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from err


def create_app(api_key: str, service: ServiceClient | None = None, long_poll_s: float = 30.0,
               fwdbwd_chunk_len: int | None = None, limits: Limits | None = None) -> FastAPI:
    """The app; ``service`` (default: a ServiceClient on $GRPO_CACHE/checkpoints) holds the
    base models and the checkpoint store. ``fwdbwd_chunk_len``: datums per forward_backward
    request the SDK may send (its default 1024); smaller batches arrive as parallel chunks."""
    if not api_key.startswith("tml-"):
        raise ValueError("the API key must start with 'tml-' (the Tinker SDK refuses any other)")
    state = ServerState(service or ServiceClient(), long_poll_s)
    state.service.directory_saves = False  # a client names checkpoints of the store, never a directory here
    limits = limits or Limits()

    # No /docs or /openapi.json: nothing is served without the key but liveness. The key and the
    # body size are checked by Guard from the headers, before any body is read or parsed.
    app = FastAPI(title="grpo Tinker-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    data_paths = frozenset({API_PREFIX + "/forward", API_PREFIX + "/forward_backward"})
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes,
                       open_paths=frozenset({API_PREFIX + "/healthz"}),
                       open_prefixes=(API_PREFIX + file_urls.FILES_ROUTE + "/",),  # signed URLs, see file_urls
                       max_json_depth=limits.max_json_depth,
                       json_items=lambda path: limits.json_items(path in data_paths))
    app.state.grpo = state
    app.state.limits = limits

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 without echoing the input back: a NaN there cannot be encoded (a 500),
        and a refused 20 MB list need not travel back."""
        return JSONResponse({"detail": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
                                        for e in exc.errors()]}, status_code=422)

    @app.get(API_PREFIX + "/healthz")
    async def healthz() -> dict[str, Any]:
        """Open without the key: liveness, and which server this is, for clients' start-up check."""
        return {"status": "ok", "server": "grpo serve", "version": _grpo_version(), "tested_sdks": list(TESTED_SDKS)}

    api = APIRouter(prefix=API_PREFIX)

    # ------------------------------------------------------------------ client config and sessions

    @api.post("/client/config")
    async def client_config() -> dict[str, Any]:
        config: dict[str, Any] = {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False}
        if fwdbwd_chunk_len:
            config["fwdbwd_max_chunk_len"] = fwdbwd_chunk_len
        return config

    @api.post("/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return {}

    @api.get("/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        names = ["tiny", "smollm2", *sorted({m.base_model for m in state.models.values()})]
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True}
                                     for n in dict.fromkeys(names)]}


    @api.post("/create_session")
    async def create_session(body: bodies.CreateSession) -> dict[str, Any]:
        session_id = f"sess-{secrets.token_hex(4)}"
        state.sessions[session_id] = {"created": time.time(), "sdk_version": body.sdk_version,
                                      "user_metadata": body.user_metadata or {}, "heartbeat": time.time()}
        return {"type": "create_session", "session_id": session_id}

    @api.post("/session_heartbeat")
    async def session_heartbeat(body: bodies.SessionRef) -> dict[str, Any]:
        state.session(body.session_id)["heartbeat"] = time.time()
        return {"type": "session_heartbeat"}

    @api.post("/sessions/{session_id}/finish")
    async def finish_session(session_id: bodies.RefInPath) -> dict[str, Any]:
        state.sessions.pop(session_id, None)
        state.futures.drop_session(session_id)
        return {"type": "finish_session"}

    @api.post("/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}  # accepted and dropped: nothing leaves this machine

    # ------------------------------------------------------------------ training models

    def register(model_id: str, base_model: str, client: TrainingClient) -> None:
        state.models[model_id] = Model(model_id, base_model, client)

    @api.post("/create_model")
    async def create_model(body: bodies.CreateModel) -> dict[str, Any]:
        state.session(body.session_id)
        try:
            models.resolve(body.base_model)
        except ValueError as err:
            raise _fail(422, "base_model", str(err)) from err
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        if model_id in state.models:
            raise _fail(409, "model_seq_id", f"model {model_id} exists already")
        lora = body.lora_config
        metadata = {str(k): str(v) for k, v in (body.user_metadata or {}).items()} or None

        def work() -> dict[str, Any]:
            client = state.service.create_lora_training_client(
                body.base_model, rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp,
                train_attn=lora.train_attn, train_unembed=lora.train_unembed, user_metadata=metadata,
                training_run_id=model_id)  # one id: the model's is its run's, as on the service
            register(model_id, body.base_model, client)
            return {"type": "create_model", "model_id": model_id}

        return {"request_id": state.submit(work), "model_id": model_id}

    @api.post("/get_info")
    async def get_info(body: bodies.ModelRef) -> dict[str, Any]:
        model = state.model(body.model_id)
        info = model.client.get_info()
        return {"type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": model.client.spec.rank,
                "model_name": model.base_model,
                "model_data": {"arch": info.model_data.arch, "model_name": model.base_model,
                               "tokenizer_id": tokenizer_id(model.base_model)}}

    async def loss_call(model_id: str, seq_id: int | None, data: list[g.Datum], loss_fn: str,
                        config: dict[str, float] | None, backward: bool) -> dict[str, Any]:
        model = state.model(model_id)
        if loss_fn not in losses.LOSSES:  # the registry: a loss registered with @register_loss is served
            raise _fail(422, "loss_fn", f"loss_fn {loss_fn!r} is not supported locally; use one of "
                        f"{', '.join(losses.LOSSES)} (stable_reinforce is server-defined and unpublished)")
        try:
            limits.check_datums((d.model_input.length for d in data), context_of(model.client.engine))
        except LimitError as err:
            raise _fail(err.status, err.field, str(err)) from err
        async with model.gate.turn(seq_id):
            try:
                call = model.client.forward_backward if backward else model.client.forward
                future = call(data, loss_fn, config)
            except (ValueError, TypeError) as err:
                raise _fail(422, "data", str(err)) from err
        return {"request_id": state.futures.add(_api_future(future), _render_fwdbwd), "model_id": model_id}

    @api.post("/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if request.headers.get("content-encoding"):
            raise HTTPException(415, detail="compressed request bodies are not supported (proto_compress_fwdbwd is off)")
        if request.headers.get("content-type", "").startswith(PROTOBUF):
            try:
                req = wire.forward_backward_from_proto(raw, limits)
            except wire.WireError as err:
                raise _fail(422, err.field, str(err)) from err
            return await loss_call(req["model_id"], req["seq_id"], req["data"], req["loss_fn"] or "cross_entropy",
                                   req["loss_fn_config"], backward=not req["forward_only"])
        body = _parse_json(raw, bodies.ForwardBackward)
        return await loss_json(body.model_id, body.seq_id, body.forward_backward_input, backward=True)

    @api.post("/forward")
    async def forward(body: bodies.Forward) -> dict[str, Any]:
        return await loss_json(body.model_id, body.seq_id, body.forward_input, backward=False)

    async def loss_json(model_id: str, seq_id: int | None, fb: bodies.ForwardBackwardInput,
                        backward: bool) -> dict[str, Any]:
        try:
            data = wire.data_from_json(fb.data, limits)  # sizes checked before anything is copied
        except wire.WireError as err:
            raise _fail(422, f"forward_backward_input.{err.field}", str(err)) from err
        return await loss_call(model_id, seq_id, data, fb.loss_fn, fb.loss_fn_config, backward)

    @api.post("/optim_step")
    async def optim_step(body: bodies.OptimStep) -> dict[str, Any]:
        model = state.model(body.model_id)
        try:
            adam = g.AdamParams(**body.adam_params.model_dump(include=set(bodies.AdamParams.model_fields)))
        except g.ParamError as err:
            raise _fail(422, f"adam_params.{err.field}", str(err)) from err
        except ValueError as err:
            raise _fail(422, "adam_params", str(err)) from err
        async with model.gate.turn(body.seq_id):
            future = model.client.optim_step(adam)
        return {"request_id": state.futures.add(
            _api_future(future), lambda r, _p: {"type": "optim_step", "metrics": r.metrics})}

    # ------------------------------------------------------------------ checkpoints

    def checked_name(value: Any) -> str:
        """A save's name: one component of the store, never a directory of the host."""
        try:
            return names.check_name(value, "path")
        except names.UnsafeName as err:
            raise _fail(422, "path", str(err)) from err

    @api.post("/save_weights")
    async def save_weights(body: bodies.SaveWeights) -> dict[str, Any]:
        model = state.model(body.model_id)
        async with model.gate.turn(body.seq_id):
            try:
                future = model.client.save_state(checked_name(body.path), ttl_seconds=body.ttl_seconds,
                                                 overwrite=body.overwrite, user_metadata=body.user_metadata)
            except ValueError as err:
                raise _fail(422, "path", str(err)) from err
        return {"request_id": state.futures.add(
            _api_future(future), lambda r, _p: {"type": "save_weights", "path": r.path})}

    @api.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(body: bodies.SaveWeights) -> dict[str, Any]:
        model = state.model(body.model_id)
        if body.path is None:  # save_weights_and_get_sampling_client: an in-memory snapshot, no file
            sampler_id = f"{model.model_id}:sample:{next(model.sampler_ids)}"
            async with model.gate.turn(body.seq_id):
                # Taking the snapshot waits for the queued training work; hold the turn until it
                # is taken so later requests cannot slip in before it.
                snap = state.executor.submit(model.client.save_weights_and_get_sampling_client)
                await asyncio.wait({asyncio.wrap_future(snap)})
            if snap.exception() is None:
                state.samplers[sampler_id] = Sampler(sampler_id, model.base_model, snap.result())
            return {"request_id": state.futures.add(_chain(snap, lambda _c: {
                "type": "save_weights_for_sampler", "sampling_session_id": sampler_id}))}
        async with model.gate.turn(body.seq_id):
            try:
                future = model.client.save_weights_for_sampler(checked_name(body.path), ttl_seconds=body.ttl_seconds,
                                                               user_metadata=body.user_metadata)
            except ValueError as err:
                raise _fail(422, "path", str(err)) from err
        return {"request_id": state.futures.add(
            _api_future(future), lambda r, _p: {"type": "save_weights_for_sampler", "path": r.path})}

    @api.post("/save_weights_external")
    async def save_weights_external(body: bodies.SaveWeightsExternal) -> dict[str, Any]:
        # tinker_cookbook.weights.download exports a training checkpoint this way (age-encrypted
        # to a key it makes), then fetches the files through external_weights_urls below.
        model = state.model(body.model_id)
        name = checked_name(body.path if body.path is not None else f"external-{body.seq_id or 0}")
        async with model.gate.turn(body.seq_id):
            try:
                future = model.client.save_weights_external(name, ttl_seconds=body.ttl_seconds,
                                                            age_encryption_recipients=body.age_encryption_recipients)
            except ValueError as err:  # the name was checked above: what is left is the recipients
                raise _fail(422, "age_encryption_recipients", str(err)) from err
        return {"request_id": state.futures.add(
            _api_future(future), lambda r, _p: {"type": "save_weights_external", "path": r.path})}

    @api.post("/load_weights")
    async def load_weights(body: bodies.LoadWeights) -> dict[str, Any]:
        state.local_path(body.path)  # 404 or 422 now, rather than a failed future later
        if body.model_id is not None:  # load into an existing model, in its request order
            model = state.model(body.model_id)
            async with model.gate.turn(body.seq_id):
                load = model.client.load_state_with_optimizer if body.optimizer else model.client.load_state
                future = load(body.path)
            return {"request_id": state.futures.add(
                _api_future(future), lambda _r, _p: {"type": "load_weights", "path": body.path})}
        if body.session_id is None:
            raise _fail(422, "model_id", "load_weights needs model_id (an existing model) or session_id and "
                        "model_seq_id (a new model from the checkpoint)")
        state.session(body.session_id)
        model_id = f"{body.session_id}:train:{body.model_seq_id or 0}"
        info = state.store.weights_info(body.path)

        def work() -> dict[str, Any]:
            resume = (state.service.create_training_client_from_state_with_optimizer if body.optimizer
                      else state.service.create_training_client_from_state)
            register(model_id, info.base_model, resume(body.path, training_run_id=model_id))
            return {"type": "load_weights", "path": body.path, "model_id": model_id}

        return {"request_id": state.submit(work), "model_id": model_id}

    @api.post("/weights_info")
    async def weights_info(body: bodies.WeightsInfo) -> dict[str, Any]:
        """What a checkpoint was trained from: SDK 0.22's create_training_client_from_state
        builds a fresh LoRA client from this, then loads the checkpoint into it."""
        state.local_path(body.tinker_path, "tinker_path")
        return _record(state.store.weights_info(body.tinker_path))

    # The RestClient's calls: listing, TTL, publishing, deleting; all answered by the store.

    def store_call(fn, *args: Any) -> Any:
        try:
            return fn(*args)
        except FileNotFoundError as err:
            raise HTTPException(404, detail=state.public(err)) from err
        except ValueError as err:
            raise HTTPException(422, detail=state.public(err)) from err
        except OSError as err:  # the disk refused (read-only, immutable, full, something in the way):
            # a 4xx, as a 5xx (and 409) would have the SDK retry what will fail again
            raise HTTPException(403, detail="the checkpoint store's disk refused this: " + state.public(err)) from err

    def ckpt_path(run_id: str, checkpoint_id: str) -> str:
        return f"tinker://{run_id}/{checkpoint_id}"

    @api.get("/training_runs")
    async def list_training_runs(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return _record(store_call(state.store.list_runs, limit, offset))

    @api.get("/training_runs/{run_id}")
    async def get_training_run(run_id: bodies.RunIdInPath) -> dict[str, Any]:
        return _record(store_call(state.store.get_run, run_id))

    @api.get("/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: bodies.RunIdInPath) -> dict[str, Any]:
        return _record(store_call(state.store.list_checkpoints, run_id))

    @api.get("/checkpoints")
    async def list_user_checkpoints(limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return _record(store_call(state.store.list_user_checkpoints, limit, offset))

    signer = file_urls.FileSigner()

    @api.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(run_id: bodies.RunIdInPath, checkpoint_id: bodies.CheckpointIdInPath,
                                    request: Request) -> dict[str, Any]:
        # Not the in-process file:// URLs, which would show where the store lies on this disk:
        # signed URLs of this server (file_urls), which urllib fetches as the SDK's storage URLs.
        path = ckpt_path(run_id, checkpoint_id)
        files = store_call(state.store.file_paths, path)
        expires = file_urls.expiry()
        base = str(request.base_url).rstrip("/") + API_PREFIX
        return _record(g.ExternalWeightsUrlsResponse(
            urls={rel: signer.url(base, path, rel, expires) for rel in files},
            expires=datetime.datetime.fromtimestamp(expires, datetime.UTC)))

    @api.get(file_urls.FILES_ROUTE + "/{run_id}/{segment}/{name}/{rel:path}")
    async def checkpoint_file(run_id: bodies.RunIdInPath, segment: bodies.Segment, name: bodies.NameInPath,
                              rel: bodies.RefInPath, expires: bodies.TextInQuery = "",
                              sig: bodies.TextInQuery = "") -> Response:
        """A file of a checkpoint by a URL external_weights_urls signed (no API key: the URL is it)."""
        path = f"tinker://{run_id}/{segment}/{name}"
        if not signer.valid(path, rel, expires, sig):
            raise HTTPException(403, detail="this checkpoint file URL is not one the server signed, or it has "
                                "expired: ask external_weights_urls for a fresh one")
        file = store_call(state.store.file_paths, path).get(rel)
        if file is None:
            raise HTTPException(404, detail=f"{path} has no file {rel!r} (deleted or replaced since)")
        return FileResponse(file, media_type="application/octet-stream")

    @api.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    async def publish_checkpoint(run_id: bodies.RunIdInPath,
                                 checkpoint_id: bodies.CheckpointIdInPath) -> Response:
        store_call(state.store.set_public, ckpt_path(run_id, checkpoint_id), True)
        return Response(status_code=204)

    @api.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
    async def unpublish_checkpoint(run_id: bodies.RunIdInPath,
                                   checkpoint_id: bodies.CheckpointIdInPath) -> Response:
        store_call(state.store.set_public, ckpt_path(run_id, checkpoint_id), False)
        return Response(status_code=204)

    @api.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_checkpoint_ttl(run_id: bodies.RunIdInPath, checkpoint_id: bodies.CheckpointIdInPath,
                                 body: bodies.SetTtl) -> Response:
        store_call(state.store.set_ttl, ckpt_path(run_id, checkpoint_id), body.ttl_seconds)
        return Response(status_code=204)

    # Registered after the /publish and /ttl routes, which its {checkpoint_id:path} would swallow.
    @api.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: bodies.RunIdInPath,
                                checkpoint_id: bodies.CheckpointIdInPath) -> Response:
        store_call(state.store.delete, ckpt_path(run_id, checkpoint_id))
        return Response(status_code=204)

    # ------------------------------------------------------------------ sampling

    @api.post("/create_sampling_session")
    async def create_sampling_session(body: bodies.CreateSamplingSession) -> dict[str, Any]:
        state.session(body.session_id)
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        if body.model_path:
            local = state.local_path(body.model_path, "model_path")
            if not (local / "adapter_config.json").exists():
                raise _fail(404, "model_path", f"no sampler weights at {body.model_path}")
            base = body.base_model or json.loads((local / "adapter_config.json").read_text())["base_model_name_or_path"]
            client = await load_sampler(model_path=body.model_path)
        elif body.base_model:
            base = body.base_model
            client = await load_sampler(base_model=base)
        else:
            raise _fail(422, "model_path", "create_sampling_session needs model_path or base_model")
        state.samplers[sampler_id] = Sampler(sampler_id, base, client, body.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @api.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: bodies.RefInPath) -> dict[str, Any]:
        sampler = state.sampler(sampler_id)
        return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    @api.post("/asample")
    async def asample(body: bodies.Sample) -> dict[str, Any]:
        tokens = [t for chunk in body.prompt.chunks for t in chunk.tokens]
        max_tokens = body.sampling_params.max_tokens
        try:  # the bounds that need no model first: nothing is loaded for a request refused anyway
            limits.check_sample(len(tokens), max_tokens, body.num_samples, context=None)
        except LimitError as err:
            raise _fail(err.status, err.field, str(err)) from err
        if body.sampling_session_id:
            client = state.sampler(body.sampling_session_id).client
        elif body.base_model:
            if body.base_model not in state.base_samplers:
                state.base_samplers[body.base_model] = await load_sampler(base_model=body.base_model)
            client = state.base_samplers[body.base_model]
        else:
            raise _fail(422, "sampling_session_id", "asample needs a sampling_session_id")
        try:
            limits.check_sample(len(tokens), max_tokens, body.num_samples, context_of(client.engine))
            params = wire.sampling_params_from_json(body.sampling_params.model_dump())
            future = client.sample(g.ModelInput.from_ints(tokens), body.num_samples, params,
                                   include_prompt_logprobs=body.prompt_logprobs)
        except LimitError as err:
            raise _fail(err.status, err.field, str(err)) from err
        except wire.WireError as err:
            raise _fail(422, err.field, str(err)) from err
        except (ValueError, TypeError) as err:
            raise _fail(422, "prompt", str(err)) from err
        # Sampler ids start with their session's id ("sess-..:sample:N", "sess-..:train:M:sample:N").
        session = body.sampling_session_id.split(":")[0] if body.sampling_session_id else None
        state.seen(session)
        request_id = state.futures.add(_api_future(future), _render_sample, session=session)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(body.num_samples)]}

    async def load_sampler(**where: str) -> SamplingClient:
        """A sampling client; a model that cannot be loaded is the client's mistake (a 422 naming
        the field), never a 5xx the SDK would retry for a minute."""
        field_name = next(iter(where))
        try:
            if "base_model" in where:
                models.resolve(where["base_model"])
            return await asyncio.to_thread(state.service.create_sampling_client, **where)
        except FileNotFoundError as err:
            raise _fail(404, field_name, state.public(err)) from err
        except Exception as err:  # transformers raises OSError, ValueError, ... for a model it cannot load
            raise _fail(422, field_name, f"{where[field_name]!r} could not be loaded: {state.public(err)}") from err

    # ------------------------------------------------------------------ futures

    def drop_silent_sessions() -> None:
        """A client that stopped polling is gone (killed, disconnected): its queued sampling would
        only keep the others waiting. Checked on every poll, so no timer thread is needed."""
        cutoff = time.time() - limits.client_timeout_s
        for session_id, info in list(state.sessions.items()):
            if info["heartbeat"] < cutoff and state.futures.drop_session(session_id):
                info["heartbeat"] = time.time()  # dropped once; a later request of its own revives it

    def public_error(err: BaseException) -> dict[str, Any]:
        result = error_result(err)
        return {**result, "error": state.public(result["error"])}

    @api.post("/retrieve_future")
    async def retrieve_future(body: bodies.RetrieveFuture, request: Request) -> Response:
        pending = state.futures.get(body.request_id)
        if pending is not None:
            state.seen(pending.session)
        drop_silent_sessions()
        if pending is None:
            raise _fail(404, "request_id", f"unknown request_id {body.request_id!r} (results are kept "
                        "10 minutes, and not across a server restart)")
        if pending.future.cancelled():
            return JSONResponse(cancelled_result())
        if not await state.futures.wait(pending):
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        err = pending.future.exception()
        if err is not None:
            return JSONResponse(public_error(err))
        accept = request.headers.get("accept", "")
        want_proto = PROTOBUF in accept and "application/json" not in accept
        try:
            rendered = pending.render(pending.future.result(), want_proto)
            if isinstance(rendered, bytes):
                return Response(rendered, media_type=PROTOBUF)
            return JSONResponse(rendered)  # raises ValueError on a non-finite number
        except Exception as render_err:  # never a 5xx: the SDK would retry it forever
            return JSONResponse(public_error(render_err))

    app.include_router(api)
    return app
