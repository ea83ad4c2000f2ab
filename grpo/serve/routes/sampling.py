"""The sampling routes: sampling sessions (from a checkpoint or a base model) and asample.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter

from grpo import models
from grpo import types as g
from grpo.backends.local.clients import SamplingClient
from grpo.serve import bodies, wire
from grpo.serve.limits import LimitError, Limits
from grpo.serve.state import Sampler, ServerState, api_future, context_of, fail, render_sample


def build(state: ServerState, limits: Limits) -> APIRouter:
    """The routes; ``limits`` bound a prompt, max_tokens and num_samples before any work."""
    router = APIRouter()

    @router.post("/create_sampling_session")
    async def create_sampling_session(body: bodies.CreateSamplingSession) -> dict[str, Any]:
        state.session(body.session_id)
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        if body.model_path:
            local = state.local_path(body.model_path, "model_path")
            if not (local / "adapter_config.json").exists():
                raise fail(404, "model_path", f"no sampler weights at {body.model_path}")
            base = body.base_model or json.loads((local / "adapter_config.json").read_text())["base_model_name_or_path"]
            client = await load_sampler(model_path=body.model_path)
        elif body.base_model:
            base = body.base_model
            client = await load_sampler(base_model=base)
        else:
            raise fail(422, "model_path", "create_sampling_session needs model_path or base_model")
        state.register_sampler(Sampler(sampler_id, base, client, body.model_path))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @router.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: bodies.RefInPath) -> dict[str, Any]:
        sampler = state.sampler(sampler_id)
        return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    @router.get("/samplers/{sampler_id}/stats")
    async def sampler_stats(sampler_id: bodies.RefInPath) -> dict[str, Any]:
        """grpo's own: what the sampler of this session's base model has done (prompt tokens,
        tokens prefilled, prefix-cache hits and the tokens they covered, evictions), summed since
        the model loaded; every session of one base model shares that sampler and its cache."""
        sampler = state.sampler(sampler_id)
        return {"sampler_id": sampler.sampler_id, **sampler.client.sampler_stats()}

    @router.post("/asample")
    async def asample(body: bodies.Sample) -> dict[str, Any]:
        tokens = [t for chunk in body.prompt.chunks for t in chunk.tokens]
        max_tokens = body.sampling_params.max_tokens
        try:  # the bounds that need no model first: nothing is loaded for a request refused anyway
            limits.check_sample(len(tokens), max_tokens, body.num_samples, context=None)
        except LimitError as err:
            raise fail(err.status, err.field, str(err)) from err
        if body.sampling_session_id:
            client = state.sampler(body.sampling_session_id).client
        elif body.base_model:
            if body.base_model not in state.base_samplers:
                state.base_samplers[body.base_model] = await load_sampler(base_model=body.base_model)
            client = state.base_samplers[body.base_model]
        else:
            raise fail(422, "sampling_session_id", "asample needs a sampling_session_id")
        try:
            limits.check_sample(len(tokens), max_tokens, body.num_samples, context_of(client.engine))
            params = wire.sampling_params_from_json(body.sampling_params.model_dump())
            future = client.sample(g.ModelInput.from_ints(tokens), body.num_samples, params,
                                   include_prompt_logprobs=body.prompt_logprobs)
        except LimitError as err:
            raise fail(err.status, err.field, str(err)) from err
        except wire.WireError as err:
            raise fail(422, err.field, str(err)) from err
        except (ValueError, TypeError) as err:
            raise fail(422, "prompt", str(err)) from err
        # Sampler ids start with their session's id ("sess-..:sample:N", "sess-..:train:M:sample:N").
        session = body.sampling_session_id.split(":")[0] if body.sampling_session_id else None
        state.seen(session)
        request_id = state.futures.add(api_future(future), render_sample, session=session)
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
            raise fail(404, field_name, state.public(err)) from err
        except Exception as err:  # transformers raises OSError, ValueError, ... for a model it cannot load
            raise fail(422, field_name, f"{where[field_name]!r} could not be loaded: {state.public(err)}") from err

    return router
