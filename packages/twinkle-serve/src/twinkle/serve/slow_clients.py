"""Deadlines on slow and stalled clients, at the HTTP protocol (uvicorn has none of these by default).

A connection holds a file descriptor, buffers and, once its headers are in, a task: a client that
trickles its headers byte by byte, sends its body at 1 byte/s, or never reads what the server writes
could hold them forever. Each phase of a request gets a deadline:

- headers: a new connection, or a kept-alive one that starts its next request, must deliver the whole
  request head within `header_timeout_s` (a connection that sent nothing is closed; one that sent
  part of a head gets a 408 first);
- body: once the head is in, the body must be complete within `body_timeout_s` (408, then closed; the
  route reading it sees the client disconnect);
- writes: a response the client does not read fills the socket buffers and pauses the transport;
  paused longer than `write_stall_s`, the connection is aborted (its buffered bytes dropped).

Idle kept-alive connections are uvicorn's `timeout_keep_alive`, how many connections may hold work is
its `limit_concurrency` (server.py). The guard is a subclass of uvicorn's protocol class, because the
ASGI app never sees a request whose head has not arrived.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Deadlines:
    header_timeout_s: float
    body_timeout_s: float
    write_stall_s: float


def _timeout_answer(message: str) -> bytes:
    body = json.dumps({"error": message, "detail": message}).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _DeadlineGuard(asyncio.Protocol):
    """The three deadlines, mixed in before uvicorn's protocol class (`guarded`). Only attributes
    HttpToolsProtocol and H11Protocol share are used: `transport`, `loop`, `cycle` (the request in
    progress: `more_body`, `response_started`, `response_complete`)."""

    deadlines: Deadlines
    transport: Any
    loop: Any
    cycle: Any

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_timer = self._stall_timer = None
        self._bytes_in = 0
        self._arm_headers()

    def connection_lost(self, exc) -> None:
        self._cancel("_read_timer"), self._cancel("_stall_timer")
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self._idle():  # a kept-alive connection starts a request
            self._arm_headers()
        self._bytes_in += len(data)
        super().data_received(data)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.deadlines.write_stall_s, self._stalled)

    def resume_writing(self) -> None:
        self._cancel("_stall_timer")
        super().resume_writing()

    # ---- the deadlines ---------------------------------------------------------------------
    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name, None)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _arm_headers(self) -> None:
        self._cancel("_read_timer")
        self._bytes_in = 0
        waiting_for = self.cycle  # the head is in once uvicorn made a new cycle for it
        self._read_timer = self.loop.call_later(self.deadlines.header_timeout_s, self._headers_due, waiting_for)

    def _headers_due(self, previous) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is previous:  # still no complete head
            if self._bytes_in == 0:
                self.transport.close()  # never started a request: nobody to answer
                return
            return self._refuse(f"request headers not received within {self.deadlines.header_timeout_s:g} s")
        if self.cycle.more_body:  # the head is in, the body is not: its own deadline, from now
            self._read_timer = self.loop.call_later(self.deadlines.body_timeout_s, self._body_due, self.cycle)

    def _body_due(self, cycle) -> None:
        self._read_timer = None
        if not self.transport.is_closing() and self.cycle is cycle and cycle.more_body:
            self._refuse(f"request body not received within {self.deadlines.body_timeout_s:g} s of its headers")

    def _refuse(self, message: str) -> None:
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_timeout_answer(message))
        self.transport.close()

    def _stalled(self) -> None:
        self._stall_timer = None
        if not self.transport.is_closing() or self.transport.get_write_buffer_size():
            self.transport.abort()  # close() would wait for the buffer to drain, i.e. forever


def guarded(base: type[asyncio.Protocol], deadlines: Deadlines) -> type[asyncio.Protocol]:
    """`base` (uvicorn's HttpToolsProtocol or H11Protocol) with the three deadlines."""
    return type(f"Guarded{base.__name__}", (_DeadlineGuard, base), {"deadlines": deadlines})
