"""Running a request's prompts on the base model's scheduler (the sampler the Tinker API uses too), with
the request's usage counted like any other sampling: all at once (`generate`), or streamed as server-sent
events while the tokens are decoded (`stream`).

A stream answers only once its first decode step is done (or it failed), so a failure before the first
byte is still a proper error status; one after it ends the stream with an `{"error": ...}` event. A reader
who leaves mid-stream stops the decode loop at its next step (StreamClosed, or the scheduler's cancel when
the decode is paused for another tenant's turn), and the tokens decoded until then are counted.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from fastapi.responses import StreamingResponse

import twinkle.serve.openai.responses as responses
from twinkle.sampler import SampleResponse, SamplingParams
from twinkle.serve.backend import UserError
from twinkle.serve.core import bounds
from twinkle.serve.core.records import SamplingSession
from twinkle.serve.core.service import Service
from twinkle.serve.core.slices import Cancelled
from twinkle.serve.core.work import StoredAnswer
from twinkle.serve.errors import internal_error
from twinkle.serve.openai.errors import OpenAIError, error_body
from twinkle.serve.openai.models import Target
from twinkle.serve.openai.streaming import ChoiceText

POLL_S = 30.0


class StreamClosed(Exception):
    """Raised into the decode loop once the stream's reader is gone: sampling stops at that step."""


class _Job:
    """One admitted request's prompts on its target's backend; counts what it samples."""

    def __init__(
        self, svc: Service, tenant: str, target: Target, prompts: list[list[int]], n: int, params, images=None
    ):
        backend = target.engine.backend
        self.images = images  # a one-prompt chat's image pixels (openai/images.py), or None
        bounds.sample_cost([len(p) for p in prompts], n, params.max_tokens, backend.max_context, svc.rt.config.caps)
        self.hold = svc.admit_tokens(tenant, sum(len(p) for p in prompts))  # over the rate: starts later
        self.svc, self.tenant, self.target, self.prompts, self.n, self.params = svc, tenant, target, prompts, n, params
        ckpt = target.checkpoint
        self.folder = str(svc.checkpoints.folder(ckpt)) if ckpt else None
        path = ckpt.tinker_path if ckpt else None
        self.usage = SamplingSession(f"openai:{target.model}", tenant, "", target.engine.entry.name, path, time.time())

    def install(self) -> None:
        if self.folder is not None and self.target.adapter is not None:  # both come from the target's checkpoint
            self.target.engine.backend.install_sampler_from_folder(self.target.adapter, self.folder)

    def sample(self, prompt: list[int], on_tokens=None) -> SampleResponse:
        # a backend that cannot hand out tokens per step (a remote one) never calls on_tokens: the whole
        # answer streams at the end
        return self.target.engine.backend.sample(
            self.target.adapter, prompt, self.params, on_tokens=on_tokens, images=self.images
        )

    def count(self, prompt: list[int], sampled: int) -> None:
        self.svc.count_sampling(self.usage, len(prompt), sampled)

    def submit(self, run) -> str:
        """Queue `run` on the worker thread, like every other backend call; the future's id."""
        return self.svc.submit(
            self.tenant, self.target.engine, f"openai:{self.tenant}", None, run, hold=self.hold, sliced=True
        )


def _sampled(result: SampleResponse) -> int:
    return sum(len(s.tokens) for s in result.sequences)


async def generate(
    svc: Service, tenant: str, target: Target, prompts: list[list[int]], n: int, params: SamplingParams, images=None
) -> list[SampleResponse]:
    """One SampleResponse (n sequences) per prompt, in order."""
    job = _Job(svc, tenant, target, prompts, n, params, images)
    results: list[SampleResponse] = []

    def run():
        job.install()
        for prompt in prompts:
            result = job.sample(prompt)
            job.count(prompt, _sampled(result))
            results.append(result)
        return StoredAnswer.json({})

    request_id = job.submit(run)
    rt = svc.rt
    row = await rt.hub.wait(request_id, tenant, POLL_S)
    while row is not None and row.status == "pending":
        row = await rt.hub.wait(request_id, tenant, POLL_S)
    if row is None:
        raise OpenAIError(500, f"request {request_id} vanished from the future store")
    if row.status == "failed":
        failure = json.loads(row.payload or b"{}")
        raise OpenAIError(400 if failure.get("category") == "user" else 500, failure["error"])
    return results


def _as_openai(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, UserError):
        return OpenAIError(400, str(e))
    return OpenAIError(500, internal_error("an OpenAI-API generation", e))


async def stream(
    svc: Service,
    tenant: str,
    target: Target,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    chunks: responses.ChatChunks,
    images=None,
) -> StreamingResponse:
    """Choice `p * n + j` is sample j of prompt p; its chunks go out as its tokens are decoded."""
    job = _Job(svc, tenant, target, prompts, n, params, images)
    tokenizer = target.engine.backend.tokenizer
    choices = [ChoiceText(tokenizer, params.stop_strings) for _ in range(len(prompts) * n)]
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()  # unbounded: the worker never waits on a slow reader
    closed = threading.Event()
    opening = [c for i in range(len(choices)) for c in chunks.opening(i)]

    def send(kind: str, items) -> None:  # on the worker thread
        nonlocal opening
        if opening and kind != "error":
            items, opening = opening + items, []
        loop.call_soon_threadsafe(events.put_nowait, (kind, items))

    def pieces(i: int, text: str, lo: int, hi: int, r) -> list[dict]:
        return [chunks.piece(i, text, r, lo, hi)] if text else []

    def run():
        results, decoded = [], 0

        def on_tokens(step) -> None:
            nonlocal decoded
            if closed.is_set():
                raise StreamClosed
            decoded += len(step)
            out = []
            for t in step:
                i = p * n + t.index
                out += pieces(i, *choices[i].add(t), choices[i].partial)
            if out or opening:  # held-back text sends nothing yet
                send("chunks", out)

        if closed.is_set():  # the caller went away while this waited in the queue
            return StoredAnswer.json({"closed": True})
        try:
            job.install()
            for p, prompt in enumerate(prompts):
                decoded = 0
                try:
                    result = job.sample(prompt, on_tokens)
                except (StreamClosed, Cancelled):
                    job.count(prompt, decoded)
                    return StoredAnswer.json({"closed": True})
                job.count(prompt, _sampled(result))
                results.append(result)
                out = []
                for j, seq in enumerate(result.sequences):
                    i = p * n + j
                    text, lo, hi, final = choices[i].finish(seq)
                    out += [*pieces(i, text, lo, hi, final), chunks.finish(i, final.finish_reason)]
                send("chunks", out)
        except Exception as e:
            send("error", e)
            raise
        send("done", chunks.usage(responses.usage(prompts, results)))
        return StoredAnswer.json({})

    request_id = job.submit(run)

    def leave() -> None:
        """The reader is gone: the decode stops at its next step, also when it is paused for others' turns."""
        closed.set()
        svc.cancel(tenant, request_id)

    try:
        first = await events.get()
    except BaseException:  # the handler was cancelled before the first step: stop the worker there too
        leave()
        raise
    if first[0] == "error":
        closed.set()
        raise _as_openai(first[1])

    async def body():
        # What the worker queued meanwhile goes out as one write: a stream of n choices sends n chunks a
        # decode step, and a write per chunk is event-loop time (and the GIL) taken from other tenants' passes.
        kind, items = first
        try:
            while kind != "error":
                out = [responses.sse(item) for item in items]
                while kind == "chunks" and not events.empty():
                    kind, items = events.get_nowait()
                    out += [responses.sse(item) for item in items] if kind != "error" else []
                if kind == "done":
                    out.append(responses.sse("[DONE]"))
                if out:
                    yield "".join(out)
                if kind == "done":
                    return
                if kind != "error":
                    kind, items = await events.get()
            e = _as_openai(items)
            yield responses.sse(error_body(e.status, e.message, e.param, e.code))
        finally:  # a reader who disconnected lands here too (the generator is cancelled or closed)
            if kind == "chunks":
                leave()
            closed.set()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
