"""The protobuf messages of the Tinker wire protocol that the SDK sends or expects as protobuf: the
`forward_backward` request body (in), and the `SampleResponse` and `ForwardBackwardOutput` results of a
future (out, when the client asks with `Accept: application/x-protobuf`). Everything else is JSON.

A small protobuf wire-format codec of our own (varints, length-delimited fields, little-endian fixed 64-bit),
with the field numbers of the protocol's messages; no generated code and no protobuf dependency. Decoding is
bounded: every length is checked against what is left of the buffer, nesting is fixed by the schema, and
anything malformed raises `WireError` (the server answers 400).

Messages (field number: name):
- ForwardBackwardRequest: 1 model_id (string), 2 seq_id (int32), 3 data (repeated Datum), 4 loss_fn (string),
  5 loss_fn_config (map string -> double), 6 forward_only (bool), 7 loss_fn_config_v2 (map string ->
  {1 number: double, 2 text: string}; preferred when present)
- Datum: 1 model_input (repeated Chunk), 2 loss_fn_inputs (map string -> Tensor), 3, 4 provenance spans
- Chunk: 1 encoded_text {1 tokens: bytes, int32 little-endian}, 2 image, 3 dmel (not served)
- Tensor: 1 dense (bytes), 2 sparse_csr {1 values, 2 crow_indices (int64), 3 col_indices (int64)}, 3 dtype
  (1 float32, 2 int64, 3 int32, 4 bfloat16), 4 shape (repeated int64)
- SampleResponse: 1 sequences (repeated {1 stop_reason: 0 stop / 1 length, 2 tokens: int32 bytes, 3 logprobs:
  float32 bytes}), 2 prompt_logprobs (float32 bytes, NaN where not scored)
- ForwardBackwardOutput: 1 loss_fn_output_type (string), 2 loss_fn_outputs (repeated ArrayRecord {1 type_tag,
  2 fields: map string -> BatchedTensor {1 data, 2 offsets: int64 byte offsets, one per datum + 1, 3 dtype,
  4 trailing_shape}, 3 num_datums}), 3 metrics (map string -> double)
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FLOAT32, INT64, INT32, BFLOAT16 = 1, 2, 3, 4
DTYPE_NAMES = {FLOAT32: "float32", INT64: "int64", INT32: "int32", BFLOAT16: "bfloat16"}


class WireError(ValueError):
    """A malformed protobuf body."""


class TooLarge(WireError):
    """A body that decodes to more than a request may hold (the server answers 413)."""


MAX_FIELDS = 1 << 16  # fields of one message (a datum's chunks and inputs, a chunk's token runs)
MAX_DATUM_FIELDS = 256  # a datum's inputs, or its model input's chunks
MAX_DIMS = 8  # entries of a tensor's shape read before it is refused


# -- reading ------------------------------------------------------------------------------------------
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def fields(buf: bytes, most: int = MAX_FIELDS) -> Iterator[tuple[int, int, Any]]:
    """The (field number, wire type, value) of a message, in order: an int for varints, bytes for
    length-delimited fields, an int (the raw little-endian bits) for fixed 32 / 64-bit ones. Read as they
    are used (nothing is built for fields not yet reached); `TooLarge` past `most` fields."""
    pos, count = 0, 0
    value: Any
    while pos < len(buf):
        count += 1
        if count > most:
            raise TooLarge(f"a message of more than {most} fields")
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise WireError("truncated fixed64")
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if size > len(buf) - pos:
                raise WireError(f"a field of {size} bytes runs past the end of the message")
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            if pos + 4 > len(buf):
                raise WireError("truncated fixed32")
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise WireError(f"unsupported wire type {wire}")
        yield number, wire, value


def _signed(v: int) -> int:
    """A varint read as a two's-complement 64-bit integer (int32 / int64 fields)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _double(v: int) -> float:
    value: float = struct.unpack("<d", v.to_bytes(8, "little"))[0]
    return value


def _string(v: Any) -> str:
    if not isinstance(v, bytes):
        raise WireError("a string field is not length-delimited")
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("a string field is not UTF-8") from exc


def _message(v: Any) -> bytes:
    if not isinstance(v, bytes):
        raise WireError("a message field is not length-delimited")
    return v


def _ints(wire: int, v: Any) -> list[int]:
    """A repeated integer field's values: packed (one length-delimited run) or one varint."""
    if wire == 0:
        return [_signed(v)]
    if wire != 2:
        raise WireError("an integer field has the wrong wire type")
    out, pos = [], 0
    while pos < len(v):
        x, pos = _varint(v, pos)
        out.append(_signed(x))
    return out


def _map_entry(buf: bytes) -> tuple[str, list[tuple[int, int, Any]]]:
    key = ""
    rest = []
    for number, wire, value in fields(buf):
        if number == 1:
            key = _string(value)
        else:
            rest.append((number, wire, value))
    return key, rest


@dataclass(slots=True)
class WireTensor:
    """A decoded `Tensor`: dtype name, shape, dense values (or the CSR parts)."""

    dtype: str
    shape: list[int]
    dense: bytes | None = None
    values: bytes | None = None
    crow: bytes | None = None
    col: bytes | None = None


def _tensor(buf: bytes) -> WireTensor:
    t = WireTensor("", [])
    for number, wire, value in fields(buf):
        if number == 1:
            t.dense = _message(value)
        elif number == 2:
            for n, _, v in fields(_message(value)):
                if n == 1:
                    t.values = _message(v)
                elif n == 2:
                    t.crow = _message(v)
                elif n == 3:
                    t.col = _message(v)
        elif number == 3:
            t.dtype = DTYPE_NAMES.get(value, f"unknown ({value})") if wire == 0 else "unknown"
        elif number == 4:
            t.shape.extend(_ints(wire, value))
            if len(t.shape) > MAX_DIMS:
                raise WireError(f"a tensor shape of more than {MAX_DIMS} dimensions")
    if t.dense is None and t.values is None:
        t.dense = b""
    return t


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


def decode_forward_backward(body: bytes, max_datums: int = 1 << 16) -> WireForwardBackward:
    """Parse a ForwardBackwardRequest (raises WireError on anything malformed, `TooLarge` as soon as it holds
    more than `max_datums` datums: nothing is built for the rest)."""
    out = WireForwardBackward()
    legacy: dict[str, float | str] = {}
    v2: dict[str, float | str] = {}
    for number, wire, value in fields(body, max_datums + 64):
        if number == 1:
            out.model_id = _string(value)
        elif number == 2:
            out.seq_id = _signed(value) if wire == 0 else -1
        elif number == 3:
            if len(out.data) >= max_datums:
                raise TooLarge(f"more than this server's max_datums ({max_datums}) datums in one call")
            out.data.append(_datum(_message(value)))
        elif number == 4:
            out.loss_fn = _string(value)
        elif number == 5:
            key, rest = _map_entry(_message(value))
            legacy[key] = next((_double(v) for n, w, v in rest if n == 2 and w == 1), 0.0)
        elif number == 6:
            out.forward_only = bool(value)
        elif number == 7:
            key, rest = _map_entry(_message(value))
            for n, _, v in rest:
                if n != 2:
                    continue
                for m, w, x in fields(_message(v)):
                    if m == 1 and w == 1:
                        v2[key] = _double(x)
                    elif m == 2:
                        v2[key] = _string(x)
    out.config = v2 or legacy
    return out


def _datum(buf: bytes) -> WireDatum:
    d = WireDatum()
    for number, _, value in fields(buf, MAX_DATUM_FIELDS):
        if number == 1:
            for n, _, v in fields(_message(value), MAX_DATUM_FIELDS):
                if n == 1:
                    tokens = b"".join(_message(x) for m, _, x in fields(_message(v)) if m == 1)
                    d.chunks.append(("encoded_text", tokens))
                else:
                    d.chunks.append(({2: "image", 3: "dmel"}.get(n, f"chunk kind {n}"), b""))
        elif number == 2:
            key, rest = _map_entry(_message(value))
            for n, _, v in rest:
                if n == 2:
                    d.inputs[key] = _tensor(_message(v))
        elif number in (3, 4):
            d.spans = True
    return d


# -- writing ------------------------------------------------------------------------------------------
def _put_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _put_varint(number << 3 | wire)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _key(number, 2) + _put_varint(len(data)) + data


def _varint_field(number: int, value: int) -> bytes:
    return _key(number, 0) + _put_varint(value)


def _double_field(number: int, value: float) -> bytes:
    return _key(number, 1) + struct.pack("<d", value)


def encode_sample_response(
    sequences: list[dict[str, Any]], prompt_logprobs: np.ndarray | None, topk: dict[str, np.ndarray] | None = None
) -> bytes:
    """A SampleResponse: per sequence its stop reason, int32 tokens and float32 log-probs; the prompt's
    log-probs (NaN where not scored) when asked for; the prompt's top-k (`topk`: `token_ids` int32 and
    `logprobs` float32, both [L, K]) as a TopkLogprobs {1 token_ids, 2 logprobs, 3 k, 4 length}."""
    out = bytearray()
    for s in sequences:
        seq = _varint_field(1, 0 if s["stop_reason"] == "stop" else 1)
        seq += _bytes_field(2, np.asarray(s["tokens"], dtype="<i4").tobytes())
        seq += _bytes_field(3, np.asarray(s["logprobs"], dtype="<f4").tobytes())
        out += _bytes_field(1, seq)
    if prompt_logprobs is not None:
        out += _bytes_field(2, np.asarray(prompt_logprobs, dtype="<f4").tobytes())
    if topk is not None:
        ids, lps = np.asarray(topk["token_ids"], dtype="<i4"), np.asarray(topk["logprobs"], dtype="<f4")
        length, k = ids.shape
        out += _bytes_field(3, _bytes_field(1, ids.tobytes()) + _bytes_field(2, lps.tobytes()) + _varint_field(3, k)
                            + _varint_field(4, length))  # fmt: skip
    return bytes(out)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: the datums' outputs as ArrayRecords, one per run of datums whose fields have the
    same trailing shape (each field a BatchedTensor: those datums' values one after another, their byte offsets,
    the trailing shape), and the metrics."""
    out = _bytes_field(1, b"ArrayRecord")
    for run in _runs(outputs):
        out += _bytes_field(2, _record(run))
    for k, v in sorted(metrics.items()):
        out += _bytes_field(3, _bytes_field(1, k.encode()) + _double_field(2, float(v)))
    return out


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


def _record(outputs: list[dict[str, np.ndarray]]) -> bytes:
    record = _bytes_field(1, b"ArrayRecord") + _varint_field(3, len(outputs))
    for name in sorted(outputs[0]):
        arrays = [np.asarray(o[name], dtype="<f4") for o in outputs]
        offsets = np.cumsum([0, *[a.nbytes for a in arrays]]).astype("<i8")
        bt = _bytes_field(1, b"".join(a.tobytes() for a in arrays)) + _bytes_field(2, offsets.tobytes())
        bt += _varint_field(3, FLOAT32)
        trailing = list(arrays[0].shape[1:])
        if trailing:
            bt += _bytes_field(4, b"".join(_put_varint(x) for x in trailing))
        record += _bytes_field(2, _bytes_field(1, name.encode()) + _bytes_field(2, bt))
    return record


__all__ = [
    "TooLarge",
    "WireDatum",
    "WireError",
    "WireForwardBackward",
    "WireTensor",
    "decode_forward_backward",
    "encode_forward_backward_output",
    "encode_sample_response",
    "fields",
]
