"""Arrays end to end on the Tinker path: the codec yields one int64 token array per datum (read from
the protobuf's bytes), the Tinker layer's rows keep Tinker's one-token shift as arrays, the engine's collate
makes them the same tensors as list rows, and the log-probs go back as one float32 array."""

from __future__ import annotations

import numpy as np
import torch

from twinkle.model.multi_lora.batch import collate
from twinkle.serve.tinker import codec, datums
from twinkle.serve.tinker import wire_proto as pb


def _request(chunks: list[list[int]], targets: list[int], weights: list[float]) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=3, loss_fn="cross_entropy")
    d = msg.data.add()
    for tokens in chunks:  # several text chunks of one datum
        d.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
    for name, values, dtype, np_dtype in (
        ("target_tokens", targets, pb.DTYPE_INT64, np.int64),
        ("weights", weights, pb.DTYPE_FLOAT32, np.float32),
    ):
        t = d.loss_fn_inputs[name]
        t.dtype, t.dense = dtype, np.asarray(values, dtype=np_dtype).tobytes()
        t.shape.append(len(values))
    return msg.SerializeToString()


def test_the_codec_yields_arrays_that_become_the_same_tensors_as_lists():
    body = _request([[5, 9, 11], [13, 2]], [9, 11, 13, 2, 7], [0.0, 1.0, 1.0, 0.5, 1.0])
    req = codec.decode_forward_backward(body)
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("s:train:0", 3, "cross_entropy", False)
    assert req.provenance == [None]
    (datum,) = req.data
    assert isinstance(datum.tokens, np.ndarray) and datum.tokens.dtype == np.int64
    assert datum.tokens.tolist() == [5, 9, 11, 13, 2]

    (row,) = datums.rows([datum])
    assert row["input_ids"].dtype == np.int64 and row["input_ids"].tolist() == [5, 9, 11, 13, 2, 7]
    assert row["labels"].tolist() == [-100, 9, 11, 13, 2, 7]  # Tinker's shift: predict targets[t] at t
    assert row["weights"].dtype == np.float32 and row["weights"].tolist() == [0.0, 0.0, 1.0, 1.0, 0.5, 1.0]

    from_arrays = collate([row], pad_id=0)
    from_lists = collate([{k: v.tolist() for k, v in row.items()}], pad_id=0)
    assert torch.equal(from_arrays.input_ids_B_T, from_lists.input_ids_B_T)
    assert torch.equal(from_arrays.labels_B_T, from_lists.labels_B_T)
    assert torch.equal(from_arrays.fields["weights"], from_lists.fields["weights"])
    assert from_arrays.fields["weights"].tolist() == [[0.0, 0.0, 1.0, 1.0, 0.5, 1.0]]


def test_log_probs_go_back_as_one_float32_array_with_per_datum_offsets():
    logprobs = [np.array([-0.5, -1.25, -2.0], np.float32), np.array([-3.5], np.float32), np.zeros(0, np.float32)]
    out = pb.ForwardBackwardOutput()
    out.ParseFromString(codec.encode_forward_result(datums.TinkerForwardResult(logprobs, {"loss:sum": 7.25})))
    field = out.loss_fn_outputs[0].fields["logprobs"]
    assert np.frombuffer(field.data, np.float32).tolist() == [-0.5, -1.25, -2.0, -3.5]
    assert np.frombuffer(field.offsets, np.int64).tolist() == [0, 12, 16, 16]  # byte offsets of each datum
    assert out.loss_fn_outputs[0].num_datums == 3 and out.metrics["loss:sum"] == 7.25
