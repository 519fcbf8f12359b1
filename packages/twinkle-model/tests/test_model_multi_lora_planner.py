"""The planner answers on sizes and kinds: small requests share a pass, large ones run alone, each
tenant keeps its order, training and forward-only requests never share a group; and a group it plans
is one fused pass of MultiLoraModel whose results equal each tenant's own calls."""

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.multi_lora.planner import FusionPlanner, Request, batch_shape

torch.set_num_threads(2)


def rows(seed, n, length):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 800, (length,), generator=g).tolist()} for _ in range(n)]


def req(tenant, n, length, kind="forward_backward", rid=None):
    return Request(tenant, kind, (n, length, n * length), request_id=rid)


def shape_of(plan):
    return [(g.kind, [r.request_id or r.tenant for r in g.requests]) for g in plan]


@pytest.mark.no_float
def test_plan_fuses_small_runs_large_alone_and_keeps_tenant_order():
    planner = FusionPlanner(fuse_max_tokens=256, group_max_tokens=512, max_padding=0.25)
    queue = [
        req("a", 2, 32, rid="a1"),
        req("b", 2, 32, rid="b1"),
        req("big", 8, 128, rid="big1"),
        Request("a", "step", request_id="a-step"),
        req("c", 2, 30, rid="c1"),
        req("a", 2, 32, rid="a2"),
        req("d", 1, 20, "forward", rid="d1"),
        req("e", 1, 20, "forward", rid="e1"),
    ]
    plan = planner.plan(queue)
    assert shape_of(plan) == [
        ("forward_backward", ["c1", "a1", "b1"]),  # small ones share a pass (sorted by length), 2% padding
        ("forward", ["d1", "e1"]),  # no-grad requests fuse among themselves
        ("forward_backward", ["big1"]),  # 1024 tokens: already fills the GEMMs, runs alone
        ("step", ["a-step"]),  # a's step after a's first batch, before its second
        ("forward_backward", ["a2"]),
    ]
    # the token budget, the padding limit and max_fuse split groups
    tight = FusionPlanner(fuse_max_tokens=256, group_max_tokens=128).plan([req(t, 2, 32) for t in "abc"])
    assert [len(g.requests) for g in tight] == [2, 1]
    ragged = FusionPlanner(max_padding=0.1).plan([req("a", 2, 10), req("b", 2, 40)])
    assert [len(g.requests) for g in ragged] == [1, 1]
    capped = FusionPlanner(max_fuse=2).plan([req(t, 1, 8) for t in "abcde"])
    assert [len(g.requests) for g in capped] == [2, 2, 1]
    # real tokens decide the padding: rows of 40 and 4 tokens with two full rows of 40 are 36 of 160 padding
    ragged_rows = [Request("s", shape=(2, 40, 44)), req("t", 2, 40)]
    assert [len(g.requests) for g in FusionPlanner(max_padding=0.25).plan(ragged_rows)] == [2]
    assert [len(g.requests) for g in FusionPlanner(max_padding=0.2).plan(ragged_rows)] == [1, 1]
    assert batch_shape([{"input_ids": [1] * 40}, {"input_ids": [1] * 4}]) == (2, 40, 44)


@pytest.mark.no_float
def test_training_and_forward_only_requests_are_never_one_group():
    # the engine runs forward_backward_fused and forward_fused as two passes: so does the plan
    queue = [req("a", 1, 16), req("b", 1, 16, "forward"), req("c", 1, 16), req("d", 1, 16, "forward")]
    plan = FusionPlanner().plan(queue)
    assert [(g.kind, [r.tenant for r in g.requests]) for g in plan] == [
        ("forward_backward", ["a", "c"]),
        ("forward", ["b", "d"]),
    ]


@pytest.mark.no_float
def test_bad_requests_and_thresholds_are_refused_by_name():
    with pytest.raises(ValueError, match="kind must be one of"):
        Request("a", "train", (1, 4, 4))
    with pytest.raises(ValueError, match="real tokens <= rows"):
        Request("a", "forward", (1, 4, 5))
    with pytest.raises(ValueError, match="max_padding"):
        FusionPlanner(max_padding=1.5)
    with pytest.raises(ValueError, match="max_fuse"):
        FusionPlanner(max_fuse=0)
    with pytest.raises(TypeError, match="expected Request"):
        FusionPlanner().plan([("a", 1)])  # ty: ignore[invalid-argument-type]


def test_a_planned_group_is_one_fused_pass_equal_to_each_tenant_alone():
    def make():
        model = MultiLoraModel(TEST_MODEL)
        for rank, name in enumerate("abc", start=1):
            model.add_adapter_to_model(name, LoraConfig(r=4 * rank, lora_alpha=8, target_modules="all-linear"))
            model.set_optimizer("SGD", adapter_name=name, lr=0.1)
        return model

    served, direct = make(), make()
    batches = {"a": rows(1, 2, 16), "b": rows(2, 2, 14), "c": rows(3, 6, 64), "zed": rows(4, 1, 8)}
    plan = FusionPlanner(fuse_max_tokens=128).plan([Request(t, shape=batch_shape(b)) for t, b in batches.items()])
    assert [[r.tenant for r in g.requests] for g in plan] == [["zed", "b", "a"], ["c"]]
    outcomes = {}
    for group in plan:
        outcomes |= served.forward_backward_fused({r.tenant: batches[r.tenant] for r in group.requests}, False)
    assert "no adapter named 'zed'" in str(outcomes["zed"])  # fails alone; a and b in its pass still trained
    for name in "abc":
        assert outcomes[name]["loss"] == pytest.approx(
            direct.forward_backward(batches[name], adapter_name=name)["loss"], rel=1e-5
        )
        served.clip_grad_and_step(adapter_name=name)
        direct.clip_grad_and_step(adapter_name=name)
        for p, q in zip(served.adapters[name].params, direct.adapters[name].params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
