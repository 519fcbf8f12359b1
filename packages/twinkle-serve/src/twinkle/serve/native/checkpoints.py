"""Native save / load / resume: the adapter (and, on request, its training state) in the one checkpoint
format (twinkle.model.checkpoint, written and read by the backend), in the core's checkpoint layout, so
either API can list and load it."""

from __future__ import annotations

from twinkle.client.schema import CheckpointRef, LoadRequest, SaveRequest
from twinkle.model.checkpoint import has_training_state, record_consumed_samples
from twinkle.serve.backend import UserError
from twinkle.serve.core.checkpoints import check_name
from twinkle.serve.errors import BadRequest, server_path_as
from twinkle.serve.native.models import NativeModels, internal_name


def folder_config(folder, path: str):
    """The LoraConfig a checkpoint folder holds; one peft cannot read is a 400 naming the checkpoint."""
    from peft import LoraConfig

    try:
        return LoraConfig.from_pretrained(str(folder))
    except (ValueError, OSError) as e:  # a missing or malformed adapter_config.json, unknown fields
        raise UserError(server_path_as(str(e).strip("'\""), folder, path)) from None


class NativeCheckpoints:
    def __init__(self, models: NativeModels):
        self.models, self.svc = models, models.svc

    def save(self, tenant: str, model_id: str, seq, req: SaveRequest) -> dict:
        name = check_name(req.name)
        if req.consumed_train_samples is not None and not req.save_training_state:
            raise BadRequest("consumed_train_samples is kept with the training state: pass save_training_state=true")
        self.svc.admit_save(tenant)

        def work(backend, run):
            internal = self.models.adapter(model_id, req.adapter_name)

            def fill(staging) -> dict:
                backend.save_checkpoint(internal, staging, req.save_training_state)
                if req.consumed_train_samples is not None:
                    record_consumed_samples(staging, req.consumed_train_samples)
                return {
                    "native": True,
                    "adapter_name": self.models.label(model_id, internal),
                    "lora": {
                        "rank": backend.adapter_rank(internal),
                        "seed": None,
                        "train_attn": True,
                        "train_mlp": True,
                        "train_unembed": False,
                    },
                }

            ckpt = self.svc.checkpoints.write(run, "training", name, fill)
            return CheckpointRef(path=ckpt.tinker_path, model_id=model_id).model_dump()

        return self.models.submit(tenant, model_id, seq, work)

    def load(self, tenant: str, model_id: str, seq, req: LoadRequest) -> dict:
        ckpt = self.svc.checkpoints.readable(tenant, req.path, "training", purpose="load")
        folder = self.svc.checkpoints.folder(ckpt)
        if req.resume and not has_training_state(folder):
            raise BadRequest(f"checkpoint {req.path} was saved without save_training_state: it cannot resume")
        run = self.models.model(tenant, model_id)
        label = req.adapter_name or "default"
        if not self.models.has(model_id, label):  # a new adapter from the folder's own LoraConfig: counted
            self.models.reserve(run, internal_name(model_id, label), folder_config(folder, req.path), req.path)

        def work(backend, run):
            new = not self.models.has(model_id, label)
            internal = internal_name(model_id, label) if new else self.models.adapter(model_id, label)
            try:
                counters = backend.load_checkpoint(internal, folder, req.resume)
                if new:
                    self.models.register(run, backend.adapter_rank(internal), label, internal)
            except BaseException:
                if new:  # a new adapter that failed midway is not left half-loaded (an existing one stays)
                    self.models.forget_adapter(backend, run, label, internal)
                raise
            out = {"path": req.path, "adapter_name": label, "resumed": False}
            if req.resume:
                out.update(
                    resumed=True,
                    optimizer_steps=counters["optimizer_steps"],
                    data_position=counters["data_position"],
                    consumed_train_samples=counters.get("consumed_train_samples", 0),
                )
            return out

        return self.models.submit(tenant, model_id, seq, work)
