"""One adapter over a whole batch without gradients (a served decode step) takes the few-op path
(multi_lora/one_adapter.py): bit for bit what the general path computes, on a bf16 base with fp32
factors and on an fp32 base."""

from __future__ import annotations

import pytest
import torch

from twinkle.model.multi_lora import layer as multi_lora_layer
from twinkle.model.multi_lora.layer import MultiLoraLinear, Routing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(8, 1, 64), (3, 5, 64), (6, 64)])
def test_the_one_adapter_path_equals_the_general_path_bitwise(dtype, shape, monkeypatch):
    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(64, 96, bias=False).to(dtype)
    routing = Routing()
    layer = MultiLoraLinear(base, routing)
    a, b = torch.randn(4, 64, generator=g), torch.randn(96, 4, generator=g)
    layer.load_adapter("t", a, b, 2.0)
    routing.set([("t", shape[0], 0)], training=False)
    x = torch.randn(*shape, generator=g).to(dtype)
    calls = []
    original = multi_lora_layer.one_adapter.add_update
    monkeypatch.setattr(multi_lora_layer.one_adapter, "add_update", lambda *args: calls.append(1) or original(*args))
    with torch.no_grad():
        general = base(x)
        multi_lora_layer._add_low_rank(x, general, layer._plan(x, layer._segments(shape[0])), [a, b])
        fast = layer(x)
    assert calls == [1]
    assert fast.dtype == dtype and torch.equal(fast, general)
    plain = base(x).float() + 2.0 * (x.float() @ a.T) @ b.T
    assert torch.allclose(fast.float(), plain, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
