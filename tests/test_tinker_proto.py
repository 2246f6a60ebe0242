"""Our protobuf codec of the Tinker wire format (`plexrl/server/tinker/proto.py`) against the SDK's own encoders and
decoders (`tinker.proto`): what the SDK sends we read, what we send the SDK reads, and a malformed body is a
`WireError` (never a hang, a crash or a huge allocation); tensors decode dense and sparse, and bad ones are
refused with the reason (`decode.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
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


def test_what_we_send_the_sdk_reads() -> None:
    seqs = [{"stop_reason": "stop", "tokens": np.array([5, 6]), "logprobs": np.array([-1.0, -2.0])},
            {"stop_reason": "length", "tokens": np.array([7]), "logprobs": np.array([-3.0])}]  # fmt: skip
    got = deserialize_sample_response(proto.encode_sample_response(seqs, np.array([np.nan, -1.5, -2.5])))
    assert [s.tokens for s in got.sequences] == [[5, 6], [7]]
    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert got.sequences[0].logprobs == [-1.0, -2.0] and got.prompt_logprobs == [None, -1.5, -2.5]
    outputs = [{"logprobs": np.array([-1.0, -2.0, -3.0])}, {"logprobs": np.array([[-4.0, -5.0]])}]
    out = deserialize_forward_backward_output(proto.encode_forward_backward_output(outputs, {"loss:sum": 3.5}))
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0, -3.0], [[-4.0, -5.0]]]


@pytest.mark.parametrize(
    "body",
    [b"\x0a", b"\x0a\xff\xff\xff\xff\x0f", b"\x1a\x05\x0a\x03\x0a", b"\xff" * 11, b"\x0b\x00", b"\x19\x00"],
)
def test_a_malformed_body_is_a_wire_error(body: bytes) -> None:
    with pytest.raises(proto.WireError):
        proto.decode_forward_backward(body)


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
