"""Tinker checkpoints: save_weights (adapter + optimizer), save_weights_for_sampler (named or ephemeral),
load_weights (into a new run from a checkpoint, or into an existing one). Paths are
`tinker://{model_id}/weights/{name}` and `tinker://{model_id}/sampler_weights/{name}`."""

from __future__ import annotations

import uuid
from pathlib import Path

from twinkle.serve.backend import LoraSpec
from twinkle.serve.core.checkpoints import check_name
from twinkle.serve.core.records import Kind, Run
from twinkle.serve.core.service import Service
from twinkle.serve.errors import BadRequest
from twinkle.serve.tinker.models import TinkerModels, adapter_name
from twinkle.serve.tinker.sampling import TinkerSampling


class TinkerWeights:
    def __init__(self, svc: Service, models: TinkerModels, sampling: TinkerSampling):
        self.svc, self.rt, self.models, self.sampling = svc, svc.rt, models, sampling

    def _write(self, run: Run, engine, kind: Kind, name: str, body: dict, overwrite: bool) -> str:
        adapter = self.svc.live_adapter(run.model_id)

        def fill(staging: Path) -> dict:
            engine.backend.save_checkpoint(adapter, staging, kind == "training")
            return {"lora": run.lora}

        return self.svc.checkpoints.write(run, kind, name, fill, overwrite=overwrite, ttl=body.get("ttl_seconds"),
                                          user_metadata=body.get("user_metadata")).tinker_path

    def _queue(self, tenant, engine, run: Run, body: dict, work) -> dict:
        return {"request_id": self.svc.submit(tenant, engine, run.model_id, body.get("seq_id"), work),
                "model_id": run.model_id}

    def save_weights(self, tenant: str, body: dict) -> dict:
        run = self.svc.run(tenant, body.get("model_id"))
        engine = self.rt.engine(run.base_model)
        name = check_name(body.get("path") or f"ckpt-{uuid.uuid4().hex[:8]}")

        def work():
            path = self._write(run, engine, "training", name, body, bool(body.get("overwrite", False)))
            return "json", {"type": "save_weights", "path": path}

        return self._queue(tenant, engine, run, body, work)

    def save_weights_for_sampler(self, tenant: str, body: dict) -> dict:
        run = self.svc.run(tenant, body.get("model_id"))
        engine = self.rt.engine(run.base_model)
        if body.get("path"):
            name = check_name(body["path"])

            def work():
                return "json", {"type": "save_weights_for_sampler",
                                "path": self._write(run, engine, "sampler", name, body, True)}
        else:
            seq = body.get("sampling_session_seq_id")
            if not isinstance(seq, int):
                raise BadRequest("save_weights_for_sampler needs a path (named) or sampling_session_seq_id (ephemeral)")

            def work():
                return "json", self.sampling.install_snapshot(tenant, engine, run.session_id, seq, run.model_id)

        return self._queue(tenant, engine, run, body, work)

    def load_weights(self, tenant: str, body: dict) -> dict:
        path = body.get("path")
        ckpt = self.svc.checkpoints.readable(tenant, path, "training")
        folder = self.svc.checkpoints.folder(ckpt)
        meta = self.svc.checkpoints.meta(ckpt)
        with_optimizer = bool(body.get("optimizer"))
        if body.get("session_id") is not None:  # create_training_client_from_state(_with_optimizer)
            spec = LoraSpec(**{k: v for k, v in meta["lora"].items() if k in LoraSpec.__dataclass_fields__})
            run, engine = self.models.new_run(tenant, body["session_id"], body.get("model_seq_id"),
                                              meta["base_model"], spec, body.get("user_metadata"))
            seq_id = 0
        else:  # TrainingClient.load_state: into an existing model
            run = self.svc.run(tenant, body.get("model_id"))
            engine, seq_id, spec = self.rt.engine(run.base_model), body.get("seq_id"), None

        def work():
            if spec is None:
                engine.backend.load_checkpoint(self.svc.live_adapter(run.model_id), folder, with_optimizer, True)
            else:  # the adapter is built from the folder's own LoraConfig (rank, alpha, targets)
                engine.backend.load_checkpoint(adapter_name(run.model_id), folder, with_optimizer, True)
                self.svc.set_live(run.model_id, engine, adapter_name(run.model_id))
            return "json", {"type": "load_weights", "path": path, "model_id": run.model_id}

        return {"request_id": self.svc.submit(tenant, engine, run.model_id, seq_id, work), "model_id": run.model_id}
