"""Patches (gradient checkpointing, chunked cross-entropy) and inputs from the data package."""

import pytest
import torch
from peft import LoraConfig
from torch.utils._python_dispatch import TorchDispatchMode

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel
from twinkle.patch import ChunkedCrossEntropy, GradientCheckpointing

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


class LargestTensor(TorchDispatchMode):
    """Records the largest vocabulary-wide tensor (last dim = vocab size) any op produces."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def _grads_after_step(m, rows):
    out = m.forward_backward(inputs=rows)
    grads = {n: p.grad.clone() for n, p in m.states["default"].named_params() if p.grad is not None}
    m.zero_grad()
    m.states["default"].micro_step = 0
    return out["loss"], grads


def test_patches_give_the_same_loss_and_gradients_and_revert(rows):
    torch.manual_seed(0)
    m = TransformersModel(model_id=TEST_MODEL)
    m.add_adapter_to_model("default", LORA)
    torch.nn.init.normal_(next(p for n, p in m.states["default"].named_params() if "lora_B" in n))
    loss, grads = _grads_after_step(m, rows)
    for patch in (GradientCheckpointing(), ChunkedCrossEntropy(chunk_size=7), "chunked_ce"):
        with m.apply_patch(patch):
            patched_loss, patched_grads = _grads_after_step(m, rows)
        torch.testing.assert_close(patched_loss, loss, rtol=1e-6, atol=1e-6)
        for n in grads:
            torch.testing.assert_close(patched_grads[n], grads[n], rtol=1e-4, atol=1e-6)
    assert m.head_chunk_size is None and not m.hf_model.is_gradient_checkpointing
    assert "forward" not in vars(m.hf_model.get_output_embeddings())


def test_chunked_cross_entropy_never_materialises_batch_logits(rows):
    m = TransformersModel(model_id=TEST_MODEL)
    m.add_adapter_to_model("default", LORA)
    batch = rows * 16
    B, T, V = len(batch), max(len(r["input_ids"]) for r in batch), m.vocab_size
    with LargestTensor(V) as plain:
        m.forward_backward(inputs=batch)
    with m.apply_patch(ChunkedCrossEntropy(chunk_size=16)), LargestTensor(V) as chunked:
        m.forward_backward(inputs=batch)
    assert plain.largest >= B * (T - 1) * V
    # one chunk's logits at a time; the only other vocab-wide tensor is the projection weight (H x V)
    assert chunked.largest <= max(16 * V, m.hf_model.config.hidden_size * V) < plain.largest / 5


def test_raw_trajectories_are_encoded_through_the_template():
    from twinkle.template import Template

    m = TransformersModel(model_id=TEST_MODEL)
    m.add_adapter_to_model("default", LORA)
    m.set_optimizer("AdamW", lr=1e-2)
    trajectories = [
        {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Glimmer."}]}
    ] * 2
    out = m.forward_backward(inputs=trajectories)  # template built from the model id on first use
    encoded = Template(model_id=TEST_MODEL).encode(trajectories[0])
    assert m.forward_only(inputs=[encoded])["loss"] == pytest.approx(out["loss"], rel=1e-5)  # batch of 1 vs 2
    assert torch.isfinite(torch.tensor(out["loss"]))
