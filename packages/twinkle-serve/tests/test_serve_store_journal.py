"""The store's journal (store/db.py): bookkeeping rows wait for the next commit, read back at once in
this process, are committed together, survive a failed write and a clean close; a future whose row a
killed server never committed answers the restart error after the restart, not 404."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time

from twinkle.serve.core.futures import FutureHub
from twinkle.serve.core.store import Store


def _on_disk(tmp_path, sql: str, args=()) -> list[tuple]:
    """What another connection (another process) reads from the file: only what was committed."""
    conn = sqlite3.connect(tmp_path / "twinkle.db")
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def test_journaled_rows_read_back_at_once_and_commit_with_the_next_write(tmp_path):
    store = Store(tmp_path)
    store.db.flush_after_s = 3600.0  # only the writes below commit the journal
    hub = FutureHub(store)
    writes = store.db.writes
    request_id = hub.create("alice")
    store.idempotency.put("alice", "key-1", "fp", 200, "application/json", b'{"request_id": "r"}')
    store.curves.add("m1", "alice", 7, {"loss": 2.5})
    assert store.db.writes == writes and store.db.pending_writes() == 3  # nothing committed yet
    assert store.futures.get(request_id, "alice").status == "pending"
    assert store.futures.get(request_id, "bob") is None  # another tenant's, journaled or not
    assert store.futures.pending("alice") == (1, 1)
    assert store.idempotency.get("alice", "key-1")["body"] == b'{"request_id": "r"}'
    assert store.curves.last("m1", "loss") == {"step": 7, "value": 2.5}
    assert _on_disk(tmp_path, "SELECT COUNT(*) FROM futures") == [(0,)]

    store.keys.add("carol", "hash-c")  # an ordinary write takes the journal along: one transaction
    assert store.db.writes == writes + 1 and store.db.pending_writes() == 0
    assert _on_disk(tmp_path, "SELECT status FROM futures WHERE request_id=?", (request_id,)) == [("pending",)]
    assert _on_disk(tmp_path, "SELECT body FROM idempotency") == [(b'{"request_id": "r"}',)]
    assert _on_disk(tmp_path, "SELECT step, value FROM run_curves") == [(7, 2.5)]
    assert store.curves.last("m1", "loss") == {"step": 7, "value": 2.5}  # now read from the table
    store.close()


def test_a_batch_commits_once_and_only_then_the_results_are_on_disk(tmp_path):
    store = Store(tmp_path)
    store.db.flush_after_s = 3600.0
    hub = FutureHub(store)
    ids = [hub.create(t) for t in ("alice", "bob", "carol")]
    writes = store.db.writes
    with hub.batch():
        hub.complete_json(ids[0], {"loss": 1.0})
        hub.complete_proto(ids[1], b"\x08\x01")
        hub.fail(ids[2], "bad datum", "user")
        assert _on_disk(tmp_path, "SELECT COUNT(*) FROM futures") == [(0,)]
    assert store.db.writes == writes + 1  # three futures created and finished: one commit
    rows = dict(_on_disk(tmp_path, "SELECT request_id, status FROM futures"))
    assert rows == {ids[0]: "complete", ids[1]: "complete", ids[2]: "failed"}
    assert json.loads(store.futures.get(ids[2], "carol").payload) == {"error": "bad datum", "category": "user"}
    store.close()


def test_a_failed_write_keeps_the_journal_for_the_next(tmp_path):
    store = Store(tmp_path)
    store.db.flush_after_s = 3600.0
    hub = FutureHub(store)
    request_id = hub.create("alice")
    try:
        store.db.execute("INSERT INTO no_such_table VALUES (1)")
    except sqlite3.OperationalError:
        pass
    else:
        raise AssertionError("the insert into a missing table succeeded")
    assert store.db.pending_writes() == 1 and _on_disk(tmp_path, "SELECT COUNT(*) FROM futures") == [(0,)]
    hub.complete_json(request_id, {"ok": True})  # outside a batch: committed at once
    assert _on_disk(tmp_path, "SELECT status FROM futures") == [("complete",)]
    store.close()


def test_a_clean_close_commits_and_a_quiet_journal_commits_by_itself(tmp_path):
    store = Store(tmp_path)
    store.db.flush_after_s = 3600.0
    store.curves.add("m1", "alice", 1, {"loss": 3.0})
    store.close()
    assert _on_disk(tmp_path, "SELECT value FROM run_curves") == [(3.0,)]

    store = Store(tmp_path)
    store.db.flush_after_s = 0.05
    store.idempotency.put("alice", "k", "fp", 200, "application/json", b"{}")
    deadline = time.monotonic() + 30
    while store.db.pending_writes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _on_disk(tmp_path, "SELECT key FROM idempotency") == [("k",)]
    store.close()


KILLED = """
import os, sys
from twinkle.serve.core.futures import FutureHub
from twinkle.serve.core.store import Store
store = Store(sys.argv[1])
store.db.flush_after_s = 3600.0
hub = FutureHub(store)
print(hub.create("alice"), hub.boot_id, flush=True)
os._exit(0)  # like kill -9: the journal dies with the process
"""


def test_a_future_a_killed_server_never_committed_answers_the_restart_error(tmp_path):
    out = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], capture_output=True, text=True, check=True)
    lost, old_boot = out.stdout.split()
    assert lost.startswith(old_boot) and len(lost) == 32
    store = Store(tmp_path)
    assert _on_disk(tmp_path, "SELECT COUNT(*) FROM futures") == [(0,)]  # its row was lost
    hub = FutureHub(store)
    assert hub.boot_id != old_boot
    row = asyncio.run(hub.wait(lost, "alice", timeout=0.01))
    assert row.status == "failed"
    body = json.loads(row.payload)
    assert body["category"] == "server" and "the server restarted while this request was pending" in body["error"]
    # ids no boot of this data dir made, or this boot's unknown ones, are unknown (404)
    unknown = ["f" * 32, hub.boot_id + lost[8:], "nope", old_boot + "0" * 8 + lost[16:]]
    assert [asyncio.run(hub.wait(r, "alice", timeout=0.01)) for r in unknown] == [None] * 4
    store.close()
