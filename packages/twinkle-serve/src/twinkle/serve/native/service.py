"""The native Twinkle operations: what each route queues on the base model's scheduler.

A native model is a training run in the same store as Tinker's (`models` row, id
`{session}:train:0`), so runs, checkpoints, limits, futures and the dashboard see both APIs alike.
It holds any number of named LoRA adapters on the shared `MultiLoraModel`; every operation runs on
the scheduler's worker thread in the client's order (`seq`), and completes a future.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import shutil
import tempfile
import threading
import time
from pathlib import Path

from twinkle.client.schema import (AddAdapterRequest, CheckpointRef, CreateModelRequest,
                                   ForwardRequest, ForwardResult, LoadRequest, LogRequest, MetricRequest,
                                   ModelInfo, NamedComponent, SaveRequest, StepRequest, StepResult)
from twinkle.serve.backend import UserError
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.native.curves import Curves
from twinkle.serve.native.lora_init import peft_like_init
from twinkle.serve.runtime import Runtime
from twinkle.serve.tinker.training import TinkerTraining

STATE_FILE = "training_state.pt"


def check_rows(rows: list[dict], vocab_size: int, max_context: int) -> None:
    """Encoded rows a forward may run on: in the vocabulary and context, loss fields finite and aligned."""
    if not rows:
        raise UserError("inputs.rows is empty: forward needs at least one row")
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        if n > max_context:
            raise UserError(f"row {i}: {n} tokens are longer than the model's context of {max_context}")
        bad = [t for t in row["input_ids"] if not 0 <= t < vocab_size]
        bad += [t for t in row.get("labels") or () if t != -100 and not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"row {i}: token {bad[0]} is outside the vocabulary [0, {vocab_size})")
        for key, value in row.items():
            if key == "input_ids":
                continue
            values = value if isinstance(value, list) else [value]
            if key != "labels" and not all(math.isfinite(v) for v in values):
                raise UserError(f"row {i}: {key} contains NaN or inf")
            if isinstance(value, list) and len(value) != n:
                raise UserError(f"row {i}: {key} has {len(value)} values for {n} input_ids (shape mismatch)")


def _internal(model_id: str, adapter: str) -> str:
    return "n" + hashlib.sha1(f"{model_id}/{adapter}".encode()).hexdigest()[:16]


def _user_errors(fn):
    """Library complaints about a request (bad name, kwargs, shapes) are the caller's errors."""
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError, KeyError) as e:
            raise UserError(str(e).strip("'\"")) from None
    return run


class NativeService:
    def __init__(self, rt: Runtime):
        self.rt = rt
        self.tinker = TinkerTraining(rt)  # sessions, checkpoint lookup and layout are shared with Tinker
        self.memory = self.tinker.memory  # the server-wide adapter memory account (max_adapter_memory_mb)
        self.curves = Curves(rt.store)
        self._adapters: dict[str, dict[str, str]] = {}  # model_id -> {adapter name -> engine adapter}
        self._fb_counts: dict[tuple[str, str], int] = {}
        self._seqs: dict[str, itertools.count] = {}
        self._templates: dict[str, object] = {}
        self._lock = threading.Lock()
        self._started_at = time.time()  # adapters of models created before this are gone (kept in memory only)

    # ---- plumbing ------------------------------------------------------------------------------
    def model(self, tenant: str, model_id: str) -> dict:
        row = self.rt.store.owned("models", "model_id", model_id, tenant)
        if row is None or not json.loads(row["lora"] or "{}").get("native"):
            raise NotFound(f"model {model_id!r} not found")
        return row

    def engine_of(self, row: dict):
        engine = self.rt.engine(row["base_model"])
        if not hasattr(engine.backend, "engine"):
            entry = engine.entry
            if entry.remote_group or entry.sampler_remote_group:
                where = (f"runs on the Ray remote group {entry.remote_group!r}" if entry.remote_group else
                         f"samples on the Ray remote group {entry.sampler_remote_group!r}")
                raise BadRequest(f"base model {row['base_model']!r} {where}; the native API trains the "
                                 "'multi_lora' backend in the server process only (no remote_group / "
                                 "sampler_remote_group on the model entry): use the Tinker API (/api/v1) for it")
            raise BadRequest(f"base model {row['base_model']!r} runs the {entry.backend!r} backend; the native "
                             "API needs backend 'multi_lora' (in the server process, without remote groups)")
        return engine

    def submit(self, tenant: str, model_id: str, seq: int | None, fn) -> dict:
        row = self.model(tenant, model_id)
        engine = self.engine_of(row)
        self.rt.store.touch_model(model_id)
        if seq is None:  # no client numbering: arrival order
            seq = next(self._seqs.setdefault(model_id, itertools.count(1 << 40)))
        request_id = self.rt.hub.create(tenant)
        engine.scheduler.submit(model_id, seq, request_id, lambda: ("json", fn(engine.backend.engine, row)))
        return {"request_id": request_id, "model_id": model_id}

    def adapter(self, model_id: str, name: str | None) -> str:
        with self._lock:
            adapters = self._adapters.get(model_id, {})
        if not adapters:
            created = self.rt.store.one("SELECT created_at FROM models WHERE model_id=?", (model_id,))
            if created and created["created_at"] < self._started_at:
                raise UserError(f"model {model_id!r} has no adapter in this server process: the server restarted "
                                "since it was created (or the model was closed); add the adapter again and resume it "
                                "from a checkpoint (resume_from_checkpoint / load)")
            raise UserError(f"model {model_id!r} has no adapter yet; call add_adapter_to_model first")
        if name is None:
            if len(adapters) != 1:
                raise UserError(f"model {model_id!r} has adapters {sorted(adapters)}: pass adapter_name")
            return next(iter(adapters.values()))
        if name not in adapters:
            raise UserError(f"no adapter {name!r} on model {model_id!r}; call add_adapter_to_model first "
                            f"(existing: {sorted(adapters)})")
        return adapters[name]

    def adapter_label(self, model_id: str, internal: str) -> str:
        with self._lock:
            return next(k for k, v in self._adapters.get(model_id, {}).items() if v == internal)

    # ---- models and adapters -------------------------------------------------------------------
    def create_model(self, tenant: str, req: CreateModelRequest) -> ModelInfo:
        engine = self.rt.engine(req.base_model)
        with self.rt.live_lock:
            live = [m for m in self.rt.live]
        self.rt.limits.models(tenant, sum(1 for m in live if self.rt.store.owned("models", "model_id", m, tenant)))
        session_id = self.tinker.create_session(tenant, {"tags": ["native"]})["session_id"]
        model_id = f"{session_id}:train:0"
        self.rt.store.insert("models", model_id=model_id, tenant=tenant, session_id=session_id,
                             base_model=engine.entry.name, created_at=time.time(), last_request_time=time.time(),
                             lora={"native": True, "rank": None, "seed": req.seed, "name": req.name},
                             user_metadata={"name": req.name} if req.name else {})
        return ModelInfo(model_id=model_id, base_model=engine.entry.name, session_id=session_id, name=req.name)

    def _reserve(self, row: dict, internal: str, config) -> None:
        """Count a new adapter against max_adapter_memory_mb before it is built (409 when full)."""
        backend = self.engine_of(row).backend
        _user_errors(self.memory.reserve)(internal, backend, config)

    def _unreserve_unless_built(self, engine, internal: str) -> None:
        if internal not in engine.adapters:  # a duplicate's failure must not free the original's share
            self.memory.release(internal)

    def add_adapter(self, tenant: str, model_id: str, seq, req: AddAdapterRequest) -> dict:
        from peft import LoraConfig

        row = self.model(tenant, model_id)
        seed = json.loads(row["lora"])["seed"]
        config = _user_errors(LoraConfig)(**req.lora_config.model_dump())
        internal = _internal(model_id, req.adapter_name)
        with self._lock:
            if req.adapter_name in self._adapters.get(model_id, {}):
                raise UserError(f"adapter {req.adapter_name!r} already exists on model {model_id!r}")
        self._reserve(row, internal, config)

        @_user_errors
        def run(engine, row):
            if internal in engine.adapters:
                raise UserError(f"adapter {req.adapter_name!r} already exists on model {model_id!r}")
            try:
                engine.add_adapter_to_model(internal, config, req.gradient_accumulation_steps, seed=seed)
            finally:
                self._unreserve_unless_built(engine, internal)
            peft_like_init(engine, internal, seed)
            with self._lock:
                self._adapters.setdefault(model_id, {})[req.adapter_name] = internal
            with self.rt.live_lock:
                self.rt.live.setdefault(model_id, (row["base_model"], internal))
            lora = {"native": True, "rank": config.r, "seed": seed, "name": json.loads(row["lora"]).get("name"),
                    "adapters": sorted(self._adapters[model_id])}
            self.rt.store.execute("UPDATE models SET lora=? WHERE model_id=?", (json.dumps(lora), model_id))
            return {"adapter_name": req.adapter_name, "rank": config.r}

        return self.submit(tenant, model_id, seq, run)

    def configure(self, tenant: str, model_id: str, seq, what: str, req: NamedComponent) -> dict:
        @_user_errors
        def run(engine, row):
            internal = self.adapter(model_id, req.adapter_name)
            state = engine.adapters[internal]
            if what == "loss":
                state.set_loss(req.name, **req.kwargs)
            elif what == "optimizer":
                state.set_optimizer(req.name, **req.kwargs)
            elif what == "lr_scheduler":
                from twinkle.model.optim import resolve_scheduler

                # the local TransformersModel's scheduler classes, so both modes follow one lr schedule
                state.set_scheduler(resolve_scheduler(req.name), **req.kwargs)
            else:
                from twinkle.metric import METRICS

                state.metrics(req.is_training).append(METRICS.create(req.name, **req.kwargs))
            return {"set": what, "name": req.name}

        return self.submit(tenant, model_id, seq, run)

    # ---- compute -------------------------------------------------------------------------------
    def template(self, backend):
        with self._lock:
            if backend.base_model not in self._templates:
                from transformers import AutoTokenizer

                from twinkle.template import Template

                # the operator's trust_remote_code covers a custom tokenizer class too
                trust = self.rt.engines[backend.base_model].entry.trust_remote_code
                tokenizer = AutoTokenizer.from_pretrained(backend.tokenizer_path, trust_remote_code=trust)
                self._templates[backend.base_model] = Template(model_id=backend.tokenizer_path, tokenizer=tokenizer)
            return self._templates[backend.base_model]

    def rows(self, backend, req: ForwardRequest) -> list[dict]:
        inputs = req.inputs
        if (inputs.rows is None) == (inputs.trajectories is None):
            raise UserError("inputs needs exactly one of 'rows' (encoded) or 'trajectories' (chat messages)")
        if inputs.rows is not None:
            return [{"input_ids": r.input_ids, **({"labels": r.labels} if r.labels is not None else {}), **r.fields}
                    for r in inputs.rows]
        template, rows = self.template(backend), []
        for i, traj in enumerate(inputs.trajectories):
            encoded = template.encode({"messages": [m.model_dump(exclude_none=True) for m in traj.messages]})
            if encoded is None:
                raise UserError(f"trajectory {i} is longer than the template's max_length")
            rows.append({"input_ids": encoded["input_ids"], "labels": encoded["labels"], **traj.fields})
        return rows

    def forward(self, tenant: str, model_id: str, seq, req: ForwardRequest, backward: bool) -> dict:
        row = self.model(tenant, model_id)
        backend = self.engine_of(row).backend
        rows = self.rows(backend, req) if req.inputs.rows is not None else None  # encode trajectories later
        if rows is not None:
            self.rt.limits.input_tokens(tenant, sum(len(r["input_ids"]) for r in rows))

        @_user_errors
        def run(engine, row):
            batch = rows if rows is not None else self.rows(backend, req)
            internal = self.adapter(model_id, req.adapter_name)
            check_rows(batch, backend.vocab_size, backend.max_context)  # before any compute: bad input is cheap
            tokens = sum(len(r["input_ids"]) for r in batch)
            if backward:
                out = engine.forward_backward(batch, adapter_name=internal)
                result = ForwardResult(loss=out["loss"], metrics=out.get("metrics", {}))
            else:
                out = engine.forward_fused({internal: batch})[internal]
                result = ForwardResult(loss=out["loss"] if out.get("finite") else None, metrics=out.get("metrics", {}),
                                       logprobs=[[0.0] + lps for lps in out["logprobs"]])
            self.curves.count_tokens(tokens)
            if backward:
                key = (model_id, internal)
                self._fb_counts[key] = step = self._fb_counts.get(key, 0) + 1
                self.curves.add(model_id, tenant, step, {"loss": out["loss"]} if out.get("finite") else {})
            return result.model_dump()

        return self.submit(tenant, model_id, seq, run)

    def clip_grad_and_step(self, tenant: str, model_id: str, seq, req: StepRequest) -> dict:
        @_user_errors
        def run(engine, row):
            internal = self.adapter(model_id, req.adapter_name)
            try:
                out = engine.clip_grad_and_step(adapter_name=internal, max_grad_norm=req.max_grad_norm)
            except RuntimeError as e:  # no gradients: forward_backward was not called
                raise UserError(str(e)) from None
            if out.get("stepped"):
                self.curves.add(model_id, tenant, out["step"], {"grad_norm": out["grad_norm"], "lr": out["lr"]})
            return StepResult(stepped=bool(out.get("stepped")), grad_norm=out.get("grad_norm"), lr=out.get("lr"),
                              step=out.get("step")).model_dump()

        return self.submit(tenant, model_id, seq, run)

    def calculate_metric(self, tenant: str, model_id: str, seq, req: MetricRequest) -> dict:
        @_user_errors
        def run(engine, row):
            internal = self.adapter(model_id, req.adapter_name)
            out = engine.calculate_metric(is_training=req.is_training, adapter_name=internal)
            if req.is_training:
                out["step"] = float(engine.adapters[internal].optimizer_steps)
            return {k: float(v) for k, v in out.items()}

        return self.submit(tenant, model_id, seq, run)

    def log(self, tenant: str, model_id: str, req: LogRequest) -> dict:
        self.model(tenant, model_id)
        step = req.step
        if step is None:
            last = self.rt.store.one("SELECT MAX(step) AS s FROM run_curves WHERE model_id=?", (model_id,))
            step = (last["s"] or 0) if last else 0
        self.curves.add(model_id, tenant, step, req.metrics)
        return {"logged": len(req.metrics), "step": step}

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self, tenant: str, model_id: str, seq, req: SaveRequest) -> dict:
        name = self.tinker._check_name(req.name)

        @_user_errors
        def run(engine, row):
            import torch

            internal = self.adapter(model_id, req.adapter_name)
            final = self.tinker._ckpt_dir(tenant, model_id, "training", name)
            final.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
            engine.save(str(staging), adapter_name=internal)
            state = engine.adapters[internal]
            if req.save_training_state:
                opt = state.ensure_optimizer()
                torch.save({"optimizer": opt.state_dict(),
                            "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
                            "optimizer_steps": state.optimizer_steps, "step_calls": state.micro_step,
                            "fb_count": self._fb_counts.get((model_id, internal), 0)}, staging / STATE_FILE)
            spec = state.spec
            meta = {"base_model": row["base_model"], "model_id": model_id, "native": True,
                    "adapter_name": self.adapter_label(model_id, internal),
                    "lora": {"rank": spec.rank, "seed": None, "train_attn": True, "train_mlp": True,
                             "train_unembed": False}}
            (staging / "twinkle_checkpoint.json").write_text(json.dumps(meta))
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
            path = f"tinker://{model_id}/weights/{name}"
            self.rt.store.insert("checkpoints", tinker_path=path, tenant=tenant, model_id=model_id, kind="training",
                                 name=name, created_at=time.time(),
                                 size_bytes=sum(f.stat().st_size for f in final.iterdir()), public=0,
                                 expires_at=None, dir=str(final), user_metadata={})
            return CheckpointRef(path=path, model_id=model_id).model_dump()

        return self.submit(tenant, model_id, seq, run)

    def load(self, tenant: str, model_id: str, seq, req: LoadRequest) -> dict:
        ckpt = self.tinker.readable_checkpoint(tenant, req.path, "training")
        folder = Path(ckpt["dir"])
        if req.resume and not (folder / STATE_FILE).exists():
            raise BadRequest(f"checkpoint {req.path} was saved without save_training_state: it cannot resume")
        label = req.adapter_name or "default"
        with self._lock:
            new = label not in self._adapters.get(model_id, {})
        if new:  # a new adapter from the folder's own LoraConfig: counted like add_adapter's
            from peft import LoraConfig

            row = self.model(tenant, model_id)
            self._reserve(row, _internal(model_id, label), _user_errors(LoraConfig.from_pretrained)(str(folder)))

        @_user_errors
        def run(engine, row):
            import torch
            from safetensors.torch import load_file

            with self._lock:
                exists = label in self._adapters.get(model_id, {})
            if not exists:  # a new adapter from the folder's own LoraConfig
                internal = _internal(model_id, label)
                try:
                    engine.load(str(folder), internal)
                finally:
                    self._unreserve_unless_built(engine, internal)
                with self._lock:
                    self._adapters.setdefault(model_id, {})[label] = internal
                with self.rt.live_lock:
                    self.rt.live.setdefault(model_id, (row["base_model"], internal))
            internal = self.adapter(model_id, label)
            saved = {k.replace(".default.", "."): v for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
            own = engine.adapter_state_dict(internal)
            if set(saved) != set(own):
                raise UserError(f"checkpoint {req.path} does not fit adapter {label!r} (different targets or rank)")
            with torch.no_grad():
                for key, param in own.items():
                    if saved[key].shape != param.shape:
                        raise UserError(f"checkpoint tensor {key} {tuple(saved[key].shape)} does not fit "
                                        f"{tuple(param.shape)}")
                    param.copy_(saved[key])
            out = {"path": req.path, "adapter_name": label, "resumed": False}
            if req.resume:
                state = engine.adapters[internal]
                blob = torch.load(folder / STATE_FILE, weights_only=True)
                state.ensure_optimizer().load_state_dict(blob["optimizer"])
                if blob["scheduler"] is not None and state.scheduler is not None:
                    state.scheduler.load_state_dict(blob["scheduler"])
                state.optimizer_steps, state.micro_step = blob["optimizer_steps"], blob["step_calls"]
                self._fb_counts[(model_id, internal)] = blob["fb_count"]
                out.update(resumed=True, optimizer_steps=blob["optimizer_steps"])
            return out

        return self.submit(tenant, model_id, seq, run)

    def close(self, tenant: str, model_id: str) -> dict:
        """Free the model's adapters once its queued work has run (the run and its checkpoints stay)."""
        def run(engine, row):
            with self._lock:
                adapters = self._adapters.pop(model_id, {})
            for internal in adapters.values():
                engine.remove_adapter(internal)
                self.memory.release(internal)
            with self.rt.live_lock:
                self.rt.live.pop(model_id, None)
            self.rt.store.execute("UPDATE sessions SET finished_at=?, finish_reason='success' WHERE session_id=?",
                                  (time.time(), row["session_id"]))
            return {"closed": model_id, "adapters": sorted(adapters)}

        return self.submit(tenant, model_id, None, run)
