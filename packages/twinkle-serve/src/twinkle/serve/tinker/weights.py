"""Tinker checkpoints: save_weights (adapter + optimizer), save_weights_for_sampler (named or ephemeral),
load_weights (into a new run from a checkpoint, or into an existing one). Paths are
`tinker://{model_id}/weights/{name}` and `tinker://{model_id}/sampler_weights/{name}`."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from twinkle.serve.backend import LoraSpec
from twinkle.serve.core.checkpoints import META_FILE, check_name
from twinkle.serve.core.records import Checkpoint, Kind, Run
from twinkle.serve.core.service import Service
from twinkle.serve.core.work import StoredAnswer
from twinkle.serve.errors import BadRequest
from twinkle.serve.tinker import bodies as b
from twinkle.serve.tinker.models import TinkerModels, adapter_name
from twinkle.serve.tinker.sampling import TinkerSampling

# what a save reads, its TTL and seq_id in range (a TTL the calendar can hold, a 64-bit seq_id)
Save = b.SaveWeightsBody | b.SaveWeightsForSamplerBody | b.SaveWeightsExternalBody


class TinkerWeights:
    def __init__(self, svc: Service, models: TinkerModels, sampling: TinkerSampling):
        self.svc, self.rt, self.models, self.sampling = svc, svc.rt, models, sampling

    def _write(self, run: Run, engine, kind: Kind, name: str, body: Save, overwrite: bool) -> Checkpoint:
        adapter = self.svc.live_adapter(run.model_id)

        def fill(staging: Path) -> dict:
            engine.backend.save_checkpoint(adapter, staging, kind == "training")
            return {"lora": run.lora}

        return self.svc.checkpoints.write(
            run,
            kind,
            name,
            fill,
            overwrite=overwrite,
            ttl=body.ttl_seconds,
            user_metadata=body.user_metadata,
        )

    def _queue(self, tenant, engine, run: Run, body: Save, work) -> dict:
        return {
            "request_id": self.svc.submit(tenant, engine, run.model_id, body.seq_id, work),
            "model_id": run.model_id,
        }

    def save_weights(self, tenant: str, body: b.SaveWeightsBody) -> dict:
        run = self.svc.run(tenant, body.model_id)
        self.svc.admit_save(tenant)
        engine = self.rt.engine(run.base_model)
        name = check_name(body.path or f"ckpt-{uuid.uuid4().hex[:8]}")

        def work():
            path = self._write(run, engine, "training", name, body, body.overwrite).tinker_path
            return StoredAnswer.json({"type": "save_weights", "path": path})

        return self._queue(tenant, engine, run, body, work)

    def save_weights_for_sampler(self, tenant: str, body: b.SaveWeightsForSamplerBody) -> dict:
        run = self.svc.run(tenant, body.model_id)
        engine = self.rt.engine(run.base_model)
        if body.path:
            if body.kind == "inflight":
                raise BadRequest(
                    "kind='inflight' publishes to the model's shared target and returns a sampling session: "
                    "send it without a path (save_weights_and_get_sampling_client(kind='inflight'))"
                )
            name = check_name(body.path)
            self.svc.admit_save(tenant)

            def work():
                return StoredAnswer.json(
                    {
                        "type": "save_weights_for_sampler",
                        "path": self._write(run, engine, "sampler", name, body, True).tinker_path,
                    }
                )
        else:
            seq, kind = body.sampling_session_seq_id, body.kind
            if seq is None:
                raise BadRequest("save_weights_for_sampler needs a path (named) or sampling_session_seq_id (ephemeral)")
            self.svc.admit_sampler(tenant)

            def work():
                return StoredAnswer.json(
                    self.sampling.install_ephemeral(tenant, engine, run.session_id, seq, run.model_id, kind)
                )

        return self._queue(tenant, engine, run, body, work)

    def load_weights(self, tenant: str, body: b.LoadWeightsBody) -> dict:
        path = body.path
        ckpt = self.svc.checkpoints.readable(tenant, path, "training", purpose="load")
        folder = self.svc.checkpoints.folder(ckpt)
        meta = self.svc.checkpoints.meta(ckpt)
        with_optimizer = body.optimizer
        if body.session_id is not None:  # create_training_client_from_state(_with_optimizer)
            spec = LoraSpec(**{k: v for k, v in meta["lora"].items() if k in LoraSpec.__dataclass_fields__})
            run, engine = self.models.new_run(
                tenant, body.session_id, body.model_seq_id, meta["base_model"], spec, body.user_metadata
            )
            seq_id = 0
        else:  # TrainingClient.load_state: into an existing model
            run = self.svc.run(tenant, body.model_id)
            engine, seq_id, spec = self.rt.engine(run.base_model), body.seq_id, None

        def work():
            if spec is None:
                engine.backend.load_checkpoint(self.svc.live_adapter(run.model_id), folder, with_optimizer, True)
            else:  # the adapter is built from the folder's own LoraConfig (rank, alpha, targets)
                try:
                    engine.backend.load_checkpoint(adapter_name(run.model_id), folder, with_optimizer, True)
                    self.svc.set_live(run.model_id, engine, adapter_name(run.model_id))
                except BaseException:
                    self.models.forget_run(run, engine)  # a model that never loaded is not listed
                    raise
            return StoredAnswer.json({"type": "load_weights", "path": path, "model_id": run.model_id})

        return {"request_id": self.svc.submit(tenant, engine, run.model_id, seq_id, work), "model_id": run.model_id}

    # ---- external weights (a PEFT adapter folder to download: tinker/external_weights.py serves it) ----
    def save_weights_external(self, tenant: str, body: b.SaveWeightsExternalBody) -> dict:
        if body.age_encryption_recipients:
            raise BadRequest("age_encryption_recipients: encrypted exports are not supported by this server")
        run = self.svc.run(tenant, body.model_id)
        self.svc.admit_save(tenant)
        engine = self.rt.engine(run.base_model)
        name = check_name(body.path)

        def work():
            ckpt = self._write(run, engine, "external", name, body, True)
            return StoredAnswer.json(
                {"type": "save_weights_external", "path": ckpt.tinker_path, "size_bytes": ckpt.size_bytes}
            )

        return self._queue(tenant, engine, run, body, work)

    def copy_checkpoint(self, tenant: str, source: Checkpoint, model_id: str, session_id: str, ttl: int | None) -> str:
        """A readable checkpoint copied (files hard-linked: no bytes duplicated) into a new training run
        `model_id` of `session_id`, which holds it and cannot be trained on. -> the copy's tinker path."""
        origin = self.rt.store.runs.of_checkpoint(source)
        run = self.svc.create_run(
            tenant,
            session_id,
            model_id,
            self.rt.engine(origin.base_model),
            "tinker",
            origin.lora,
            {"copied_from": source.tinker_path},
        )
        meta = self.svc.checkpoints.meta(source)
        folder = self.svc.checkpoints.folder(source)

        def fill(staging: Path) -> dict:
            # training checkpoints hold a training_state/ folder: link every file, make the folders
            for f in sorted(folder.rglob("*")):
                rel = f.relative_to(folder)
                if f.is_dir():
                    (staging / rel).mkdir(parents=True, exist_ok=True)
                elif rel.name != META_FILE or len(rel.parts) > 1:
                    os.link(f, staging / rel)
            return {k: v for k, v in meta.items() if k not in ("base_model", "model_id")}

        return self.svc.checkpoints.write(run, source.kind, source.name, fill, ttl=ttl).tinker_path
