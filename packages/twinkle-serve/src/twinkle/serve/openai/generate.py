"""Running a request's prompts on the base model's scheduler (the sampler the Tinker API uses too) and
waiting for them, with the request's usage counted like any other sampling."""

from __future__ import annotations

import json
import time

from twinkle.serve.backend import SampleParams, SampleResult
from twinkle.serve.core.records import Sampler
from twinkle.serve.core.service import Service
from twinkle.serve.openai.errors import OpenAIError
from twinkle.serve.openai.models import Target

POLL_S = 30.0


async def generate(
    svc: Service, tenant: str, target: Target, prompts: list[list[int]], n: int, params: SampleParams
) -> list[SampleResult]:
    """One SampleResult (n sequences) per prompt, in order."""
    rt, engine = svc.rt, target.engine
    rt.limits.input_tokens(tenant, sum(len(p) for p in prompts))
    folder = str(svc.checkpoints.folder(target.checkpoint)) if target.checkpoint else None
    ckpt_path = target.checkpoint.tinker_path if target.checkpoint else None
    usage = Sampler(f"openai:{target.model}", tenant, "", engine.entry.name, ckpt_path, time.time())
    results: list[SampleResult] = []

    def run():  # on the scheduler's worker thread, like every other backend call
        if folder is not None and target.adapter is not None:  # both come from the target's checkpoint
            engine.backend.install_sampler_from_folder(target.adapter, folder)
        for prompt in prompts:
            result = engine.backend.sample(target.adapter, prompt, n, params, False)
            svc.count_sampling(usage, len(prompt), sum(len(s.tokens) for s in result.sequences))
            results.append(result)
        return "json", {}

    request_id = svc.submit(tenant, engine, f"openai:{tenant}", None, run)
    row = await rt.hub.wait(request_id, tenant, POLL_S)
    while row is not None and row.status == "pending":
        row = await rt.hub.wait(request_id, tenant, POLL_S)
    if row is None:
        raise OpenAIError(500, f"request {request_id} vanished from the future store")
    if row.status == "failed":
        failure = json.loads(row.payload or b"{}")
        raise OpenAIError(400 if failure.get("category") == "user" else 500, failure["error"])
    return results
