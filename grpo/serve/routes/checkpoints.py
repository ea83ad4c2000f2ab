"""The checkpoint routes of a training model: save (state, sampler weights, age-encrypted
export), load, and what a checkpoint was trained from. Every name a client gives passes the
store's one name rule (grpo.api.names).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from grpo.api import names
from grpo.serve import bodies
from grpo.serve.state import Sampler, ServerState, api_future, chain, fail, record


def build(state: ServerState) -> APIRouter:
    router = APIRouter()

    def checked_name(value: Any) -> str:
        """A save's name: one component of the store, never a directory of the host."""
        try:
            return names.check_name(value, "path")
        except names.UnsafeName as err:
            raise fail(422, "path", str(err)) from err

    async def save_to_store(model, body: bodies.SaveWeights, kind: str, save) -> dict[str, Any]:
        """Run ``save(name)`` in the model's turn on the checked ``body.path``; a refused name is a
        422 on ``path``; the future answers ``kind`` with the saved checkpoint's path."""
        async with model.gate.turn(body.seq_id):
            try:
                future = save(checked_name(body.path))
            except ValueError as err:
                raise fail(422, "path", str(err)) from err
        return {"request_id": state.futures.add(api_future(future), lambda r, _p: {"type": kind, "path": r.path})}

    @router.post("/save_weights")
    async def save_weights(body: bodies.SaveWeights) -> dict[str, Any]:
        model = state.model(body.model_id)
        return await save_to_store(model, body, "save_weights", lambda name: model.client.save_state(
            name, ttl_seconds=body.ttl_seconds, overwrite=body.overwrite, user_metadata=body.user_metadata))

    @router.post("/save_weights_for_sampler")
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
                state.register_sampler(Sampler(sampler_id, model.base_model, snap.result()))
            return {"request_id": state.futures.add(chain(snap, lambda _c: {
                "type": "save_weights_for_sampler", "sampling_session_id": sampler_id}))}
        return await save_to_store(model, body, "save_weights_for_sampler",
                                   lambda name: model.client.save_weights_for_sampler(
                                       name, ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata))

    @router.post("/save_weights_external")
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
                raise fail(422, "age_encryption_recipients", str(err)) from err
        return {"request_id": state.futures.add(
            api_future(future), lambda r, _p: {"type": "save_weights_external", "path": r.path})}

    @router.post("/load_weights")
    async def load_weights(body: bodies.LoadWeights) -> dict[str, Any]:
        state.local_path(body.path)  # 404 or 422 now, rather than a failed future later
        if body.model_id is not None:  # load into an existing model, in its request order
            model = state.model(body.model_id)
            async with model.gate.turn(body.seq_id):
                load = model.client.load_state_with_optimizer if body.optimizer else model.client.load_state
                future = load(body.path)
            return {"request_id": state.futures.add(
                api_future(future), lambda _r, _p: {"type": "load_weights", "path": body.path})}
        if body.session_id is None:
            raise fail(422, "model_id", "load_weights needs model_id (an existing model) or session_id and "
                       "model_seq_id (a new model from the checkpoint)")
        state.session(body.session_id)
        model_id = f"{body.session_id}:train:{body.model_seq_id or 0}"
        info = state.store.weights_info(body.path)

        def work() -> dict[str, Any]:
            resume = (state.service.create_training_client_from_state_with_optimizer if body.optimizer
                      else state.service.create_training_client_from_state)
            state.register_model(model_id, info.base_model, resume(body.path, training_run_id=model_id))
            return {"type": "load_weights", "path": body.path, "model_id": model_id}

        return {"request_id": state.submit(work), "model_id": model_id}

    @router.post("/weights_info")
    async def weights_info(body: bodies.WeightsInfo) -> dict[str, Any]:
        """What a checkpoint was trained from: SDK 0.22's create_training_client_from_state
        builds a fresh LoRA client from this, then loads the checkpoint into it."""
        state.local_path(body.tinker_path, "tinker_path")
        return record(state.store.weights_info(body.tinker_path))

    return router
