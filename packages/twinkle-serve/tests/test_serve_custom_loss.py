"""Custom losses run on the server (`create_custom_loss` + `forward_backward_custom`), through the SDK.

The uploaded torch.fx op graph is interpreted against an allow-list: the server-side run must equal
the SDK's client-side fallback (same loss, metrics, logprobs, and bit-exact adapter weights after
optim_step) while submitting one forward_backward instead of two.
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import torch

from twinkle.hub import TEST_MODEL

SEQS = [[5 + (7 * i) % 60 for i in range(20)], [100 + (3 * i) % 50 for i in range(14)]]


def clipped_ratio_loss(logprobs, old_logprobs, advantages):
    ratio = torch.exp(logprobs - old_logprobs)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages).sum()
    loss = loss + 0.1 * torch.nn.functional.softplus(logprobs).mean() * math.sqrt(logprobs.shape[0])
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/tokens:sum": (advantages != 0).float().sum()}


def _f32(values):
    from tinker import types

    return types.TensorData(data=values, dtype="float32", shape=[len(values)])


def _data():
    from tinker import types

    data = []
    for k, seq in enumerate(SEQS):
        n = len(seq) - 1
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={
                    "target_tokens": seq[1:],
                    "old_logprobs": _f32([-3.0 - 0.05 * i for i in range(n)]),
                    "advantages": _f32([(1.0 if k == 0 else -0.5)] * n),
                },
            )
        )
    return data


def _futures(server, tenant) -> int:
    server.runtime.store.db.flush()  # a created future may still be journaled (store/db.py)
    return server.runtime.store.db.one("SELECT COUNT(*) AS n FROM futures WHERE tenant=?", (tenant,))["n"]


def _adapter_after_step(server, tc, name):
    from safetensors.torch import load_file

    path = tc.save_weights_for_sampler(name).result().path
    row = server.runtime.store.db.one("SELECT dir FROM checkpoints WHERE tinker_path=?", (path,))
    return load_file(f"{server.runtime.data_dir / row['dir']}/adapter_model.safetensors")


@pytest.fixture(scope="module")
def dave_key(server):
    return server.create_key("dave-customloss")


@pytest.fixture(scope="module")
def dave(server, dave_key):
    import tinker

    return tinker.ServiceClient(base_url=server.url, api_key=dave_key)


@pytest.fixture(scope="module")
def ratio_handle(dave):
    return dave.create_custom_loss(clipped_ratio_loss, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}).result()


def test_server_side_loss_equals_client_fallback_in_one_round_trip(server, dave, ratio_handle):
    from tinker import types

    handle = ratio_handle
    assert handle.loss_id is not None  # the server took it: it will run there
    adam = types.AdamParams(learning_rate=5e-2)
    on_server = dave.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=7).result()
    on_client = dave.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=7).result()

    def client_side(data, logprobs_list):  # the same per-datum loss, summed, as the SDK's fallback runs it
        losses = [
            clipped_ratio_loss(
                lp, d.loss_fn_inputs["old_logprobs"].to_torch(), d.loss_fn_inputs["advantages"].to_torch()
            )
            for d, lp in zip(data, logprobs_list)
        ]
        metrics = {
            "custom/ratio:mean": sum(m["custom/ratio:mean"].item() for _, m in losses) / len(losses),
            "custom/tokens:sum": sum(m["custom/tokens:sum"].item() for _, m in losses),
        }
        return sum(loss for loss, _ in losses), metrics

    passes = []  # the base model's forward calls: one per model pass
    hook = server.runtime.engine(TEST_MODEL).backend.engine.base.register_forward_hook(lambda *_: passes.append(1))
    results, submitted, model_passes = [], [], []
    try:
        for tc, loss_fn in ((on_server, handle), (on_client, client_side)):
            before, passes_before = _futures(server, "dave-customloss"), len(passes)
            out = tc.forward_backward_custom(_data(), loss_fn).result()
            submitted.append(_futures(server, "dave-customloss") - before)
            model_passes.append(len(passes) - passes_before)
            tc.optim_step(adam).result()
            results.append(out)
    finally:
        hook.remove()
    assert submitted == [1, 2]  # one forward_backward on the server path; forward + backward client-side
    assert model_passes == [1, 2]  # the loss runs inside the server's one pass
    server_out, client_out = results
    assert server_out.metrics["loss:sum"] == pytest.approx(client_out.metrics["loss:sum"], rel=1e-6)
    for key in ("custom/ratio:mean", "custom/tokens:sum", "surrogate_loss:sum"):
        assert server_out.metrics[key] == pytest.approx(client_out.metrics[key], rel=1e-6), key
    assert server_out.metrics["custom/tokens:sum"] == sum(len(s) - 1 for s in SEQS)
    for a, b in zip(server_out.loss_fn_outputs, client_out.loss_fn_outputs):
        np.testing.assert_array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
    w_server = _adapter_after_step(server, on_server, "cl-server")
    w_client = _adapter_after_step(server, on_client, "cl-client")
    assert w_server.keys() == w_client.keys()
    moved = 0
    for k in w_server:
        torch.testing.assert_close(w_server[k], w_client[k], rtol=0, atol=0)
        moved += int(torch.count_nonzero(w_server[k]).item() > 0 and "lora_B" in k)
    assert moved > 0  # lora_B starts at zero: the step really applied the custom loss's gradient


def _upload(server, key, session_id, fn, ranks, graph_edit=None):
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(fn, ranks, session_id)
    graph = encode_graph(handle).model_dump(mode="json")
    if graph_edit:
        graph_edit(graph["nodes"])
    body = {
        "session_id": session_id,
        "custom_loss_seq_id": 99,
        "name": handle.name,
        "inputs": [i.model_dump() for i in handle.inputs],
        "graph": graph,
        "type": "create_custom_loss",
    }
    return httpx.post(f"{server.url}/api/v1/create_custom_loss", json=body, headers={"X-API-Key": key})


def _weighted(logprobs, weights):
    return -(logprobs * weights).sum(), {}


def test_ops_outside_the_allow_list_are_400s_naming_them(server, dave, dave_key):
    session_id = dave.holder.get_session_id()

    def big(logprobs, weights):
        return (torch.nn.functional.one_hot(weights.long(), 10**6).float().sum() * logprobs).sum(), {}

    r = _upload(server, dave_key, session_id, big, {"logprobs": 1, "weights": 1})
    assert r.status_code == 400 and "torch._C._nn.one_hot" in r.json()["error"], r.text

    def rename(target):  # what a hand-written (not SDK-traced) graph could send
        def edit(nodes):
            next(n for n in nodes if n["op"] == "call_function")["target"] = target

        return edit

    r = _upload(server, dave_key, session_id, _weighted, {"logprobs": 1, "weights": 1}, rename("os.system"))
    assert r.status_code == 400 and "'os.system'" in r.json()["error"], r.text

    def method(nodes):
        n = next(n for n in nodes if n["op"] == "call_method")
        n["target"] = "__reduce_ex__"

    r = _upload(server, dave_key, session_id, _weighted, {"logprobs": 1, "weights": 1}, method)
    assert r.status_code == 400 and "'__reduce_ex__'" in r.json()["error"], r.text

    def captured(nodes):
        nodes.insert(2, {"op": "get_attr", "name": "w", "target": "weight", "args": [], "kwargs": {}})

    r = _upload(server, dave_key, session_id, _weighted, {"logprobs": 1, "weights": 1}, captured)
    assert r.status_code == 400 and "'get_attr'" in r.json()["error"], r.text

    def dangling(nodes):
        next(n for n in nodes if n["op"] == "call_method")["args"] = [{"ref": "nowhere"}]

    r = _upload(server, dave_key, session_id, _weighted, {"logprobs": 1, "weights": 1}, dangling)
    assert r.status_code == 400 and "'nowhere'" in r.json()["error"], r.text


def test_another_tenants_session_and_loss_are_404(server, dave, dave_key, bob, keys):
    from tinker import types

    r = _upload(server, keys["bob"], dave.holder.get_session_id(), _weighted, {"logprobs": 1, "weights": 1})
    assert r.status_code == 404, r.text
    handle = dave.create_custom_loss(_weighted, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id
    # bob forges a forward_backward naming dave's loss on his own model: the loss is not found for him
    tc = bob.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(SEQS[0][:-1]),
        loss_fn_inputs={"target_tokens": SEQS[0][1:], "weights": [1.0] * (len(SEQS[0]) - 1)},
    )
    with pytest.raises(Exception, match="not found"):
        tc.forward_backward([datum], "custom", {"loss_id": handle.loss_id}).result()


def test_missing_input_is_a_400_naming_it(dave, ratio_handle):
    from tinker import types

    handle = ratio_handle
    tc = dave.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(SEQS[0][:-1]),
        loss_fn_inputs={"target_tokens": SEQS[0][1:], "old_logprobs": _f32([0.0] * (len(SEQS[0]) - 1))},
    )
    # the SDK checks inputs itself; sent anyway (as a raw loss_fn="custom" call), the server names the field
    with pytest.raises(Exception, match="advantages"):
        tc.forward_backward([datum], "custom", {"loss_id": handle.loss_id}).result()


def test_a_custom_loss_fuses_with_another_tenants_pass_and_keeps_its_numbers(server, dave, ratio_handle, sft):
    """Queued behind a held worker, a custom-loss forward_backward and another run's cross-entropy one run as
    one fused pass; each equals the same request run alone on an identical adapter (a fused batch has other
    shapes than a solo one: fp32 agreement relative to magnitude, not bit-exact)."""
    import threading
    import time

    from twinkle.serve.core.work import Call, StoredAnswer

    def pair(seed):
        return [dave.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=seed).result() for _ in "ab"]

    (custom_solo, custom_fused), (ce_solo, ce_fused) = pair(11), pair(12)
    ce_data = [sft(SEQS[0]), sft(SEQS[1])]
    solo = (custom_solo.forward_backward_custom(_data(), ratio_handle).result(),)
    solo += (ce_solo.forward_backward(ce_data, "cross_entropy").result(),)

    scheduler = server.runtime.engines[TEST_MODEL].scheduler
    gate, held = threading.Event(), threading.Event()

    def hold():
        held.set()
        gate.wait(60)
        return StoredAnswer.json({})

    passes, items = scheduler.fused_passes, scheduler.fused_items["tinker"]
    scheduler.submit(Call("test-gate-custom", None, server.runtime.hub.create("dave-customloss"), hold))
    deadline = time.monotonic() + 60
    while not held.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    futures = (
        custom_fused.forward_backward_custom(_data(), ratio_handle),
        ce_fused.forward_backward(ce_data, "cross_entropy"),
    )
    while not (scheduler.pending(custom_fused.model_id) == 1 and scheduler.pending(ce_fused.model_id) == 1):
        assert time.monotonic() < deadline, "both requests should be queued"
        time.sleep(0.01)
    gate.set()
    fused = tuple(f.result() for f in futures)
    assert scheduler.fused_passes == passes + 1 and scheduler.fused_items["tinker"] == items + 2

    for alone, together in zip(solo, fused, strict=True):
        assert together.metrics.keys() == alone.metrics.keys()
        for key, value in alone.metrics.items():
            assert together.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        for a, b in zip(alone.loss_fn_outputs, together.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(b["logprobs"].to_numpy(), a["logprobs"].to_numpy(), rtol=1e-5, atol=1e-5)
    assert "surrogate_loss:sum" in fused[0].metrics and "custom/ratio:mean" in fused[0].metrics


def _call(name, target, *args):
    return {"op": "call_function", "name": name, "target": target, "args": list(args), "kwargs": {}}


def _returning(extra, use):
    """An edit of _weighted's graph: `extra` nodes before the output, whose loss becomes `use` (a node
    that also depends on the log-probs, so the program still trains)."""

    def edit(nodes):
        out = nodes.pop()
        nodes += [*extra, _call("probe_loss", "operator.add", {"ref": "neg"}, {"ref": use})]
        out["args"] = [{"tuple": [{"ref": "probe_loss"}, {"dict": {}}]}]
        nodes.append(out)

    return edit


def test_values_are_bounded_before_they_are_computed(server, dave, dave_key):
    """Ints, sequences and tensors a loss makes are bounded, each before the op that would pass the bound:
    constant operands are refused on upload (400), the rest when the loss runs on a datum (category user),
    every message naming the op and the bound. Before: operator.pow(7, 10**7) froze the server 7-12 s,
    a list repeated 5e7 times and 21 chained torch.cat grew it 0.5 GB each."""
    from tinker import RequestFailedError, types
    from tinker.types import RequestErrorCategory

    from twinkle.serve.tinker import loss_bounds as LB

    session_id = dave.holder.get_session_id()
    ranks = {"logprobs": 1, "weights": 1}
    on_upload = {
        "operator.pow(7, 10000000) would be an integer of ~2.81e+07 bits; at most 4096": [
            _call("p", "operator.pow", 7, 10**7),
            _call("ps", "operator.mul", {"ref": "p"}, 0.0),
        ],
        "operator.mul repeats a list of 1 items 50000000 times; at most 65536 items": [
            _call("l", "operator.mul", [0.0], 50_000_000),
            _call("ls", "torch.tensor", {"ref": "l"}),
            _call("ps", "torch.sum", {"ref": "ls"}),
        ],
        "operator.mod on a string formats text": [
            _call("s", "operator.mod", "%099999999d", 1),
            _call("ps", "operator.mul", {"ref": "s"}, 0),
        ],
    }
    for message, nodes in on_upload.items():
        r = _upload(server, dave_key, session_id, _weighted, ranks, _returning(nodes, "ps"))
        assert r.status_code == 400 and message in r.json()["error"], r.text

    doubling = [_call("c0", "torch.cat", [{"ref": "logprobs"}, {"ref": "logprobs"}])]
    doubling += [_call(f"c{i}", "torch.cat", [{"ref": f"c{i - 1}"}] * 2) for i in range(1, 21)]
    n = len(SEQS[0]) - 1
    at_run = {  # datum: n log-probs and n weights, so one value may hold 64 * 2n + 65536 elements
        f"torch.cat takes an argument of {2**12 * n} tensor elements; at most {64 * 2 * n + 65536}": [
            *doubling,
            _call("ps", "torch.sum", {"ref": "c20"}),
        ],
        "operator.pow(a 2808-bit integer, 1000) would be an integer of ~2.81e+06 bits; at most 4096": [
            _call("a", "operator.pow", 7, 1000),
            _call("b", "operator.pow", {"ref": "a"}, 1000),
            _call("ps", "operator.mul", {"ref": "logprobs"}, {"ref": "b"}),
        ],
        "operator.mul repeats a list of 2 items 50000000 times; at most 65536 items": [
            _call("l2", "operator.add", [0.0], [{"ref": "neg"}]),
            _call("l", "operator.mul", {"ref": "l2"}, 50_000_000),
            _call("ps", "operator.getitem", {"ref": "l"}, 1),
        ],
    }
    tc = dave.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=3).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(SEQS[0][:-1]),
        loss_fn_inputs={"target_tokens": SEQS[0][1:], "weights": [1.0] * n},
    )
    for message, nodes in at_run.items():
        r = _upload(server, dave_key, session_id, _weighted, ranks, _returning(nodes, "ps"))
        assert r.status_code == 200, r.text
        loss_id = f"{session_id}:loss:99"  # _upload's custom_loss_seq_id: each upload replaces the last
        with pytest.raises(RequestFailedError) as e:
            tc.forward_backward([datum], "custom", {"loss_id": loss_id}).result()
        assert e.value.category == RequestErrorCategory.User and message in str(e.value), e.value
    assert LB.ELEMENTS_PER_DATUM == 64 and LB.ELEMENTS_FLOOR == 65536  # the figures the messages above quote
