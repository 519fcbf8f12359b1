"""Issue 43, class 4: a tenant's patterns and loss programs cost what their input does.

Against a real `twinkle-server`, a hostile tenant sends what froze or grew the server before: a
`target_modules` regex that backtracks exponentially (`model\\.lay(.|.)*X`: 5-9 s a request holding
the GIL), a lookahead pattern, and custom losses computing `operator.pow(7, 10**7)` (7-12 s), a list
repeated 5e7 times and 21 chained `torch.cat` doublings (0.5 GB each). Each probe gets its status and
a message naming the op and the bound, while another tenant trains through the Tinker SDK: its step
latency beside each probe stays within 2x of its clean steps measured in the same test (beside the
hostile tenant's ordinary custom-loss step instead of a probe), and the server's private memory grows
less than a stated bound over all the probes.
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx
from _util_isolation import NativeWire
from harness import SUMMARY

ROUNDS = 3  # each probe this many times, one beside each measured step
RSS_BOUND_MB = 100  # one pre-fix probe grew the server 500 MB
SEQ = [5 + (7 * i) % 60 for i in range(24)]


def _private_mb(pid: int) -> float:
    """Anonymous resident plus swapped memory: what requests allocate (mapped files come and go)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields.get(k, "0 kB").split()[0]) for k in ("RssAnon", "VmSwap")) / 1024


def _call(name, target, *args):
    return {"op": "call_function", "name": name, "target": target, "args": list(args), "kwargs": {}}


def _weighted(logprobs, weights):
    return -(logprobs * weights).sum(), {}


def _loss_body(session_id: str, seq: int, extra: list[dict]) -> dict:
    """create_custom_loss for `_weighted` traced by the SDK, plus hand-written nodes (`extra`, the last
    named `ps`) whose value the loss adds: what a client that does not trace could send."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(_weighted, {"logprobs": 1, "weights": 1}, session_id)
    graph = encode_graph(handle).model_dump(mode="json")
    out = graph["nodes"].pop()
    graph["nodes"] += [*extra, _call("probe_loss", "operator.add", {"ref": "neg"}, {"ref": "ps"})]
    out["args"] = [{"tuple": [{"ref": "probe_loss"}, {"dict": {}}]}]
    graph["nodes"].append(out)
    inputs = [i.model_dump() for i in handle.inputs]
    return {"session_id": session_id, "custom_loss_seq_id": seq, "name": "probe", "inputs": inputs, "graph": graph}


def _doublings(k: int) -> list[dict]:
    nodes = [_call("c0", "torch.cat", [{"ref": "logprobs"}, {"ref": "logprobs"}])]
    nodes += [_call(f"c{i}", "torch.cat", [{"ref": f"c{i - 1}"}] * 2) for i in range(1, k)]
    return [*nodes, _call("ps", "torch.sum", {"ref": f"c{k - 1}"})]


BENIGN = [_call("ps", "operator.mul", {"ref": "neg"}, 0.5)]  # a loss that trains
LOSS_PROBES = {  # name -> (nodes, when refused, what the refusal names)
    "pow": (
        [_call("p", "operator.pow", 7, 10**7), _call("ps", "operator.mul", {"ref": "p"}, 0.0)],
        "upload",
        "operator.pow(7, 10000000)",
    ),
    "pow chain": (
        [
            _call("a", "operator.pow", 7, 1000),
            _call("b", "operator.pow", {"ref": "a"}, 1000),
            _call("ps", "operator.mul", {"ref": "logprobs"}, {"ref": "b"}),
        ],
        "run",
        "at most 4096",
    ),
    "list repetition": (
        [
            _call("l2", "operator.add", [0.0], [{"ref": "neg"}]),
            _call("l", "operator.mul", {"ref": "l2"}, 50_000_000),
            _call("ps", "operator.getitem", {"ref": "l"}, 1),
        ],
        "run",
        "operator.mul repeats a list of 2 items 50000000 times; at most 65536 items",
    ),
    "21 torch.cat doublings": (_doublings(21), "run", "torch.cat takes an argument of"),
}


def test_patterns_and_programs_cost_what_their_input_does(launch):
    import tinker
    from tinker import RequestFailedError, types
    from tinker.types import RequestErrorCategory

    from twinkle.hub import TEST_MODEL

    srv, keys = launch(["steady", "hostile"], long_poll_s=1.0)
    pid = srv.proc.pid
    steady = tinker.ServiceClient(base_url=srv.url, api_key=keys["steady"])
    hostile = tinker.ServiceClient(base_url=srv.url, api_key=keys["hostile"])
    native = NativeWire(srv.url, keys["hostile"])
    raw = httpx.Client(base_url=f"{srv.url}/api/v1", headers={"X-API-Key": keys["hostile"]}, timeout=60)
    trainer = steady.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=1).result()
    victim = hostile.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=2).result()
    session_id = hostile.holder.get_session_id()
    native_model = native.model()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)},
    )
    adam = types.AdamParams(learning_rate=1e-3)

    def step() -> float:
        t0 = time.perf_counter()
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(adam).result()
        return time.perf_counter() - t0

    def adapter(name: str, pattern: str) -> tuple[int, str]:
        body = {"adapter_name": name, "lora_config": {"r": 4, "lora_alpha": 8, "target_modules": pattern}}
        r = native.post(f"/models/{native_model}/add_adapter_to_model", body)
        if r.status_code != 200:
            return r.status_code, r.json().get("detail") or r.json().get("error") or r.text
        out = native.wait(r.json()["request_id"])
        return (200, "") if out["status"] == "complete" else (out.get("category"), str(out.get("error")))

    seq = iter(range(100, 10_000))
    probes = {
        "regex model\\.lay(.|.)*X": lambda: adapter(f"p{next(seq)}", r"model\.lay(.|.)*X"),
        "regex lookahead": lambda: adapter(f"p{next(seq)}", r"^(?!.*mlp).*q_proj"),
    }
    expected = {"regex model\\.lay(.|.)*X": "matches no Linear layer", "regex lookahead": "lookahead"}

    def loss_probe(name):
        nodes, when, _ = LOSS_PROBES[name] if name != "benign" else (BENIGN, "run", "")
        r = raw.post("/create_custom_loss", json=_loss_body(session_id, next(seq), nodes))
        if when == "upload" or r.status_code != 200:
            return r.status_code, r.json().get("error", r.text)
        loss_id = raw.post("/retrieve_future", json={"request_id": r.json()["request_id"]}).json()["loss_id"]
        try:
            victim.forward_backward([datum], "custom", {"loss_id": loss_id}).result()
        except RequestFailedError as e:
            return ("user" if e.category == RequestErrorCategory.User else e.category), str(e)
        return 200, "accepted"

    for name, (_, _when, message) in LOSS_PROBES.items():
        probes[f"loss {name}"] = lambda name=name: loss_probe(name)
        expected[f"loss {name}"] = message
    want_status = {name: {400} for name in probes}
    want_status.update({f"loss {n}": {"user"} for n, (_, when, _m) in LOSS_PROBES.items() if when == "run"})
    # compiles on the linear matcher, selects nothing: refused when the adapter is built (a failed future,
    # category user) or before it is queued (400), whichever the native route checks first
    want_status["regex model\\.lay(.|.)*X"] = {400, "user"}

    for _ in range(3):  # warm-up: the first steps compile kernels and fill caches
        step()
    memory_before = _private_mb(pid)
    clean, beside, answers = [], {name: [] for name in probes}, []
    for _ in range(ROUNDS):
        for name, probe in probes.items():
            trained = {}  # the hostile tenant's ordinary custom-loss step: the clean steps' neighbour
            neighbour = threading.Thread(target=lambda t=trained: t.update(out=loss_probe("benign")))
            neighbour.start()
            clean.append(step())
            neighbour.join(120)
            assert trained.get("out") == (200, "accepted"), trained
            result = {}
            thread = threading.Thread(target=lambda p=probe, r=result: r.update(out=p()))
            thread.start()
            beside[name].append(step())
            thread.join(120)
            assert not thread.is_alive(), f"probe {name} still running after 120 s"
            answers.append((name, *result["out"]))
    growth = _private_mb(pid) - memory_before
    for name, status, message in answers:
        assert status in want_status[name] and expected[name] in message, (name, status, message)
    base = statistics.median(clean)
    ratios = {name: statistics.median(times) / base for name, times in beside.items()}
    worst = max(ratios, key=ratios.get)
    SUMMARY["class 4: patterns and loss programs (issue 43)"] = (
        f"{len(answers)} probes refused naming op and bound; other tenant's median step beside each probe "
        f"<= {ratios[worst]:.2f}x its clean {base * 1e3:.0f} ms (worst: {worst}); "
        f"server private memory {growth:+.0f} MB (bound {RSS_BOUND_MB})"
    )
    print(SUMMARY["class 4: patterns and loss programs (issue 43)"], ratios)
    assert ratios[worst] <= 2.0, (clean, beside)
    assert growth < RSS_BOUND_MB, growth
    for c in (native, raw):
        c.close()
