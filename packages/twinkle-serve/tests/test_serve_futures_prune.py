"""Finished futures (and the sampling-queue rows naming them) are retired after the retention window;
pending ones and recent results stay retrievable, at start and while the server runs."""

from __future__ import annotations

import time

from twinkle.serve.core.futures import FutureHub
from twinkle.serve.core.store import Store


def _age(store: Store, request_id: str, seconds: float) -> None:
    store.db.execute(
        "UPDATE futures SET completed_at=?, created_at=? WHERE request_id=?",
        (time.time() - seconds, time.time() - seconds, request_id),
    )


def test_old_finished_futures_and_their_sample_rows_are_pruned(tmp_path):
    store = Store(tmp_path)
    hub = FutureHub(store, keep_s=3600)
    old, recent, failed_old, pending = (hub.create("alice") for _ in range(4))
    hub.complete_json(old, {"loss": 1.0})
    hub.complete_json(recent, {"loss": 2.0})
    hub.fail(failed_old, "bad input", "user")
    for request_id in (old, failed_old):
        _age(store, request_id, 2 * 3600)
    _age(store, pending, 5 * 3600)  # still queued (e.g. a long job): never pruned
    store.db.execute("UPDATE futures SET status='pending' WHERE request_id=?", (pending,))
    for request_id in (old, recent):
        store.sample_requests.record(request_id, "alice", "sampler-1", 0)

    assert hub.prune() == 2
    assert store.futures.get(old, "alice") is None and store.futures.get(failed_old, "alice") is None
    assert store.futures.get(recent, "alice").status == "complete"
    assert store.futures.get(pending, "alice").status == "pending"
    assert not store.sample_requests.owned(old, "alice") and store.sample_requests.owned(recent, "alice")
    assert store.futures.count() == 2
    store.close()


def test_a_restart_prunes_and_a_running_hub_prunes_again(tmp_path):
    store = Store(tmp_path)
    hub = FutureHub(store, keep_s=3600)
    first = hub.create("alice")
    hub.complete_json(first, {"ok": True})
    _age(store, first, 2 * 3600)
    store.close()

    store = Store(tmp_path)  # the next server on this data dir
    hub = FutureHub(store, keep_s=3600)
    assert store.futures.get(first, "alice") is None
    second = hub.create("alice")
    hub.complete_json(second, {"ok": True})
    _age(store, second, 2 * 3600)
    hub._pruned_at -= 3600  # the last prune was an hour ago: the next submission prunes again
    third = hub.create("alice")
    assert store.futures.get(second, "alice") is None and store.futures.get(third, "alice").status == "pending"
    store.close()
