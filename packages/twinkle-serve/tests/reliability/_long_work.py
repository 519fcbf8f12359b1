"""One tenant's long work, for the preemption test (test_reliability_isolation.py): a native training pass
of many rows, a Tinker sample of 8 long sequences and an OpenAI chat stream of n=8 long choices, each
sent again as soon as it ends while the load is on, and stopped when it goes off: the training pass by
the native cancel, the sample by Tinker's cancel_future, the stream by its reader leaving. Each kind
records how its requests ended (done, or the server's "stopped after k steps")."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import defaultdict

import httpx
from _util_isolation import NativeWire
from harness import Wire

POLL_S = 0.2


class LongWorkProcess:
    """LongWork in a process of its own, as another tenant's client is: its stream reading and polling
    do not take the test process's GIL (and a core) from tenant B's client, whose steps are measured."""

    def __init__(self, *args, **kwargs):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_long_work_child, args=(child, args, kwargs), daemon=True)
        self._proc.start()
        self.sampler = self._call("ready")  # its Tinker sampling session

    def _call(self, command: str):
        if command != "ready":
            self._conn.send(command)
        if not self._conn.poll(120):
            raise TimeoutError(f"the long-work process did not answer {command!r}")
        return self._conn.recv()

    def start(self) -> None:
        self._call("start")

    def load(self, on: bool) -> None:
        """Load on (each kind sends its long request, again as each ends), or off (each cancels and idles)."""
        self._call("on" if on else "off")

    def close(self) -> dict[str, list[str]]:
        """Stops the process; -> how each kind's requests ended."""
        ended = self._call("close")
        self._proc.join(timeout=60)
        return ended


def _long_work_child(conn, args, kwargs) -> None:
    work = LongWork(*args, **kwargs)
    conn.send(work.sampler)
    while True:
        command = conn.recv()
        if command == "start":
            work.start()
        elif command == "on":
            work.on.set()
        elif command == "off":
            work.off()
        elif command == "close":
            work.close()
            conn.send(dict(work.ended))
            return
        conn.send(None)


class LongWork:
    def __init__(self, url: str, key: str, base_model: str, rows: int, length: int, max_tokens: int):
        self.native, self.tinker = NativeWire(url, key), Wire(url, key)
        self.openai = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120)
        self.base_model, self.max_tokens = base_model, max_tokens
        self.model = self.native.model(seed=5)
        self.native.done(self.native.add_adapter(self.model, r=8))
        self.rows = [
            {"input_ids": r, "labels": r}
            for r in ([9 + (5 * i + 11 * k) % 800 for i in range(length)] for k in range(rows))
        ]
        self.sampler = self.tinker.ok(
            self.tinker.post(
                "/create_sampling_session",
                {"session_id": self.tinker.session(), "sampling_session_seq_id": 0, "base_model": base_model},
            )
        )["sampling_session_id"]
        self.on, self.quit = threading.Event(), threading.Event()
        self.busy = {kind: threading.Event() for kind in ("train", "sample", "stream")}
        self.ended: dict[str, list[str]] = defaultdict(list)  # kind -> "done" or the failure message, per request
        self._threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in self.busy]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def off(self, deadline_s: float = 60) -> None:
        """Load off: every kind stops its request in flight and goes idle."""
        self.on.clear()
        end = time.monotonic() + deadline_s
        while any(b.is_set() for b in self.busy.values()):
            assert time.monotonic() < end, {k: b.is_set() for k, b in self.busy.items()}
            time.sleep(0.01)

    def close(self) -> None:
        self.quit.set()
        self.on.set()
        for t in self._threads:
            t.join(timeout=60)
        for w in (self.native, self.tinker, self.openai):
            w.close()

    def _loop(self, kind: str) -> None:
        while not self.quit.is_set():
            if not self.on.wait(0.05) or self.quit.is_set():
                continue
            self.busy[kind].set()
            try:
                self.ended[kind].append(getattr(self, f"_{kind}")())
            finally:
                self.busy[kind].clear()

    def _until_off(self, request_id: str, cancel) -> str:
        """Poll the request until it ends; once the load is off, cancel it and wait for its end."""
        cancelled = False
        while True:
            out = self.native.ok(self.native.get(f"/futures/{request_id}", params={"timeout": POLL_S}))
            if out["status"] == "complete":
                return "done"
            if out["status"] == "failed":
                return out["error"]
            if not self.on.is_set() and not cancelled:
                cancel(request_id)
                cancelled = True

    def _train(self) -> str:
        body = {"inputs": {"rows": self.rows}}
        request_id = self.native.ok(self.native.post(f"/models/{self.model}/forward_backward", body))["request_id"]
        return self._until_off(request_id, lambda rid: self.native.ok(self.native.post(f"/futures/{rid}/cancel")))

    def _sample(self) -> str:
        body = {
            "sampling_session_id": self.sampler,
            "prompt": {"chunks": [{"tokens": [5, 6, 7]}]},
            "num_samples": 8,
            "sampling_params": {"max_tokens": self.max_tokens, "stop": [], "temperature": 1.0},
        }
        request_id = self.tinker.ok(self.tinker.post("/asample", body))["request_id"]
        return self._until_off(
            request_id, lambda rid: self.tinker.ok(self.tinker.post("/cancel_future", {"request_id": rid}))
        )

    def _stream(self) -> str:
        body = {
            "model": self.base_model,
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "n": 8,
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        with self.openai.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()[:300]
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    return "done"
                if not self.on.is_set():
                    return "reader left"  # closing the response: the server stops the decode at its next step
        return "ended without [DONE]"
