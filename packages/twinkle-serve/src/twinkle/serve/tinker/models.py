"""Tinker sessions and training models: create, describe, forward_backward (fused), optim_step, finish.

Ids follow the SDK's expectations: model `{session}:train:{n}`. A run's adapter is named from its
model id (peft adapter names end up in module paths: no ':' or '.').
"""

from __future__ import annotations

import functools
import hashlib

from twinkle.serve.backend import AdamParams, LoraSpec, UserError
from twinkle.serve.core import bounds
from twinkle.serve.core.passes import Pass, submit_pass
from twinkle.serve.core.records import Run
from twinkle.serve.core.service import Service
from twinkle.serve.core.work import StoredAnswer
from twinkle.serve.errors import BadRequest
from twinkle.serve.tinker import bodies as b
from twinkle.serve.tinker import codec, custom_loss_service, datums, images, model_names
from twinkle.serve.tinker.program_loss import PROGRAM_LOSS, tinker_metrics
from twinkle.serve.tinker.provenance import Provenance


def adapter_name(model_id: str) -> str:
    return "m" + hashlib.sha1(model_id.encode()).hexdigest()[:16]


def spec_of(run: Run) -> LoraSpec:
    return LoraSpec(**{k: run.lora[k] for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed")})


class TinkerModels:
    def __init__(self, svc: Service):
        self.svc, self.rt = svc, svc.rt
        self.provenance = Provenance(svc)
        self.custom_losses = custom_loss_service.Programs(svc)
        self.caps = svc.rt.config.caps

    # ---- sessions ------------------------------------------------------------------------------
    def create_session(self, tenant: str, body: b.CreateSessionBody) -> dict:
        session = self.svc.create_session(tenant, body.tags, body.user_metadata)
        return {"type": "create_session", "session_id": session.session_id}

    def heartbeat(self, tenant: str, body: b.SessionRef) -> dict:
        self.rt.store.sessions.heartbeat(self.svc.session(tenant, body.session_id).session_id)
        return {"type": "session_heartbeat"}

    def finish_session(self, tenant: str, session_id: str, body: b.FinishSessionBody) -> None:
        self.svc.session(tenant, session_id)
        self.rt.store.sessions.finish(session_id, (body.reason or b.FinishReasonBody()).type)
        self.rt.store.stability.drop_session(session_id)  # its recorded sequences can no longer be trained on
        # Free the session's adapters once their queued work has drained (runs and checkpoints stay).
        # A native run's adapters are the native API's to free (DELETE /twinkle/v1/models/{id}).
        for run in self.rt.store.runs.of_session(session_id):
            if run.api == "tinker" and self.rt.live.get(run.model_id) is not None:
                self.svc.unload(
                    tenant,
                    run,
                    [adapter_name(run.model_id)],
                    lambda run=run: {"type": "unload_model", "model_id": run.model_id},
                )

    # ---- models --------------------------------------------------------------------------------
    def new_run(self, tenant: str, session_id, model_seq_id, base_model, spec: LoraSpec, user_metadata):
        """A run's record and its adapter-memory reservation (its adapter is built on the worker)."""
        session_id = self.svc.session(tenant, session_id).session_id
        engine = model_names.engine(self.rt, base_model)  # `<base>:peft:<context>` names too
        self.svc.admit_run(tenant)
        self.svc.admit_adapter(tenant)
        if not isinstance(model_seq_id, int):
            raise BadRequest("model_seq_id must be an integer")
        model_id = f"{session_id}:train:{model_seq_id}"
        if self.rt.store.runs.get(model_id) is not None:  # before reserving memory for it
            raise BadRequest(f"model {model_id!r} already exists")
        self.rt.adapter_memory.reserve(adapter_name(model_id), engine.backend, spec)
        try:
            return self._record_run(tenant, session_id, model_id, engine, spec, user_metadata), engine
        except BaseException:
            self.rt.adapter_memory.release(adapter_name(model_id))  # a refused run holds no memory
            raise

    def _record_run(self, tenant, session_id, model_id, engine, spec: LoraSpec, user_metadata) -> Run:
        lora = {
            "rank": spec.rank,
            "seed": spec.seed,
            "train_attn": spec.train_attn,
            "train_mlp": spec.train_mlp,
            "train_unembed": spec.train_unembed,
        }
        metadata = {str(k): str(v) for k, v in (user_metadata or {}).items()}
        return self.svc.create_run(tenant, session_id, model_id, engine, "tinker", lora, metadata)

    def forget_run(self, run: Run, engine) -> None:
        """A creation that failed midway leaves nothing: no adapter, no reservation, no live entry, no run."""
        adapter = adapter_name(run.model_id)
        if engine.backend.adapter_rank(adapter) is not None:
            engine.backend.remove_adapter(adapter)
        self.rt.adapter_memory.release(adapter)
        self.rt.live.pop(run.model_id)
        self.rt.store.runs.forget(run.model_id)

    def build_adapter(self, run: Run, engine, spec: LoraSpec) -> str:
        adapter = adapter_name(run.model_id)
        engine.backend.create_adapter(adapter, spec)
        self.svc.set_live(run.model_id, engine, adapter)
        return adapter

    def create_model(self, tenant: str, body: b.CreateModelBody) -> dict:
        cfg = body.lora_config or b.LoraConfigBody()
        backend = model_names.engine(self.rt, body.base_model).backend  # `<base>:peft:<n>` too
        spec = LoraSpec(
            rank=bounds.lora_rank("lora_config.rank", cfg.rank, backend, self.caps),
            seed=cfg.seed,
            train_attn=cfg.train_attn,
            train_mlp=cfg.train_mlp,
            train_unembed=cfg.train_unembed,
        )
        try:
            spec.roles()
        except UserError as e:
            raise BadRequest(str(e)) from None
        run, engine = self.new_run(
            tenant, body.session_id, body.model_seq_id, body.base_model, spec, body.user_metadata
        )

        def work():
            try:
                self.build_adapter(run, engine, spec)
            except BaseException:
                self.forget_run(run, engine)
                raise
            return StoredAnswer.json({"type": "create_model", "model_id": run.model_id})

        return {"request_id": self.svc.submit(tenant, engine, run.model_id, 0, work), "model_id": run.model_id}

    def get_info(self, tenant: str, body: b.ModelRef) -> dict:
        run = self.svc.run(tenant, body.model_id)
        engine = self.rt.engine(run.base_model)
        return {
            "type": "get_info",
            "model_id": run.model_id,
            "is_lora": True,
            "lora_rank": run.lora.get("rank"),
            "model_name": run.base_model,
            "base_dtype": engine.backend.base_dtype(),  # an extra field: the SDK's response models allow them
            "model_data": {
                "arch": model_names.arch(engine),  # the config's model_type
                "model_name": run.base_model,
                "tokenizer_id": engine.backend.tokenizer_path,
            },
        }

    def forward_backward(self, tenant: str, body: bytes) -> dict:
        try:
            req = codec.decode_forward_backward(body)
        except UserError as e:
            raise BadRequest(str(e)) from None
        model_id, loss_fn, forward_only = req.model_id, req.loss_fn, req.forward_only
        run = self.svc.run(tenant, model_id)
        backend = self.rt.engine(run.base_model).backend
        data = images.expand_datums(req.data, backend, run.base_model, self.caps)
        loss, extra = None, {}
        if loss_fn == "custom":  # a loss uploaded with create_custom_loss, run inside the pass: tinker/program_loss.py
            program = self.custom_losses.get(tenant, run.session_id, req.loss_config.get("loss_id"))
            data, loss = custom_loss_service.prepare(program, data)
        elif loss_fn == "stable_reinforce":  # the sampler's log-probs, from the records the spans name
            data, extra = self.provenance.resolve(tenant, run, data, req.provenance)
        # Checked and shifted once, here; a bad request still fails its own future, in its seq_id place.
        try:
            item = datums.training_pass("", data, loss_fn, req.loss_config, forward_only, backend, loss)
        except UserError as e:
            item = e

        def encode(outcome: dict) -> StoredAnswer:
            result = datums.forward_result(outcome, data)
            if loss is not None:
                result.metrics = tinker_metrics(result.metrics, forward_only)
            result.metrics.update(extra)
            return StoredAnswer.proto(codec.encode_forward_result(result))

        # loss_tokens: what loss:sum sums over (cross_entropy's weights), so the dashboard shows it per token
        weighted = loss_fn == "cross_entropy"
        counted = sum(
            float(d.inputs["weights"].sum()) if weighted and "weights" in d.inputs else len(d.tokens) for d in data
        )
        adapter = functools.partial(self.svc.live_adapter, model_id)
        tokens = sum(len(d.tokens) for d in data)
        p = Pass(item, adapter, tokens, encode, "tinker", counted, PROGRAM_LOSS if loss is not None else None)
        return {"request_id": submit_pass(self.svc, tenant, run, req.seq_id, p), "model_id": model_id}

    def optim_step(self, tenant: str, body: b.OptimStepBody) -> dict:
        run = self.svc.run(tenant, body.model_id)
        engine = self.rt.engine(run.base_model)
        other = body.optimizer_params
        if other is not None and other.type not in (None, "adam", "adamw"):
            raise BadRequest(f"optimizer {other.type!r} is not supported; use AdamParams")
        # the fields sent (the rest keep AdamParams' defaults), an unknown one refused by name
        raw = body.adam_params.model_dump(exclude_unset=True) if body.adam_params is not None else {}
        raw = raw or ((other.model_extra or {}) if other is not None else {})
        params = AdamParams(**bounds.adam_params("adam_params", raw))

        def work():
            stepped = engine.backend.optim_step(self.svc.live_adapter(run.model_id), params)
            metrics = {"grad_norm:mean": stepped["grad_norm"]}  # Tinker's name for the norm before clipping
            self.svc.record_step(run, {"grad_norm": stepped["grad_norm"], "lr": params.learning_rate}, same_step=True)
            return StoredAnswer.json({"type": "optim_step", "metrics": metrics})

        request_id = self.svc.submit(tenant, engine, run.model_id, body.seq_id, work)
        return {"request_id": request_id, "model_id": run.model_id}
