"""A long row's pass pauses inside its forward and backward (decoder layers, attention, MLP and head chunks) while
other passes run on the same engine from another thread, and comes out as if uninterrupted; without a
pause handler the model computes exactly what transformers' sdpa computes."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from peft import LoraConfig

from twinkle.model import preemption
from twinkle.model.families import FAMILIES, tiny_model
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.structure import decoder_layer_list

torch.set_num_threads(2)

CONFIGS = {
    "long": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1),
    "other": LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
}


def rows(seed: int, length: int, n: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 250, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    return out


def engine(base, checkpointing: bool) -> MultiLoraModel:
    model = MultiLoraModel(model=copy.deepcopy(base), activation_checkpointing=checkpointing, seed=3)
    for name, config in CONFIGS.items():
        model.add_adapter_to_model(name, config)
        with torch.no_grad():
            g = torch.Generator().manual_seed(len(name))
            for p in model.adapters[name].params:
                p.normal_(0, 0.05, generator=g)
    return model


class Turns:
    """The pause handler of a thread that hands over to the main thread at every `every`-th point,
    as a server's sliced job hands the engine to the scheduler (twinkle.serve.core.slices)."""

    def __init__(self, every: int):
        self.every, self.points, self.pauses = every, 0, 0
        self.paused, self.resume = threading.Event(), threading.Event()
        self.grad_mode_at_points: set[bool] = set()

    def __call__(self, pausing) -> bool:
        self.points += 1
        self.grad_mode_at_points.add(torch.is_grad_enabled())
        if self.points % self.every:
            return False
        self.pauses += 1
        resumed = pausing()
        self.resume.clear()
        self.paused.set()
        self.resume.wait()
        resumed()
        return True


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_a_paused_long_row_equals_its_uninterrupted_pass_while_other_passes_run_between(monkeypatch, checkpointing):
    monkeypatch.setattr(preemption, "CHUNK_MACS", 2**14)  # a 160-token row: 10 attention chunks per layer
    base = tiny_model("qwen3")
    long_rows, other_rows = rows(1, 160), rows(2, 24, n=2)

    # uninterrupted, chunked the same way (a handler that never pauses): with LoRA dropout on, a dense MLP's
    # token chunks draw their masks chunk by chunk, so the reference is the chunked pass, not the whole one
    alone = engine(base, checkpointing)
    preemption.handler(lambda pausing: False)
    try:
        expected = alone.forward_backward_fused({"long": long_rows})["long"]
    finally:
        preemption.handler(None)
    expected_grads = [p.grad.clone() for p in alone.adapters["long"].params]
    other_alone = engine(base, checkpointing).forward_fused({"other": other_rows})["other"]

    model = engine(base, checkpointing)
    turns, result, between = Turns(every=4), {}, []

    def long_pass():
        preemption.handler(turns)
        try:
            result.update(model.forward_backward_fused({"long": long_rows}))
        finally:
            preemption.handler(None)
            turns.paused.set()

    worker = threading.Thread(target=long_pass)
    worker.start()
    while True:
        turns.paused.wait()
        turns.paused.clear()
        if not worker.is_alive() or result:
            break
        # in between: another tenant's eval pass (puts the model in eval mode) and its training pass
        between.append(model.forward_fused({"other": other_rows})["other"])
        model.forward_backward_fused({"other": other_rows})
        turns.resume.set()
    worker.join()

    assert turns.pauses >= 10 and turns.grad_mode_at_points == {True, False}  # paused in forward and backward
    assert result["long"]["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    for got, want in zip([p.grad for p in model.adapters["long"].params], expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert all(b["loss"] == pytest.approx(other_alone["loss"], rel=1e-5) for b in between)
    assert not model.residency.in_use  # the paused pass's adapters are released once it is over


def test_without_a_handler_attention_is_sdpa_call_for_call():
    base = tiny_model("qwen3")
    model = MultiLoraModel(model=copy.deepcopy(base))
    assert model.base.config._attn_implementation == preemption.NAME
    ids = torch.randint(3, 250, (2, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the mask sdpa gets is an explicit one
    with torch.no_grad():
        ours = model.base(input_ids=ids, attention_mask=mask).logits
        theirs = base(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_attention_and_mlp_equal_the_whole_on_every_family(monkeypatch, family):
    monkeypatch.setattr(preemption, "CHUNK_MACS", 2**12)
    base = tiny_model(family)
    model = copy.deepcopy(base)
    layers = decoder_layer_list(model)
    preemption.enable(model, layers)
    ids = torch.randint(3, 250, (2, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    points = []
    preemption.handler(lambda pausing: points.append(1) is None and False)
    try:
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask).logits
    finally:
        preemption.handler(None)
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    # a point at every layer's start, more between chunks (attention under sdpa, projections, dense MLPs)
    assert len(points) > 2 * len(layers), (len(points), len(layers))


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_and_rotary_pause_in_chunks_and_equal_the_whole_on_every_family(monkeypatch, family):
    """A long row's norms and rotary embedding are cut by elements with a point between chunks; the
    logits and the input embedding's gradient equal the uncut pass's."""
    base = tiny_model(family)
    model = copy.deepcopy(base)
    layers = decoder_layer_list(model)
    preemption.enable(model, layers)
    ids = torch.randint(3, 250, (1, 96), generator=torch.Generator().manual_seed(2))

    def run(elements: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        monkeypatch.setattr(preemption, "CHUNK_ELEMENTS", elements)
        points = []
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        preemption.handler(lambda pausing: points.append(1) is None and False)
        try:
            logits = model(inputs_embeds=embeds).logits
            logits.float().square().mean().backward()
        finally:
            preemption.handler(None)
        return logits.detach(), embeds.grad, len(points)

    whole_logits, whole_grad, whole_points = run(2**40)
    cut_logits, cut_grad, cut_points = run(2**8)
    torch.testing.assert_close(cut_logits, whole_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cut_grad, whole_grad, rtol=1e-5, atol=1e-8)
    norms = [m for layer in layers for m in layer.modules() if preemption._is_norm(m)]
    assert norms and cut_points > whole_points + 2 * len(norms), (family, whole_points, cut_points, len(norms))
    family_module = __import__(type(layers[0].self_attn).__module__, fromlist=["_"])
    rotary = getattr(family_module, "apply_rotary_pos_emb", None)
    assert rotary is None or rotary in preemption.CHUNKED_ROTARY
