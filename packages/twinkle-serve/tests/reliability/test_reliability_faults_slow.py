"""Slow and stalled clients against the real server (raw sockets, loopback), while two tenants train:

- headers trickled byte by byte: answered 408 naming the header deadline, then closed;
- a body sent at 1 byte/s (a valid key, so the route waits on it): 408 naming the body deadline;
- a client that pipelines requests for a large response and never reads: the server drops it
  (connection reset) once its writes have been stalled for write_stall_s;
- 1,000 idle keep-alive connections (after one request each): all closed by the server after
  keep_alive_s, and every one of them was served (the open-file limit allows it: checked);
- the tenants' p99 step time with the attacks running stays within 2x of their p99 without them,
  measured in alternating windows of the same run (so the machine's other load hits both alike).
"""

from __future__ import annotations

import contextlib
import resource
import socket
import statistics
import threading
import time

import httpx
from harness import HOST, SUMMARY
from test_reliability_baddata import _good_tenant as trainer  # a closed-loop trainer, 4 x 128 tokens a step

DEADLINES = {"header_timeout_s": 2.0, "body_timeout_s": 2.0, "write_stall_s": 2.0, "keep_alive_s": 10.0}
IDLE = 1000
WINDOW_S, PAIRS = 6.0, 3


def _connect(port: int, timeout: float = 30) -> socket.socket:
    s = socket.create_connection((HOST, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (or resets) the connection; bounded by the socket timeout."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


class Attacks:
    """The stalling clients, in threads; each records what the server answered it."""

    def __init__(self, port: int, key: str):
        self.port, self.key = port, key
        self.answers: dict[str, list] = {"trickle": [], "slow_body": [], "never_reads": []}
        self.active = threading.Event()
        self.stop = threading.Event()

    def _loop(self, kind, fn) -> None:
        while not self.stop.is_set():
            if self.active.wait(0.1):
                self.answers[kind].append(fn())

    def trickle(self) -> bytes:
        s = _connect(self.port)
        try:
            for b in b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 10_000:
                s.sendall(bytes([b]))
                time.sleep(0.02)
        except OSError:
            pass  # the server closed: read its answer
        with s:
            return _read_all(s)

    def slow_body(self) -> bytes:
        s = _connect(self.port)
        head = (
            f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: {self.key}\r\n"
            "content-type: application/json\r\ncontent-length: 100\r\n\r\n"
        )
        try:
            s.sendall(head.encode())
            for _ in range(100):
                s.sendall(b" ")
                time.sleep(1.0)
        except OSError:
            pass
        with s:
            return _read_all(s)

    def never_reads(self, requests: int = 400) -> tuple[int, int]:
        """Pipelines `requests` GETs of the OpenAPI schema with a tiny receive buffer and reads nothing
        for a while; -> (bytes it could read afterwards, bytes the server would have sent in all)."""
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(30)
        s.connect((HOST, self.port))
        one = f"GET /openapi.json HTTP/1.1\r\nHost: x\r\nX-API-Key: {self.key}\r\n\r\n".encode()
        with contextlib.suppress(OSError):
            s.sendall(one * requests)
        time.sleep(DEADLINES["write_stall_s"] + 3)
        with s:
            return len(_read_all(s)), requests * self.schema_bytes

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._loop, args=(k, getattr(self, k)), daemon=True) for k in self.answers]
        for t in threads:
            t.start()
        return threads


def _idle_pool(port: int, key: str) -> list[socket.socket]:
    """IDLE connections, each served one request and left open (keep-alive)."""
    pool = []
    for _ in range(IDLE):
        s = _connect(port)
        s.sendall(f"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-API-Key: {key}\r\n\r\n".encode())
        pool.append(s)
    for s in pool:
        answer = b""
        while b"\r\n\r\n" not in answer:  # the head; the body is its content-length
            answer += s.recv(4096)
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += s.recv(4096)
    return pool


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def test_slow_and_stalled_clients_are_bounded_and_other_tenants_keep_their_p99(launch):
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft > 2 * IDLE + 256, f"ulimit -n is {soft}: too low to hold {IDLE} connections in this test"
    srv, keys = launch(["good0", "good1", "staller"], **DEADLINES)
    attacks = Attacks(srv.port, keys["staller"])
    attacks.schema_bytes = len(httpx.get(f"{srv.url}/openapi.json", headers={"X-API-Key": keys["staller"]}).content)
    stop, steps = threading.Event(), []
    trainers = [
        threading.Thread(target=trainer, args=(srv.url, keys[f"good{i}"], i, stop, steps), daemon=True)
        for i in range(2)
    ]
    for t in trainers:
        t.start()
    while len(steps) < 4:  # both warmed up
        time.sleep(0.05)
    threads = attacks.start()
    windows, idle_closed, idle_wait = [], [], []
    for _ in range(PAIRS):
        t0 = time.monotonic()
        time.sleep(WINDOW_S)
        windows.append(("clean", t0, time.monotonic()))
        pool = _idle_pool(srv.port, keys["staller"])  # opened between the windows: the burst is not timed
        attacks.active.set()
        t0 = time.monotonic()
        time.sleep(WINDOW_S)
        windows.append(("attack", t0, time.monotonic()))
        attacks.active.clear()
        opened = t0
        for s in pool:  # the server closes every idle connection after keep_alive_s
            with s:
                try:
                    idle_closed.append(_read_all(s) == b"")
                except TimeoutError:
                    idle_closed.append(False)
        idle_wait.append(time.monotonic() - opened)
    stop.set()
    attacks.stop.set()
    for t in trainers + threads:
        t.join(timeout=120)

    times = {"clean": [], "attack": []}
    for start, end in steps:
        for phase, w0, w1 in windows:
            if w0 <= start and end <= w1:
                times[phase].append(end - start)
    p99 = {phase: _p99(v) for phase, v in times.items()}

    assert all(idle_closed) and len(idle_closed) == PAIRS * IDLE, f"{idle_closed.count(False)} idle stayed open"
    trickled = attacks.answers["trickle"]
    assert trickled and all(b" 408 " in a and b"request headers not received within 2 s" in a for a in trickled)
    slow = attacks.answers["slow_body"]
    assert slow and all(b" 408 " in a and b"request body not received within 2 s" in a for a in slow), slow[:1]
    stalled = attacks.answers["never_reads"]
    assert stalled and all(got < total for got, total in stalled), stalled  # dropped, not served to the end
    assert p99["attack"] <= 2 * p99["clean"], (p99, {k: len(v) for k, v in times.items()})

    n = {k: len(v) for k, v in times.items()}
    print(
        f"\nslow clients: tenants' p99 step {p99['clean'] * 1000:.0f} ms clean / {p99['attack'] * 1000:.0f} ms "
        f"under attack ({n['clean']} / {n['attack']} steps, {PAIRS} window pairs, under load); "
        f"{len(trickled)} trickled heads and {len(slow)} 1-byte/s bodies answered 408, {len(stalled)} non-reading "
        f"clients dropped after reading {max(g for g, _ in stalled):,} of {stalled[0][1]:,} bytes; "
        f"{PAIRS} x {IDLE} idle keep-alive connections closed by the server (last after {max(idle_wait):.1f} s)"
    )
    SUMMARY["slow and stalled clients"] = (
        f"p99 step {p99['clean'] * 1000:.0f} ms clean vs {p99['attack'] * 1000:.0f} ms under trickled headers, "
        f"1 B/s bodies, non-reading clients and {IDLE} idle keep-alives; each bounded (408 / reset / closed)"
    )
