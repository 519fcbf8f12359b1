"""`MultiLoraTransformersModel`: twinkle-kit's client model, on our native proxy (twinkle.client.model).

Each call waits for its result, as twinkle-kit's do; results are twinkle-kit's records (`.result`,
`.twinkle_path`). What our server does under another name maps to it; what it cannot do is refused by
name. Where the mapping is not one call for one call, the method says so.
"""

from __future__ import annotations

from typing import Any

from twinkle.client.errors import TwinkleAPIError
from twinkle.client.http import TwinkleClient
from twinkle.client.model import TransformersModel, lora_config_dict
from twinkle_client.inputs import BASE_MODEL_REFERENCE, BaseModelReference, with_loss_inputs
from twinkle_client.types import ModelResult, SaveResponse

PROCESSORS = ("InputProcessor",)


class MultiLoraTransformersModel:
    def __init__(self, model_id: str, *, client: TwinkleClient | None = None, name: str | None = None, seed: int = 42):
        self.proxy = TransformersModel(model_id=model_id, client=client, name=name, seed=seed)
        self.model_id = self.proxy.model_id
        self.base_model = self.proxy.base_model
        self.adapter_name: str | None = None
        self.settings: dict[str, Any] = {}  # what this client configured: get_train_configs reports it
        self.save_dir: str | None = None
        self._max_grad_norm: float | None = 1.0
        self._stepped = False

    # ---- configuration -------------------------------------------------------------------------
    def add_adapter_to_model(
        self, adapter_name: str, config=None, gradient_accumulation_steps: int = 1, *, save_dir: str | None = None
    ) -> None:
        """`save_dir`: every checkpoint this adapter saves is also downloaded there (twinkle-kit's server
        writes it there; ours keeps checkpoints in its own store and serves them)."""
        if config is None:
            raise NotImplementedError(
                "full-parameter training over HTTP is not offered: pass a peft LoraConfig (this server trains LoRAs)"
            )
        self.proxy.add_adapter_to_model(adapter_name, config, gradient_accumulation_steps).result()
        self.adapter_name, self.save_dir = adapter_name, save_dir
        self.settings.update(adapter=adapter_name, lora=lora_config_dict(config), gas=gradient_accumulation_steps)

    def set_loss(self, loss_cls, **loss_kwargs) -> None:
        self.proxy.set_loss(loss_cls, self.adapter_name, **loss_kwargs).result()
        self.settings["loss"] = (_name(loss_cls), loss_kwargs)

    def set_optimizer(self, optimizer_cls, **optimizer_kwargs) -> None:
        self.proxy.set_optimizer(optimizer_cls, self.adapter_name, **optimizer_kwargs).result()
        self.settings["optimizer"] = (_name(optimizer_cls), optimizer_kwargs)

    def set_lr_scheduler(self, scheduler_cls, **scheduler_kwargs) -> None:
        self.proxy.set_lr_scheduler(scheduler_cls, self.adapter_name, **scheduler_kwargs).result()
        self.settings["lr_scheduler"] = (_name(scheduler_cls), scheduler_kwargs)

    def add_metric(self, metric_cls, is_training: bool = True, **metric_kwargs) -> None:
        self.proxy.add_metric(metric_cls, is_training, self.adapter_name, **metric_kwargs).result()

    def set_template(self, template_cls="Template", *, model_id: str | None = None, **template_kwargs) -> None:
        """The template chats are encoded with on this machine (needs twinkle-client[local-encoding]);
        without one, the server encodes them with its model's own chat template."""
        from twinkle_client.inputs import local_template

        self.proxy.set_encoder_template(local_template(template_cls, model_id or self.base_model, template_kwargs))

    def set_processor(self, processor_cls="InputProcessor", *, padding_side: str = "right", padding_free: bool = False):
        """How the server collates a batch: ours pads on the right; anything else is refused by name."""
        if _name(processor_cls) not in PROCESSORS or padding_side != "right" or padding_free:
            raise NotImplementedError(
                f"set_processor({_name(processor_cls)!r}, padding_side={padding_side!r}, padding_free={padding_free}): "
                "the server collates with InputProcessor, padding on the right"
            )

    def get_train_configs(self) -> ModelResult:
        lines = [f"Adapter {self.adapter_name!r} on {self.base_model} (run {self.model_id})"]
        lines += [f"{key}: {value}" for key, value in self.settings.items() if key != "adapter"]
        return ModelResult(result="\n".join(lines))

    # ---- compute -------------------------------------------------------------------------------
    def forward_backward(
        self,
        inputs,
        *,
        old_logps=None,
        advantages=None,
        ref_outputs=None,
        micro_batch_size: int | None = None,
        task: str = "causal_lm",
    ) -> ModelResult:
        """`task='embedding'`: the server embeds the rows for an embedding loss (InfonceLoss); a task it
        does not offer is answered with a 400 naming it."""
        if micro_batch_size is not None:
            raise NotImplementedError(
                "micro_batch_size over HTTP: the server runs each forward_backward as one pass; send smaller calls"
            )
        rows = with_loss_inputs(inputs, old_logps, advantages, ref_outputs)
        self._stepped = False
        return ModelResult(result=self.proxy.forward_backward(rows, self.adapter_name, task=task).result())

    def forward_only(self, inputs, *, disable_lora: bool = False, task: str = "causal_lm") -> ModelResult:
        """`disable_lora=True`: the base model's log-probs as a DPO reference. Over HTTP the loss takes
        them on the server (the base model with the adapter switched off, the same numbers), so the
        result stands for them: pass it to forward_backward(ref_outputs=...). `task='embedding'`: each
        row's embedding (`embeddings`) and the embedding loss."""
        if disable_lora:
            if task != "causal_lm":
                raise NotImplementedError(f"forward_only(disable_lora=True, task={task!r}): a reference is log-probs")
            return ModelResult(result=BASE_MODEL_REFERENCE)
        return ModelResult(result=self.proxy.forward_only(inputs, self.adapter_name, task=task).result())

    def clip_grad_and_step(
        self, max_grad_norm: float = 1.0, norm_type: int = 2, *, gradient_accumulation_steps: int | None = None
    ) -> ModelResult:
        _check_norm(norm_type)
        self._stepped = True
        step = self.proxy.clip_grad_and_step(
            max_grad_norm, self.adapter_name, gradient_accumulation_steps=gradient_accumulation_steps
        )
        return ModelResult(result=step.result())

    # twinkle-kit's four-call step: our server clips, steps, clears and schedules in one call
    def clip_grad_norm(self, max_grad_norm: float = 1.0, norm_type: int = 2) -> None:
        """Sets the clip for the coming step(); the norm comes back in step()'s result."""
        _check_norm(norm_type)
        self._max_grad_norm = max_grad_norm

    def step(self) -> ModelResult:
        self._stepped = True
        return ModelResult(result=self.proxy.clip_grad_and_step(self._max_grad_norm, self.adapter_name).result())

    def zero_grad(self) -> None:
        if not self._stepped:
            raise NotImplementedError("zero_grad() without step() over HTTP: gradients are cleared by the step")

    def lr_step(self) -> None:
        if not self._stepped:
            raise NotImplementedError("lr_step() without step() over HTTP: the scheduler advances with the step")

    def calculate_metric(self, is_training: bool = True) -> ModelResult:
        return ModelResult(result=dict(self.proxy.calculate_metric(is_training, self.adapter_name).result()))

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(
        self,
        name: str,
        *,
        save_optimizer: bool = False,
        consumed_train_samples: int | None = None,
        is_sampler: bool = False,  # noqa: ARG002 - twinkle-kit's keyword, see the docstring
    ) -> SaveResponse:
        """`is_sampler`: twinkle-kit replaces the previous sampler copy; ours keeps every checkpoint,
        each a path a sampler can read, so nothing needs replacing."""
        path = self.proxy.save(
            name, self.adapter_name, save_optimizer, consumed_train_samples=consumed_train_samples
        ).result()
        local = None
        if self.save_dir is not None:
            from pathlib import Path

            from twinkle.client.download import download_checkpoint

            local = str(Path(self.save_dir) / name)
            download_checkpoint(self.proxy.client, path, local)
        return SaveResponse(twinkle_path=path, checkpoint_dir=local)

    def load(self, name: str, *, load_optimizer: bool = False) -> None:
        """`name`: a checkpoint path (tinker://...); with `load_optimizer` the training state too."""
        if load_optimizer:
            self.resume_from_checkpoint(name)
        else:
            self.proxy.load(str(name), self.adapter_name).result()

    def resume_from_checkpoint(self, name: str, *, resume_only_model: bool = False) -> dict:
        if resume_only_model:
            raise NotImplementedError("resume_only_model over HTTP: use load(path) for the weights alone")
        out = dict(self.proxy.resume_from_checkpoint(str(name), self.adapter_name).result())
        return {**out, "cur_step": out.get("optimizer_steps", 0)}

    def upload_to_hub(
        self,
        checkpoint_dir,
        hub_model_id: str,
        hub_token: str | None = None,
        async_upload: bool = True,  # noqa: ARG002 - twinkle-kit's keyword, see the docstring
    ) -> str:
        """Download the checkpoint here and upload it from this machine (`ms://` unless `hub_model_id`
        names `hf://`): twinkle.client.hub_upload. Returns the hub's URL; `async_upload` changes nothing
        (twinkle-kit waits too)."""
        import tempfile

        from twinkle.client.download import download_checkpoint
        from twinkle.client.hub_upload import upload_folder

        path = getattr(checkpoint_dir, "twinkle_path", checkpoint_dir)
        target = hub_model_id if "://" in hub_model_id else f"ms://{hub_model_id}"
        with tempfile.TemporaryDirectory(prefix="twinkle-upload-") as tmp:
            download_checkpoint(self.proxy.client, str(path), tmp)
            return upload_folder(tmp, target, token=hub_token)

    def __repr__(self) -> str:
        return f"MultiLoraTransformersModel(model_id={self.model_id!r}, base_model={self.base_model!r})"


def _name(obj) -> str:
    return obj if isinstance(obj, str) else getattr(obj, "__name__", None) or type(obj).__name__


def _check_norm(norm_type) -> None:
    if norm_type != 2:
        raise NotImplementedError(f"norm_type={norm_type}: the server clips the L2 norm (norm_type=2)")


__all__ = ["BaseModelReference", "MultiLoraTransformersModel", "TwinkleAPIError"]
