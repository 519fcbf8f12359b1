"""The two defaults that keep a training step's heap compact (`twinkle.model.compact_heap`, issue 47):
an adapter's gradients live in one buffer kept from step to step, and activation checkpointing in one
process runs each layer's forward without an autograd graph (the reentrant checkpoint)."""

from __future__ import annotations

import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel
from twinkle.model.compact_heap import GradArena
from twinkle.model.structure import decoder_layer_list


def _model() -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-3)
    return model


def _storages(params) -> set[int]:
    return {p.grad.untyped_storage().data_ptr() for p in params}


def test_adapter_gradients_accumulate_into_one_buffer_kept_across_steps(rows):
    model = _model()
    params = model.states["default"].params
    model.forward_backward(rows)
    first = _storages(params)
    assert len(first) == 1  # every factor's gradient is a view of one buffer, none allocated by backward
    grads = [p.grad.clone() for p in params]
    model.forward_backward(rows)  # accumulation adds in place
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, 2 * g, rtol=1e-6, atol=0)
    model.clip_grad_and_step(1.0)
    assert all(p.grad is None for p in params)  # the step rule still sees gradients cleared
    model.forward_backward(rows)
    assert _storages(params) == first  # the next step reuses the buffer


def test_gradients_equal_a_plain_backward_and_unreached_parameters_stay_none():
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    params = [*used.parameters(), *unused.parameters()]
    arena = GradArena(params)
    x = torch.randn(5, 3)
    arena.attach()
    used(x).square().sum().backward()
    arena.release_untouched()
    want = torch.autograd.grad(used(x).square().sum(), list(used.parameters()))
    for p, g in zip(used.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=0)
    assert unused.weight.grad is None and unused.bias.grad is None  # an optimizer must not step them
    assert len({p.grad.untyped_storage().data_ptr() for p in used.parameters()}) == 1


def test_checkpointed_layers_run_their_forward_without_a_graph(rows):
    model = _model()
    grad_modes = []
    decoder_layer_list(model.hf_model)[0].mlp.register_forward_pre_hook(
        lambda *_: grad_modes.append(torch.is_grad_enabled())
    )
    with model.apply_patch("GradientCheckpointing"):
        model.forward_backward(rows)
    # the forward keeps no graph (nothing small outlives its activations); the recompute builds it
    assert grad_modes == [False, True]
