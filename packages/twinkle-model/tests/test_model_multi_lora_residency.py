"""Parking an adapter (host memory, detached from the layers) or spilling it (safetensors + JSON on
disk) and bringing it back changes nothing: losses, weights, gradients mid-window, Adam moments and
step counts, lr schedule and dropout stream all equal a model that never moved it, bit for bit."""

import json

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from twinkle.hub import TEST_MODEL
from twinkle.model.multi_lora import MultiLoraLinear, MultiLoraModel

torch.set_num_threads(2)


def rows(seed, n=2, length=10):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 800, (length,), generator=g).tolist()} for _ in range(n)]


def make_model(tmp_path=None, device=None):
    model = MultiLoraModel(TEST_MODEL, device=device)
    for i, name in enumerate(("a", "b")):
        # dropout on: the restored adapter must keep drawing from the same generator
        config = LoraConfig(r=2 + 2 * i, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear")
        model.add_adapter_to_model(name, config, gradient_accumulation_steps=2)
        model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
        model.set_lr_scheduler("CosineWarmupScheduler", adapter_name=name, num_warmup_steps=1, num_training_steps=8)
    if tmp_path is not None:
        model.enable_spill(tmp_path / "spill")
    return model


def train(model, moves):
    """Three accumulation windows of two micro-batches for both adapters; `moves(model, i)` between calls."""
    losses = []
    for i in range(6):
        out = model.forward_backward_fused({"a": rows(i), "b": rows(100 + i)})
        losses.append((out["a"]["loss"], out["b"]["loss"]))
        moves(model, 2 * i)
        for name in ("a", "b"):
            model.clip_grad_and_step(1.0, adapter_name=name)
        moves(model, 2 * i + 1)
    return losses


def final(model, name):
    state = model._state(name)
    return {
        "weights": [p.detach().clone() for p in state.params],
        "moments": [{k: v.clone() for k, v in state.optimizer.state[p].items()} for p in state.params],
        "moment_order": [list(state.optimizer.state[p]) for p in state.params],  # a checkpoint's layout
        "lr": state.optimizer.param_groups[0]["lr"],
        "scheduler": state.scheduler.state_dict(),
        "steps": state.optimizer_steps,
        "generator": state.dropout_generator.get_state().clone(),
    }


def test_park_and_spill_round_trips_are_bit_exact(tmp_path):
    reference = make_model()
    expected_losses = train(reference, lambda m, i: None)

    def moves(model, i):
        # between a window's micro-batches (pending gradients) and after steps (Adam moments)
        name = "a" if i % 2 == 0 else "b"
        if i % 3 == 0:
            model.spill_adapter(name)
            assert model.adapter_tier(name) == "spilled"
        else:
            model.park_adapter(name)
            assert model.adapter_tier(name) == "parked"

    moved = make_model(tmp_path)
    assert train(moved, moves) == expected_losses
    for name in ("a", "b"):
        got, expected = final(moved, name), final(reference, name)
        assert got.pop("moment_order") == expected.pop("moment_order")
        # nested dicts/lists of tensors and numbers; zero tolerance: bit-exact
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    stats = moved.residency.stats
    assert stats.parked >= 8 and stats.spilled >= 4 and stats.restored_from_disk >= 4
    assert stats.restored == stats.parked  # everything that left came back
    assert not any((tmp_path / "spill").iterdir())  # a restored adapter's spill folder is removed


def test_a_parked_adapter_is_off_every_layer_and_costs_no_parameter_memory(tmp_path):
    model = make_model(tmp_path)
    model.forward_backward_fused({"a": rows(0), "b": rows(1)})
    model.park_adapter("a")
    layers = [m for m in model.base.modules() if isinstance(m, MultiLoraLinear)]
    assert layers and all("a" not in layer.lora_A and "b" in layer.lora_A for layer in layers)
    assert all(p.numel() == 0 and p.grad is None for p in model.adapters["a"].params)
    assert model.residency.counts() == {"live": 1, "parked": 1, "spilled": 0}
    assert model.residency.parked_bytes() > 0
    # spilled: tensors are safetensors (weights, pending grads), the rest JSON; nothing pickled
    model.spill_adapter("a")
    folder = tmp_path / "spill" / "a"
    assert sorted(p.name for p in folder.iterdir()) == ["residency.json", "tensors.safetensors"]
    tensors = load_file(str(folder / "tensors.safetensors"))
    assert "0.w" in tensors and "0.g" in tensors
    assert "moved" in json.loads((folder / "residency.json").read_text())
    assert model.residency.parked_bytes() == 0
    # the last adapter parked leaves plain Linears behind; using it brings its wrappers back
    model.park_adapter("b")
    assert not any(isinstance(m, MultiLoraLinear) for m in model.base.modules())
    model.forward_fused({"a": rows(2)})
    assert model.adapter_tier("a") == "live" and model.adapter_tier("b") == "parked"


def test_removing_a_spilled_adapter_deletes_its_files_and_unknown_names_fail_clearly(tmp_path):
    model = make_model(tmp_path)
    model.spill_adapter("b")
    model.remove_adapter("b")
    assert not (tmp_path / "spill" / "b").exists() and model.adapter_names == ["a"]
    with pytest.raises(KeyError, match="no adapter named 'zz'"):
        model.park_adapter("zz")
    with pytest.raises(RuntimeError, match="enable_spill"):
        make_model().spill_adapter("a")


def test_make_room_runs_before_an_adapter_comes_back_and_never_parks_the_pass(tmp_path):
    model = make_model(tmp_path)
    model.add_adapter_to_model("c", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    calls = []

    def make_room(name, pinned):
        calls.append((name, sorted(pinned)))
        for other in model.residency.least_recent():
            if other not in pinned:
                model.residency.park(other)

    model.residency.make_room = make_room
    model.park_adapter("a")
    model.park_adapter("b")
    model.forward_fused({"a": rows(0), "b": rows(1)})  # both come back, neither parks the other
    assert calls == [("a", ["a", "b"]), ("b", ["a", "b"])]
    assert [model.adapter_tier(n) for n in ("a", "b", "c")] == ["live", "live", "parked"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (gathered by the gpu session)")
def test_on_cuda_parking_frees_device_memory_into_pinned_host_memory_and_round_trips_bit_exact(tmp_path):
    reference = make_model(device="cuda")
    expected_losses = train(reference, lambda m, i: None)
    moved = make_model(tmp_path, device="cuda")

    def moves(model, i):
        (model.spill_adapter if i % 3 == 0 else model.park_adapter)("a" if i % 2 == 0 else "b")

    assert train(moved, moves) == expected_losses
    for name in ("a", "b"):
        got, expected = final(moved, name), final(reference, name)
        assert got.pop("moment_order") == expected.pop("moment_order")
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved.park_adapter("a")
    assert torch.cuda.memory_allocated() < before  # weights, moments off the device
    parked = moved.residency._away["a"].tensors
    assert all(
        t.device.type == "cpu" and t.is_pinned()
        for k, t in parked.items()
        if k in moved.residency._away["a"].meta["moved"]
    )
