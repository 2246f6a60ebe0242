"""The Tinker wire format (`plexrl/server/tinker/proto.py`: our schema on the protobuf library) against the SDK's own
schema, encoders and decoders (`tinker.proto`): every message and field the server reads or writes is the SDK's
(name, number, type, repeated, map and message types), what the SDK sends we read, what we send the SDK reads, and
a malformed body is a `WireError` (never a hang, a crash or a huge allocation); tensors decode dense and sparse,
and bad ones are refused with the reason (`decode.py`)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as sdk  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402
from tinker.types.tensor_data import TensorData  # noqa: E402

from plexrl.server.tinker import decode, proto  # noqa: E402
from plexrl.server.tinker.config import TinkerConfig  # noqa: E402


def request(data: list[types.Datum], loss: str = "ppo", config: dict[str, float | str] | None = None) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
        model_id="s0123456789abcdef:train:3", seq_id=7,
    )  # fmt: skip
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = True
    return msg.SerializeToString()


def _messages(desc: Any) -> Iterator[Any]:
    yield desc
    for nested in desc.nested_types:  # (a map's entry type)
        yield from _messages(nested)


def _shape(f: Any) -> tuple[Any, ...]:
    kind = f.message_type or f.enum_type
    return f.number, f.type, f.is_repeated, kind.full_name if kind else None


def schema_disagreements() -> list[str]:
    """Where our schema differs from the SDK's, for every message, field and enum value the server declares."""
    problems, fields = [], 0
    for top in proto.FILE.message_types_by_name.values():
        for ours in _messages(top):
            try:
                theirs = sdk.DESCRIPTOR.pool.FindMessageTypeByName(ours.full_name)
            except KeyError:
                problems.append(f"{ours.full_name}: no such message in the SDK")
                continue
            if ours.GetOptions().map_entry != theirs.GetOptions().map_entry:
                problems.append(f"{ours.full_name}: a map entry in one schema only")
            for f in ours.fields:
                fields += 1
                t = theirs.fields_by_name.get(f.name)
                if t is None or _shape(f) != _shape(t):
                    problems.append(f"{f.full_name}: ours {_shape(f)}, the SDK's {t and _shape(t)}")
                elif f.containing_oneof and f.containing_oneof.name != getattr(t.containing_oneof, "name", None):
                    problems.append(f"{f.full_name}: in oneof {f.containing_oneof.name}, not in the SDK's")
    for name, values in proto.ENUMS.items():
        theirs = {v.name: v.number for v in sdk.DESCRIPTOR.enum_types_by_name[name].values}
        problems += [f"{name}.{v}: ours {i}, the SDK's {theirs.get(v)}" for i, v in enumerate(values)
                     if theirs.get(v) != i]  # fmt: skip
    assert fields >= 40, fields  # (every field of the schema was compared)
    return problems


def test_the_schema_is_the_sdks() -> None:
    problems = schema_disagreements()
    assert not problems, "the server's schema (proto.SCHEMA) differs from the SDK's:\n" + "\n".join(problems)


def test_the_server_does_not_import_the_sdk() -> None:
    """(The SDK is a test dependency only: the schema above is the server's own.)"""
    for path in Path(proto.__file__).parents[1].rglob("*.py"):  # plexrl/server
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            assert not [n for n in names if n.split(".")[0] == "tinker"], f"{path} imports {names}"


def test_what_the_sdk_sends_is_read_dense_and_sparse() -> None:
    sparse = torch.zeros((3, 4), dtype=torch.int64)
    sparse[1, 2] = 9
    d = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_torch(torch.tensor([6, 7, 8])),
            "weights": TensorData.from_torch(torch.tensor([0.0, 1.0, 0.5])),
            "grid": TensorData.from_torch_sparse(sparse),
        },
    )
    wire = proto.decode_forward_backward(request([d, d], config={"clip_low_threshold": 0.7, "note": "x"}))
    assert (wire.model_id, wire.seq_id, wire.loss_fn, wire.forward_only) == (
        "s0123456789abcdef:train:3",
        7,
        "ppo",
        True,
    )
    assert wire.config == {"clip_low_threshold": 0.7, "note": "x"} and len(wire.data) == 2
    assert decode.tokens_of(wire.data[0].chunks, "x").tolist() == [5, 6, 7]
    inputs = wire.data[0].inputs
    assert decode.tensor("w", inputs["weights"], 100).tolist() == [0.0, 1.0, 0.5]
    assert decode.tensor("t", inputs["target_tokens"], 100).dtype == np.int64
    assert np.array_equal(decode.tensor("g", inputs["grid"], 100), sparse.numpy())
    # provenance spans are a flag; fields the schema does not name (a newer SDK's: 101, 102) are ignored
    msg = sdk.ForwardBackwardRequest.FromString(request([d]))
    msg.data[0].model_input_spans.add().prompt_tokens.sequence_id = "s/0/0"
    datum = msg.data[0].SerializeToString() + b"\xb2\x06\x02hi"  # field 102 (bytes), inside the datum
    msg.ClearField("data")
    n = len(datum)
    length = bytes([0x80 | n & 0x7F, n >> 7]) if n > 127 else bytes([n])
    newer = msg.SerializeToString() + b"\xa8\x06\x01" + b"\x1a" + length + datum  # field 101 (varint) at the top
    got = proto.decode_forward_backward(newer)
    assert got.data[0].spans and not proto.decode_forward_backward(request([d])).data[0].spans
    got.data[0].spans = False
    assert got == proto.decode_forward_backward(request([d]))


def test_what_we_send_the_sdk_reads() -> None:
    seqs = [{"stop_reason": "stop", "tokens": np.array([5, 6]), "logprobs": np.array([-1.0, -2.0])},
            {"stop_reason": "length", "tokens": np.array([7]), "logprobs": np.array([-3.0])}]  # fmt: skip
    topk = {"token_ids": np.array([[1, 2], [3, 4], [5, 6]]), "logprobs": np.full((3, 2), -0.5)}
    got = deserialize_sample_response(proto.encode_sample_response(seqs, np.array([np.nan, -1.5, -2.5]), topk))
    assert [s.tokens for s in got.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert got.sequences[0].logprobs == [-1.0, -2.0] and got.prompt_logprobs == [None, -1.5, -2.5]
    top = got.topk_prompt_logprobs_np
    assert top is not None and top.token_ids.tolist() == [[1, 2], [3, 4], [5, 6]] and (top.logprobs == -0.5).all()
    assert deserialize_sample_response(proto.encode_sample_response(seqs[1:], None)).prompt_logprobs is None
    outputs = [{"logprobs": np.array([-1.0, -2.0, -3.0])}, {"logprobs": np.array([[-4.0, -5.0]])}]
    body = proto.encode_forward_backward_output(outputs, {"loss:sum": 3.5, "a": 1.0})
    out = deserialize_forward_backward_output(body)
    assert out.metrics == {"loss:sum": 3.5, "a": 1.0}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0, -3.0], [[-4.0, -5.0]]]
    assert body == proto.encode_forward_backward_output(outputs, {"a": 1.0, "loss:sum": 3.5})  # (maps in key order)


@pytest.mark.parametrize(
    "body",
    [
        b"\x0a",  # truncated: a length missing
        b"\x0a\xff\xff\xff\xff\x0f",  # a declared length past the end
        b"\x1a\x05\x0a\x03\x0a",  # a datum whose length runs past the body
        b"\xff" * 11,  # a varint of more than 10 bytes
        b"\x0b\x00",  # a group never ended
        b"\x19\x00",  # a truncated fixed64
        b"\x22\x01\xff",  # loss_fn not UTF-8
        b"\x5b" * 200_000,  # groups of an unknown field nested 200000 deep
        b"\x1a\x02\x0b\x00",  # a datum holding a group never ended
    ],
)
def test_a_malformed_body_is_a_wire_error(body: bytes) -> None:
    with pytest.raises(proto.WireError, match=r"does not parse as a tinker_public\.ForwardBackwardRequest"):
        proto.decode_forward_backward(body)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"\x18\x01", "data of ForwardBackwardRequest"),  # a message as a varint
        (b"\x21" + b"\0" * 8, "loss_fn of ForwardBackwardRequest"),  # a string as a fixed64
        (b"\x1a\x02\x08\x01", "model_input of Datum"),
        (b"\x1a\x06\x0a\x04\x0a\x02\x08\x05", "tokens of EncodedTextChunk"),
        (b"\x1a\x09\x12\x07\x0a\x01x\x12\x02\x1a\x00", "dtype of Tensor"),  # an enum as bytes
    ],
)
def test_a_field_of_the_wrong_wire_type_is_named(body: bytes, field: str) -> None:
    with pytest.raises(proto.WireError, match=f"field {field} has the wrong wire type"):
        proto.decode_forward_backward(body)


def test_sizes_past_the_bounds_are_too_large() -> None:
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={})
    with pytest.raises(proto.TooLarge, match=r"max_datums \(2\)"):
        proto.decode_forward_backward(request([d] * 2) + b"\x1a\x00" * 10_000, max_datums=2)
    with pytest.raises(proto.TooLarge, match="neither tokens nor tensors"):  # (a newer client's fields, but so many)
        proto.decode_forward_backward(request([d]) + b"\xa8\x06\x01" * 30_000)
    chunks = b"\x0a\x00" * (proto.MAX_DATUM_PARTS + 1)
    with pytest.raises(proto.TooLarge, match="model-input chunks"):
        proto.decode_forward_backward(b"\x1a" + bytes([0x80 | len(chunks) & 0x7F, len(chunks) >> 7]) + chunks)
    shape = b"\x22\x09" + b"\x01" * 9  # a tensor of 9 dimensions
    entry = b"\x0a\x01x\x12" + bytes([len(shape)]) + shape
    datum = b"\x12" + bytes([len(entry)]) + entry
    with pytest.raises(proto.WireError, match="more than 8 dimensions"):
        proto.decode_forward_backward(b"\x1a" + bytes([len(datum)]) + datum)


def test_a_body_past_max_datums_is_refused_before_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The top level's tags and lengths alone count the datums (the parse builds 20-30 bytes a wire byte first):
    an 8 MiB body of 4 M empty datums, the default `max_body_bytes`, is refused with nothing parsed."""
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={})
    assert proto.prescan(request([d] * 3), 3) == 3  # (what the SDK sends: counted, not refused)

    def parsed() -> None:
        raise AssertionError("the body was parsed")

    monkeypatch.setattr(proto, "ForwardBackwardRequest", parsed)
    flood = b"\x1a\x00" * (4 << 20)
    with pytest.raises(proto.TooLarge, match=r"max_datums \(256\)"):
        proto.decode_forward_backward(flood, max_datums=256)
    # after a model id, a group of an unknown field and a known field of another wire type: counted all the same
    for head in (b"\x0a\x02ab", b"\x5b\x08\x01\x1a\x00\x5c", b"\x18\x01"):
        with pytest.raises(proto.TooLarge, match=r"max_datums \(256\)"):
            proto.decode_forward_backward(head + flood[:514], max_datums=256)
    with pytest.raises(proto.TooLarge, match="outside its datums"):  # (a newer client's fields, but so many)
        proto.decode_forward_backward(b"\xa8\x06\x01" * 30_000 + flood, max_datums=256)


def test_bad_tensors_are_refused_with_the_reason() -> None:
    def wire(**fields: object) -> proto.WireTensor:
        return proto.WireTensor(**{"dtype": "float32", "shape": [3], **fields})  # type: ignore[arg-type]

    for t, why in [
        (wire(dense=b"\0" * 8), "bytes do not hold shape"),
        (wire(dtype="bfloat16", dense=b"\0" * 6), "dtype bfloat16 is not served"),
        (wire(shape=[2, 2, 2], dense=b"\0" * 32), "1 or 2 non-negative dimensions"),
        (wire(shape=[10**9], dense=b""), "exceed this server's"),
        (
            wire(
                shape=[2, 2],
                values=b"\0" * 4,
                crow=np.array([0, 1, 9], "<i8").tobytes(),
                col=np.array([0], "<i8").tobytes(),
            ),
            "out of range",
        ),
    ]:
        with pytest.raises(decode.Refused, match=why):
            decode.tensor("x", t, 1000)


def test_a_call_is_checked_whole_before_anything_is_queued() -> None:
    limits, cfg = decode.ModelLimits(vocab=50, context=8), TinkerConfig(max_datums=2)
    good = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": TensorData.from_torch(torch.tensor([2, 3, 4])),
                        "logprobs": TensorData.from_torch(torch.zeros(3)),
                        "advantages": TensorData.from_torch(torch.ones(3))},
    )  # fmt: skip
    call = decode.forward_backward(proto.decode_forward_backward(request([good])), limits, cfg)
    assert call.loss == "ppo" and not call.backward and call.data[0].tokens.tolist() == [1, 2, 3]

    def like(**update: object) -> types.Datum:
        fields = {"model_input": good.model_input, "loss_fn_inputs": good.loss_fn_inputs, **update}
        return types.Datum(**fields)  # type: ignore[arg-type]

    masked = like(loss_fn_inputs={**good.loss_fn_inputs, "mask": good.loss_fn_inputs["logprobs"]})
    cases = {
        "413": request([good] * 3),  # more datums than max_datums
        "remove mask": request([masked]),  # an input the loss does not take (the cookbook removes it before sending)
        "exceed the model's context": request([like(model_input=types.ModelInput.from_ints(list(range(9))))]),
        "not served": request([good], loss="gspo"),
        "takes the config keys": request([good], config={"beta": 1.0}),
    }
    for why, body in cases.items():
        with pytest.raises(decode.Refused) as exc:
            decode.forward_backward(proto.decode_forward_backward(body), limits, cfg)
        assert why in f"{exc.value.status} {exc.value.message}"
