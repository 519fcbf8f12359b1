"""Crash: `kill -9` the real server at 10 seeded random moments while tenants train, restart it on
the same data dir each time, and check what a user was promised:

- every checkpoint acknowledged before a kill is byte-identical on disk afterwards, and the last one
  of each tenant loads into a fresh model whose saved adapter equals it bit for bit;
- every training run ever created is still listed;
- the SQLite database passes `PRAGMA integrity_check`;
- every future that was in flight at a kill answers, after the restart, either its completed result
  (of the right kind) or a clear server-category error saying the server restarted -- never a
  silently wrong result and never an endless "try again".

Tenants resume after each restart from their last acknowledged checkpoint (with optimizer state),
as a user would. The raw wire client is used (bounded timeouts) because the SDK retries for minutes.
"""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from harness import SUMMARY, Wire, fb_body, sft_pair

KILLS = int(os.environ.get("RELIABILITY_KILLS", "10"))
TENANTS = ["crash0", "crash1", "crash2"]
SEED = 1129


def files_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


class Tenant:
    def __init__(self, name: str, index: int, key: str):
        self.name, self.index, self.key = name, index, key
        self.runs: list[str] = []
        self.acked: dict[str, tuple[Path, dict]] = {}  # tinker path -> (folder, file digests at ack time)
        self.last: str | None = None
        self.pending: dict[str, str] = {}  # request id -> op, submitted but not yet seen finished
        self.steps = 0
        self.error: str | None = None

    def folder(self, data_dir: Path, model_id: str, name: str) -> Path:
        return data_dir / "tenants" / self.name / model_id.replace(":", "_") / "weights" / name

    def train(self, url: str, data_dir: Path, round_: int, stop: threading.Event, started: threading.Event):
        w = Wire(url, self.key, timeout=20)
        try:
            sid = w.session()
            if self.last is None:
                mid = w.create_model(sid, seed=self.index)
            else:  # resume from the last acknowledged checkpoint, optimizer included
                mid = w.done(w.post("/load_weights", {"session_id": sid, "model_seq_id": 0, "path": self.last,
                                                      "optimizer": True}))["model_id"]
            self.runs.append(mid)
            seq, n = 1, 0
            rng = np.random.default_rng(self.index)
            while not stop.is_set():
                tokens = rng.integers(9, 800, size=14).tolist()
                name = f"r{round_}-{n}"
                subs = [("forward_backward", w.http.post("/api/v1/forward_backward",
                                                         content=fb_body(mid, seq, [sft_pair(tokens)]),
                                                         headers={"content-type": "application/x-protobuf"})),
                        ("optim_step", w.post("/optim_step", {"model_id": mid, "seq_id": seq + 1,
                                                              "adam_params": {"learning_rate": 1e-2}})),
                        ("save_weights", w.post("/save_weights", {"model_id": mid, "seq_id": seq + 2, "path": name}))]
                ids = [(op, w.ok(r)["request_id"]) for op, r in subs]
                self.pending.update({rid: op for op, rid in ids})
                for op, rid in ids:
                    kind, out = w.result(rid, 120)
                    assert kind in ("json", "proto"), (op, kind, out)
                    if op == "save_weights":
                        folder = self.folder(data_dir, mid, name)
                        self.acked[out["path"]] = (folder, files_digest(folder))  # what the client was told exists
                        self.last = out["path"]
                    self.pending.pop(rid)
                seq, n = seq + 3, n + 1
                self.steps += 1
                started.set()
        except (httpx.HTTPError, OSError):
            pass  # the server was killed under us: expected
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = repr(e)
        finally:
            w.close()


def check_in_flight(w: Wire, t: Tenant, data_dir: Path) -> dict[str, int]:
    """After a restart: every future in flight at the kill finished, or failed clearly."""
    tally = {"completed": 0, "failed clearly": 0}
    for rid, op in list(t.pending.items()):
        kind, out = w.result(rid, 30)
        if kind == "error":
            assert out["category"] == "server" and "restarted" in out["error"], (op, out)
            tally["failed clearly"] += 1
        else:
            assert kind == ("proto" if op == "forward_backward" else "json"), (op, kind)
            if op != "forward_backward":
                assert out["type"] == op, (op, out)
            if op == "save_weights":  # completed: it must really be there, listed and on disk
                mid = out["path"].split("/")[2]
                listed = w.ok(w.get(f"/training_runs/{mid}/checkpoints"))["checkpoints"]
                assert out["path"] in {c["tinker_path"] for c in listed}, out
            tally["completed"] += 1
        t.pending.pop(rid)
    return tally


def test_kill9_loses_nothing_acknowledged(launch):
    srv, keys = launch(TENANTS, long_poll_s=2.0, limits={"max_models": 64})
    tenants = [Tenant(n, i, keys[n]) for i, n in enumerate(TENANTS)]
    rng = random.Random(SEED)
    moments, in_flight, restarts = [], {"completed": 0, "failed clearly": 0}, []
    for round_ in range(KILLS):
        stop, started = threading.Event(), [threading.Event() for _ in tenants]
        threads = [threading.Thread(target=t.train, args=(srv.url, srv.data_dir, round_, stop, s), daemon=True)
                   for t, s in zip(tenants, started)]
        for th in threads:
            th.start()
        for s in started:
            assert s.wait(180), "a tenant did not finish a step within 180 s"
        moment = rng.uniform(0.2, 3.0)
        time.sleep(moment)
        srv.kill9()
        moments.append(moment)
        stop.set()
        for th in threads:
            th.join(timeout=60)
        assert not any(th.is_alive() for th in threads)
        assert not [t.error for t in tenants if t.error], [t.error for t in tenants]
        db = sqlite3.connect(srv.data_dir / "twinkle.db")
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        db.close()
        t0 = time.monotonic()
        srv.start()
        restarts.append(time.monotonic() - t0)
        for t in tenants:
            w = Wire(srv.url, t.key)
            for k, v in check_in_flight(w, t, srv.data_dir).items():
                in_flight[k] += v
            listed = {r["training_run_id"] for r in w.ok(w.get("/training_runs", params={"limit": 1000}))["training_runs"]}
            assert set(t.runs) <= listed, (t.name, set(t.runs) - listed)
            for path, (folder, digest) in t.acked.items():
                assert files_digest(folder) == digest, path
            w.close()
    # the last acknowledged checkpoint of each tenant loads into a fresh model bit for bit
    from safetensors.numpy import load_file

    for t in tenants:
        w = Wire(srv.url, t.key)
        sid = w.session()
        mid = w.done(w.post("/load_weights", {"session_id": sid, "model_seq_id": 0, "path": t.last,
                                              "optimizer": True}))["model_id"]
        w.done(w.post("/save_weights", {"model_id": mid, "seq_id": 1, "path": "reloaded"}))
        a = load_file(str(t.acked[t.last][0] / "adapter_model.safetensors"))
        b = load_file(str(t.folder(srv.data_dir, mid, "reloaded") / "adapter_model.safetensors"))
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), t.name
        w.close()
    acked = sum(len(t.acked) for t in tenants)
    steps = sum(t.steps for t in tenants)
    print(f"\ncrash: {KILLS} kill -9 at seeded moments {[round(m, 2) for m in moments]} s into load; "
          f"{steps} acknowledged steps, {acked} acknowledged checkpoints all byte-identical after every restart, "
          f"{sum(len(t.runs) for t in tenants)} runs all listed, integrity_check ok x{KILLS}; in-flight futures "
          f"after restart: {in_flight}; restart-to-ready {np.median(restarts):.1f} s median")
    SUMMARY["kills survived (kill -9, restart)"] = (f"{KILLS}; {acked} acked checkpoints intact, "
                                                    f"{sum(in_flight.values())} in-flight futures answered "
                                                    f"({in_flight['completed']} result, "
                                                    f"{in_flight['failed clearly']} clear error)")
