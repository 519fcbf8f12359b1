"""Native training models and their named LoRA adapters, over the shared service core.

A native model is a training run in the same store as Tinker's (`api='native'`, id
`{session}:train:0`), so runs, checkpoints, limits, futures and the dashboard see both APIs alike.
It holds any number of named LoRA adapters on the base model's backend (through the typed `Backend`
operations, so in this process or on a Ray remote group alike), registered under their names in the
core's one registry of live adapters (`core/live.py`, where a Tinker run's one adapter is too); every
operation runs on the scheduler's worker thread in the client's order (`seq`), and completes a future.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time

from twinkle.client.schema import AddAdapterRequest, CreateModelRequest, ModelInfo, NamedComponent
from twinkle.serve.backend import UserError
from twinkle.serve.core import bounds, lora_configs
from twinkle.serve.core.records import Run
from twinkle.serve.core.service import Service
from twinkle.serve.core.work import StoredAnswer
from twinkle.serve.errors import BadRequest


def internal_name(model_id: str, adapter: str) -> str:
    return "n" + hashlib.sha1(f"{model_id}/{adapter}".encode()).hexdigest()[:16]


def _scheduler_kwargs(name: str, kwargs: dict) -> None:
    """The library's own scheduler-argument check, at the call: a 400 naming the argument, not a failed
    step later (StepLR's step_size 0 divides by zero at the next step)."""
    from twinkle.model.optim import SchedulerArgumentError, check_scheduler_args, resolve_scheduler

    try:
        factory = resolve_scheduler(name)
    except ValueError:
        return  # an unknown name: the worker's answer lists the registered ones
    try:
        check_scheduler_args(factory, kwargs)
    except SchedulerArgumentError as e:
        raise BadRequest(f"kwargs.{e.field}: {e}") from None


class NativeModels:
    def __init__(self, svc: Service):
        self.svc, self.rt = svc, svc.rt
        self._seqs: dict[str, itertools.count] = {}
        self._lock = threading.Lock()
        self._started_at = time.time()  # adapters of models created before this are gone (kept in memory only)

    # ---- plumbing ------------------------------------------------------------------------------
    def model(self, tenant: str, model_id) -> Run:
        return self.svc.run(tenant, model_id, api="native")

    def engine_of(self, run: Run):
        return self.rt.engine(run.base_model)

    def submit(self, tenant: str, model_id: str, seq: int | None, fn) -> dict:
        """Queue `fn(backend, run)` (the base model's Backend and the run) on the model's queue; a
        FutureRef. (A forward pass goes through `core.passes.submit_pass` instead.)"""
        run = self.model(tenant, model_id)
        engine = self.engine_of(run)
        self.rt.store.runs.touch(model_id)
        request_id = self.svc.submit(
            tenant, engine, model_id, self.seq(model_id, seq), lambda: StoredAnswer.json(fn(engine.backend, run))
        )
        return {"request_id": request_id, "model_id": model_id}

    def seq(self, model_id: str, seq: int | None) -> int:
        """The request's place in its model's order: the client's number, or arrival order without one."""
        if seq is not None:
            return seq
        with self._lock:
            return next(self._seqs.setdefault(model_id, itertools.count(1 << 40)))

    def adapters(self, model_id: str) -> dict[str, str]:
        """The model's adapters: the client's name -> the engine's (core's registry, `rt.live`)."""
        return {label: live.adapter for label, live in self.rt.live.named(model_id).items()}

    def adapter(self, model_id: str, name: str | None) -> str:
        adapters = self.adapters(model_id)
        if not adapters:
            run = self.rt.store.runs.get(model_id)
            if run and run.created_at < self._started_at:
                raise UserError(
                    f"model {model_id!r} has no adapter in this server process: the server restarted "
                    "since it was created (or the model was closed); add the adapter again and resume it "
                    "from a checkpoint (resume_from_checkpoint / load)"
                )
            raise UserError(f"model {model_id!r} has no adapter yet; call add_adapter_to_model first")
        if name is None:
            if len(adapters) != 1:
                raise UserError(f"model {model_id!r} has adapters {sorted(adapters)}: pass adapter_name")
            return next(iter(adapters.values()))
        if name not in adapters:
            raise UserError(
                f"no adapter {name!r} on model {model_id!r}; call add_adapter_to_model first "
                f"(existing: {sorted(adapters)})"
            )
        return adapters[name]

    def label(self, model_id: str, internal: str) -> str:
        return next(k for k, v in self.adapters(model_id).items() if v == internal)

    def has(self, model_id: str, label: str) -> bool:
        return label in self.adapters(model_id)

    def register(self, run: Run, rank: int, label: str, internal: str) -> None:
        self.svc.set_live(run.model_id, self.rt.engine(run.base_model), internal, label)
        lora = {**run.lora, "rank": rank, "adapters": sorted(self.adapters(run.model_id))}
        self.rt.store.runs.set_lora(run.model_id, lora)

    def reserve(self, run: Run, internal: str, config, where: str) -> None:
        """Count a new adapter against max_adapter_memory_mb before it is built (409 when full); `where`
        names the LoraConfig for a 400 when its target_modules select nothing of the base model."""
        try:
            self.rt.adapter_memory.reserve(internal, self.engine_of(run).backend, config)
        except ValueError as e:  # the estimate matches the config's modules as the engine will
            raise UserError(f"{where}: {e}") from None

    def forget_adapter(self, backend, run: Run, label: str, internal: str) -> None:
        if backend.adapter_rank(internal) is not None:
            backend.remove_adapter(internal)
        self.rt.adapter_memory.release(internal)
        if self.adapters(run.model_id).get(label) == internal:  # the run stays live on the adapters it still has
            self.rt.live.remove(run.model_id, label)

    # ---- models and adapters -------------------------------------------------------------------
    def create_model(self, tenant: str, req: CreateModelRequest) -> ModelInfo:
        engine = self.rt.engine(req.base_model)
        self.svc.admit_run(tenant)
        session = self.svc.create_session(tenant, ["native"])
        run = self.svc.create_run(
            tenant,
            session.session_id,
            f"{session.session_id}:train:0",
            engine,
            "native",
            {"rank": None, "seed": req.seed, "name": req.name},
            {"name": req.name} if req.name else {},
        )
        return ModelInfo(
            model_id=run.model_id, base_model=engine.entry.name, session_id=session.session_id, name=req.name
        )

    def add_adapter(self, tenant: str, model_id: str, seq, req: AddAdapterRequest) -> dict:
        run = self.model(tenant, model_id)
        backend, caps = self.engine_of(run).backend, self.rt.config.caps
        # the one LoraConfig check, as adapter import runs it (twinkle.serve.core.lora_configs)
        config = lora_configs.lora_config("lora_config.", req.lora_config.model_dump(), backend, caps)
        internal = internal_name(model_id, req.adapter_name)
        if self.has(model_id, req.adapter_name):
            raise UserError(f"adapter {req.adapter_name!r} already exists on model {model_id!r}")
        self.svc.admit_adapter(tenant)
        self.reserve(run, internal, config, "lora_config")

        def work(backend, run):
            if backend.adapter_rank(internal) is not None:
                raise UserError(f"adapter {req.adapter_name!r} already exists on model {model_id!r}")
            try:
                rank = backend.add_lora(internal, config, req.gradient_accumulation_steps, run.lora["seed"])
                self.register(run, rank, req.adapter_name, internal)
            except BaseException:  # failed midway: no adapter, reservation or registration is left behind
                self.forget_adapter(backend, run, req.adapter_name, internal)
                raise
            return {"adapter_name": req.adapter_name, "rank": config.r}

        return self.submit(tenant, model_id, seq, work)

    def configure(self, tenant: str, model_id: str, seq, what: str, req: NamedComponent) -> dict:
        bounds.json_depth("kwargs", req.kwargs, self.rt.config.caps)
        if what == "optimizer":
            bounds.optimizer_kwargs(req.kwargs)
        elif what == "lr_scheduler":
            _scheduler_kwargs(req.name, req.kwargs)

        def work(backend, run):
            internal = self.adapter(model_id, req.adapter_name)
            backend.configure_adapter(internal, what, req.name, req.kwargs, getattr(req, "is_training", True))
            return {"set": what, "name": req.name}

        return self.submit(tenant, model_id, seq, work)

    def close(self, tenant: str, model_id: str) -> dict:
        """Free the model's adapters once its queued work has run (the run and its checkpoints stay)."""

        def work(backend, run):
            adapters = self.adapters(model_id)
            for internal in adapters.values():
                backend.remove_adapter(internal)
                self.rt.adapter_memory.release(internal)
            self.rt.live.pop(model_id)
            with self._lock:
                self._seqs.pop(model_id, None)  # a closed model's numbering: nothing per model outlives it
            self.rt.store.sessions.finish(run.session_id, "success")
            return {"closed": model_id, "adapters": sorted(adapters)}

        return self.submit(tenant, model_id, None, work)
