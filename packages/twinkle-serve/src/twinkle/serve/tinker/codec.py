"""Tinker protobuf <-> backend data: forward_backward requests in, fwd/bwd and sample results out."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from twinkle.serve.backend import UserError
from twinkle.serve.tinker import dmel, images
from twinkle.serve.tinker import wire_proto as pb
from twinkle.serve.tinker.datums import Datum, TinkerForwardResult
from twinkle.serve.tinker.prompt_scores import TinkerSampleResult

TOPK_MASK_LOGPROB = -99999.0  # the SDK's empty-cell value in TopkLogprobs (tinker.types.topk_logprobs)
MAX_TENSOR_ELEMENTS = 1 << 26  # a sparse tensor is densified: refuse shapes no real request has
_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _buffer(data: bytes, dtype, where: str) -> np.ndarray:
    if len(data) % np.dtype(dtype).itemsize:
        raise UserError(f"{where} has {len(data)} bytes: not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(data, dtype=dtype)


def _csr_ok(crow: np.ndarray, col: np.ndarray, n_values: int, shape) -> bool:
    """A CSR layout of `shape` over `n_values` cells: rows + 1 row offsets from 0, never decreasing,
    to the value count, and a column in [0, columns) for each value."""
    rows, cols = shape
    return (
        len(crow) == rows + 1
        and len(col) == n_values
        and crow[0] == 0
        and crow[-1] == n_values
        and bool((np.diff(crow) >= 0).all())
        and bool(((col >= 0) & (col < cols)).all())
    )


def _tensor(msg, where: str) -> np.ndarray:
    if msg.dtype not in _NP:
        raise UserError(f"{where}: unsupported tensor dtype {msg.dtype}")
    dtype = _NP[msg.dtype]
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        values = _buffer(csr.values, dtype, f"{where}.sparse_csr.values")
        crow = _buffer(csr.crow_indices, np.int64, f"{where}.sparse_csr.crow_indices")
        col = _buffer(csr.col_indices, np.int64, f"{where}.sparse_csr.col_indices")
        shape = list(msg.shape)
        if len(shape) != 2:
            raise UserError(f"{where}: a sparse tensor needs a 2-d shape, got {shape}")
        if any(n < 0 for n in shape) or shape[0] * shape[1] > MAX_TENSOR_ELEMENTS:
            raise UserError(f"{where}: sparse shape {shape} is negative or too large")
        if not _csr_ok(crow, col, len(values), shape):
            raise UserError(
                f"{where}.sparse_csr: crow_indices / col_indices are not a CSR layout of shape {shape} over "
                f"{len(values)} values (crow_indices: {shape[0] + 1} offsets from 0 to {len(values)}, never "
                f"decreasing; col_indices: one per value, each in [0, {shape[1]}))"
            )
        dense = np.zeros(shape, dtype=dtype)
        dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
        return dense
    arr = _buffer(msg.dense, dtype, f"{where}.dense")
    if not msg.shape:
        return arr
    if math.prod(msg.shape) != arr.size:  # exact ints: a huge shape must not overflow to a match
        raise UserError(f"{where}: shape {list(msg.shape)} does not match {arr.size} values")
    return arr.reshape(msg.shape)  # the sent shape (a custom loss declares its inputs' ranks); a view


def _datum(i: int, d) -> Datum:
    parts: list[np.ndarray] = []  # the text chunks' int32 tokens, read in place from the body
    pieces = []  # image chunks, expanded to tokens once the model is known (tinker/images.py)
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind == "image":
            pieces.append(images.from_proto(chunk.image, sum(p.size for p in parts)))
            continue
        if kind == dmel.DMEL:
            raise UserError(dmel.refused(f"datum {i}"))
        if kind != "encoded_text":
            raise UserError(f"datum {i}: {kind or 'empty'} chunks are not supported by this server (text and images)")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    # one int64 array (the dtype of the model's input ids): it becomes a tensor without another copy
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    inputs = {name: _tensor(t, f"datum {i} loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
    return Datum(tokens, inputs, pieces or None)


@dataclass(frozen=True)
class Span:
    """One provenance run (tinker.PromptProvenanceSpan / SampledProvenanceSpan), as sent."""

    kind: str  # "prompt" | "sampled"
    sequence_id: str
    offset: int
    length: int


def _spans(d) -> tuple[list[Span], list[Span]] | None:
    """A datum's (model_input spans, loss_fn_input spans), or None when it carries no provenance."""
    if not d.model_input_spans and not d.loss_fn_input_spans:
        return None
    out = []
    for field in (d.model_input_spans, d.loss_fn_input_spans):
        runs = []
        for s in field:
            kind = s.WhichOneof("span")  # None: a span with neither set (refused when resolved)
            run = s.prompt_tokens if kind == "prompt_tokens" else s.sampled_tokens
            label = {"prompt_tokens": "prompt", "sampled_tokens": "sampled"}.get(kind, "empty")
            runs.append(Span(label, run.sequence_id, run.offset, run.length))
        out.append(runs)
    return out[0], out[1]


@dataclass(frozen=True)
class ForwardBackwardInput:
    """A decoded forward(_backward) request: everything the routes read from its one protobuf parse."""

    model_id: str
    seq_id: int
    data: list[Datum]  # each loss_fn_inputs array in its sent shape
    loss_fn: str
    loss_config: dict
    forward_only: bool
    provenance: list[tuple[list[Span], list[Span]] | None]  # per datum (stable_reinforce), None without


def decode_forward_backward(body: bytes) -> ForwardBackwardInput:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise UserError(f"forward_backward body is not a valid ForwardBackwardRequest protobuf: {e}") from None
    data = []
    for i, d in enumerate(msg.data):
        try:
            data.append(_datum(i, d))
        except ValueError as e:  # numpy: a byte buffer that is not a whole number of elements, a bad shape
            raise UserError(f"datum {i}: malformed tensor: {e}") from None
    config: dict = {k: v for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.number if v.WhichOneof("value") == "number" else v.text
    provenance = [_spans(d) for d in msg.data]
    return ForwardBackwardInput(msg.model_id, msg.seq_id, data, msg.loss_fn, config, msg.forward_only, provenance)


def encode_forward_result(result: TinkerForwardResult) -> bytes:
    """The datums' log-probs as ArrayRecords: one per run of datums with the same trailing shape ([N] or
    [N, K]: K may differ between datums), each one float32 array with per-datum byte offsets and the
    trailing shape the SDK reshapes by."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    arrays = [np.asarray(a, dtype=np.float32) for a in result.logprobs]
    runs = [list(run) for _, run in itertools.groupby(arrays, key=lambda a: a.shape[1:])] or [[]]
    for run in runs:
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(run))
        flat = np.concatenate([a.reshape(-1) for a in run]) if run else np.zeros(0, np.float32)
        offsets = np.concatenate([[0], np.cumsum([a.size for a in run], dtype=np.int64)]).astype(np.int64) * 4
        field = record.fields["logprobs"]
        field.data = flat.tobytes()
        field.offsets = offsets.tobytes()
        field.dtype = pb.DTYPE_FLOAT32
        field.trailing_shape.extend(run[0].shape[1:] if run else ())
    for k, v in result.metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def _topk(msg, rows: list, k: int) -> None:
    """Rows of (id, log-prob) pairs (None: not scored) -> Tinker's dense [length, k] TopkLogprobs; missing
    cells hold the SDK's sentinel (token 0, log-prob -99999), which it reads back as None / a shorter row."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), TOPK_MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = tok, lp
    msg.token_ids, msg.logprobs, msg.k, msg.length = ids.tobytes(), lps.tobytes(), k, len(rows)


def decode_target_ids(obj, prompt_len: int, vocab_size: int, max_cells: int):
    """asample's `target_prompt_logprobs` (TensorData JSON, dense or sparse CSR) -> (int64 [prompt_len - 1, K]
    with -1 where nothing is asked, the CSR layout (crow, col) to answer in, or None for dense)."""
    rows = prompt_len - 1
    where = "target_prompt_logprobs"
    if not isinstance(obj, dict) or obj.get("dtype") != "int64":
        raise UserError(f"{where} must be an int64 TensorData of token ids")
    shape, data = obj.get("shape"), obj.get("data")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(_is_int(n) for n in shape)
        or shape[0] != rows
        or shape[1] < 1
    ):
        raise UserError(f"{where} must have shape [len(prompt) - 1 = {rows}, K >= 1], got {shape!r}")
    if shape[0] * shape[1] > max_cells:
        raise UserError(f"{where} shape {shape} exceeds {max_cells} cells")
    if not isinstance(data, list) or not all(_is_int(v) and -1 <= v < vocab_size for v in data):
        raise UserError(f"{where} data must be token ids in [0, {vocab_size}) or -1")
    crow, col = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
    ids = np.full(shape, -1, dtype=np.int64)
    layout = None
    if crow is None and col is None:
        if len(data) != rows * shape[1]:
            raise UserError(f"{where}: {len(data)} values for shape {shape}")
        ids[:] = np.asarray(data, dtype=np.int64).reshape(shape)
    else:
        ints = (
            isinstance(crow, list) and isinstance(col, list) and all(_is_int(c) and abs(c) < 2**62 for c in crow + col)
        )
        crow_a, col_a = (np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)) if ints else (None, None)
        if crow_a is None or col_a is None or not _csr_ok(crow_a, col_a, len(data), shape):
            raise UserError(f"{where}: sparse_crow_indices / sparse_col_indices are not a CSR layout of shape {shape}")
        ids[np.repeat(np.arange(rows), np.diff(crow_a)), col_a] = data
        layout = (crow_a, col_a)
    if not (ids >= 0).any():
        raise UserError(f"{where} names no token id (every cell is -1)")
    distinct = len(np.unique(ids[ids >= 0]))
    if prompt_len * distinct > max_cells:
        raise UserError(f"{where}: len(prompt) {prompt_len} x {distinct} distinct ids exceeds {max_cells}")
    return ids, layout


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tensor_out(msg, array: np.ndarray, dtype: int, layout=None) -> None:
    """A response Tensor: dense, or the request's CSR layout (its cells' values only)."""
    if layout is None:
        msg.dense = np.ascontiguousarray(array).tobytes()
    else:
        crow, col = layout
        msg.sparse_csr.values = array[np.repeat(np.arange(len(crow) - 1), np.diff(crow)), col].tobytes()
        msg.sparse_csr.crow_indices, msg.sparse_csr.col_indices = crow.tobytes(), col.tobytes()
    msg.dtype = dtype
    msg.shape.extend(array.shape)


def encode_sample_result(
    result: TinkerSampleResult, topk_prompt: int = 0, topk_sample: int = 0, target_layout=None
) -> bytes:
    out = pb.SampleResponse()
    for s in result.sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if topk_sample and s.top_logprobs is not None:
            _topk(seq.topk_sampled_logprobs, s.top_logprobs, topk_sample)
    out.prompt_cache_hit_tokens = result.prompt_cache_hit_tokens
    if result.prompt_logprobs is not None:
        lps = np.array([np.nan if v is None else v for v in result.prompt_logprobs], dtype=np.float32)
        out.prompt_logprobs = lps.tobytes()
    if topk_prompt and result.topk_prompt_logprobs is not None:
        _topk(out.topk_prompt_logprobs, result.topk_prompt_logprobs, topk_prompt)
    if result.target_prompt_logprobs is not None:
        _tensor_out(
            out.target_prompt_logprobs,
            result.target_prompt_logprobs.astype(np.float32),
            pb.DTYPE_FLOAT32,
            target_layout,
        )
    if result.prompt_alt_tokens is not None:
        ids, lps = result.prompt_alt_tokens
        _tensor_out(out.prompt_alt_tokens.tokens, ids.astype(np.int64), pb.DTYPE_INT64)
        _tensor_out(out.prompt_alt_tokens.logprobs, lps.astype(np.float32), pb.DTYPE_FLOAT32)
    return out.SerializeToString()
