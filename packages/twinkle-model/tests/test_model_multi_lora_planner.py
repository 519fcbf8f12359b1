"""The planner fuses small requests, runs large ones alone, keeps each tenant's order, and the
executor hands back each tenant's result as soon as its pass is done."""

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.multi_lora.planner import FusionPlanner, Request

torch.set_num_threads(2)


def rows(seed, n, length):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 800, (length,), generator=g).tolist()} for _ in range(n)]


def fb(tenant, n, length, seed=0, rid=None):
    return Request(tenant, "forward_backward", rows(seed, n, length), request_id=rid)


def shape_of(plan):
    return [(g.kind, [r.request_id or r.tenant for r in g.requests]) for g in plan]


def test_plan_fuses_small_runs_large_alone_and_keeps_tenant_order():
    planner = FusionPlanner(fuse_max_tokens=256, group_max_tokens=512, max_padding=0.25)
    queue = [
        fb("a", 2, 32, rid="a1"),
        fb("b", 2, 32, rid="b1"),
        fb("big", 8, 128, rid="big1"),
        Request("a", "step", request_id="a-step"),
        fb("c", 2, 30, rid="c1"),
        fb("a", 2, 32, rid="a2"),
        Request("d", "forward", rows(0, 1, 20), request_id="d1"),
        Request("e", "forward", rows(0, 1, 20), request_id="e1"),
    ]
    plan = planner.plan(queue)
    assert shape_of(plan) == [
        ("forward_backward", ["c1", "a1", "b1"]),  # small ones share a pass (sorted by length), 7% padding
        ("forward", ["d1", "e1"]),  # no-grad requests fuse among themselves
        ("forward_backward", ["big1"]),  # 1024 tokens: already fills the GEMMs, runs alone
        ("step", ["a-step"]),  # a's step after a's first batch, before its second
        ("forward_backward", ["a2"]),
    ]
    # the token budget and the padding limit split groups
    tight = FusionPlanner(fuse_max_tokens=256, group_max_tokens=128).plan([fb(t, 2, 32) for t in "abc"])
    assert [len(g.requests) for g in tight] == [2, 1]
    ragged = FusionPlanner(max_padding=0.1).plan([fb("a", 2, 10), fb("b", 2, 40)])
    assert [len(g.requests) for g in ragged] == [1, 1]


def test_bad_requests_are_refused_by_name():
    with pytest.raises(ValueError, match="kind must be one of"):
        Request("a", "train", rows(0, 1, 4))
    with pytest.raises(ValueError, match="needs inputs"):
        Request("a", "forward_backward")
    with pytest.raises(ValueError, match="max_padding"):
        FusionPlanner(max_padding=1.5)


def test_execute_returns_results_as_passes_finish_and_equal_direct_calls():
    def make():
        model = MultiLoraModel(TEST_MODEL)
        for rank, name in enumerate("abc", start=1):
            model.add_adapter_to_model(name, LoraConfig(r=4 * rank, lora_alpha=8, target_modules="all-linear"))
            model.set_optimizer("SGD", adapter_name=name, lr=0.1)
        return model

    served, direct = make(), make()
    queue = [
        fb("a", 2, 16, seed=1),
        fb("b", 2, 16, seed=2),
        Request("a", "step", options={"max_grad_norm": None}),
        fb("c", 6, 64, seed=3),
        Request("c", "step"),
        fb("a", 2, 16, seed=4),
        fb("zed", 1, 8),
        Request("b", "forward", rows(5, 1, 16)),
    ]
    seen = []
    completions = list(served.run(queue, FusionPlanner(fuse_max_tokens=128), on_result=seen.append))
    assert seen == completions and len(completions) == len(queue)
    order = [(c.request.tenant, c.request.kind) for c in completions]
    # small a1/b1/zed share the first pass and come back before c's large pass ends
    assert order.index(("c", "forward_backward")) > order.index(("a", "forward_backward"))
    first = completions[0]
    assert set(first.fused_with) | {first.request.tenant} == {"a", "b", "zed"}
    zed = next(c for c in completions if c.request.tenant == "zed")
    assert not zed.ok and "no adapter named 'zed'" in str(zed.error)  # fails alone; a and b still trained
    assert all(c.ok for c in completions if c.request.tenant != "zed")

    direct.forward_backward(queue[0].inputs, adapter_name="a")
    direct.forward_backward(queue[1].inputs, adapter_name="b")
    direct.clip_grad_and_step(adapter_name="a", max_grad_norm=None)
    direct.forward_backward(queue[3].inputs, adapter_name="c")
    direct.clip_grad_and_step(adapter_name="c")
    direct.forward_backward(queue[5].inputs, adapter_name="a")
    for name in "abc":
        for p, q in zip(served.adapters[name].params, direct.adapters[name].params):
            assert torch.allclose(p, q, atol=1e-6)
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert torch.allclose(p.grad, q.grad, atol=1e-6)
    logprobs = next(c for c in completions if c.request.kind == "forward").result["logprobs"]
    assert len(logprobs) == 1 and len(logprobs[0]) == 15
