"""Native save / load / resume: the adapter as a PEFT folder (the engine's own save), optionally with its
training state, in the core's checkpoint layout, so either API can list and load it."""

from __future__ import annotations

from pathlib import Path

from twinkle.client.schema import CheckpointRef, LoadRequest, SaveRequest
from twinkle.serve.backend import UserError
from twinkle.serve.core.checkpoints import check_name
from twinkle.serve.errors import BadRequest
from twinkle.serve.native.compute import NativeCompute
from twinkle.serve.native.models import NativeModels, internal_name, user_errors

STATE_FILE = "training_state.pt"


class NativeCheckpoints:
    def __init__(self, models: NativeModels, compute: NativeCompute):
        self.models, self.compute, self.svc = models, compute, models.svc

    def save(self, tenant: str, model_id: str, seq, req: SaveRequest) -> dict:
        name = check_name(req.name)

        @user_errors
        def work(engine, run):
            import torch

            internal = self.models.adapter(model_id, req.adapter_name)
            state = engine.adapters[internal]

            def fill(staging: Path) -> dict:
                engine.save(str(staging), adapter_name=internal)
                if req.save_training_state:
                    opt = state.ensure_optimizer()
                    torch.save({"optimizer": opt.state_dict(),
                                "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
                                "optimizer_steps": state.optimizer_steps, "step_calls": state.micro_step,
                                "fb_count": self.compute.fb_counts.get((model_id, internal), 0)}, staging / STATE_FILE)
                return {"native": True, "adapter_name": self.models.label(model_id, internal),
                        "lora": {"rank": state.spec.rank, "seed": None, "train_attn": True, "train_mlp": True,
                                 "train_unembed": False}}

            ckpt = self.svc.checkpoints.write(run, "training", name, fill)
            return CheckpointRef(path=ckpt.tinker_path, model_id=model_id).model_dump()

        return self.models.submit(tenant, model_id, seq, work)

    def load(self, tenant: str, model_id: str, seq, req: LoadRequest) -> dict:
        ckpt = self.svc.checkpoints.readable(tenant, req.path, "training")
        folder = self.svc.checkpoints.folder(ckpt)
        if req.resume and not (folder / STATE_FILE).exists():
            raise BadRequest(f"checkpoint {req.path} was saved without save_training_state: it cannot resume")
        label = req.adapter_name or "default"
        if not self.models.has(model_id, label):  # a new adapter from the folder's own LoraConfig: counted
            from peft import LoraConfig

            run = self.models.model(tenant, model_id)
            self.models.reserve(run, internal_name(model_id, label),
                                user_errors(LoraConfig.from_pretrained)(str(folder)))

        @user_errors
        def work(engine, run):
            if not self.models.has(model_id, label):
                internal = internal_name(model_id, label)
                try:
                    engine.load(str(folder), internal)
                finally:
                    self.models.unreserve_unless_built(engine, internal)
                self.models.register(run, engine.adapters, label, internal)
            internal = self.models.adapter(model_id, label)
            self._copy_weights(engine, internal, folder, req.path, label)
            out = {"path": req.path, "adapter_name": label, "resumed": False}
            if req.resume:
                out.update(resumed=True, optimizer_steps=self._resume(engine, internal, folder, model_id))
            return out

        return self.models.submit(tenant, model_id, seq, work)

    @staticmethod
    def _copy_weights(engine, internal: str, folder: Path, path: str, label: str) -> None:
        import torch
        from safetensors.torch import load_file

        saved = {k.replace(".default.", "."): v for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
        own = engine.adapter_state_dict(internal)
        if set(saved) != set(own):
            raise UserError(f"checkpoint {path} does not fit adapter {label!r} (different targets or rank)")
        with torch.no_grad():
            for key, param in own.items():
                if saved[key].shape != param.shape:
                    raise UserError(f"checkpoint tensor {key} {tuple(saved[key].shape)} does not fit "
                                    f"{tuple(param.shape)}")
                param.copy_(saved[key])

    def _resume(self, engine, internal: str, folder: Path, model_id: str) -> int:
        import torch

        state = engine.adapters[internal]
        blob = torch.load(folder / STATE_FILE, weights_only=True)
        state.ensure_optimizer().load_state_dict(blob["optimizer"])
        if blob["scheduler"] is not None and state.scheduler is not None:
            state.scheduler.load_state_dict(blob["scheduler"])
        state.optimizer_steps, state.micro_step = blob["optimizer_steps"], blob["step_calls"]
        self.compute.fb_counts[(model_id, internal)] = blob["fb_count"]
        return blob["optimizer_steps"]
