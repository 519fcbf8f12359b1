"""`TransformersModel` over HTTP: the local class's constructor and method names, each call a Future.

    from twinkle.client import init_twinkle_client
    from twinkle.client.model import TransformersModel
    init_twinkle_client(base_url="http://host:8000", api_key="tml-...")
    model = TransformersModel(model_id="twinkle://qwen3-demo")
    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    model.forward_backward(inputs=batch)        # returns at once; .result() / await waits

It implements the `twinkle.model.TwinkleModel` contract (same arguments, order, defaults and
accumulation rule; a test compares the signatures), each result wrapped in a Future. What cannot
cross HTTP is refused by name: `forward` / `backward` (an autograd graph; use forward_only /
forward_backward)
and `save(data_position=...)` (the server counts the data position itself).

Calls on one model run on the server in the order they were made (they carry a sequence number),
so a loop can issue several before reading any result. Placement arguments of the local class
(`remote_group`, `device_mesh`, `strategy`, ...) are accepted and ignored: the server places the model.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import PurePosixPath

from twinkle.client.future import Future
from twinkle.client.http import TwinkleClient
from twinkle.client.inputs import LocalEncoder, to_inputs
from twinkle.client.schema import (
    AddAdapterRequest,
    AddMetricRequest,
    CheckpointRef,
    CreateModelRequest,
    ForwardRequest,
    LoadRequest,
    LogRequest,
    LoraConfigModel,
    MetricRequest,
    ModelInfo,
    NamedComponent,
    SaveRequest,
    StepRequest,
)
from twinkle.client.session import get_client


def lora_config_dict(config) -> dict:
    """A peft.LoraConfig (only what differs from peft's defaults, plus the core fields), a dict, or a
    LoraConfigModel, as the wire's LoraConfigModel."""
    if isinstance(config, LoraConfigModel):
        return config.model_dump()
    if isinstance(config, dict):
        return LoraConfigModel.model_validate(config).model_dump()
    if hasattr(config, "to_dict"):

        def plain(v):
            return sorted(v) if isinstance(v, (set, frozenset)) else v

        ours, defaults = config.to_dict(), type(config)().to_dict()
        core = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "bias")
        out = {k: plain(ours[k]) for k in core if k in ours}
        out.update(
            {
                k: plain(v)
                for k, v in ours.items()
                if k not in core
                and k not in ("peft_type", "task_type", "base_model_name_or_path", "revision", "auto_mapping")
                and v != defaults.get(k)
            }
        )
        return LoraConfigModel.model_validate(out).model_dump()
    raise TypeError(f"expected a peft.LoraConfig, a dict or LoraConfigModel, got {type(config).__name__}")


def _name(obj) -> str:
    return obj if isinstance(obj, str) else getattr(obj, "__name__", None) or type(obj).__name__


class TransformersModel:
    def __init__(
        self,
        model_id: str | None = None,
        *,
        client: TwinkleClient | None = None,
        name: str | None = None,
        seed: int = 42,
        encode: str = "auto",
        **placement,
    ):
        self.client = client or get_client()
        info = ModelInfo.model_validate(
            self.client.post("/models", CreateModelRequest(base_model=model_id, name=name, seed=seed).model_dump())
        )
        self.model_id = info.model_id
        self.base_model: str | None = info.base_model  # None on a proxy from attach()
        self._encoder = LocalEncoder(info.base_model, encode)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    @classmethod
    def attach(cls, model_id: str, client: TwinkleClient | None = None) -> TransformersModel:
        """A proxy for an existing model of this tenant (e.g. after the client process restarted)."""
        self = cls.__new__(cls)
        self.client = client or get_client()
        self.model_id, self.base_model = model_id, None
        self._encoder, self._seq, self._lock = LocalEncoder("", "server"), itertools.count(1 << 20), threading.Lock()
        return self

    def set_encoder_template(self, template) -> None:
        """Encode chats on this machine with `template` (a twinkle.template.Template) from now on."""
        self._encoder = LocalEncoder(self.base_model or "", "local", template)

    def _call(self, op: str, body, parse=None) -> Future:
        with self._lock:  # the sequence number and the submission in one order
            ref = self.client.post(f"/models/{self.model_id}/{op}", body.model_dump(), seq=next(self._seq))
        return Future(self.client, ref, parse)

    # ---- configuration -------------------------------------------------------------------------
    def add_adapter_to_model(self, adapter_name: str, config, gradient_accumulation_steps: int = 1) -> Future:
        return self._call(
            "add_adapter_to_model",
            AddAdapterRequest(
                adapter_name=adapter_name,
                lora_config=lora_config_dict(config),
                gradient_accumulation_steps=gradient_accumulation_steps,
            ),
        )

    def set_loss(self, loss, adapter_name: str | None = None, **kwargs) -> Future:
        return self._call("set_loss", NamedComponent(adapter_name=adapter_name, name=_name(loss), kwargs=kwargs))

    def set_optimizer(self, optimizer_cls="AdamW", adapter_name: str | None = None, **kwargs) -> Future:
        return self._call(
            "set_optimizer", NamedComponent(adapter_name=adapter_name, name=_name(optimizer_cls), kwargs=kwargs)
        )

    def set_lr_scheduler(self, scheduler_cls, adapter_name: str | None = None, **kwargs) -> Future:
        return self._call(
            "set_lr_scheduler", NamedComponent(adapter_name=adapter_name, name=_name(scheduler_cls), kwargs=kwargs)
        )

    def add_metric(self, metric, is_training: bool = True, adapter_name: str | None = None, **kwargs) -> Future:
        return self._call(
            "add_metric",
            AddMetricRequest(adapter_name=adapter_name, name=_name(metric), is_training=is_training, kwargs=kwargs),
        )

    # ---- compute -------------------------------------------------------------------------------
    def _forward(self, op: str, inputs, adapter_name, task: str) -> Future:
        body = ForwardRequest(adapter_name=adapter_name, inputs=to_inputs(inputs, self._encoder), task=task)
        return self._call(
            op,
            body,
            parse=lambda r: {
                "loss": r["loss"],
                **r["metrics"],
                **{k: r[k] for k in ("logprobs", "embeddings") if r.get(k)},
            },
        )

    def forward_backward(self, inputs, adapter_name: str | None = None, *, task: str = "causal_lm") -> Future:
        """Forward, loss and backward; result {'loss', ...loss metrics}. `task='embedding'`: the rows are
        embedded (twinkle-kit's rows: one-number `labels`, 1 on each group's anchor) for an embedding
        loss such as InfonceLoss."""
        return self._forward("forward_backward", inputs, adapter_name, task)

    def forward_only(self, inputs, adapter_name: str | None = None, *, task: str = "causal_lm") -> Future:
        """No-gradient forward; result {'loss', 'logprobs': per row, aligned with labels}, or with
        `task='embedding'` {'loss', 'embeddings': per row, unit length}."""
        return self._forward("forward_only", inputs, adapter_name, task)

    def forward(self, inputs, adapter_name: str | None = None):
        raise NotImplementedError(
            "TransformersModel over HTTP cannot return an autograd graph: use forward_only "
            "for log-probs, or forward_backward with set_loss for training"
        )

    def backward(self, loss, adapter_name: str | None = None):
        raise NotImplementedError(
            "TransformersModel over HTTP cannot back-propagate a local loss: use forward_backward with set_loss"
        )

    def clip_grad_and_step(
        self,
        max_grad_norm: float | None = 1.0,
        adapter_name: str | None = None,
        *,
        gradient_accumulation_steps: int | None = None,
    ) -> Future:
        """`gradient_accumulation_steps`: the adapter's window is that many micro-batches from this call on
        (as TransformersModel's); shrinking a window that has begun fails the request by name."""
        req = StepRequest(
            adapter_name=adapter_name,
            max_grad_norm=max_grad_norm,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        return self._call("clip_grad_and_step", req)

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> Future:
        return self._call("calculate_metric", MetricRequest(adapter_name=adapter_name, is_training=is_training))

    # ---- checkpoints and curves ----------------------------------------------------------------
    def save(
        self,
        path,
        adapter_name: str | None = None,
        save_training_state: bool = False,
        data_position: int | None = None,
        *,
        consumed_train_samples: int | None = None,
    ) -> Future:
        """Saved on the server under the last component of `path`; result: its tinker:// path
        (`twinkle download PATH` fetches the PEFT folder). `consumed_train_samples` (the client's data
        position in samples) is kept with the training state and returned by resume_from_checkpoint."""
        if data_position is not None:
            raise NotImplementedError(
                "TransformersModel over HTTP cannot take save(data_position=...): the server "
                "records the forward_backward calls it ran; resume returns that position"
            )
        name = PurePosixPath(str(path)).name
        return self._call(
            "save",
            SaveRequest(
                adapter_name=adapter_name,
                name=name,
                save_training_state=save_training_state,
                consumed_train_samples=consumed_train_samples,
            ),
            parse=lambda r: CheckpointRef.model_validate(r).path,
        )

    def load(self, path: str, adapter_name: str | None = None) -> Future:
        return self._call("load", LoadRequest(adapter_name=adapter_name, path=path))

    def resume_from_checkpoint(self, path: str, adapter_name: str | None = None) -> Future:
        return self._call("resume_from_checkpoint", LoadRequest(adapter_name=adapter_name, path=path, resume=True))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> dict:
        """Put client-side numbers (e.g. the reward of an RL step) on this run's dashboard curves."""
        return self.client.post(f"/models/{self.model_id}/log", LogRequest(step=step, metrics=metrics).model_dump())

    def close(self) -> Future:
        return Future(self.client, self.client.request("DELETE", f"/models/{self.model_id}"))

    def __repr__(self) -> str:
        return f"TransformersModel(model_id={self.model_id!r}, base_model={self.base_model!r}, via {self.client!r})"


MultiLoraModel = TransformersModel  # the server's engine is multi-LoRA either way
