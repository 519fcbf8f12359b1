"""The value bounds of custom losses (tinker/loss_bounds.py) on SDK-traced programs, without a server:
ops whose result outgrows their arguments are refused from the shapes the meta device computes, before
anything is allocated; the run's total work is bounded; ordinary programs compute what eager torch does."""

from __future__ import annotations

import pytest
import torch

from twinkle.serve.tinker import loss_bounds as LB
from twinkle.serve.tinker.custom_loss import LossGraphError, LossProgram


def _program(fn) -> LossProgram:
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(fn, {"logprobs": 1, "weights": 1}, "session")
    graph = encode_graph(handle).model_dump(mode="json")
    return LossProgram.parse(handle.name, [i.model_dump() for i in handle.inputs], graph)


def pairwise(logprobs, weights):  # an all-pairs margin: T^2 elements by broadcasting
    margins = logprobs[:, None] - logprobs[None, :]
    return (torch.nn.functional.softplus(margins) * weights.mean()).mean(), {}


def outer(logprobs, weights):
    return torch.outer(logprobs, weights).sum(), {}


def masked(logprobs, weights):
    return -logprobs[weights > 0].sum(), {"custom/kept:sum": (weights > 0).float().sum()}


def repeated_reads(logprobs, weights):
    square = torch.outer(logprobs, weights)
    total = square.sum()
    for _ in range(60):  # traced as 60 reads of the whole square
        total = total + square.sum()
    return total, {}


def _datum(t: int):
    torch.manual_seed(t)
    return torch.randn(t, requires_grad=True), torch.rand(t) - 0.2


@pytest.mark.parametrize("fn", [pairwise, outer])
def test_a_result_larger_than_the_datum_allows_is_refused_before_it_exists(fn):
    program = _program(fn)
    small = _datum(20)  # 400 elements: well within 64 x 40 + 65536
    loss, _ = program(*small)
    torch.testing.assert_close(loss, fn(*small)[0], rtol=1e-6, atol=0)
    bound = LB.ELEMENTS_PER_DATUM * 2 * 2000 + LB.ELEMENTS_FLOOR
    with pytest.raises(LossGraphError, match=f"would make 4000000 tensor elements; at most {bound} "):
        program(*_datum(2000))  # 2000 x 2000: refused from its shape, never allocated


def test_boolean_masks_index_without_a_size_check_and_match_eager():
    program = _program(masked)
    args = _datum(50)
    loss, metrics = program(*args)
    expected, expected_metrics = masked(*args)
    assert (
        loss.item() == expected.item()
        and metrics["custom/kept:sum"].item() == expected_metrics["custom/kept:sum"].item()
    )


def test_the_runs_work_is_bounded_by_the_datum():
    """A 300-token datum (600 elements): the 90,000-element square fits one value, but reading it 61
    times passes 1024 x 600 + 2^22 elements of work; a 40-token one reads its 1,600 61 times easily."""
    program = _program(repeated_reads)
    program(*_datum(40))
    with pytest.raises(LossGraphError, match=r"work budget .*1024 x the datum's 600 \+ 4194304"):
        program(*_datum(300))
