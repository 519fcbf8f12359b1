"""MultiLoraLinear's hand-written backward (one autograd node per layer, grouped GEMMs) against
autograd itself: torch.autograd.gradcheck at fp64, and at fp32 the same outputs and gradients as
an unfused reference written with plain ops, one adapter per run of rows (peft's formula)."""

import pytest
import torch
from torch import nn

from twinkle.model.multi_lora.layer import MultiLoraLinear, Routing

IN, OUT = 12, 10
# equal ranks next to each other (one bmm), a lone rank, base-only rows, unequal scalings in a group
ADAPTERS = {"a": (4, 2.0), "b": (4, 0.5), "c": (6, 1.0), "d": (2, 3.0)}
SEGMENTS = [("a", 2), ("b", 2), ("c", 2), (None, 1), ("d", 3)]


def make_layer(dtype, dropout=0.0):
    torch.manual_seed(0)
    routing = Routing()
    layer = MultiLoraLinear(nn.Linear(IN, OUT, dtype=dtype), routing).requires_grad_(False)
    for i, (name, (rank, scaling)) in enumerate(ADAPTERS.items()):
        gens = [torch.Generator().manual_seed(10 * i + k) for k in range(2)]
        layer.add_adapter(name, rank, scaling, dropout, *gens)
        a, b = layer.factors(name)
        with torch.no_grad():
            b.normal_(0, 0.5, generator=gens[1])  # B starts at zero: make every gradient non-trivial
        a.requires_grad_(True), b.requires_grad_(True)
    return layer, routing


def reference(layer, x, segments):
    """out = base(x) + scaling * B(A(x)) per run of rows, with nothing but autograd's own ops."""
    parts, start = [], 0
    for name, rows in segments:
        xs = x[start : start + rows]
        y = layer.base_layer(xs)
        if name is not None:
            a, b = layer.factors(name)
            y = y + (xs @ a.t()) @ b.t() * layer.scaling[name]
        parts.append(y)
        start += rows
    return torch.cat(parts)


def params(layer):
    return [w for name in ADAPTERS for w in layer.factors(name)]


def test_plan_groups_equal_sizes_and_ranks_only():
    layer, routing = make_layer(torch.float32)
    routing.set([(name, rows, 5) for name, rows in SEGMENTS], training=True)
    x = torch.zeros(10, 5, IN)
    plan = layer._plan(x, layer._segments(10))
    assert [(g.start, g.count, g.rank) for g in plan] == [(0, 2, 4), (4, 1, 6), (7, 1, 2)]


@pytest.mark.parametrize("time", [1, 2])
def test_gradcheck_fp64(time):
    layer, routing = make_layer(torch.float64)
    x = torch.randn(10, time, IN, dtype=torch.float64, requires_grad=True)
    routing.set([(name, rows, time) for name, rows in SEGMENTS], training=True)
    assert torch.autograd.gradcheck(lambda x, *w: layer(x), (x, *params(layer)), eps=1e-6, atol=1e-8)


def test_fp32_output_and_gradients_equal_unfused_reference():
    layer, routing = make_layer(torch.float32)
    x = torch.randn(10, 5, IN, requires_grad=True)
    g = torch.randn(10, 5, OUT)
    routing.set([(name, rows, 5) for name, rows in SEGMENTS], training=True)
    fused = layer(x)
    grads = torch.autograd.grad(fused, (x, *params(layer)), g)
    expected = reference(layer, x, SEGMENTS)
    expected_grads = torch.autograd.grad(expected, (x, *params(layer)), g)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-4)
    for got, want in zip(grads, expected_grads):
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the no-grad path (sampling) computes the same thing without a node
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-4)


def test_dropout_rows_get_masked_gradients():
    """With dropout, A's gradient and x's gradient go through each tenant's own mask: compare
    with the reference fed the same masks (drawn again from generators in the same state)."""
    layer, routing = make_layer(torch.float64, dropout=0.3)
    x = torch.randn(10, 5, IN, dtype=torch.float64, requires_grad=True)
    states = {name: layer.generators[name].get_state() for name in ADAPTERS}
    routing.set([(name, rows, 5) for name, rows in SEGMENTS], training=True)
    fused = layer(x)
    g = torch.randn_like(fused)
    grads = torch.autograd.grad(fused, (x, *params(layer)), g)
    for name, state in states.items():
        layer.generators[name].set_state(state)
    masked, start = [], 0
    for name, rows in SEGMENTS:
        keep = layer._keep_mask(name, x[start : start + rows], 5) if name else None
        masked.append((name, rows, keep))
        start += rows
    parts, start = [], 0
    for name, rows, keep in masked:
        xs = x[start : start + rows]
        y = layer.base_layer(xs)
        if name is not None:
            a, b = layer.factors(name)
            y = y + ((xs * keep) @ a.t()) @ b.t() * layer.scaling[name]
        parts.append(y)
        start += rows
    expected = torch.cat(parts)
    torch.testing.assert_close(fused, expected)
    for got, want in zip(grads, torch.autograd.grad(expected, (x, *params(layer)), g)):
        torch.testing.assert_close(got, want)


def test_bf16_base_equals_per_segment_reference_with_and_without_dropout():
    """A bf16 base with fp32 factors (the served 0.6B shape's case): each segment's fp32 product added
    to its bf16 base output and rounded once; one group drawing dropout, the others not, base-only
    rows between them. Factor gradients to fp32 rounding, x and the output to bf16's."""
    layer, routing = make_layer(torch.bfloat16, dropout=0.3)
    layer.dropout["c"] = layer.dropout["d"] = 0.0  # a and b (one group) draw masks, c and d do not
    x = torch.randn(10, 5, IN).to(torch.bfloat16).requires_grad_(True)
    states = {name: layer.generators[name].get_state() for name in ADAPTERS}
    routing.set([(name, rows, 5) for name, rows in SEGMENTS], training=True)
    fused = layer(x)
    g = torch.randn(fused.shape).to(torch.bfloat16)
    grads = torch.autograd.grad(fused, (x, *params(layer)), g)
    for name, state in states.items():
        layer.generators[name].set_state(state)
    parts, start = [], 0
    for name, rows in SEGMENTS:
        xs = x[start : start + rows]
        y = layer.base_layer(xs)
        if name is not None:
            keep = layer._keep_mask(name, xs, 5)
            a, b = layer.factors(name)
            low = ((xs if keep is None else xs * keep).float() @ a.t()) @ b.t() * layer.scaling[name]
            y = (y.float() + low).to(torch.bfloat16)
        parts.append(y)
        start += rows
    expected = torch.cat(parts)
    expected_grads = torch.autograd.grad(expected, (x, *params(layer)), g)
    torch.testing.assert_close(fused, expected)
    # grad x: base and LoRA parts each rounded to bf16 before their sum here, after it there: two
    # roundings apart, which near a cancellation is a large relative error, so measured against the scale
    scale = float(expected_grads[0].abs().max())
    torch.testing.assert_close(grads[0].float(), expected_grads[0].float(), rtol=0, atol=2 * 2**-8 * scale)
    for got, want in zip(grads[1:], expected_grads[1:]):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
