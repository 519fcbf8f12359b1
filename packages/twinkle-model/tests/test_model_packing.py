"""Packed SFT (InputProcessor(packing=True): rows concatenated padding-free, position_ids restarting per
row) trains exactly like padding: the same per-token log-probs, loss and gradients, in fp32. Any
attention across packed rows would change the later rows' log-probs."""

import random

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel
from twinkle.model.inputs import sequence_spans

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)  # B != 0: real grads


def variable_rows(n: int, seed: int, length=(5, 60)) -> list[dict]:
    """Rows of very different lengths, each with a prompt left out of the loss."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(1, 800) for _ in range(rng.randint(*length))]
        prompt = rng.randint(1, len(ids) // 2)
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def lora_model(packing: bool) -> TransformersModel:
    torch.manual_seed(0)
    m = TransformersModel(model_id=TEST_MODEL)
    m.add_adapter_to_model("default", LORA)
    m.set_optimizer("AdamW", lr=1e-2)
    m.set_processor("InputProcessor", packing=packing)
    return m


def test_packed_rows_give_the_padded_per_token_logprobs_loss_and_gradients():
    rows = variable_rows(6, seed=3)
    padded, packed = lora_model(False), lora_model(True)
    a, b = padded.forward_only(rows), packed.forward_only(rows)
    assert [len(r) for r in b["logprobs"]] == [len(r["input_ids"]) for r in rows]  # split back per row
    for x, y in zip(a["logprobs"], b["logprobs"]):
        torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=1e-5, atol=1e-5)
    # packed rows attend in other kernel blocks than padded ones: fp32 agrees relative to magnitude
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    fa, fb = padded.forward_backward(rows), packed.forward_backward(rows)
    assert fb["loss"] == pytest.approx(fa["loss"], rel=1e-5)
    grads = [(p.grad, q.grad) for p, q in zip(padded.states["default"].params, packed.states["default"].params)]
    assert all(g is not None and g.abs().sum() > 0 for g, _ in grads)
    for g, h in grads:
        torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-6)


def test_sequence_spans_of_padded_and_packed_batches():
    from twinkle.processor import InputProcessor

    rows = variable_rows(3, seed=1)
    lengths = [len(r["input_ids"]) for r in rows]
    assert sequence_spans(InputProcessor()(rows)) == [(b, 0, n) for b, n in enumerate(lengths)]
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    assert sequence_spans(InputProcessor(packing=True)(rows)) == [(0, s, n) for s, n in zip(starts, lengths)]
    T = max(lengths)  # left padding: each row's real tokens start after its pads
    assert sequence_spans(InputProcessor(padding_side="left")(rows)) == [(b, T - n, n) for b, n in enumerate(lengths)]


def test_forward_only_with_left_padding_returns_the_rows_log_probs():
    """Left-padded rows give the right-padded log-probs (positions count real tokens from 0 either way);
    the spans once started every row at column 0, so a short row came back as its pads' zeros."""
    rows = variable_rows(4, seed=5)
    right = lora_model(False).forward_only(inputs=rows)["logprobs"]
    left_model = lora_model(False)
    left_model.set_processor("InputProcessor", padding_side="left")
    left = left_model.forward_only(inputs=rows)["logprobs"]
    assert [len(r) for r in left] == [len(r["input_ids"]) for r in rows]
    for got, want, row in zip(left, right, rows):
        assert all(v < 0 for v, label in zip(got, row["labels"]) if label != -100)  # every target has one
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
