"""Read-side of the native API: sampling, runs with their curves, checkpoints (list, download as a
PEFT folder), and the server's capacity and queue. Every listing is scoped to the caller's tenant."""

from __future__ import annotations

import io
import json
import time
import uuid
import zipfile
from pathlib import Path

from twinkle.client.schema import (BaseModelInfo, CheckpointInfo, CheckpointList, RunCurves, RunList, RunSummary,
                                   SampledSequence, SampleOutput, SampleRequest, SampleResult, ServerStatus)
from twinkle.serve.backend import SampleParams, UserError
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.native.service import NativeService

PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")


class NativeViews:
    def __init__(self, service: NativeService):
        self.svc, self.rt = service, service.rt

    # ---- sampling ------------------------------------------------------------------------------
    def sample(self, tenant: str, req: SampleRequest) -> dict:
        if (req.prompts is None) == (req.chats is None):
            raise BadRequest("sample needs exactly one of 'prompts' (token ids) or 'chats' (messages)")
        if req.model_id is not None and req.checkpoint is not None:
            raise BadRequest("sample from a model's current adapter (model_id) or a checkpoint, not both")
        if req.model_id is not None:
            row = self.svc.model(tenant, req.model_id)
            engine, queue = self.svc.engine_of(row), req.model_id  # after the model's queued training
        elif req.checkpoint is not None:
            ckpt = self.svc.tinker.readable_checkpoint(tenant, req.checkpoint)
            base = self.rt.store.one("SELECT base_model FROM models WHERE model_id=?", (ckpt["model_id"],))
            engine, queue = self.rt.engine(base["base_model"]), f"sample:{tenant}"
        else:
            engine, queue = self.rt.engine(req.base_model), f"sample:{tenant}"
        sp = req.sampling_params
        params = SampleParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_k=sp.top_k or -1,
                              top_p=sp.top_p, seed=sp.seed, stop=sp.stop)

        def run():
            backend = engine.backend
            if req.chats is not None:
                template = self.svc.template(backend)
                prompts = [template.encode_prompt({"messages": [m.model_dump(exclude_none=True) for m in chat]})
                           ["input_ids"] for chat in req.chats]
            else:
                prompts = req.prompts
            sampler = None
            if req.model_id is not None:  # a fresh snapshot of the adapter as trained so far
                sampler = "snap" + uuid.uuid4().hex[:12]
                backend.install_sampler_from_adapter(sampler, self.svc.adapter(req.model_id, req.adapter_name))
            elif req.checkpoint is not None:
                sampler = "ckpt" + uuid.uuid5(uuid.NAMESPACE_URL, ckpt["dir"]).hex[:12]
                backend.install_sampler_from_folder(sampler, ckpt["dir"])
            try:
                outputs = []
                for prompt in prompts:
                    result = backend.sample(sampler, list(prompt), sp.num_samples, params, False)
                    outputs.append(SampleOutput(sequences=[
                        SampledSequence(tokens=s.tokens, logprobs=s.logprobs, stop_reason=str(s.stop_reason),
                                        text=backend.sampler.tokenizer.decode(s.tokens, skip_special_tokens=True))
                        for s in result.sequences]))
            finally:
                if req.model_id is not None:
                    backend.remove_sampler(sampler)
            return "json", SampleResult(outputs=outputs).model_dump()

        def guarded():
            try:
                return run()
            except (ValueError, KeyError) as e:
                raise UserError(str(e)) from None

        request_id = self.rt.hub.create(tenant)
        engine.scheduler.submit(queue, None, request_id, guarded)
        return {"request_id": request_id, "model_id": req.model_id}

    # ---- runs ----------------------------------------------------------------------------------
    def runs(self, tenant: str, limit: int = 100) -> RunList:
        rows = self.rt.store.all("SELECT * FROM models WHERE tenant=? ORDER BY created_at DESC LIMIT ?",
                                 (tenant, limit))
        out = []
        for row in rows:
            lora = json.loads(row["lora"] or "{}")
            last = self.svc.curves.last(row["model_id"], "loss")
            steps = self.rt.store.one("SELECT COUNT(*) AS n FROM run_curves WHERE model_id=? AND name='loss'",
                                      (row["model_id"],))["n"]
            out.append(RunSummary(model_id=row["model_id"], name=lora.get("name"), base_model=row["base_model"],
                                  created_at=row["created_at"], last_request_time=row["last_request_time"],
                                  api="native" if lora.get("native") else "tinker", lora_rank=lora.get("rank"),
                                  steps=steps, last_loss=last["value"] if last else None))
        return RunList(runs=out)

    def _owned_run(self, tenant: str, model_id: str) -> dict:
        row = self.rt.store.owned("models", "model_id", model_id, tenant)
        if row is None:
            raise NotFound(f"run {model_id!r} not found")
        return row

    def curves(self, tenant: str, model_id: str, since_step: int = -1) -> RunCurves:
        self._owned_run(tenant, model_id)
        return RunCurves(model_id=model_id, curves=self.svc.curves.of(model_id, since_step))

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoints(self, tenant: str, model_id: str | None = None) -> CheckpointList:
        sql, args = "SELECT * FROM checkpoints WHERE tenant=?", [tenant]
        if model_id:
            self._owned_run(tenant, model_id)  # another tenant's run id: 404, as every id-taking route answers
            sql, args = sql + " AND model_id=?", args + [model_id]
        rows = self.rt.store.all(sql + " ORDER BY created_at DESC", tuple(args))
        return CheckpointList(checkpoints=[
            CheckpointInfo(path=r["tinker_path"], model_id=r["model_id"], name=r["name"], kind=r["kind"],
                           created_at=r["created_at"], size_bytes=r["size_bytes"])
            for r in rows if not (r["expires_at"] and r["expires_at"] < time.time())])

    def archive(self, tenant: str, path: str) -> bytes:
        """The checkpoint's PEFT folder (adapter_model.safetensors + adapter_config.json) as a zip."""
        ckpt = self.svc.tinker.readable_checkpoint(tenant, path)
        folder = Path(ckpt["dir"])
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
        with self.rt.live_lock:
            live = dict(self.rt.live)
        models = [BaseModelInfo(name=name, backend=e.entry.backend, max_context=e.backend.max_context,
                                vocab_size=e.backend.vocab_size,
                                live_adapters=sum(1 for base, _ in live.values() if base == name))
                  for name, e in self.rt.engines.items()]
        pending = self.rt.store.one("SELECT COUNT(*) AS n, SUM(tenant=?) AS mine FROM futures WHERE status='pending'",
                                    (tenant,))
        done = self.rt.store.one("SELECT COUNT(*) AS n FROM futures WHERE completed_at > ?", (time.time() - 60,))["n"]
        return ServerStatus(ready=self.rt.ready.is_set(), base_models=models, queue_depth=pending["n"] or 0,
                            tenant_queue_depth=pending["mine"] or 0, completed_last_60s=done,
                            requests_per_s=done / 60.0, tokens_per_s=self.svc.curves.tokens_per_s(), tenant=tenant,
                            max_models_per_tenant=self.rt.limits.of(tenant).max_models)
