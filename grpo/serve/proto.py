"""The protobuf messages of the Tinker wire protocol, built at import from a table.

Tinker SDK >= 0.25 sends forward_backward as ``tinker_public.ForwardBackwardRequest`` and reads
sample and forward_backward results only as protobuf. The field names and numbers below are
those of ``tinker_public.proto`` as the SDK ships it (see docs/serve.md); only the ``protobuf``
runtime is needed, not the SDK and not protoc.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tinker_public"
_F = descriptor_pb2.FieldDescriptorProto

# (name, number, type, label, message type or None, oneof index or None, proto3 optional)
_OPT, _REP = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
_BYTES, _STR, _I32, _I64, _U32, _U64 = _F.TYPE_BYTES, _F.TYPE_STRING, _F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64
_DBL, _FLT, _BOOL, _MSG, _ENUM = _F.TYPE_DOUBLE, _F.TYPE_FLOAT, _F.TYPE_BOOL, _F.TYPE_MESSAGE, _F.TYPE_ENUM

ENUMS = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}

# message -> (oneof names, fields); a field is (name, number, type, repeated, type_name, oneof, optional)
MESSAGES: dict[str, tuple[list[str], list[tuple]]] = {
    "SampleResponse": ([], [
        ("sequences", 1, _MSG, True, "SampledSequence", None, False),
        ("prompt_logprobs", 2, _BYTES, False, None, None, True),
        ("topk_prompt_logprobs", 3, _MSG, False, "TopkLogprobs", None, True),
        ("prompt_cache_hit_tokens", 4, _I32, False, None, None, False),
        ("target_prompt_logprobs", 5, _MSG, False, "Tensor", None, True),
        ("prompt_alt_tokens", 6, _MSG, False, "PromptAltTokens", None, True),
    ]),
    "PromptAltTokens": ([], [
        ("tokens", 1, _MSG, False, "Tensor", None, False),
        ("logprobs", 2, _MSG, False, "Tensor", None, False),
    ]),
    "SampledSequence": ([], [
        ("stop_reason", 1, _ENUM, False, "StopReason", None, False),
        ("tokens", 2, _BYTES, False, None, None, False),
        ("logprobs", 3, _BYTES, False, None, None, True),
        ("topk_sampled_logprobs", 4, _MSG, False, "TopkLogprobs", None, True),
    ]),
    "TopkLogprobs": ([], [
        ("token_ids", 1, _BYTES, False, None, None, False),
        ("logprobs", 2, _BYTES, False, None, None, False),
        ("k", 3, _U32, False, None, None, False),
        ("length", 4, _U32, False, None, None, False),
    ]),
    "SparseCsr": ([], [
        ("values", 1, _BYTES, False, None, None, False),
        ("crow_indices", 2, _BYTES, False, None, None, False),
        ("col_indices", 3, _BYTES, False, None, None, False),
    ]),
    "Tensor": (["encoding"], [
        ("dense", 1, _BYTES, False, None, 0, False),
        ("sparse_csr", 2, _MSG, False, "SparseCsr", 0, False),
        ("dtype", 3, _ENUM, False, "DType", None, False),
        ("shape", 4, _I64, True, None, None, False),
    ]),
    "BatchedTensor": ([], [
        ("data", 1, _BYTES, False, None, None, False),
        ("offsets", 2, _BYTES, False, None, None, False),
        ("dtype", 3, _ENUM, False, "DType", None, False),
        ("trailing_shape", 4, _I64, True, None, None, False),
    ]),
    "ArrayRecord": ([], [
        ("type_tag", 1, _STR, False, None, None, False),
        ("fields", 2, _MSG, True, "ArrayRecord.FieldsEntry", None, False),
        ("num_datums", 3, _I64, False, None, None, False),
    ]),
    "ForwardBackwardOutput": ([], [
        ("loss_fn_output_type", 1, _STR, False, None, None, False),
        ("loss_fn_outputs", 2, _MSG, True, "ArrayRecord", None, False),
        ("metrics", 3, _MSG, True, "ForwardBackwardOutput.MetricsEntry", None, False),
    ]),
    "ForwardBackwardRequest": ([], [
        ("model_id", 1, _STR, False, None, None, False),
        ("seq_id", 2, _I32, False, None, None, False),
        ("data", 3, _MSG, True, "Datum", None, False),
        ("loss_fn", 4, _STR, False, None, None, False),
        ("loss_fn_config", 5, _MSG, True, "ForwardBackwardRequest.LossFnConfigEntry", None, False),
        ("forward_only", 6, _BOOL, False, None, None, False),
        ("loss_fn_config_v2", 7, _MSG, True, "ForwardBackwardRequest.LossFnConfigV2Entry", None, False),
    ]),
    "LossConfigValue": (["value"], [
        ("number", 1, _DBL, False, None, 0, False),
        ("text", 2, _STR, False, None, 0, False),
    ]),
    "Datum": ([], [
        ("model_input", 1, _MSG, True, "Chunk", None, False),
        ("loss_fn_inputs", 2, _MSG, True, "Datum.LossFnInputsEntry", None, False),
        ("model_input_spans", 3, _MSG, True, "ProvenanceSpan", None, False),
        ("loss_fn_input_spans", 4, _MSG, True, "ProvenanceSpan", None, False),
    ]),
    "ProvenanceSpan": (["span"], [
        ("prompt_tokens", 1, _MSG, False, "PromptProvenanceSpan", 0, False),
        ("sampled_tokens", 2, _MSG, False, "SampledProvenanceSpan", 0, False),
    ]),
    "PromptProvenanceSpan": ([], [
        ("sequence_id", 1, _STR, False, None, None, False),
        ("offset", 2, _I64, False, None, None, False),
        ("length", 3, _I64, False, None, None, False),
    ]),
    "SampledProvenanceSpan": ([], [
        ("sequence_id", 1, _STR, False, None, None, False),
        ("offset", 2, _I64, False, None, None, False),
        ("length", 3, _I64, False, None, None, False),
    ]),
    "Chunk": (["chunk"], [
        ("encoded_text", 1, _MSG, False, "EncodedTextChunk", 0, False),
        ("image", 2, _MSG, False, "ImageChunk", 0, False),
        ("dmel", 3, _MSG, False, "DmelChunk", 0, False),
    ]),
    "EncodedTextChunk": ([], [("tokens", 1, _BYTES, False, None, None, False)]),
    "ImageChunk": ([], [
        ("data", 1, _BYTES, False, None, None, False),
        ("format", 2, _STR, False, None, None, False),
        ("expected_tokens", 3, _I32, False, None, None, True),
        ("override_dimensions", 4, _MSG, False, "ImageDimensions", None, True),
    ]),
    "ImageDimensions": ([], [
        ("width", 1, _U32, False, None, None, False),
        ("height", 2, _U32, False, None, None, False),
    ]),
    "DmelChunk": ([], [("dmel", 1, _BYTES, False, None, None, False)]),
}

# map<K, V> fields are nested "Entry" messages with map_entry set.
MAP_ENTRIES = {
    "ArrayRecord.FieldsEntry": (_STR, (_MSG, "BatchedTensor")),
    "ForwardBackwardOutput.MetricsEntry": (_STR, (_DBL, None)),
    "ForwardBackwardRequest.LossFnConfigEntry": (_STR, (_DBL, None)),
    "ForwardBackwardRequest.LossFnConfigV2Entry": (_STR, (_MSG, "LossConfigValue")),
    "Datum.LossFnInputsEntry": (_STR, (_MSG, "Tensor")),
}


def _add_field(msg: descriptor_pb2.DescriptorProto, name: str, number: int, ftype: int, repeated: bool,
               type_name: str | None, oneof: int | None = None) -> descriptor_pb2.FieldDescriptorProto:
    field = msg.field.add(name=name, number=number, type=ftype, label=_REP if repeated else _OPT)
    if type_name:
        field.type_name = f".{PACKAGE}.{type_name}"
    if oneof is not None:
        field.oneof_index = oneof
    return field


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name="grpo_tinker_public.proto", package=PACKAGE, syntax="proto3")
    for name, values in ENUMS.items():
        enum = fdp.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, (oneofs, fields) in MESSAGES.items():
        msg = fdp.message_type.add(name=name)
        for oneof in oneofs:
            msg.oneof_decl.add(name=oneof)
        # proto3 `optional` is a synthetic oneof per field, declared after the real ones.
        for fname, number, ftype, repeated, type_name, oneof, optional in fields:
            field = _add_field(msg, fname, number, ftype, repeated, type_name, oneof)
            if optional:
                field.proto3_optional = True
                field.oneof_index = len(msg.oneof_decl)
                msg.oneof_decl.add(name=f"_{fname}")
        for entry_name, (key_type, (value_type, value_msg)) in MAP_ENTRIES.items():
            parent, _, short = entry_name.partition(".")
            if parent != name:
                continue
            entry = msg.nested_type.add(name=short)
            entry.options.map_entry = True
            _add_field(entry, "key", 1, key_type, False, None)
            _add_field(entry, "value", 2, value_type, False, value_msg)
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_build_file())


def message_class(name: str) -> type:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ForwardBackwardRequest = message_class("ForwardBackwardRequest")
ForwardBackwardOutput = message_class("ForwardBackwardOutput")
SampleResponse = message_class("SampleResponse")
ArrayRecord = message_class("ArrayRecord")
Tensor = message_class("Tensor")
