"""A sampling session's completion queue (SDK 0.38 `sample_use_retrieve_futures`), explicit cancels,
and clone ids for unpickled sampling clients (`join_sampling_session`).

`retrieve_futures` long-polls one (sampling session, clone) target: it answers the target's sample
requests finished since the client's cursor (numbered in the order they are first seen finished, so a
cursor never skips one that finished late), and forgets those the client says it has retrieved.
"""

from __future__ import annotations

import asyncio
import time

from twinkle.serve.core.service import Service
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.tinker import bodies as b
from twinkle.serve.tinker.sampling import TinkerSampling

IDLE_RECHECK_S = 0.2  # with nothing pending to wait on (a request not yet recorded), look again this soon


async def retrieve_futures(sampling: TinkerSampling, tenant: str, body: b.FuturesRetrieveBody) -> dict:
    sampler_id, rt = sampling.sampler(tenant, body.target.sampling_session_id).sampler_id, sampling.rt
    clone, cursor, timeout = body.target.cloned_sampler_id, body.prev_cursor, body.timeout
    rt.store.sample_requests.forget(tenant, body.retrieved_request_ids)
    deadline = time.monotonic() + min(rt.config.long_poll_s, rt.config.long_poll_s if timeout is None else timeout)
    while True:
        done, pending = rt.store.sample_requests.completions(tenant, sampler_id, clone, cursor)
        remaining = deadline - time.monotonic()
        if done or remaining <= 0:
            break
        waits = [asyncio.ensure_future(rt.hub.wait(rid, tenant, remaining)) for rid in pending]
        if not waits:
            await asyncio.sleep(min(remaining, IDLE_RECHECK_S))
            continue
        _, still = await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        for w in still:
            w.cancel()
    completions = [
        {"state": "finished", "request_id": r["request_id"], "response_payload_uncompressed_size": r["size"]}
        if r["status"] == "complete"
        else {"state": "failed", "request_id": r["request_id"]}
        for r in done
    ]
    return {"completions": completions, "cursor": max([cursor] + [r["completion"] for r in done])}


def cancel_future(svc: Service, tenant: str, body: b.FutureBody) -> dict:
    """Cancel a sample request: a queued one is dropped, a running one stops at its next decode step
    (its future fails saying how far it got), a finished one is left as it is (and said so)."""
    request_id, rt = body.request_id, svc.rt
    if not rt.store.sample_requests.owned(request_id, tenant):
        if rt.store.futures.get(request_id, tenant) is not None:
            raise BadRequest(f"request {request_id!r} is not a sample request: only sampling can be cancelled")
        raise NotFound(f"future {request_id!r} not found")
    return {"request_id": request_id, "status": svc.cancel(tenant, request_id)}


def join_sampling_session(sampling: TinkerSampling, tenant: str, body: b.JoinSamplingSessionBody) -> dict:
    sampler_id = sampling.sampler(tenant, body.sampling_session_id).sampler_id
    return {"type": "join_sampling_session", "client_counter": sampling.rt.store.sample_requests.join(sampler_id)}
