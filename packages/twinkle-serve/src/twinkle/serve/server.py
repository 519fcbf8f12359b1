"""Starting the server from Python: `twinkle.serve.initialize(mode='http', ...)` (the CLI wraps this).

Graceful shutdown: the first SIGTERM (or Ctrl-C) drains. New work is refused with 503 ("shutting
down"), the work already accepted runs to completion (up to the config's `drain_s`) while clients can
still poll its futures, then HTTP stops. A future still pending after that is answered, after the
next start, with the documented restart error. A second signal exits at once (uvicorn's own).
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.serve.config import ServeConfig, load_config
from twinkle.serve.core.store import default_data_dir
from twinkle.serve.runtime import ServerRuntime

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("twinkle.serve")


@dataclass
class Server:
    """A running server (returned by `initialize(..., block=False)`)."""

    url: str
    runtime: ServerRuntime
    _uvicorn: uvicorn.Server
    _thread: threading.Thread

    def wait_ready(self, timeout: float = 300) -> Server:
        if not self.runtime.ready.wait(timeout):
            raise TimeoutError(f"server at {self.url} did not load its models within {timeout} s")
        return self

    def create_key(self, name: str) -> str:
        return self.runtime.keys.create(name)

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=30)
        self.runtime.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _draining_server(config: uvicorn.Config, runtime: ServerRuntime) -> uvicorn.Server:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if runtime.draining or sig not in (signal.SIGTERM, signal.SIGINT):
                return super().handle_exit(sig, frame)
            log.warning("signal %s: draining (new work refused, accepted work finishing)", sig)
            runtime.begin_drain()
            threading.Thread(target=self._drain_then_exit, name="twinkle-drain", daemon=True).start()

        def _drain_then_exit(self) -> None:
            left = runtime.drain(runtime.config.drain_s)
            if left:
                log.warning("drain_s=%s passed with %d requests still queued", runtime.config.drain_s, left)
            time.sleep(min(1.0, runtime.config.drain_s))  # clients' polls pick up the last results
            self.should_exit = True

    return DrainingServer(config)


def _connection_limit(config: ServeConfig) -> int:
    """config.max_connections, or what the open-file limit allows (raising the soft limit to the hard one,
    so 1,000 idle keep-alive connections do not exhaust a default of 1,024)."""
    if config.max_connections is not None:
        return config.max_connections
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if want > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    except (ImportError, ValueError, OSError):  # no rlimits (Windows) or not allowed: keep what there is
        soft = 1024
    return max(64, soft - 256)


def _uvicorn_config(app, host: str, port: int, log_level: str, config: ServeConfig) -> uvicorn.Config:
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from twinkle.serve.slow_clients import Deadlines, guarded

    deadlines = Deadlines(config.header_timeout_s, config.body_timeout_s, config.write_stall_s)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        http=guarded(AutoHTTPProtocol, deadlines),
        timeout_keep_alive=math.ceil(config.keep_alive_s),  # uvicorn takes whole seconds
        limit_concurrency=_connection_limit(config),
        # a connection that never finishes its request cannot hold the shutdown past the longest poll
        timeout_graceful_shutdown=math.ceil(config.long_poll_s + 5),
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def initialize(
    mode: str = "http",
    *,
    host: str = "127.0.0.1",
    port: int | None = 8000,
    data_dir: str | Path | None = None,
    config: ServeConfig | str | Path | dict | None = None,
    block: bool = True,
    log_level: str = "info",
) -> Server | None:
    """Start the Twinkle server: the Tinker-compatible API over the configured base models.

    `block=True` serves until interrupted (what the CLI does); `block=False` serves on a background
    thread and returns a `Server` (use `.wait_ready()`, `.stop()`). `port=None` or 0 picks a free port.
    """

    from twinkle.serve.app import create_app

    if mode != "http":
        raise ValueError(f"twinkle.serve.initialize serves mode='http' only, got {mode!r}")
    if isinstance(config, dict):
        config = ServeConfig.model_validate(config)
    elif not isinstance(config, ServeConfig):
        config = load_config(config)
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    port = port or free_port(host)
    runtime = ServerRuntime(config, data_dir)
    runtime.start_cluster()  # Ray (when configured) starts here, on the caller's thread, before serving
    if runtime.keys.count() == 0:
        log.warning(
            "no API keys exist yet: every request will be refused (401). Create one with "
            "`twinkle-server keys create NAME --data-dir %s`",
            data_dir,
        )
    app = create_app(runtime)
    server = _draining_server(_uvicorn_config(app, host, port, log_level, config), runtime)
    url = f"http://{host}:{port}"

    def announce_once_bound() -> None:
        # said only once the socket accepts connections: scripts wait for this line, then connect
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.02)
        log.info(
            "twinkle-server listening on %s (data dir %s); Tinker SDK: TINKER_BASE_URL=%s TINKER_API_KEY=tml-...",
            url,
            data_dir,
            url,
        )

    if block:
        threading.Thread(target=announce_once_bound, name="twinkle-announce", daemon=True).start()
        try:
            server.run()
        finally:
            runtime.close()
        return None
    thread = threading.Thread(target=server.run, name="twinkle-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start on {url}")
        time.sleep(0.02)
    announce_once_bound()
    return Server(url, runtime, server, thread)
