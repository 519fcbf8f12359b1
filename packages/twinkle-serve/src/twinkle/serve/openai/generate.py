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
    out = _Stream(_Job(svc, tenant, target, prompts, n, params, images), chunks, asyncio.get_running_loop())
    request_id = out.job.submit(out.run)
    out.request_id = request_id
    try:
        first = await out.events.get()
    except BaseException:  # the handler was cancelled before the first step: stop the worker there too
        out.leave()
        raise
    if first[0] == "error":
        out.closed.set()
        raise _as_openai(first[1])
    return StreamingResponse(out.body(first), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _Stream:
    """One streamed request: `run` decodes on the worker thread and queues (kind, items) events, kind
    "chunks", "done" or "error"; `body` sends them to the reader as server-sent events."""

    def __init__(self, job: _Job, chunks: responses.ChatChunks, loop: asyncio.AbstractEventLoop):
        self.job, self.chunks, self.loop = job, chunks, loop
        tokenizer = job.target.engine.backend.tokenizer
        self.choices = [ChoiceText(tokenizer, job.params.stop_strings) for _ in range(len(job.prompts) * job.n)]
        self.events: asyncio.Queue = asyncio.Queue()  # unbounded: the worker never waits on a slow reader
        self.closed = threading.Event()
        self.opening = [c for i in range(len(self.choices)) for c in chunks.opening(i)]
        self.request_id = ""

    # ---- on the worker thread ------------------------------------------------------------------
    def send(self, kind: str, items) -> None:
        if self.opening and kind != "error":
            items, self.opening = self.opening + items, []
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, items))

    def pieces(self, i: int, text: str, lo: int, hi: int, r) -> list[dict]:
        return [self.chunks.piece(i, text, r, lo, hi)] if text else []

    def run(self) -> StoredAnswer:
        if self.closed.is_set():  # the caller went away while this waited in the queue
            return StoredAnswer.json({"closed": True})
        job, results = self.job, []
        try:
            job.install()
            for p, prompt in enumerate(job.prompts):
                decoded = [0]
                try:
                    result = job.sample(prompt, lambda step, p=p, decoded=decoded: self.on_tokens(p, step, decoded))
                except (StreamClosed, Cancelled):
                    job.count(prompt, decoded[0])
                    return StoredAnswer.json({"closed": True})
                job.count(prompt, _sampled(result))
                results.append(result)
                out = []
                for j, seq in enumerate(result.sequences):
                    i = p * job.n + j
                    text, lo, hi, final = self.choices[i].finish(seq)
                    out += [*self.pieces(i, text, lo, hi, final), self.chunks.finish(i, final.finish_reason)]
                self.send("chunks", out)
        except Exception as e:
            self.send("error", e)
            raise
        self.send("done", self.chunks.usage(responses.usage(job.prompts, results)))
        return StoredAnswer.json({})

    def on_tokens(self, p: int, step, decoded: list[int]) -> None:
        if self.closed.is_set():
            raise StreamClosed
        decoded[0] += len(step)
        out = []
        for t in step:
            i = p * self.job.n + t.index
            out += self.pieces(i, *self.choices[i].add(t), self.choices[i].partial)
        if out or self.opening:  # held-back text sends nothing yet
            self.send("chunks", out)

    # ---- on the event loop ---------------------------------------------------------------------
    def leave(self) -> None:
        """The reader is gone: the decode stops at its next step, also when it is paused for others' turns."""
        self.closed.set()
        self.job.svc.cancel(self.job.tenant, self.request_id)

    async def body(self, first):
        # What the worker queued meanwhile goes out as one write: a stream of n choices sends n chunks a
        # decode step, and a write per chunk is event-loop time (and the GIL) taken from other tenants' passes.
        kind, items = first
        try:
            while kind != "error":
                out = [responses.sse(item) for item in items]
                while kind == "chunks" and not self.events.empty():
                    kind, items = self.events.get_nowait()
                    out += [responses.sse(item) for item in items] if kind != "error" else []
                if kind == "done":
                    out.append(responses.sse("[DONE]"))
                if out:
                    yield "".join(out)
                if kind == "done":
                    return
                if kind != "error":
                    kind, items = await self.events.get()
            e = _as_openai(items)
            yield responses.sse(error_body(e.status, e.message, e.param, e.code))
        finally:  # a reader who disconnected lands here too (the generator is cancelled or closed)
            if kind == "chunks":
                self.leave()
            self.closed.set()
