"""Which torch kernels build_optimizer picks on CPU, and that the fast one is the same update."""

import inspect

import pytest
import torch

from twinkle.model.optim import build_optimizer


def _lora_like(seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 64), (64, 8), (16, 64), (32, 16)]
    return [(f"layer{i}.lora_A.weight", torch.nn.Parameter(torch.randn(s, generator=g))) for i, s in enumerate(shapes)]


def _train(optimizer, params, steps: int = 5) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for _, p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
def test_cpu_parameters_get_torchs_fused_kernel_and_the_same_update_as_its_reference_loop(name):
    fast, reference = _lora_like(0), _lora_like(0)
    kwargs = {"lr": 1e-2, "momentum": 0.9} if name == "SGD" else {"lr": 1e-2}
    optimizer = build_optimizer(name, fast, weight_decay=0.01, **kwargs)
    assert all(group["fused"] is True for group in optimizer.param_groups)
    loop = build_optimizer(name, reference, weight_decay=0.01, foreach=False, **kwargs)  # the caller's choice stands
    assert all(not group["fused"] and group["foreach"] is False for group in loop.param_groups)
    _train(optimizer, fast)
    _train(loop, reference)
    for (n, a), (_, b), (_, start) in zip(fast, reference, _lora_like(0)):
        assert (a - start).abs().max() > 1e-3, n  # it trained
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} {n}")  # rounding, not a different rule


def test_an_optimizer_without_a_fused_kernel_gets_foreach():
    cls = torch.optim.RMSprop
    if "fused" in inspect.signature(cls.__init__).parameters:
        pytest.skip("this torch has a fused RMSprop")
    optimizer = build_optimizer(cls, _lora_like(0), lr=1e-3)
    assert optimizer.param_groups[0]["foreach"] is True


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_non_contiguous_gradients_and_parameters_get_the_reference_update(name):
    """torch's fused CPU kernels misread strided tensors (a transposed gradient: a wrong update, no
    error); build_optimizer's fused optimizers must still give the reference loop's numbers."""
    kwargs = {"lr": 1e-1, "momentum": 0.9} if name == "SGD" else {"lr": 1e-1}

    def run(**extra):
        g = torch.Generator().manual_seed(3)
        strided = torch.nn.Parameter(torch.randn(16, 8, generator=g).T)  # a parameter built from a view
        plain = torch.nn.Parameter(torch.randn(8, 16, generator=g))
        params = [("a.lora_A.weight", strided), ("b.lora_B.weight", plain)]
        optimizer = build_optimizer(name, params, weight_decay=0.01, **kwargs, **extra)
        for step in range(3):
            g = torch.Generator().manual_seed(200 + step)
            strided.grad = torch.randn(16, 8, generator=g).T  # strided gradients, as autograd may give
            plain.grad = torch.randn(16, 8, generator=g).T
            optimizer.step()
        return optimizer, [p.detach().clone() for _, p in params]

    fast, got = run()
    # a strided parameter: its group takes foreach
    assert [(bool(group["fused"]), group["foreach"]) for group in fast.param_groups] == [(False, True)]
    _, want = run(foreach=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    # contiguous parameters keep the fused kernel; their strided gradients are made contiguous first
    g = torch.Generator().manual_seed(4)
    params = [("w.lora_A.weight", torch.nn.Parameter(torch.randn(8, 16, generator=g)))]
    reference = [("w.lora_A.weight", torch.nn.Parameter(params[0][1].detach().clone()))]
    fused = build_optimizer(name, params, **kwargs)
    loop = build_optimizer(name, reference, foreach=False, **kwargs)
    assert fused.param_groups[0]["fused"] is True
    for step in range(3):
        grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(300 + step)).T
        params[0][1].grad, reference[0][1].grad = grad, grad.clone()
        fused.step()
        loop.step()
    assert fused.param_groups[0]["fused"] is True
    torch.testing.assert_close(params[0][1].detach(), reference[0][1].detach(), rtol=1e-5, atol=1e-6)
