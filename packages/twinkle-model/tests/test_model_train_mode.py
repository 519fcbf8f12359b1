"""Training mode exactly when training (issue 47): forward_backward runs the model in train() mode, so
peft's lora_dropout applies and transformers' activation checkpointing really recomputes the decoder
layers in backward; forward_only runs in eval() mode, so two identical evaluations are equal. The same
for the fused multi-tenant engine."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.structure import decoder_layer_list

DROPOUT = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.5)


def _model(config=DROPOUT) -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("default", config)
    with torch.no_grad():  # B starts at zero, which would hide the adapter (and its dropout) entirely
        for p in model.states["default"].params:
            p.normal_(0, 0.2)
    return model


def _fresh_grads(model):
    grads = [p.grad.clone() for p in model.states["default"].params]
    model.zero_grad()
    model.states["default"].micro_step = 0
    return grads


def test_lora_dropout_applies_in_forward_backward_and_not_in_forward_only(rows):
    model = _model()
    evals = [model.forward_only(rows) for _ in range(2)]
    assert evals[0]["loss"] == evals[1]["loss"] and evals[0]["logprobs"] == evals[1]["logprobs"]
    first = model.forward_backward(rows)["loss"]
    _fresh_grads(model)
    second = model.forward_backward(rows)["loss"]
    # the weights did not move (no step): only fresh dropout masks make the two passes differ
    assert first != second and first != evals[0]["loss"]
    assert model.forward_only(rows)["loss"] == evals[0]["loss"]  # and evaluation is back to no dropout


def test_without_dropout_training_and_evaluation_agree(rows):
    model = _model(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    evaluated = model.forward_only(rows)["loss"]
    assert model.forward_backward(rows)["loss"] == pytest.approx(evaluated, rel=1e-6)


def _count_layer_calls(module) -> dict:
    calls = {"n": 0}

    def hook(*_):
        calls["n"] += 1

    # a pre-hook: torch stops a recompute once it has every saved tensor, before the mlp returns
    decoder_layer_list(module)[0].mlp.register_forward_pre_hook(hook)
    return calls


def test_gradient_checkpointing_recomputes_layers_in_backward(rows):
    model = _model(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    calls = _count_layer_calls(model.hf_model)
    model.forward_backward(rows)
    plain_grads = _fresh_grads(model)
    assert calls["n"] == 1
    with model.apply_patch("GradientCheckpointing"):
        saved = {"bytes": 0}

        def pack(t):
            saved["bytes"] += t.numel() * t.element_size()
            return t

        # what the forward keeps for backward (a reentrant recompute saves its own, inside backward)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.calculate_loss(model.forward(rows)).loss
        model.backward(loss)
        assert calls["n"] == 3  # the forward, then the recompute in backward
        model.forward_only(rows)  # evaluation computes each layer once
        assert calls["n"] == 4
    for got, want in zip(_fresh_grads(model), plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    with torch.autograd.graph.saved_tensors_hooks(pack_plain := _Counter(), lambda t: t):
        model.calculate_loss(model.forward(rows))
    assert saved["bytes"] < pack_plain.bytes / 2  # only layer inputs, head and loss are kept


class _Counter:
    def __init__(self):
        self.bytes = 0

    def __call__(self, t):
        self.bytes += t.numel() * t.element_size()
        return t


def test_multi_lora_dropout_in_training_only(rows):
    model = MultiLoraModel(TEST_MODEL)
    model.add_adapter_to_model("ada", DROPOUT)
    with torch.no_grad():
        for p in model.adapters["ada"].params:
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    data = rows
    evals = [model.forward_only(data, "ada") for _ in range(2)]
    assert evals[0]["loss"] == evals[1]["loss"] and evals[0]["logprobs"] == evals[1]["logprobs"]
    trained = [model.forward_backward(data, "ada")["loss"] for _ in range(2)]
    assert trained[0] != trained[1] and evals[0]["loss"] not in trained
    assert model.base.training
    assert model.forward_only(data, "ada")["loss"] == evals[0]["loss"]
    assert not model.base.training  # evaluation after training is in eval mode again
