"""TransformersModel(compile=True): torch.compile over each decoder layer trains as eager does, across
a change of batch shape, and what it cannot do is refused by name. Every family of the architecture
matrix is compiled in tests/conformance (a column of its own).

fp32; inductor fuses elementwise ops and so reorders some float sums: forward values agree to ~1e-7
relative per op, so losses to 1e-5 and gradients to 1e-4 (the conformance matrix's bounds).
"""

from __future__ import annotations

import getpass
import os
import random

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel
from twinkle.model import compile as compile_layers


def _rows(n: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    ids = [[rng.randrange(3, 800) for _ in range(length)] for _ in range(n)]
    return [{"input_ids": r, "labels": [-100] * 3 + r[3:]} for r in ids]


# two batches of one length, then a longer one: the new shape compiles once more (as dynamic)
BATCHES = [_rows(3, 9, seed=1), _rows(3, 9, seed=2), _rows(2, 17, seed=3)]


def _train(compile: bool):
    """Three steps; the losses, and the gradients of the first (AdamW's update is about lr * sign(g),
    so the weights after it would magnify a last-bit difference in a near-zero gradient)."""
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL, compile=compile)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    losses, grads = [], {}
    for rows in BATCHES:
        losses.append(model.forward_backward(inputs=rows)["loss"])
        grads = grads or {name: p.grad.clone() for name, p in model.states["default"].named_params()}
        assert model.clip_grad_and_step()["stepped"]
    return model, losses, grads


def test_compiled_layers_train_as_eager():
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _, eager_losses, eager_grads = _train(False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before  # eager compiles nothing
    model, losses, grads = _train(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before  # inductor really ran
    assert all(getattr(layer, "_compiled_call_impl", None) for layer in compile_layers.language_layers(model.hf_model))
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert grads.keys() == eager_grads.keys() and len(grads) > 0
    for name, g in grads.items():
        differs = (eager_grads[name] - g).abs().max() / eager_grads[name].abs().max().clamp_min(1e-12)  # A: 0 (B=0)
        assert differs < 1e-4, (name, float(differs))
    assert losses[-1] != eager_losses[0]  # the steps trained: later losses are not the first


def test_compiled_state_dict_keeps_its_names():
    eager = TransformersModel(model_id=TEST_MODEL)
    compiled = TransformersModel(model_id=TEST_MODEL, compile=True)
    assert list(compiled.hf_model.state_dict()) == list(eager.hf_model.state_dict())  # no `_orig_mod.` prefix


@pytest.mark.parametrize(
    "cp,tp,what", [(2, 1, "context parallelism .cp_size=2."), (1, 2, "tensor parallelism .tp_size=2.")]
)
def test_cp_and_tp_are_refused_by_name(cp, tp, what):
    with pytest.raises(ValueError, match=f"compile=True is not supported with {what}: leave compile off"):
        compile_layers.check_compilable("cpu", cp_size=cp, tp_size=tp)


def test_a_cpu_without_a_cpp_compiler_is_refused(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="compile=True on CPU needs a C.. compiler .* none was found"):
        TransformersModel(model_id=TEST_MODEL, compile=True)


def test_a_model_without_a_decoder_layer_list_is_refused():
    with pytest.raises(TypeError, match="Linear has no get_decoder\\(\\).layers list"):
        compile_layers.compile_layers(torch.nn.Linear(2, 2))


def test_a_forced_cpu_capability_gets_its_own_inductor_cache(monkeypatch):
    """Without it, kernels cached under the machine's own ISA were loaded under `avx2` (NaN losses)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "set-by-the-user")
    compile_layers.separate_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "set-by-the-user"  # the user's choice stands
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    compile_layers.separate_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("torchinductor_" + getpass.getuser() + "_avx2")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what torch itself writes there
    compile_layers.separate_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("torchinductor_" + getpass.getuser() + "_avx2")
