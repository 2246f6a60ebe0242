"""The protobuf messages of the Tinker wire protocol that the SDK sends or expects as protobuf: the
`forward_backward` request body (in), and the `SampleResponse` and `ForwardBackwardOutput` results of a
future (out, when the client asks with `Accept: application/x-protobuf`). Everything else is JSON.

`SCHEMA` and `ENUMS` are the protocol's messages (package `tinker_public`), for the fields the server reads or
writes, with the protocol's names and numbers; they become message classes of the protobuf library in a private
descriptor pool. The `tinker` SDK is not imported: tests/test_tinker_proto.py checks this schema against the SDK's
generated one. Parsing is the library's: every length is checked against the buffer, nesting is fixed by the
schema (groups of unknown fields at most 100 deep), strings must be UTF-8. A body that does not parse, holds a field
of the schema with another wire type or a shape of more than `MAX_DIMS` raises `WireError` (the server answers
400); more datums than the server takes (counted before the parse, which builds every message first: `prescan`),
more chunks or inputs than a datum may hold, or more bytes besides tokens and tensors than `MAX_OVERHEAD` allows,
`TooLarge` (413). Fields the schema does not name (a newer client's) are ignored, as protobuf does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

PACKAGE = "tinker_public"
# a message's fields, "name number type": the type a scalar (protobuf's name), an enum or a message of this schema,
# after "repeated" or "map" (string keys); "oneof NAME" after it for a member of that oneof
SCHEMA: dict[str, tuple[str, ...]] = {
    "ForwardBackwardRequest": (
        "model_id 1 string", "seq_id 2 int32", "data 3 repeated Datum", "loss_fn 4 string",
        "loss_fn_config 5 map double", "forward_only 6 bool", "loss_fn_config_v2 7 map LossConfigValue",
    ),
    "LossConfigValue": ("number 1 double oneof value", "text 2 string oneof value"),
    "Datum": (
        "model_input 1 repeated Chunk", "loss_fn_inputs 2 map Tensor", "model_input_spans 3 repeated ProvenanceSpan",
        "loss_fn_input_spans 4 repeated ProvenanceSpan",
    ),
    # (provenance spans: only whether a datum has any is read; only stable_reinforce, not served, uses them)
    "ProvenanceSpan": (
        "prompt_tokens 1 PromptProvenanceSpan oneof span", "sampled_tokens 2 SampledProvenanceSpan oneof span",
    ),
    "PromptProvenanceSpan": ("sequence_id 1 string", "offset 2 int64", "length 3 int64"),
    "SampledProvenanceSpan": ("sequence_id 1 string", "offset 2 int64", "length 3 int64"),
    "Chunk": (
        "encoded_text 1 EncodedTextChunk oneof chunk", "image 2 ImageChunk oneof chunk", "dmel 3 DmelChunk oneof chunk",
    ),
    "EncodedTextChunk": ("tokens 1 bytes",),  # int32 little-endian
    "ImageChunk": (),  # (not served: refused by kind, its fields unread)
    "DmelChunk": (),
    "Tensor": (
        "dense 1 bytes oneof encoding", "sparse_csr 2 SparseCsr oneof encoding", "dtype 3 DType",
        "shape 4 repeated int64",
    ),
    "SparseCsr": ("values 1 bytes", "crow_indices 2 bytes", "col_indices 3 bytes"),  # the indices int64
    "SampleResponse": (
        "sequences 1 repeated SampledSequence", "prompt_logprobs 2 bytes", "topk_prompt_logprobs 3 TopkLogprobs",
    ),
    "SampledSequence": ("stop_reason 1 StopReason", "tokens 2 bytes", "logprobs 3 bytes"),  # int32, float32
    "TopkLogprobs": ("token_ids 1 bytes", "logprobs 2 bytes", "k 3 uint32", "length 4 uint32"),
    "ForwardBackwardOutput": (
        "loss_fn_output_type 1 string", "loss_fn_outputs 2 repeated ArrayRecord", "metrics 3 map double",
    ),
    "ArrayRecord": ("type_tag 1 string", "fields 2 map BatchedTensor", "num_datums 3 int64"),
    # a field's values of a run of datums one after another; offsets: int64 byte offsets, one per datum + 1
    "BatchedTensor": ("data 1 bytes", "offsets 2 bytes", "dtype 3 DType", "trailing_shape 4 repeated int64"),
}  # fmt: skip
ENUMS = {  # values in order of their numbers, from 0
    "DType": ("DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"),
    "StopReason": ("STOP_REASON_STOP", "STOP_REASON_LENGTH"),
}
DTYPE_NAMES = {1: "float32", 2: "int64", 3: "int32", 4: "bfloat16"}
FLOAT32 = 1
MAX_DIMS = 8  # entries of a tensor's shape taken before it is refused
MAX_DATUM_PARTS = 256  # a datum's model-input chunks, or its loss inputs
MAX_OVERHEAD = 64 << 10  # bytes of a body besides its tokens and tensors, and 1/32 of it more a datum
MAX_GROUP_DEPTH = 100  # groups of an unknown field nested in one another (the protobuf library's limit)
MALFORMED = (f"it does not parse as a {PACKAGE}.ForwardBackwardRequest (truncated, a length past its end, a string "
             "not UTF-8 or nested too deep)")  # fmt: skip


def _file() -> descriptor_pb2.FileDescriptorProto:
    """`SCHEMA` and `ENUMS` as a proto3 file descriptor (a map: a repeated `<Name>Entry` {key, value} message)."""
    t = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(name="plexrl/tinker_public.proto", package=PACKAGE, syntax="proto3")
    for name, values in ENUMS.items():
        f.enum_type.add(name=name).value.extend(
            descriptor_pb2.EnumValueDescriptorProto(name=v, number=i) for i, v in enumerate(values)
        )

    def add(m: Any, name: str, number: int, kind: str, repeated: bool = False, oneof: str = "") -> None:
        fd = m.field.add(name=name, number=number, label=t.LABEL_REPEATED if repeated else t.LABEL_OPTIONAL)
        if kind[0].islower():
            fd.type = getattr(t, f"TYPE_{kind.upper()}")
        else:
            fd.type, fd.type_name = t.TYPE_ENUM if kind in ENUMS else t.TYPE_MESSAGE, f".{PACKAGE}.{kind}"
        if oneof:
            names = [o.name for o in m.oneof_decl]
            if oneof not in names:
                names.append(m.oneof_decl.add(name=oneof).name)
            fd.oneof_index = names.index(oneof)

    for name, fields in SCHEMA.items():
        m = f.message_type.add(name=name)
        for spec in fields:
            fname, number, *rest = spec.split()
            rest, oneof = (rest[:-2], rest[-1]) if "oneof" in rest else (rest, "")
            label, kind = (rest[0], rest[1]) if len(rest) == 2 else ("", rest[0])
            if label == "map":
                entry = m.nested_type.add(name="".join(p.capitalize() for p in fname.split("_")) + "Entry")
                entry.options.map_entry = True
                add(entry, "key", 1, "string")
                add(entry, "value", 2, kind)
                kind = f"{name}.{entry.name}"
            add(m, fname, int(number), kind, bool(label), oneof)
    return f


POOL = descriptor_pool.DescriptorPool()
FILE = POOL.AddSerializedFile(_file().SerializeToString())
ForwardBackwardRequest, SampleResponse, ForwardBackwardOutput = (
    message_factory.GetMessageClass(FILE.message_types_by_name[n])
    for n in ("ForwardBackwardRequest", "SampleResponse", "ForwardBackwardOutput")
)


class WireError(ValueError):
    """A malformed protobuf body."""


class TooLarge(WireError):
    """A body that decodes to more than a request may hold (the server answers 413)."""


@dataclass(slots=True)
class WireTensor:
    """A decoded `Tensor`: dtype name, shape, dense values (or the CSR parts)."""

    dtype: str
    shape: list[int]
    dense: bytes | None = None
    values: bytes | None = None
    crow: bytes | None = None
    col: bytes | None = None


@dataclass(slots=True)
class WireDatum:
    """A decoded `Datum`: its chunks as (kind, tokens bytes) and its loss inputs."""

    chunks: list[tuple[str, bytes]] = field(default_factory=list)
    inputs: dict[str, WireTensor] = field(default_factory=dict)
    spans: bool = False  # it carries provenance spans (taken, not checked: decode.forward_backward)


@dataclass(slots=True)
class WireForwardBackward:
    """A decoded ForwardBackwardRequest."""

    model_id: str = ""
    seq_id: int = 0
    data: list[WireDatum] = field(default_factory=list)
    loss_fn: str = ""
    config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


def _known(msg: Any) -> Any:
    """`msg`, refused when it holds a field of the schema sent with another wire type (which protobuf keeps aside,
    as an unknown field, instead of failing)."""
    for unknown in UnknownFieldSet(msg):
        f = msg.DESCRIPTOR.fields_by_number.get(unknown.field_number)
        if f is not None:
            raise WireError(f"field {f.name} of {msg.DESCRIPTOR.name} has the wrong wire type ({unknown.wire_type})")
    return msg


def prescan(body: bytes, max_datums: int) -> int:
    """The datums of a ForwardBackwardRequest counted from its top-level tags and lengths alone (a datum's content
    skipped), before the protobuf library builds anything: `TooLarge` past `max_datums` datums, or past
    `MAX_OVERHEAD` bytes outside its datums (a newer client's fields, but so many), after at most that many steps.
    (The parse builds every message of a body before anything can be counted: 20-30 bytes of memory a wire byte
    for empty ones.) Something malformed ends the count: the parse fails at that place, having built only what
    came before it; groups nested past `MAX_GROUP_DEPTH` are a `WireError` here. Returns the datums counted."""
    pos, end, datums, other, depth = 0, len(body), 0, 0, 0  # depth: inside groups of an unknown field
    while pos < end:
        start, tag = pos, body[pos]
        tag, pos = (tag, pos + 1) if tag < 0x80 else _varint(body, pos)  # (a one-byte tag: the usual case, inline)
        wire, n = tag & 7, 0
        if wire == 0:
            n, pos = _varint(body, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            n = body[pos] if pos < end else -1
            n, pos = (n, pos + 1) if 0 <= n < 0x80 else _varint(body, pos)
            pos += n
        elif wire in (3, 4):
            depth += 1 if wire == 3 else -1
        if depth > MAX_GROUP_DEPTH:  # (refused here: a parse allowing deeper groups would go on past this point)
            raise WireError(MALFORMED)
        if tag < 8 or n < 0 or wire > 5 or pos > end or depth < 0:
            return datums  # (malformed: left to the parse, which stops here)
        if depth == 0 and tag == (3 << 3 | 2):  # data, a Datum
            datums += 1
            if datums > max_datums:
                raise TooLarge(f"more than this server's max_datums ({max_datums}) datums in one call")
        else:
            other += pos - start
            if other > MAX_OVERHEAD:
                raise TooLarge(f"more than {MAX_OVERHEAD} bytes of the body outside its datums are neither tokens "
                               "nor tensors (fields this server does not know?)")  # fmt: skip
    return datums


def _varint(body: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; (-1, end) when it is truncated or longer than 10 bytes."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(body))):
        byte = body[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return -1, len(body) + 1


def decode_forward_backward(body: bytes, max_datums: int = 1 << 16) -> WireForwardBackward:
    """Parse a ForwardBackwardRequest (raises WireError on anything malformed, `TooLarge` when it holds more than
    `max_datums` datums: `prescan` refuses it before the parse, nothing is built for them)."""
    prescan(body, max_datums)
    msg = ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError:
        raise WireError(MALFORMED) from None
    if len(msg.data) > max_datums:
        raise TooLarge(f"more than this server's max_datums ({max_datums}) datums in one call")
    read = [msg, *msg.loss_fn_config_v2.values()]  # the messages read, looked at by `_known` once the size is known
    config = {k: getattr(v, v.WhichOneof("value") or "number") for k, v in msg.loss_fn_config_v2.items()}
    out = WireForwardBackward(msg.model_id, msg.seq_id, [], msg.loss_fn, config or dict(msg.loss_fn_config),
                              msg.forward_only)  # fmt: skip
    payload = 0  # bytes of tokens and tensors
    for d in msg.data:
        if len(d.model_input) > MAX_DATUM_PARTS or len(d.loss_fn_inputs) > MAX_DATUM_PARTS:
            raise TooLarge(f"a datum of more than {MAX_DATUM_PARTS} model-input chunks or loss inputs")
        texts = [(c, c.encoded_text) for c in d.model_input]
        tensors = list(d.loss_fn_inputs.items())
        chunks = [(c.WhichOneof("chunk") or "encoded_text", x.tokens) for c, x in texts]
        inputs = {k: _tensor(t) for k, t in tensors}
        out.data.append(WireDatum(chunks, inputs, len(d.model_input_spans) + len(d.loss_fn_input_spans) > 0))
        payload += sum(len(b) for _, b in chunks) + sum(len(t.dense or b"") + len(t.values or b"") + len(t.crow or b"")
                                                       + len(t.col or b"") for t in inputs.values())  # fmt: skip
        read += [d, *(m for pair in texts for m in pair), *(t for _, t in tensors)]
        read += [t.sparse_csr for k, t in tensors if inputs[k].values is not None]
    rest = len(body) - payload  # (the SDK's: ~200 bytes a datum, ~25 a provenance span; unknown fields cost ~1 us each)
    if rest > MAX_OVERHEAD + MAX_OVERHEAD // 32 * len(msg.data):
        raise TooLarge(f"{rest} bytes of the body are neither tokens nor tensors (fields this server does not know?); "
                       f"at most {MAX_OVERHEAD} and {MAX_OVERHEAD // 32} a datum")  # fmt: skip
    for m in read:
        _known(m)
    return out


def _tensor(t: Any) -> WireTensor:
    if len(t.shape) > MAX_DIMS:
        raise WireError(f"a tensor shape of more than {MAX_DIMS} dimensions")
    out = WireTensor(DTYPE_NAMES.get(t.dtype, f"unknown ({t.dtype})"), list(t.shape))
    if t.WhichOneof("encoding") == "sparse_csr":
        csr = t.sparse_csr
        out.values, out.crow, out.col = csr.values, csr.crow_indices, csr.col_indices
    else:
        out.dense = t.dense
    return out


def encode_sample_response(
    sequences: list[dict[str, Any]], prompt_logprobs: np.ndarray | None, topk: dict[str, np.ndarray] | None = None
) -> bytes:
    """A SampleResponse: per sequence its stop reason, int32 tokens and float32 log-probs; the prompt's
    log-probs (NaN where not scored) when asked for; the prompt's top-k (`topk`: `token_ids` int32 and
    `logprobs` float32, both [L, K]) as a TopkLogprobs."""
    out = SampleResponse()
    for s in sequences:
        out.sequences.add(stop_reason=0 if s["stop_reason"] == "stop" else 1,
                          tokens=np.asarray(s["tokens"], dtype="<i4").tobytes(),
                          logprobs=np.asarray(s["logprobs"], dtype="<f4").tobytes())  # fmt: skip
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    if topk is not None:
        ids, lps = np.asarray(topk["token_ids"], dtype="<i4"), np.asarray(topk["logprobs"], dtype="<f4")
        t = out.topk_prompt_logprobs
        length, k = ids.shape
        t.token_ids, t.logprobs, t.k, t.length = ids.tobytes(), lps.tobytes(), k, length
    data: bytes = out.SerializeToString()
    return data


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: the datums' outputs as ArrayRecords, one per run of datums whose fields have the
    same trailing shape (each field a BatchedTensor: those datums' values one after another, their byte offsets,
    the trailing shape), and the metrics."""
    out = ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={k: float(v) for k, v in metrics.items()})
    for run in _runs(outputs):
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(run))
        for name in sorted(run[0]):
            arrays = [np.asarray(o[name], dtype="<f4") for o in run]
            bt = record.fields[name]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = np.cumsum([0, *[a.nbytes for a in arrays]]).astype("<i8").tobytes()
            bt.dtype = FLOAT32
            bt.trailing_shape.extend(arrays[0].shape[1:])
    data: bytes = out.SerializeToString(deterministic=True)  # (metrics in key order)
    return data


def _runs(outputs: list[dict[str, np.ndarray]]) -> list[list[dict[str, np.ndarray]]]:
    """Consecutive datums whose fields have the same names and trailing shapes."""
    runs: list[list[dict[str, np.ndarray]]] = []
    key = None
    for o in outputs:
        k = tuple(sorted((name, np.shape(a)[1:]) for name, a in o.items()))
        if not runs or k != key:
            runs.append([])
            key = k
        runs[-1].append(o)
    return runs


__all__ = [
    "ENUMS",
    "FILE",
    "SCHEMA",
    "TooLarge",
    "WireDatum",
    "WireError",
    "WireForwardBackward",
    "WireTensor",
    "decode_forward_backward",
    "encode_forward_backward_output",
    "encode_sample_response",
    "prescan",
]
