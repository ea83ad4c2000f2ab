"""The training model routes: create a LoRA model, its info, forward / forward_backward (JSON
or protobuf) and optim_step, each run in the model's seq_id order.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request

from grpo import models
from grpo import types as g
from grpo.api import losses
from grpo.serve import bodies, wire
from grpo.serve.limits import LimitError, Limits
from grpo.serve.state import (
    PROTOBUF,
    ServerState,
    api_future,
    context_of,
    fail,
    parse_json,
    render_fwdbwd,
    tokenizer_id,
)


def build(state: ServerState, limits: Limits) -> APIRouter:
    """The routes; ``limits`` bound every request's datums before any work."""
    router = APIRouter()

    @router.post("/create_model")
    async def create_model(body: bodies.CreateModel) -> dict[str, Any]:
        state.session(body.session_id)
        try:
            models.resolve(body.base_model)
        except ValueError as err:
            raise fail(422, "base_model", str(err)) from err
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        if model_id in state.models:
            raise fail(409, "model_seq_id", f"model {model_id} exists already")
        lora = body.lora_config
        metadata = {str(k): str(v) for k, v in (body.user_metadata or {}).items()} or None

        def work() -> dict[str, Any]:
            client = state.service.create_lora_training_client(
                body.base_model, rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp,
                train_attn=lora.train_attn, train_unembed=lora.train_unembed, user_metadata=metadata,
                training_run_id=model_id)  # one id: the model's is its run's, as on the service
            state.register_model(model_id, body.base_model, client)
            return {"type": "create_model", "model_id": model_id}

        return {"request_id": state.submit(work), "model_id": model_id}

    @router.post("/get_info")
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
            raise fail(422, "loss_fn", f"loss_fn {loss_fn!r} is not supported locally; use one of "
                       f"{', '.join(losses.LOSSES)} (stable_reinforce is server-defined and unpublished)")
        try:
            limits.check_datums((d.model_input.length for d in data), context_of(model.client.engine))
        except LimitError as err:
            raise fail(err.status, err.field, str(err)) from err
        async with model.gate.turn(seq_id):
            try:
                call = model.client.forward_backward if backward else model.client.forward
                future = call(data, loss_fn, config)
            except (ValueError, TypeError) as err:
                raise fail(422, "data", str(err)) from err
        return {"request_id": state.futures.add(api_future(future), render_fwdbwd), "model_id": model_id}

    @router.post("/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if request.headers.get("content-encoding"):
            raise HTTPException(415, detail="compressed request bodies are not supported (proto_compress_fwdbwd is off)")
        if request.headers.get("content-type", "").startswith(PROTOBUF):
            try:
                req = wire.forward_backward_from_proto(raw, limits)
            except wire.WireError as err:
                raise fail(422, err.field, str(err)) from err
            return await loss_call(req["model_id"], req["seq_id"], req["data"], req["loss_fn"] or "cross_entropy",
                                   req["loss_fn_config"], backward=not req["forward_only"])
        body = parse_json(raw, bodies.ForwardBackward)
        return await loss_json(body.model_id, body.seq_id, body.forward_backward_input, backward=True)

    @router.post("/forward")
    async def forward(body: bodies.Forward) -> dict[str, Any]:
        return await loss_json(body.model_id, body.seq_id, body.forward_input, backward=False)

    async def loss_json(model_id: str, seq_id: int | None, fb: bodies.ForwardBackwardInput,
                        backward: bool) -> dict[str, Any]:
        try:
            data = wire.data_from_json(fb.data, limits)  # sizes checked before anything is copied
        except wire.WireError as err:
            raise fail(422, f"forward_backward_input.{err.field}", str(err)) from err
        return await loss_call(model_id, seq_id, data, fb.loss_fn, fb.loss_fn_config, backward)

    @router.post("/optim_step")
    async def optim_step(body: bodies.OptimStep) -> dict[str, Any]:
        model = state.model(body.model_id)
        try:
            adam = g.AdamParams(**body.adam_params.model_dump(include=set(bodies.AdamParams.model_fields)))
        except g.ParamError as err:
            raise fail(422, f"adam_params.{err.field}", str(err)) from err
        except ValueError as err:
            raise fail(422, "adam_params", str(err)) from err
        async with model.gate.turn(body.seq_id):
            future = model.client.optim_step(adam)
        return {"request_id": state.futures.add(
            api_future(future), lambda r, _p: {"type": "optim_step", "metrics": r.metrics})}

    return router
