"""Request bodies in, results out: the Tinker wire formats <-> grpo.types.

Two encodings: JSON (every SDK; the only one SDK 0.22 sends) and protobuf (SDK >= 0.25 sends
forward_backward as protobuf and reads sample and forward_backward results only as protobuf).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from grpo import types as g
from grpo.serve import proto
from grpo.serve.limits import LimitError, Limits, RequestBudget

DEFAULT_LIMITS = Limits()


class WireError(ValueError):
    """A request body that parses but cannot be used; ``field`` names where it went wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# --------------------------------------------------------------------------- protobuf in

_PROTO_DTYPES = {1: ("float32", np.float32), 2: ("int64", np.int64), 3: ("int64", np.int32)}


def _frombuffer(raw: bytes, dtype: Any, field: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise WireError(field, f"{len(raw)} bytes is not a whole number of {np.dtype(dtype).name} values "
                        f"({itemsize} bytes each)")
    return np.frombuffer(raw, dtype=dtype)


def _declared_entries(datum_field: str, n_tokens: int, key: str, declared: int, budget: RequestBudget) -> None:
    """One loss input's declared size, before it is built: it must have one entry per position
    (grpo.types.Datum's rule, checked here on the declared size so that nothing larger than the
    datum is ever allocated), and it counts towards the request's whole."""
    field = f"{datum_field}.loss_fn_inputs.{key}"
    if declared != n_tokens:
        raise WireError(field, f"declares {declared} entries but model_input has {n_tokens} tokens; every loss "
                        "input needs one entry per input position")
    _within(budget.add_elements, declared, field)


def _within(add: Any, n: int, field: str) -> None:
    try:
        add(n, field)
    except LimitError as err:
        raise WireError(err.field, str(err).split(": ", 1)[1]) from err


def _proto_sizes(request: Any, limits: Limits) -> None:
    """Every datum's tokens and every tensor's elements as declared (shapes, buffer lengths),
    summed over the request and refused past its limits before any array is made (the number of
    datums was counted on the wire, ``_count_fields``)."""
    budget = limits.budget()
    for i, datum in enumerate(request.data):
        n = sum(len(c.encoded_text.tokens) // 4 for c in datum.model_input if c.WhichOneof("chunk") == "encoded_text")
        _within(budget.add_tokens, n, f"data[{i}].model_input")
        for key, tensor in datum.loss_fn_inputs.items():
            field = f"data[{i}].loss_fn_inputs.{key}"
            shape = _shape(tensor.shape, field, limits)
            sparse = tensor.WhichOneof("encoding") == "sparse_csr"
            itemsize = np.dtype(_PROTO_DTYPES[tensor.dtype][1]).itemsize if tensor.dtype in _PROTO_DTYPES else 1
            declared = math.prod(shape) if shape or sparse else len(tensor.dense) // itemsize
            if shape and not sparse and len(tensor.dense) != declared * itemsize:
                raise WireError(field, f"holds {len(tensor.dense) / itemsize:g} values but shape is {shape}")
            _declared_entries(f"data[{i}]", n, key, declared, budget)


def _proto_tensor(tensor: Any, field: str, limits: Limits) -> g.TensorData:
    if tensor.dtype not in _PROTO_DTYPES:
        raise WireError(field, f"dtype {tensor.dtype} is not supported (float32, int64 or int32)")
    name, np_dtype = _PROTO_DTYPES[tensor.dtype]
    shape = _shape(tensor.shape, field, limits)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        array = _dense_from_csr(tensor.sparse_csr, shape, np_dtype, field)
    else:
        array = _frombuffer(tensor.dense, np_dtype, f"{field}.dense")
        if shape and math.prod(shape) != array.size:
            raise WireError(field, f"holds {array.size} values but shape is {shape}")
        array = array.reshape(shape) if shape else array
    return g.TensorData.from_numpy(array.astype(np.int64 if name == "int64" else np.float32))


def _shape(shape: Any, field: str, limits: Limits) -> list[int]:
    """A declared shape, checked before anything of its size exists (a 100-byte body may declare
    a shape of 10^18 elements)."""
    try:
        return limits.check_shape([int(s) for s in shape], field)
    except LimitError as err:
        raise WireError(err.field, str(err).split(": ", 1)[1]) from err


def _dense_from_csr(csr: Any, shape: list[int], np_dtype: Any, field: str) -> np.ndarray:
    if len(shape) > 2:
        raise WireError(f"{field}.shape", f"{shape}: a sparse_csr tensor has one or two dimensions")
    values = _frombuffer(csr.values, np_dtype, f"{field}.sparse_csr.values")
    crow = _frombuffer(csr.crow_indices, np.int64, f"{field}.sparse_csr.crow_indices")
    cols = _frombuffer(csr.col_indices, np.int64, f"{field}.sparse_csr.col_indices")
    rows, ncols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0] if shape else 0)
    if (len(crow) != rows + 1 or len(cols) != len(values) or crow[0] != 0 or crow[-1] != len(values)
            or np.any(np.diff(crow) < 0)):
        raise WireError(f"{field}.sparse_csr", f"crow_indices must be {rows + 1} non-decreasing offsets from 0 "
                        f"to the {len(values)} values, one column index per value")
    if len(cols) and (cols.min() < 0 or cols.max() >= ncols):
        raise WireError(f"{field}.sparse_csr.col_indices", f"column indices must lie in 0..{ncols - 1}")
    dense = np.zeros((rows, ncols), dtype=np_dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), cols] = values
    return dense.reshape(shape)


def _proto_tokens(chunks: Any, field: str) -> g.ModelInput:
    out = []
    for i, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(field, g.non_text_chunk(i, kind))
        tokens = _frombuffer(chunk.encoded_text.tokens, np.int32, f"{field}[{i}].encoded_text.tokens")
        out.append(g.EncodedTextChunk(tokens=tokens.tolist()))
    return g.ModelInput(chunks=out)


def _varint(body: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(body) or shift > 63:
            raise WireError("body", "not a tinker_public.ForwardBackwardRequest (a varint runs past its end)")
        byte = body[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _count_fields(body: bytes, descriptor: Any, limit: int, flag: str, max_datums: int) -> None:
    """Walk ``body``'s protobuf wire format, into every submessage ``descriptor`` declares, and
    refuse it at its ``limit + 1``-th field, or its ``max_datums + 1``-th datum: before protobuf
    makes an object per field (an empty datum is two bytes, so a 256 MB body could otherwise hold
    134 million of them)."""
    count = datums = 0
    data = descriptor.fields_by_name["data"].number
    stack = [(descriptor, 0, len(body))]
    while stack:
        message, pos, end = stack.pop()
        while pos < end:
            tag, pos = _varint(body, pos)
            count += 1
            if count > limit:
                raise WireError("body", f"holds more than {limit} protobuf fields, this server's limit (set by {flag})")
            number, wire_type = tag >> 3, tag & 7
            if message is descriptor and number == data:
                datums += 1
                if datums > max_datums:
                    raise WireError("data", f"more than {max_datums} datums, this server's limit (set by --max-datums)")
            if wire_type == 0:
                _, pos = _varint(body, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(body, pos)
                field = message.fields_by_number.get(number) if message is not None else None
                if field is not None and field.message_type is not None:
                    stack.append((field.message_type, pos, min(pos + size, end)))
                pos += size
            else:  # groups (3, 4) are in no message of this protocol; 6, 7 are not wire types
                raise WireError("body", f"not a tinker_public.ForwardBackwardRequest (wire type {wire_type})")


def forward_backward_from_proto(body: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """A ForwardBackwardRequest as {model_id, seq_id, data, loss_fn, loss_fn_config, forward_only}."""
    _count_fields(body, proto.ForwardBackwardRequest.DESCRIPTOR, *limits.proto_fields(), limits.max_datums)
    request = proto.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as err:  # protobuf raises its own DecodeError
        raise WireError("body", f"not a tinker_public.ForwardBackwardRequest ({err})") from err
    _proto_sizes(request, limits)
    data = []
    for i, datum in enumerate(request.data):
        inputs = {k: _proto_tensor(v, f"data[{i}].loss_fn_inputs.{k}", limits) for k, v in datum.loss_fn_inputs.items()}
        data.append(_datum(_proto_tokens(datum.model_input, f"data[{i}].model_input"), inputs, f"data[{i}]"))
    config: dict[str, float] = dict(request.loss_fn_config)
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config.{key}", "text values are not supported; pass numbers")
        config[key] = value.number
    return {"model_id": request.model_id, "seq_id": request.seq_id, "data": data, "loss_fn": request.loss_fn,
            "loss_fn_config": config or None, "forward_only": request.forward_only}


def _datum(model_input: g.ModelInput, inputs: dict[str, g.TensorData], field: str) -> g.Datum:
    try:
        return g.Datum(model_input=model_input, loss_fn_inputs=inputs)
    except (TypeError, ValueError) as err:
        raise WireError(field, str(err)) from err


# --------------------------------------------------------------------------- JSON in


def _get(value: Any, key: str) -> Any:
    """A field of a parsed body, as a dict or as the pydantic model (read without copying it)."""
    return value.get(key) if isinstance(value, dict) else getattr(value, key, None)


def model_input_from_json(value: Any, field: str) -> g.ModelInput:
    chunks = []
    for i, chunk in enumerate(_get(value, "chunks") or []):
        kind = _get(chunk, "type") or "encoded_text"
        if kind != "encoded_text":
            raise WireError(f"{field}.chunks", g.non_text_chunk(i, kind))
        chunks.append(g.EncodedTextChunk(tokens=[int(t) for t in _get(chunk, "tokens")]))
    return g.ModelInput(chunks=chunks)


def _json_shape(tensor: Any, field: str, limits: Limits) -> list[int]:
    """A JSON tensor's shape (its data's length where it declares none), checked against the limits
    and against the data it holds."""
    data_len = len(_get(tensor, "data") or [])
    declared = _get(tensor, "shape")
    shape = _shape(declared if declared is not None else [data_len], field, limits)
    if math.prod(shape) != data_len:
        raise WireError(field, f"holds {data_len} values but shape is {shape}")
    return shape


def tensor_from_json(value: Any, field: str, limits: Limits = DEFAULT_LIMITS) -> g.TensorData:
    dtype = _get(value, "dtype")
    if dtype not in ("int64", "float32"):
        raise WireError(f"{field}.dtype", f"must be int64 or float32, got {dtype!r}")
    if _get(value, "sparse_crow_indices") is not None:
        raise WireError(field, "sparse tensors are not supported in JSON requests; send dense data")
    data = _get(value, "data") or []
    shape = _json_shape(value, field, limits)
    try:
        array = np.asarray(data, dtype=np.int64 if dtype == "int64" else np.float32)
    except (OverflowError, ValueError, TypeError) as err:
        raise WireError(f"{field}.data", f"values must be {dtype} numbers ({err})") from err
    return g.TensorData.from_numpy(array.reshape(shape))


def _json_sizes(data: list[Any], limits: Limits) -> None:
    """``_proto_sizes`` for a JSON body: declared shapes and list lengths, summed over the request."""
    budget = limits.budget()
    for i, datum in enumerate(data):
        n = sum(len(_get(c, "tokens") or []) for c in _get(_get(datum, "model_input"), "chunks") or [])
        _within(budget.add_tokens, n, f"data[{i}].model_input")
        for key, tensor in (_get(datum, "loss_fn_inputs") or {}).items():
            field = f"data[{i}].loss_fn_inputs.{key}"
            _json_shape(tensor, field, limits)
            _declared_entries(f"data[{i}]", n, key, len(_get(tensor, "data") or []), budget)


def data_from_json(data: list[Any], limits: Limits = DEFAULT_LIMITS) -> list[g.Datum]:
    """Datums from a parsed JSON body (dicts, or the body's pydantic models as they are)."""
    _json_sizes(data, limits)
    out = []
    for i, datum in enumerate(data):
        inputs = {k: tensor_from_json(v, f"data[{i}].loss_fn_inputs.{k}", limits)
                  for k, v in (_get(datum, "loss_fn_inputs") or {}).items()}
        out.append(_datum(model_input_from_json(_get(datum, "model_input"), f"data[{i}].model_input"), inputs,
                          f"data[{i}]"))
    return out


def sampling_params_from_json(value: dict[str, Any]) -> g.SamplingParams:
    stop = value.get("stop")
    try:
        return g.SamplingParams(max_tokens=value.get("max_tokens"), temperature=float(value.get("temperature", 1.0)),
                                top_k=int(value.get("top_k", -1)), top_p=float(value.get("top_p", 1.0)),
                                stop=stop, seed=value.get("seed"))
    except g.ParamError as err:
        raise WireError(f"sampling_params.{err.field}", str(err)) from err
    except (TypeError, ValueError) as err:
        raise WireError("sampling_params", str(err)) from err


# --------------------------------------------------------------------------- results out


def forward_backward_to_json(out: g.ForwardBackwardOutput) -> dict[str, Any]:
    return {
        "loss_fn_output_type": out.loss_fn_output_type,
        "loss_fn_outputs": [{k: {"data": v.to_numpy().reshape(-1).tolist(), "dtype": v.dtype,
                                 "shape": list(v.to_numpy().shape)} for k, v in record.items()}
                            for record in out.loss_fn_outputs],
        "metrics": {k: float(v) for k, v in out.metrics.items()},
    }


def forward_backward_to_proto(out: g.ForwardBackwardOutput) -> bytes:
    """One ArrayRecord per datum, each field a BatchedTensor of one element (offsets [0, nbytes])."""
    message = proto.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type,
                                          metrics={k: float(v) for k, v in out.metrics.items()})
    for record in out.loss_fn_outputs:
        array_record = message.loss_fn_outputs.add(num_datums=1)
        for key, value in record.items():
            array = value.to_numpy()
            dtype = 2 if value.dtype == "int64" else 1
            raw = array.astype(np.int64 if dtype == 2 else np.float32).tobytes()
            field = array_record.fields[key]
            field.data = raw
            field.offsets = np.asarray([0, len(raw)], dtype=np.int64).tobytes()
            field.dtype = dtype
            field.trailing_shape.extend(list(array.shape[1:]))
    return message.SerializeToString()


def sample_to_json(out: g.SampleResponse) -> dict[str, Any]:
    return {
        "type": "sample",
        "sequences": [{"stop_reason": s.stop_reason, "tokens": list(s.tokens), "logprobs": s.logprobs}
                      for s in out.sequences],
        "prompt_logprobs": out.prompt_logprobs,
    }


def sample_to_proto(out: g.SampleResponse) -> bytes:
    message = proto.SampleResponse()
    for seq in out.sequences:
        item = message.sequences.add(stop_reason=0 if seq.stop_reason == "stop" else 1,
                                     tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes())
        if seq.logprobs is not None:
            item.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if out.prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray([math.nan if x is None else x for x in out.prompt_logprobs],
                                             dtype=np.float32).tobytes()
    return message.SerializeToString()
