"""grpo.types <-> the SDK's types, at the boundary, so run_grpo sees one type system.

``sdk_types`` is the SDK's ``types`` module (``tinker.types``; ``mint.types`` is the same
module). Only public constructors and attributes are used, which Tinker SDK 0.22 (pinned by
MinT) and 0.38 share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from grpo import types as g


def model_input(sdk_types: ModuleType, value: g.ModelInput) -> Any:
    if not isinstance(value, g.ModelInput):
        raise TypeError(f"expected a grpo.types.ModelInput, got {type(value).__name__}")
    chunks = []
    for i, chunk in enumerate(value.chunks):
        if isinstance(chunk, g.EncodedTextChunk):
            chunks.append(sdk_types.EncodedTextChunk(tokens=[int(t) for t in chunk.tokens]))
            continue
        # Image and audio chunks: the service runs them (grpo's local models do not); same fields.
        sdk_class = getattr(sdk_types, type(chunk).__name__, None)
        if sdk_class is None or not dataclasses.is_dataclass(chunk):
            raise TypeError(f"chunk {i} ({type(chunk).__name__}) has no counterpart in this SDK's types")
        chunks.append(sdk_class(**{f.name: getattr(chunk, f.name) for f in dataclasses.fields(chunk)}))
    return sdk_types.ModelInput(chunks=chunks)


def tensor_data(sdk_types: ModuleType, value: g.TensorData) -> Any:
    # from_numpy keeps dtype and shape exactly and skips a list round trip.
    return sdk_types.TensorData.from_numpy(value.to_numpy())


def datum(sdk_types: ModuleType, value: g.Datum) -> Any:
    if not isinstance(value, g.Datum):
        raise TypeError(f"forward_backward takes grpo.types.Datum items, got {type(value).__name__}")
    return sdk_types.Datum(
        model_input=model_input(sdk_types, value.model_input),
        loss_fn_inputs={k: tensor_data(sdk_types, v) for k, v in value.loss_fn_inputs.items()},
    )


def sampling_params(sdk_types: ModuleType, value: g.SamplingParams | None,
                    decode: Callable[[int], str] | None = None) -> Any:
    """grpo's ``stop`` (strings and/or ids) plus ``stop_token_ids`` become the SDK's ``stop``.

    The SDK takes either strings or token ids, not both. A mix is sent as strings, each id
    decoded with ``decode`` (the tokenizer), because a string matches wherever its token would.
    """
    value = value if value is not None else g.SamplingParams()
    strings, ids = value.stop_strings_and_ids()
    stop: list[str] | list[int] | None
    if strings and ids:
        if decode is None:
            raise ValueError("SamplingParams.stop mixes strings and token ids; the service takes one kind, "
                             "and no tokenizer is at hand to turn the ids into strings")
        decoded = [decode(i) for i in ids]
        empty = [i for i, s in zip(ids, decoded, strict=True) if not s]
        if empty:
            raise ValueError(f"stop token ids {empty} decode to empty strings; pass stop strings only, or ids only")
        stop = list(dict.fromkeys([*strings, *decoded]))
    elif strings:
        stop = strings
    elif ids:
        stop = list(dict.fromkeys(ids))
    else:
        stop = None  # the service still stops at end-of-sequence
    return sdk_types.SamplingParams(max_tokens=value.max_tokens, temperature=float(value.temperature),
                                    top_k=int(value.top_k), top_p=float(value.top_p), stop=stop,
                                    seed=value.seed)


# Values that mean "off" for the optimizer fields an older SDK may lack.
_ADAM_NEUTRAL = {"weight_decay": 0.0, "grad_clip_norm": 0.0}


def adam_params(sdk_types: ModuleType, value: g.AdamParams) -> Any:
    """Every AdamParams field the installed SDK accepts; a field it lacks is dropped only when
    it is at its neutral value, else the user would silently train with a different optimizer."""
    cls = sdk_types.AdamParams
    accepted = set(getattr(cls, "model_fields", {}) or {})
    fields = {"learning_rate": value.learning_rate, "beta1": value.beta1, "beta2": value.beta2,
              "eps": value.eps, "weight_decay": value.weight_decay, "grad_clip_norm": value.grad_clip_norm}
    unsupported = {k: v for k, v in fields.items() if accepted and k not in accepted}
    bad = {k: v for k, v in unsupported.items() if _ADAM_NEUTRAL.get(k) != v}
    if bad:
        raise ValueError(f"the installed SDK's AdamParams has no {', '.join(bad)}; set "
                         f"{', '.join(f'{k}=0' for k in bad)} or upgrade the SDK (fields it takes: {sorted(accepted)})")
    return cls(**{k: float(v) for k, v in fields.items() if k not in unsupported})


def loss_fn_config(value: Mapping[str, Any] | None) -> dict[str, float] | None:
    return {k: float(v) for k, v in value.items()} if value else None


# --------------------------------------------------------------------------- back to grpo


def from_tensor_data(value: Any) -> g.TensorData:
    return g.TensorData.from_numpy(value.to_numpy())


def from_sample_response(value: Any) -> g.SampleResponse:
    sequences = []
    for seq in value.sequences:
        logprobs = seq.logprobs
        sequences.append(g.SampledSequence(tokens=[int(t) for t in seq.tokens],
                                           logprobs=None if logprobs is None else [float(x) for x in logprobs],
                                           stop_reason=str(seq.stop_reason)))
    prompt_lp = getattr(value, "prompt_logprobs", None)
    return g.SampleResponse(sequences=sequences,
                            prompt_logprobs=None if prompt_lp is None else
                            [None if x is None else float(x) for x in prompt_lp])


def from_forward_backward(value: Any) -> g.ForwardBackwardOutput:
    return g.ForwardBackwardOutput(
        loss_fn_output_type=str(value.loss_fn_output_type),
        loss_fn_outputs=[{k: from_tensor_data(v) for k, v in out.items()} for out in value.loss_fn_outputs],
        metrics={k: float(v) for k, v in (value.metrics or {}).items()},
    )


def from_optim_step(value: Any) -> g.OptimStepResponse:
    metrics = getattr(value, "metrics", None) or {}
    return g.OptimStepResponse(metrics={k: float(v) for k, v in metrics.items()})


def from_logprobs(value: Any) -> list[float | None]:
    return [None if x is None else float(x) for x in value]
