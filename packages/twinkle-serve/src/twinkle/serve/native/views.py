"""Read-side of the native API: sampling, runs with their curves, checkpoints (list, download as a
PEFT folder), and the server's capacity and queue. Every listing is scoped to the caller's tenant."""

from __future__ import annotations

import io
import time
import uuid
import zipfile

from twinkle.client.schema import (
    BaseModelInfo,
    CheckpointInfo,
    CheckpointList,
    RunCurves,
    RunList,
    RunSummary,
    SampledSequence,
    SampleOutput,
    SampleRequest,
    SampleResult,
    ServerStatus,
)
from twinkle.sampler import SamplingParams
from twinkle.serve.backend import UserError
from twinkle.serve.core import bounds
from twinkle.serve.core.work import StoredAnswer
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.native.compute import NativeCompute

PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")
FUSED_APIS = ("native", "tinker")  # the APIs whose passes fuse (PassJob.api)


class NativeViews:
    def __init__(self, compute: NativeCompute):
        self.compute, self.models, self.svc, self.rt = compute, compute.models, compute.svc, compute.rt
        self.store = self.rt.store

    # ---- sampling ------------------------------------------------------------------------------
    def sample(self, tenant: str, req: SampleRequest) -> dict:
        if (req.prompts is None) == (req.chats is None):
            raise BadRequest("sample needs exactly one of 'prompts' (token ids) or 'chats' (messages)")
        if req.model_id is not None and req.checkpoint is not None:
            raise BadRequest("sample from a model's current adapter (model_id) or a checkpoint, not both")
        if req.model_id is not None:
            engine = self.models.engine_of(self.models.model(tenant, req.model_id))
            queue = req.model_id  # after the model's queued training
        elif req.checkpoint is not None:
            ckpt = self.svc.checkpoints.readable(tenant, req.checkpoint)
            engine = self.rt.engine(self.store.runs.of_checkpoint(ckpt).base_model)
            queue = f"sample:{tenant}"
        else:
            engine, queue = self.rt.engine(req.base_model), f"sample:{tenant}"
        sp = req.sampling_params
        if req.chats is not None:  # tokenized below: bound the text first
            chars = sum(len(m.content or "") for chat in req.chats for m in chat)
            bounds.prompt_chars("chats", chars, self.rt.config.caps)
        else:
            lens = [len(p) for p in req.prompts or []]
            bounds.sample_cost(lens, sp.num_samples, sp.max_tokens, engine.backend.max_context, self.rt.config.caps)
        params = SamplingParams(
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_k=max(sp.top_k, 0),  # 0 or -1: no top-k
            top_p=sp.top_p,
            seed=sp.seed,
            stop=list[str | int](sp.stop or []) or None,
            ignore_eos=sp.stop == [],  # as Tinker's: an explicit empty list stops at nothing, EOS included
            num_samples=sp.num_samples,
        )

        if req.chats is not None:  # templated and its images decoded here, not on the engine's thread
            try:
                encoded = self.compute.chat_prompts(engine.backend, req.chats)
            except UserError as e:  # the template's and the image checks' refusals, naming the chat
                raise BadRequest(str(e)) from None
            prompts, prompt_images = [ids for ids, _ in encoded], [images for _, images in encoded]
            lens = [len(p) for p in prompts]  # the chats' tokens, now known: their cost before queueing
            bounds.sample_cost(lens, sp.num_samples, sp.max_tokens, engine.backend.max_context, self.rt.config.caps)
        else:
            assert req.prompts is not None  # exactly one of prompts / chats, checked above
            prompts, prompt_images = req.prompts, [None] * len(req.prompts)

        def run():
            backend = engine.backend
            sampler = None
            if req.model_id is not None:  # a fresh snapshot of the adapter as trained so far
                sampler = "snap" + uuid.uuid4().hex[:12]
                backend.install_sampler_from_adapter(sampler, self.models.adapter(req.model_id, req.adapter_name))
            elif req.checkpoint is not None:
                sampler = "ckpt" + uuid.uuid5(uuid.NAMESPACE_URL, ckpt.dir).hex[:12]
                backend.install_sampler_from_folder(sampler, str(self.svc.checkpoints.folder(ckpt)))
            try:
                outputs = []
                for prompt, images in zip(prompts, prompt_images):
                    result = backend.sample(sampler, list(prompt), params, images=images or None)
                    outputs.append(
                        SampleOutput(
                            sequences=[
                                SampledSequence(
                                    tokens=s.tokens,
                                    logprobs=s.logprobs or [],
                                    stop_reason=str(s.stop_reason),
                                    text=backend.tokenizer.decode(s.tokens, skip_special_tokens=True),
                                )
                                for s in result.sequences
                            ]
                        )
                    )
            finally:
                if req.model_id is not None and sampler is not None:
                    backend.remove_sampler(sampler)
            return StoredAnswer.json(SampleResult(outputs=outputs).model_dump())

        request_id = self.svc.submit(tenant, engine, queue, None, run, sliced=True)  # decodes in turns
        return {"request_id": request_id, "model_id": req.model_id}

    # ---- runs ----------------------------------------------------------------------------------
    def runs(self, tenant: str, limit: int = 100) -> RunList:
        out = []
        for run in self.store.runs.list(tenant, limit):
            last = self.store.curves.last(run.model_id, "loss")
            out.append(
                RunSummary(
                    model_id=run.model_id,
                    name=run.name,
                    base_model=run.base_model,
                    created_at=run.created_at,
                    last_request_time=run.last_request_time,
                    api=run.api,
                    lora_rank=run.lora.get("rank"),
                    steps=self.store.curves.count(run.model_id, "loss"),
                    last_loss=last["value"] if last else None,
                )
            )
        return RunList(runs=out)

    def curves(self, tenant: str, model_id: str, since_step: int = -1) -> RunCurves:
        if self.store.runs.owned(model_id, tenant) is None:
            raise NotFound(f"run {model_id!r} not found")
        return RunCurves(model_id=model_id, curves=self.store.curves.of(model_id, since_step))

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoints(self, tenant: str, model_id: str | None = None) -> CheckpointList:
        if model_id:
            if self.store.runs.owned(model_id, tenant) is None:  # another tenant's run id: 404, as everywhere
                raise NotFound(f"run {model_id!r} not found")
            rows = self.svc.checkpoints.of_run(tenant, model_id)[::-1]
        else:
            rows = self.svc.checkpoints.of_tenant(tenant)
        return CheckpointList(
            checkpoints=[
                CheckpointInfo(
                    path=c.tinker_path,
                    model_id=c.model_id,
                    name=c.name,
                    kind=c.kind,
                    created_at=c.created_at,
                    size_bytes=c.size_bytes,
                )
                for c in rows
            ]
        )

    def archive(self, tenant: str, path: str) -> bytes:
        """The checkpoint's PEFT folder (adapter_model.safetensors + adapter_config.json) as a zip."""
        folder = self.svc.checkpoints.folder(self.svc.checkpoints.readable(tenant, path, purpose="download"))
        missing = [f for f in PEFT_FILES if not (folder / f).exists()]
        if missing:
            raise BadRequest(f"checkpoint {path} is not a PEFT folder (missing {missing})")
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
            for f in PEFT_FILES:
                zf.write(folder / f, f)
        return buf.getvalue()

    # ---- capacity and queue --------------------------------------------------------------------
    def status(self, tenant: str) -> ServerStatus:
        models = [
            BaseModelInfo(
                name=name,
                backend=e.entry.backend,
                max_context=e.backend.max_context,
                vocab_size=e.backend.vocab_size,
                live_adapters=self.rt.live.count_on(name),
                fused_passes=e.scheduler.fused_passes,
                fused_requests={api: e.scheduler.fused_items[api] for api in FUSED_APIS},
            )
            for name, e in self.rt.engines.items()
        ]
        pending, mine = self.store.futures.pending(tenant)
        done = self.store.futures.completed_since(time.time() - 60)
        return ServerStatus(
            ready=self.rt.ready.is_set(),
            base_models=models,
            queue_depth=pending,
            tenant_queue_depth=mine,
            completed_last_60s=done,
            requests_per_s=done / 60.0,
            tokens_per_s=self.rt.throughput.tokens_per_s(),
            tenant=tenant,
            max_models_per_tenant=self.rt.limits.of(tenant).max_models,
        )
