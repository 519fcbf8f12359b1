"""Activation checkpointing in the fused multi-tenant engine: a checkpointed pass equals a plain one
(losses, LoRA gradients, weights after steps), it really recomputes the decoder layers in backward,
the recompute sees the forward's tenant routing and dropout draws even after other passes ran, and
what it cannot do is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model.families import FAMILIES, tiny_model
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.multi_lora.recompute import decoder_layers
from twinkle.model.structure import describe

torch.set_num_threads(2)

CONFIGS = {  # different ranks, dropout on one tenant (its recompute must redraw the same masks)
    "alice": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1),
    "bob": LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "carol": LoraConfig(r=2, lora_alpha=4, target_modules=r".*mlp\.down_proj"),
}


def make_rows(seed: int, n: int, lengths: list[int], vocab: int = 256) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    return rows


# unequal row counts and lengths: the fused batch pads, and routes runs of 2, 3 and 1 rows
DATA = {"alice": make_rows(1, 2, [16, 12]), "bob": make_rows(2, 3, [11]), "carol": make_rows(3, 1, [20])}


def engine(checkpointing: bool, base=None, configs=CONFIGS) -> MultiLoraModel:
    if base is None:
        model = MultiLoraModel(TEST_MODEL, activation_checkpointing=checkpointing)
    else:
        model = MultiLoraModel(model=copy.deepcopy(base), activation_checkpointing=checkpointing)
    for name, config in configs.items():
        model.add_adapter_to_model(name, config)
        model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
        with torch.no_grad():  # B starts at zero: make every factor matter from the first pass
            g = torch.Generator().manual_seed(len(name))
            for p in model.adapters[name].params:
                p.normal_(0, 0.05, generator=g)
    return model


def grads(model: MultiLoraModel, name: str) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.adapters[name].params]


def weights(model: MultiLoraModel, name: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.adapters[name].params]


# The recompute runs the same kernels on the same inputs, so the two passes agree to rounding (in
# practice bit for bit); the tolerance is relative to each tensor's own magnitude, never to this CPU.
def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(scale, 1e-30))


def assert_same_training(plain: MultiLoraModel, ckpt: MultiLoraModel, data: dict, steps: int = 2) -> None:
    for _ in range(steps):
        want, got = plain.forward_backward_fused(data), ckpt.forward_backward_fused(data)
        for name in data:
            assert got[name]["loss"] == pytest.approx(want[name]["loss"], rel=1e-5)
            for g_got, g_want in zip(grads(ckpt, name), grads(plain, name), strict=True):
                assert float(g_want.abs().max()) > 0  # every factor is trained, so equality means something
                assert_close(g_got, g_want)
            plain.clip_grad_and_step(1.0, adapter_name=name)
            ckpt.clip_grad_and_step(1.0, adapter_name=name)
            for w_got, w_want in zip(weights(ckpt, name), weights(plain, name), strict=True):
                assert_close(w_got, w_want)


@pytest.mark.parametrize("chunked_head", [False, True], ids=["logits", "chunked-head"])
def test_checkpointed_fused_pass_equals_the_plain_one(chunked_head):
    plain, ckpt = engine(False), engine(True)
    if chunked_head:  # the unembedding in chunks (its own checkpoint) under a checkpointed decoder
        plain.logits_budget_bytes = ckpt.logits_budget_bytes = 1
    assert ckpt.activation_checkpointing and not plain.activation_checkpointing
    before = weights(ckpt, "alice")
    # a second step draws alice's dropout masks after a recompute has run: equal only if the recompute
    # redrew the forward's masks and then left her generator where the forward had left it
    assert_same_training(plain, ckpt, DATA, steps=2)
    assert any(not torch.equal(a, b) for a, b in zip(before, weights(ckpt, "alice")))


def test_checkpointing_really_recomputes_and_keeps_less():
    plain, ckpt = engine(False), engine(True)
    layers = decoder_layers(ckpt.base)
    calls = {"plain": 0, "ckpt": 0}

    def counter(key):
        def hook(*_):
            calls[key] += 1

        return hook

    decoder_layers(plain.base)[0].mlp.register_forward_pre_hook(counter("plain"))
    layers[0].mlp.register_forward_pre_hook(counter("ckpt"))
    saved = {"plain": 0, "ckpt": 0}
    for key, model in (("plain", plain), ("ckpt", ckpt)):

        def pack(t, key=key):
            saved[key] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.forward_backward_fused(DATA)
    # a pre-hook: torch stops a recompute once it has every saved tensor, before the mlp returns
    assert calls == {"plain": 1, "ckpt": 2}  # forward, then the recompute in backward
    assert ckpt.checkpointer is not None and ckpt.checkpointer.recomputes == len(layers)
    # outside the layers only embeddings, final norm and head are kept: well under half the plain pass
    assert saved["ckpt"] < saved["plain"] / 2, saved
    ckpt.forward_fused(DATA)  # no-grad passes run the layers once and recompute nothing
    assert calls["ckpt"] == 3 and ckpt.checkpointer.recomputes == len(layers)


def test_switching_checkpointing_off_and_on():
    model = engine(False)
    model.set_activation_checkpointing(True)
    checkpointer = model.checkpointer
    assert checkpointer is not None
    model.forward_backward_fused(DATA)
    assert checkpointer.recomputes == 2
    model.set_activation_checkpointing(False)
    assert not model.activation_checkpointing
    model.forward_backward_fused(DATA)
    assert checkpointer.recomputes == 2  # off means off


def test_a_custom_loss_backward_after_another_pass_recomputes_under_its_own_routing():
    """forward() returns and clears the routing; another pass routes other tenants; only then backward:
    the recompute must still route the first pass's rows through alice."""
    plain, ckpt = engine(False), engine(True)
    results = []
    for model in (plain, ckpt):
        ctx = model.forward(DATA["alice"], adapter_name="alice")
        loss = -(ctx.logps_B_T * ctx.mask_B_T).sum() / ctx.mask_B_T.sum()
        model.forward_backward_fused({"bob": DATA["bob"], "carol": DATA["carol"]})  # routes bob and carol
        model.backward(loss, adapter_name="alice")
        results.append(grads(model, "alice"))
    assert ckpt.checkpointer is not None and ckpt.checkpointer.recomputes == 2 * len(decoder_layers(ckpt.base))
    for g_got, g_want in zip(results[1], results[0], strict=True):
        assert float(g_want.abs().max()) > 0
        assert_close(g_got, g_want)


def family_configs(base) -> dict[str, LoraConfig]:
    experts = describe(base).expert_parameters("experts")
    configs = {
        "alice": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], lora_dropout=0.1),
        "bob": LoraConfig(r=2, lora_alpha=2, target_modules="all-linear"),
    }
    if experts:  # MoE: one tenant's LoRA on the experts' 3-D weights too (peft refuses dropout there)
        configs["carol"] = LoraConfig(r=4, lora_alpha=4, target_modules=["o_proj"], target_parameters=experts)
    return configs


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_checkpointed_equals_plain(family):
    base = tiny_model(family)
    configs = family_configs(base)
    data = {"alice": make_rows(1, 2, [9, 7]), "bob": make_rows(2, 1, [9]), "carol": make_rows(3, 3, [8])}
    data = {name: rows for name, rows in data.items() if name in configs}
    plain, ckpt = engine(False, base, configs), engine(True, base, configs)
    assert_same_training(plain, ckpt, data, steps=1)
    assert ckpt.checkpointer is not None and ckpt.checkpointer.recomputes == len(decoder_layers(base))


def test_a_base_with_transformers_checkpointing_on_is_refused():
    base = tiny_model("qwen3")
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="has transformers' gradient checkpointing on"):
        MultiLoraModel(model=base)


def test_an_architecture_transformers_cannot_checkpoint_is_refused_by_class():
    base = tiny_model("llama")
    layers = base.get_decoder().layers
    layers[1] = torch.nn.Identity()  # stands for a decoder layer that is no GradientCheckpointingLayer
    model = MultiLoraModel(model=base)
    with pytest.raises(TypeError, match="Identity is not a transformers GradientCheckpointingLayer"):
        model.set_activation_checkpointing(True)
    assert not model.activation_checkpointing


def test_image_rows_and_a_tenant_training_its_projector_checkpointed_equal_plain():
    """The vision tower is not checkpointed (a tenant's own projector is swapped in only during the
    forward call); the language decoder behind it is, with 3-D rotary positions."""
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.hub.embedded_vl import VL_TEST_MODEL
    from twinkle.template import Template

    template = Template(VL_TEST_MODEL)
    rows = [template.encode(r) for r in Dataset(DatasetMeta("twinkle://shapes", data_slice=range(3)))]
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    engines = []
    for checkpointing in (False, True):
        model = MultiLoraModel(VL_TEST_MODEL, activation_checkpointing=checkpointing)
        model.add_adapter_to_model(
            "p", LoraConfig(r=4, lora_alpha=8, target_modules=targets), train_vision=("projector",)
        )
        model.add_adapter_to_model("n", LoraConfig(r=6, lora_alpha=8, target_modules=targets))
        g = torch.Generator().manual_seed(0)
        for name in ("p", "n"):
            model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
            with torch.no_grad():  # B starts at zero: nudge every factor (and projector weight) off it
                for p in model.adapters[name].params:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        engines.append(model)
    plain, ckpt = engines
    assert_same_training(plain, ckpt, {"p": rows[:1], "n": rows[1:]}, steps=1)
    assert ckpt.checkpointer is not None and ckpt.checkpointer.recomputes == len(decoder_layers(ckpt.base))
