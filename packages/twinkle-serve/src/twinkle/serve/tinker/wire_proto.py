"""The Tinker protobuf messages the server reads and writes, declared here by field number.

The SDK (0.38) sends `forward_backward` bodies as protobuf and expects ForwardBackwardOutput and
SampleResponse results as protobuf. We declare the subset we need as a FileDescriptorProto built in
code (no protoc step, no dependency on the SDK): only field numbers and types matter on the wire,
and fields we do not declare are skipped by the parser.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_PKG = "twinkle_tinker_wire"


def _field(msg, name, number, ftype, *, repeated=False, type_name=None, oneof=None, optional=False):
    f = msg.field.add(name=name, number=number, type=ftype, label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    if type_name:
        f.type_name = f".{_PKG}.{type_name}"
    if oneof is not None:
        f.oneof_index = oneof
    if optional:
        f.proto3_optional = True
    return f


def _map(file, msg, name, number, value_type, value_type_name=None):
    entry_name = "".join(p.capitalize() for p in name.split("_")) + "Entry"
    entry = msg.nested_type.add(name=entry_name)
    entry.options.map_entry = True
    _field(entry, "key", 1, _F.TYPE_STRING)
    _field(entry, "value", 2, value_type, type_name=value_type_name)
    f = msg.field.add(name=name, number=number, type=_F.TYPE_MESSAGE, label=_F.LABEL_REPEATED)
    f.type_name = f".{_PKG}.{msg.name}.{entry_name}"


def _optional_oneof(msg, field_name):
    """proto3 `optional` is a synthetic oneof named `_<field>`; returns its index."""
    msg.oneof_decl.add(name=f"_{field_name}")
    return len(msg.oneof_decl) - 1


def _build():
    fd = descriptor_pb2.FileDescriptorProto(name="twinkle_tinker_wire.proto", package=_PKG, syntax="proto3")
    dtype = fd.enum_type.add(name="DType")
    for i, n in enumerate(["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"]):
        dtype.value.add(name=n, number=i)
    stop = fd.enum_type.add(name="StopReason")
    stop.value.add(name="STOP_REASON_STOP", number=0)
    stop.value.add(name="STOP_REASON_LENGTH", number=1)

    m = fd.message_type.add(name="SparseCsr")
    _field(m, "values", 1, _F.TYPE_BYTES)
    _field(m, "crow_indices", 2, _F.TYPE_BYTES)
    _field(m, "col_indices", 3, _F.TYPE_BYTES)

    m = fd.message_type.add(name="Tensor")
    m.oneof_decl.add(name="encoding")
    _field(m, "dense", 1, _F.TYPE_BYTES, oneof=0)
    _field(m, "sparse_csr", 2, _F.TYPE_MESSAGE, type_name="SparseCsr", oneof=0)
    _field(m, "dtype", 3, _F.TYPE_ENUM, type_name="DType")
    _field(m, "shape", 4, _F.TYPE_INT64, repeated=True)

    m = fd.message_type.add(name="EncodedTextChunk")
    _field(m, "tokens", 1, _F.TYPE_BYTES)
    m = fd.message_type.add(name="ImageChunk")
    _field(m, "data", 1, _F.TYPE_BYTES)
    _field(m, "format", 2, _F.TYPE_STRING)
    _field(m, "expected_tokens", 3, _F.TYPE_INT32, oneof=_optional_oneof(m, "expected_tokens"), optional=True)
    m = fd.message_type.add(name="DmelChunk")
    _field(m, "dmel", 1, _F.TYPE_BYTES)
    m = fd.message_type.add(name="Chunk")
    m.oneof_decl.add(name="chunk")
    _field(m, "encoded_text", 1, _F.TYPE_MESSAGE, type_name="EncodedTextChunk", oneof=0)
    _field(m, "image", 2, _F.TYPE_MESSAGE, type_name="ImageChunk", oneof=0)
    _field(m, "dmel", 3, _F.TYPE_MESSAGE, type_name="DmelChunk", oneof=0)

    for name in ("PromptProvenanceSpan", "SampledProvenanceSpan"):  # stable_reinforce's provenance
        m = fd.message_type.add(name=name)
        _field(m, "sequence_id", 1, _F.TYPE_STRING)
        _field(m, "offset", 2, _F.TYPE_INT64)
        _field(m, "length", 3, _F.TYPE_INT64)
    m = fd.message_type.add(name="ProvenanceSpan")
    m.oneof_decl.add(name="span")
    _field(m, "prompt_tokens", 1, _F.TYPE_MESSAGE, type_name="PromptProvenanceSpan", oneof=0)
    _field(m, "sampled_tokens", 2, _F.TYPE_MESSAGE, type_name="SampledProvenanceSpan", oneof=0)

    m = fd.message_type.add(name="Datum")
    _field(m, "model_input", 1, _F.TYPE_MESSAGE, repeated=True, type_name="Chunk")
    _map(fd, m, "loss_fn_inputs", 2, _F.TYPE_MESSAGE, "Tensor")
    _field(m, "model_input_spans", 3, _F.TYPE_MESSAGE, repeated=True, type_name="ProvenanceSpan")
    _field(m, "loss_fn_input_spans", 4, _F.TYPE_MESSAGE, repeated=True, type_name="ProvenanceSpan")

    m = fd.message_type.add(name="LossConfigValue")
    m.oneof_decl.add(name="value")
    _field(m, "number", 1, _F.TYPE_DOUBLE, oneof=0)
    _field(m, "text", 2, _F.TYPE_STRING, oneof=0)

    m = fd.message_type.add(name="ForwardBackwardRequest")
    _field(m, "model_id", 1, _F.TYPE_STRING)
    _field(m, "seq_id", 2, _F.TYPE_INT32)
    _field(m, "data", 3, _F.TYPE_MESSAGE, repeated=True, type_name="Datum")
    _field(m, "loss_fn", 4, _F.TYPE_STRING)
    _map(fd, m, "loss_fn_config", 5, _F.TYPE_DOUBLE)
    _field(m, "forward_only", 6, _F.TYPE_BOOL)
    _map(fd, m, "loss_fn_config_v2", 7, _F.TYPE_MESSAGE, "LossConfigValue")

    m = fd.message_type.add(name="BatchedTensor")
    _field(m, "data", 1, _F.TYPE_BYTES)
    _field(m, "offsets", 2, _F.TYPE_BYTES)
    _field(m, "dtype", 3, _F.TYPE_ENUM, type_name="DType")
    _field(m, "trailing_shape", 4, _F.TYPE_INT64, repeated=True)

    m = fd.message_type.add(name="ArrayRecord")
    _field(m, "type_tag", 1, _F.TYPE_STRING)
    _map(fd, m, "fields", 2, _F.TYPE_MESSAGE, "BatchedTensor")
    _field(m, "num_datums", 3, _F.TYPE_INT64)

    m = fd.message_type.add(name="ForwardBackwardOutput")
    _field(m, "loss_fn_output_type", 1, _F.TYPE_STRING)
    _field(m, "loss_fn_outputs", 2, _F.TYPE_MESSAGE, repeated=True, type_name="ArrayRecord")
    _map(fd, m, "metrics", 3, _F.TYPE_DOUBLE)

    m = fd.message_type.add(name="TopkLogprobs")  # dense row-major [length, k]
    _field(m, "token_ids", 1, _F.TYPE_BYTES)  # int32
    _field(m, "logprobs", 2, _F.TYPE_BYTES)  # float32
    _field(m, "k", 3, _F.TYPE_UINT32)
    _field(m, "length", 4, _F.TYPE_UINT32)

    m = fd.message_type.add(name="SampledSequence")
    _field(m, "stop_reason", 1, _F.TYPE_ENUM, type_name="StopReason")
    _field(m, "tokens", 2, _F.TYPE_BYTES)
    _field(m, "logprobs", 3, _F.TYPE_BYTES, oneof=_optional_oneof(m, "logprobs"), optional=True)
    _field(
        m,
        "topk_sampled_logprobs",
        4,
        _F.TYPE_MESSAGE,
        type_name="TopkLogprobs",
        oneof=_optional_oneof(m, "topk_sampled_logprobs"),
        optional=True,
    )

    m = fd.message_type.add(name="PromptAltTokens")  # both dense [len(prompt) - 1, k]
    _field(m, "tokens", 1, _F.TYPE_MESSAGE, type_name="Tensor")
    _field(m, "logprobs", 2, _F.TYPE_MESSAGE, type_name="Tensor")

    m = fd.message_type.add(name="SampleResponse")
    _field(m, "sequences", 1, _F.TYPE_MESSAGE, repeated=True, type_name="SampledSequence")
    _field(m, "prompt_logprobs", 2, _F.TYPE_BYTES, oneof=_optional_oneof(m, "prompt_logprobs"), optional=True)
    _field(
        m,
        "topk_prompt_logprobs",
        3,
        _F.TYPE_MESSAGE,
        type_name="TopkLogprobs",
        oneof=_optional_oneof(m, "topk_prompt_logprobs"),
        optional=True,
    )
    _field(m, "prompt_cache_hit_tokens", 4, _F.TYPE_INT32)
    _field(
        m,
        "target_prompt_logprobs",
        5,
        _F.TYPE_MESSAGE,
        type_name="Tensor",
        oneof=_optional_oneof(m, "target_prompt_logprobs"),
        optional=True,
    )
    _field(
        m,
        "prompt_alt_tokens",
        6,
        _F.TYPE_MESSAGE,
        type_name="PromptAltTokens",
        oneof=_optional_oneof(m, "prompt_alt_tokens"),
        optional=True,
    )

    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PKG}.{name}"))
        for name in (
            "Tensor",
            "Datum",
            "Chunk",
            "ForwardBackwardRequest",
            "ForwardBackwardOutput",
            "ArrayRecord",
            "BatchedTensor",
            "SampleResponse",
            "SampledSequence",
        )
    }


_CLASSES = _build()
Tensor = _CLASSES["Tensor"]
ForwardBackwardRequest = _CLASSES["ForwardBackwardRequest"]
ForwardBackwardOutput = _CLASSES["ForwardBackwardOutput"]
SampleResponse = _CLASSES["SampleResponse"]

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
STOP_REASON_STOP, STOP_REASON_LENGTH = 0, 1
