"""Many Tinker-SDK tenants on one server, each running one of a few workloads, for the adapter
residency tests: every tenant's losses and final adapter (weights and Adam moments, read from its
saved checkpoint) must equal the same workload run alone on a server that never moves adapters."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
from safetensors.torch import load_file

from twinkle.hub import TEST_MODEL

RANK = 2
LORA = {"rank": RANK, "train_unembed": False}
WORKLOADS = 4
TENANT = "offload"


@contextmanager
def one_torch_thread():
    """The in-process server's passes on one thread: with the SDK clients in the same process on two
    shared cores, a second OpenMP thread spin-waits against the HTTP and scheduler threads (the
    reliability harness measured ~10x slower SDK steps with two)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tokens(workload: int, step: int, length: int = 12) -> list[int]:
    return [5 + (7 * i + 11 * workload + 13 * step) % 70 for i in range(length)]


def adapter_bytes(srv, key: str) -> int:
    """One LoRA's share of the cap, as the capacity route states it."""
    got = httpx.get(
        f"{srv.url}/twinkle/v1/capacity", params={"rank": RANK, "train_unembed": False}, headers={"X-API-Key": key}
    )
    assert got.status_code == 200, got.text
    return got.json()["adapter_bytes"]


def folder_of(srv, tenant: str, path):
    from twinkle.serve.core.checkpoints import CheckpointOps

    ops = CheckpointOps(srv.runtime)
    return ops.folder(ops.readable(tenant, path))


def checkpoint_tensors(srv, tenant: str, path) -> dict:
    """Weights and optimizer tensors of a saved state (the RNG state is the server's, not the adapter's)."""
    folder = folder_of(srv, tenant, path)
    out = {f"w/{k}": v for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
    state = load_file(str(folder / "training_state" / "state.safetensors"))
    out.update({f"s/{k}": v for k, v in state.items() if "rng" not in k.lower()})
    return out


def tenant_keys(srv, n: int, prefix: str = TENANT) -> dict[str, str]:
    return {f"{prefix}-{i}": srv.create_key(f"{prefix}-{i}") for i in range(n)}


def run_tenants(srv, keys: dict[str, str], workloads: list[int], steps: int, sft) -> list[dict]:
    """One tenant (its own key) per workload, in lockstep: every tenant's forward_backward (its
    gradients then wait, parked or spilled, while the others run), then every tenant's optim_step;
    one request in flight at a time, so no two tenants share a fused pass and each result must equal
    its run alone bit for bit."""
    import tinker
    from tinker import types

    tenants = list(keys)[: len(workloads)]
    clients = [
        tinker.ServiceClient(base_url=srv.url, api_key=keys[t])
        .create_lora_training_client(base_model=TEST_MODEL, seed=w, **LORA)
        .result()
        for t, w in zip(tenants, workloads)
    ]
    losses: list[list[float]] = [[] for _ in workloads]
    for step in range(steps):
        for i, (tc, w) in enumerate(zip(clients, workloads)):
            out = tc.forward_backward([sft(tokens(w, step))], "cross_entropy").result()
            losses[i].append(out.metrics["loss:sum"])
        for tc in clients:
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return [saved(srv, tenant, tc, losses[i], f"final-{i}") for i, (tc, tenant) in enumerate(zip(clients, tenants))]


def saved(srv, tenant: str, tc, losses: list[float], name: str) -> dict:
    """A tenant's result: its losses, and its saved state's tensors and counters (steps acknowledged)."""
    path = tc.save_state(name).result().path
    counters = json.loads((folder_of(srv, tenant, path) / "training_state" / "state.json").read_text())["counters"]
    return {"losses": losses, "tensors": checkpoint_tensors(srv, tenant, path), "counters": counters}


def alone_results(start, data_dir, sft, steps: int):
    """Each workload alone on a server that never moves an adapter -> (server, results, one adapter's bytes)."""
    srv = start(data_dir, adapter_offload=False)
    keys = tenant_keys(srv, WORKLOADS)
    per = adapter_bytes(srv, keys[f"{TENANT}-0"])
    return srv, [run_tenants(srv, {t: k}, [w], steps, sft)[0] for w, (t, k) in enumerate(keys.items())], per


def crowded_server(start, data_dir, per: int, live_fit: int):
    """A server whose cap holds `live_fit` adapters live and about as many parked; the rest go to disk."""
    cap_mb = (live_fit + 0.5) * per / 2**20
    srv = start(
        data_dir,
        max_adapter_memory_mb=cap_mb,
        max_parked_adapter_memory_mb=cap_mb,
        adapter_idle_offload_s=None,
        adapter_idle_spill_s=None,
    )
    return srv, int(cap_mb * 2**20)


def check_capacity(srv, key: str, per: int, cap: int, tenants: int, live_fit: int, calls_each: int) -> dict:
    """The capacity route's numbers after `tenants` tenants made `calls_each` lockstep calls each."""
    got = httpx.get(
        f"{srv.url}/twinkle/v1/capacity", params={"rank": RANK, "train_unembed": False}, headers={"X-API-Key": key}
    )
    assert got.status_code == 200, got.text
    body = got.json()
    tiers = body["adapters"]
    assert body["cap_bytes"] == cap and body["adapter_bytes"] == per and body["offload"] is True
    assert sum(tiers.values()) == tenants and tiers["live"] <= live_fit
    assert tiers["parked"] >= 1 and tiers["spilled"] >= 1
    assert body["used_bytes"] == tiers["live"] * per
    assert body["fit_now"] == (cap - body["used_bytes"]) // per and body["fit_max"] == live_fit
    swaps = body["swaps"]
    # round-robin over more tenants than fit: every call after the first round brings one back
    assert swaps["restored"] >= tenants * calls_each - live_fit
    assert swaps["restored_from_disk"] >= 1 and swaps["spilled"] >= 1
    assert (
        swaps["parked"] == swaps["restored"] + tiers["parked"] + tiers["spilled"]
    )  # every move out came back or is out
    assert swaps["restore_s"] > 0 and swaps["park_s"] > 0
    return body


def assert_bit_equal(got: dict, expected: dict) -> None:
    import torch

    assert got["losses"] == expected["losses"]
    assert got["counters"] == expected["counters"]  # optimizer steps and forward_backward calls
    assert got["counters"]["optimizer_steps"] == len(expected["losses"])  # every acknowledged step is in it
    assert got["tensors"].keys() == expected["tensors"].keys()
    for name, tensor in expected["tensors"].items():
        assert torch.equal(got["tensors"][name], tensor), name
