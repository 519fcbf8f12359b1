"""The chunked head equals whole logits for every built-in loss (issue 47): the loss value, its metrics
and the gradients into the hidden states and, where it trains, the head's weight and bias, to fp32
tolerance (relative, rtol 1e-5); and the engines pick it by default once logits pass the budget."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.loss import LOSSES, ChunkedHead, LogitsHead, LossContext, create_loss
from twinkle.model import TransformersModel

B, T, H, V, K = 4, 9, 16, 53, 5
RTOL = 1e-5

LOSS_KWARGS = {  # every option that adds a head quantity on (entropy, a reference, top-k ids)
    "CrossEntropyLoss": {},
    "ImportanceSamplingLoss": {},
    "PPOLoss": {},
    "CISPOLoss": {},
    "DROLoss": {},
    "GSPOLoss": {},
    "GRPOLoss": {"beta": 0.1, "entropy_coef": 0.05},
    "StableReinforceLoss": {"ratio_cap": 1.1},
    "DPOLoss": {},
    "SimPOLoss": {},
    "CPOLoss": {},
    "ORPOLoss": {},
    "GKDLoss": {"beta": 0.3},
    "BNPOLoss": {"beta": 0.1, "entropy_coef": 0.05},
    "DRGRPOLoss": {"beta": 0.1, "max_completion_length": 16},
    "SAPOLoss": {"beta": 0.1, "entropy_coef": 0.05, "tau_pos": 2.0},
}


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight, bias = torch.randn(V, H, generator=g) * 0.5, torch.randn(V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[:, :2] = -100  # prompt positions
    targets[1, -3:] = -100  # padding
    fields = {
        "advantages": torch.randn(B, T, generator=g),
        "logprobs": -torch.rand(B, T, generator=g) * 4,  # behaviour log-probs: ratios far from 1 clip
        "ref_logprobs": -torch.rand(B, T, generator=g) * 4,
        "sampled_mask": (torch.rand(B, T, generator=g) > 0.2).float(),
        "weights": torch.rand(B, T, generator=g),
        "teacher_topk_ids": torch.randint(0, V, (B, T, K), generator=g),
        "teacher_topk_logprobs": torch.log_softmax(torch.randn(B, T, K, generator=g), -1),
    }
    return hidden, weight, bias, targets, fields


def _run(name: str, chunked: bool, trains_head: bool, use_bias: bool):
    hidden, weight, bias, targets, fields = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(trains_head)
    bias = bias.requires_grad_(trains_head) if use_bias else None
    if chunked:
        head = ChunkedHead(hidden, weight, bias, chunk_size=7)  # chunks cross rows
    else:
        head = LogitsHead(torch.nn.functional.linear(hidden, weight, bias))
    # GRPO reads the reference the model computed (adapter off); the others take it as an input
    ref = fields.pop("ref_logprobs") if name == "GRPOLoss" else None
    out = create_loss(name, **LOSS_KWARGS[name])(LossContext(head, targets, fields, ref))
    params = [p for p in (hidden, weight, bias) if p is not None and p.requires_grad]
    return out, torch.autograd.grad(out.loss, params)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert float((got - want).norm()) <= RTOL * float(want.norm()) + 1e-12, (got, want)


# losses over a pass without a token head (a value model's values, pooled embeddings): no logits to
# chunk; test_loss_value_infonce.py checks them
NO_TOKEN_HEAD = {"MSELoss", "PPOValueLoss", "InfonceLoss"}


def test_every_builtin_loss_is_covered():
    builtin = {c.__name__ for c in LOSSES.classes() if c.__module__.startswith("twinkle.loss.")}
    assert builtin - NO_TOKEN_HEAD == set(LOSS_KWARGS)


@pytest.mark.parametrize("trains_head,use_bias", [(False, False), (True, True)], ids=["frozen-head", "trained-head"])
@pytest.mark.parametrize("name", sorted(LOSS_KWARGS))
def test_chunked_equals_whole_logits(name, trains_head, use_bias):
    want, want_grads = _run(name, False, trains_head, use_bias)
    got, got_grads = _run(name, True, trains_head, use_bias)
    _close(got.loss.detach(), want.loss.detach())
    assert got.metrics == pytest.approx(want.metrics, rel=RTOL, abs=1e-7)
    for g, w in zip(got_grads, want_grads, strict=True):
        _close(g, w)


@pytest.mark.parametrize("name", ["GRPOLoss", "GKDLoss"])
def test_one_sweep_serves_everything_a_loss_and_the_accuracy_read(name):
    hidden, weight, _, targets, fields = _inputs()
    head = ChunkedHead(hidden.requires_grad_(), weight, chunk_size=7)
    sweeps = {"n": 0}
    original = head._sweep

    def counting(*args):
        sweeps["n"] += 1
        return original(*args)

    head._sweep = counting
    ctx = LossContext(head, targets, fields)
    create_loss(name, **LOSS_KWARGS[name])(ctx).loss.backward()
    head.correct(targets)
    assert ctx.logps_B_T.shape == targets.shape  # what forward_only returns
    assert sweeps["n"] == 1  # never a second unembedding for the entropy, the top-k or the accuracy
    logits = torch.nn.functional.linear(hidden, weight)
    assert torch.equal(head.correct(targets), logits.argmax(-1) == targets)


def test_whole_logits_head_reads_the_shifted_view_without_a_copy():
    logits = torch.randn(3, 8, V)[:, :-1]  # what the model hands the loss: a strided view
    targets = torch.randint(0, V, (3, 7))
    want = torch.log_softmax(logits.contiguous(), -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(LogitsHead(logits).target_logps(targets), want, rtol=1e-6, atol=1e-6)


def _train(model: TransformersModel, rows) -> tuple[dict, list[torch.Tensor], dict]:
    out = model.forward_backward(rows)
    grads = [p.grad.clone() for p in model.states["default"].params]
    model.zero_grad()
    model.states["default"].micro_step = 0
    return out, grads, model.forward_only(rows)


def test_transformers_model_chunks_by_default_past_the_budget(rows):
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for p in model.states["default"].params:
            p.normal_(0, 0.1)
    heads = []
    original = model._run

    def spy(*args, **kwargs):
        heads.append(original(*args, **kwargs))
        return heads[-1]

    model._run = spy
    whole, whole_grads, whole_eval = _train(model, rows)
    whole_accuracy = model.calculate_metric(is_training=True)["token_accuracy"]
    assert all(isinstance(h, LogitsHead) for h in heads)
    model.logits_budget_bytes = 1  # every pass over budget
    heads.clear()
    chunked, chunked_grads, chunked_eval = _train(model, rows)
    assert heads and all(isinstance(h, ChunkedHead) for h in heads)
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=RTOL)
    for g, w in zip(chunked_grads, whole_grads, strict=True):
        _close(g, w)
    for g_row, w_row in zip(chunked_eval["logprobs"], whole_eval["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(g_row), torch.tensor(w_row), rtol=RTOL, atol=1e-6)
    assert model.calculate_metric(is_training=True)["token_accuracy"] == whole_accuracy
