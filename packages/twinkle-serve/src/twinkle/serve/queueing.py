"""Where a submitting route does its part: on the event loop, or on the thread pool.

Per-step submissions (forward_backward, a step, a sample) only check their body and queue work for
the engine. For a small body that is less than a thread-pool hop costs while the engine runs: each
hop is two GIL hand-offs with a thread busy in the model's Python. Measured on the tiny model's
native steps (bench_client_native, 2 cores): 0.88-0.92 of local mode's steps/s with the hops,
0.93-1.04 without (median 1.01 over five runs). A large body (long sequences, images to decode, chats to template) still goes to
the pool, so no tenant's upload holds the loop that answers everyone else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

INLINE_BODY_BYTES = 256 * 1024


async def queue_work(request: Request, fn: Callable[..., Any], *args, light: bool = True) -> Any:
    """fn(*args) on the event loop when the body is at most INLINE_BODY_BYTES and `light` (the caller
    knows of nothing slow in it), else on the thread pool."""
    declared = request.headers.get("content-length", "")
    if light and declared.isdigit() and int(declared) <= INLINE_BODY_BYTES:
        return fn(*args)
    return await run_in_threadpool(fn, *args)
