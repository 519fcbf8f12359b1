"""Tinker training and sampling operations: what each submitting endpoint queues, and what it returns.

Ids follow the SDK's expectations: model `{session}:train:{n}`, sampler `{session}:sample:{n}`,
paths `tinker://{model_id}/weights/{name}` and `tinker://{model_id}/sampler_weights/{name}`.
Every lookup is scoped to the caller's tenant; another tenant's object is `NotFound`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from twinkle.serve.adapter_memory import AdapterMemory
from twinkle.serve.backend import AdamParams, LoraSpec, SampleParams, UserError
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.runtime import Runtime
from twinkle.serve.tinker import codec, custom_loss_service, usage

SEGMENT = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
# A response carries (prompt length or num_samples x max_tokens) x k pairs: bound k, and the prompt's table.
MAX_TOPK_LOGPROBS = 256
MAX_TOPK_PROMPT_CELLS = 1 << 22  # len(prompt) x topk_prompt_logprobs: 32 MB of response
MAX_NUM_SAMPLES = 1024
KIND = {v: k for k, v in SEGMENT.items()}


def _adapter_name(model_id: str) -> str:
    # peft adapter names end up in module paths: keep them free of ':' and '.'
    return "m" + hashlib.sha1(model_id.encode()).hexdigest()[:16]


def _sampler_name(key: str) -> str:
    return "s" + hashlib.sha1(key.encode()).hexdigest()[:16]


def parse_path(path: str) -> tuple[str, str, str]:
    """`tinker://{model_id}/{weights|sampler_weights}/{name}` -> (model_id, kind, name)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise BadRequest(f"checkpoint path {path!r} must look like tinker://<model_id>/weights/<name>")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KIND or not parts[2]:
        raise BadRequest(f"checkpoint path {path!r} must look like tinker://<model_id>/weights/<name> "
                         "or tinker://<model_id>/sampler_weights/<name>")
    return parts[0], KIND[parts[1]], parts[2]


class TinkerTraining:
    def __init__(self, rt: Runtime):
        self.rt = rt
        if not hasattr(rt, "adapter_memory"):  # one server-wide account, shared by every route that builds adapters
            rt.adapter_memory = AdapterMemory(rt.config.max_adapter_memory_mb)
        self.memory = rt.adapter_memory

    # ---- sessions ----------------------------------------------------------------------------------
    def create_session(self, tenant: str, body: dict) -> dict:
        session_id = uuid.uuid4().hex[:20]
        self.rt.store.insert("sessions", session_id=session_id, tenant=tenant, created_at=time.time(),
                             last_heartbeat=time.time(), tags=body.get("tags") or [],
                             user_metadata=body.get("user_metadata") or {})
        return {"type": "create_session", "session_id": session_id}

    def session(self, tenant: str, session_id: str) -> dict:
        row = self.rt.store.owned("sessions", "session_id", session_id, tenant)
        if row is None:
            raise NotFound(f"session {session_id!r} not found")
        return row

    def finish_session(self, tenant: str, session_id: str, body: dict) -> None:
        self.session(tenant, session_id)
        reason = (body.get("reason") or {}).get("type", "success")
        self.rt.store.execute("UPDATE sessions SET finished_at=?, finish_reason=? WHERE session_id=?",
                              (time.time(), reason, session_id))
        # Free the session's adapters once their queued work has drained (runs and checkpoints stay).
        # A native model's adapters are the native API's to free (DELETE /twinkle/v1/models/{id}).
        for row in self.rt.store.all("SELECT model_id, base_model, lora FROM models WHERE session_id=?", (session_id,)):
            if not json.loads(row["lora"] or "{}").get("native"):
                self._submit_unload(tenant, row["model_id"], row["base_model"])

    def _submit_unload(self, tenant, model_id, base_model):
        with self.rt.live_lock:
            live = self.rt.live.get(model_id)
        if live is None or base_model not in self.rt.engines:
            return
        engine = self.rt.engines[base_model]
        request_id = self.rt.hub.create(tenant)

        def unload():
            engine.backend.remove_adapter(live[1])
            with self.rt.live_lock:
                self.rt.live.pop(model_id, None)
            self.memory.release(model_id)
            return "json", {"type": "unload_model", "model_id": model_id}

        engine.scheduler.submit(model_id, None, request_id, unload)

    # ---- models ------------------------------------------------------------------------------------
    def _model(self, tenant: str, model_id: str) -> dict:
        row = self.rt.store.owned("models", "model_id", model_id, tenant)
        if row is None:
            raise NotFound(f"model {model_id!r} not found")
        return row

    def _live_adapter(self, model_id: str) -> str:
        with self.rt.live_lock:
            live = self.rt.live.get(model_id)
        if live is None:
            raise UserError(f"model {model_id!r} is not loaded (its session finished or the server restarted); "
                            "resume it with create_training_client_from_state")
        return live[1]

    def _count_live(self, tenant: str) -> int:
        with self.rt.live_lock:
            ids = list(self.rt.live)
        if not ids:
            return 0
        marks = ",".join("?" for _ in ids)
        return self.rt.store.one(f"SELECT COUNT(*) AS n FROM models WHERE tenant=? AND model_id IN ({marks})",
                                 (tenant, *ids))["n"]

    def _new_model(self, tenant, session_id, model_seq_id, base_model, spec: LoraSpec, user_metadata):
        self.session(tenant, session_id)
        engine = self.rt.engine(base_model)
        self.rt.limits.models(tenant, self._count_live(tenant))
        if not isinstance(model_seq_id, int):
            raise BadRequest("model_seq_id must be an integer")
        model_id = f"{session_id}:train:{model_seq_id}"
        if self.rt.store.one("SELECT model_id FROM models WHERE model_id=?", (model_id,)):
            raise BadRequest(f"model {model_id!r} already exists")
        self.memory.reserve(model_id, engine.backend, spec)
        lora = {"rank": spec.rank, "seed": spec.seed, "train_attn": spec.train_attn, "train_mlp": spec.train_mlp,
                "train_unembed": spec.train_unembed}
        self.rt.store.insert("models", model_id=model_id, tenant=tenant, session_id=session_id,
                             base_model=engine.entry.name, lora=lora, created_at=time.time(),
                             last_request_time=time.time(), user_metadata=_str_dict(user_metadata))
        return model_id, engine

    def create_model(self, tenant: str, body: dict) -> dict:
        cfg = body.get("lora_config") or {}
        spec = LoraSpec(rank=int(cfg.get("rank", 32)), seed=cfg.get("seed"),
                        train_attn=bool(cfg.get("train_attn", True)), train_mlp=bool(cfg.get("train_mlp", True)),
                        train_unembed=bool(cfg.get("train_unembed", True)))
        try:
            spec.target_modules()
        except UserError as e:
            raise BadRequest(str(e)) from None
        model_id, engine = self._new_model(tenant, body.get("session_id"), body.get("model_seq_id", 0),
                                           body.get("base_model"), spec, body.get("user_metadata"))
        adapter = _adapter_name(model_id)

        def run():
            engine.backend.create_adapter(adapter, spec)
            with self.rt.live_lock:
                self.rt.live[model_id] = (engine.entry.name, adapter)
            return "json", {"type": "create_model", "model_id": model_id}

        return self._submit(tenant, engine, model_id, 0, run, model_id=model_id)

    def get_info(self, tenant: str, body: dict) -> dict:
        row = self._model(tenant, body.get("model_id"))
        engine = self.rt.engine(row["base_model"])
        lora = json.loads(row["lora"])
        return {"type": "get_info", "model_id": row["model_id"], "is_lora": True, "lora_rank": lora["rank"],
                "model_name": row["base_model"],
                "model_data": {"arch": "qwen3", "model_name": row["base_model"],
                               "tokenizer_id": engine.backend.tokenizer_path}}

    def _submit(self, tenant, engine, queue, seq_id, fn, **extra) -> dict:
        request_id = self.rt.hub.create(tenant)
        engine.scheduler.submit(queue, seq_id, request_id, fn)
        return {"request_id": request_id, **extra}

    def forward_backward(self, tenant: str, body: bytes) -> dict:
        try:
            model_id, seq_id, data, loss_fn, config, forward_only = codec.decode_forward_backward(body)
        except UserError as e:
            raise BadRequest(str(e)) from None
        row = self._model(tenant, model_id)
        self.rt.limits.input_tokens(tenant, sum(len(d.tokens) for d in data))
        engine = self.rt.engine(row["base_model"])
        self.rt.store.touch_model(model_id)
        if loss_fn == "custom":  # a loss uploaded with create_custom_loss, run here: tinker/custom_loss_service.py
            return custom_loss_service.submit(self, tenant, engine, row, seq_id, data, config, forward_only, body)

        def finish(result):
            if isinstance(result, Exception):
                raise result
            usage.record_training(self.rt.store, tenant, row, data)
            return "proto", codec.encode_forward_result(result)

        def run():
            adapter = self._live_adapter(model_id)
            return finish(engine.backend.forward_backward(adapter, data, loss_fn, config, forward_only))

        fuse = None
        with self.rt.live_lock:
            live = self.rt.live.get(model_id)
        if live is not None:  # fusable once the adapter exists (create_model already ran)
            fuse = ((live[1], data, loss_fn, config, forward_only), finish)
        request_id = self.rt.hub.create(tenant)
        engine.scheduler.submit(model_id, seq_id, request_id, run, fuse=fuse)
        return {"request_id": request_id, "model_id": model_id}

    def optim_step(self, tenant: str, body: dict) -> dict:
        model_id = body.get("model_id")
        row = self._model(tenant, model_id)
        engine = self.rt.engine(row["base_model"])
        raw = body.get("adam_params") or {}
        if body.get("optimizer_params") and (body["optimizer_params"].get("type") not in (None, "adam", "adamw")):
            raise BadRequest(f"optimizer {body['optimizer_params'].get('type')!r} is not supported; use AdamParams")
        raw = raw or {k: v for k, v in (body.get("optimizer_params") or {}).items() if k != "type"}
        try:
            params = AdamParams(**{k: float(v) for k, v in raw.items() if v is not None})
        except TypeError as e:
            raise BadRequest(f"bad adam_params: {e}") from None

        def run():
            return "json", {"type": "optim_step", "metrics": engine.backend.optim_step(self._live_adapter(model_id), params)}

        return self._submit(tenant, engine, model_id, body.get("seq_id"), run, model_id=model_id)

    # ---- checkpoints -------------------------------------------------------------------------------
    def _ckpt_dir(self, tenant, model_id, kind, name) -> Path:
        return self.rt.data_dir / "tenants" / tenant / model_id.replace(":", "_") / SEGMENT[kind] / name

    def _write_checkpoint(self, tenant, engine, model_id, kind, name, overwrite, ttl, user_metadata):
        from safetensors.torch import save_file

        from twinkle.sampler import save_adapter_folder

        adapter = self._live_adapter(model_id)
        path = f"tinker://{model_id}/{SEGMENT[kind]}/{name}"
        final = self._ckpt_dir(tenant, model_id, kind, name)
        if final.exists() and not overwrite:
            raise UserError(f"checkpoint {path} already exists (pass overwrite to replace it)")
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
        save_adapter_folder(engine.backend.adapter_tensors(adapter), staging, base_model_path=engine.entry.name)
        if kind == "training":
            save_file(engine.backend.optimizer_tensors(adapter), str(staging / "optimizer.safetensors"))
        row = self._model(tenant, model_id)
        (staging / "twinkle_checkpoint.json").write_text(json.dumps(
            {"base_model": row["base_model"], "lora": json.loads(row["lora"]), "model_id": model_id}))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        size = sum(f.stat().st_size for f in final.iterdir())
        now = time.time()
        self.rt.store.insert("checkpoints", tinker_path=path, tenant=tenant, model_id=model_id, kind=kind, name=name,
                             created_at=now, size_bytes=size, public=0, expires_at=now + ttl if ttl else None,
                             dir=str(final), user_metadata=_str_dict(user_metadata))
        return path

    def _check_name(self, name) -> str:
        # A name becomes one directory under the tenant's folder: no separators, no '.'/'..', no NUL or
        # other control characters (the OS would refuse them mid-write, as a server error).
        if (not isinstance(name, str) or not name or len(name) > 128 or name in (".", "..")
                or any(c in name for c in "/\\") or any(ord(c) < 32 or ord(c) == 127 for c in name)):
            raise BadRequest(f"checkpoint name {name!r} must be 1-128 characters without '/', '\\', control "
                             "characters, and not '.' or '..'")
        return name

    def save_weights(self, tenant: str, body: dict) -> dict:
        model_id = body.get("model_id")
        row = self._model(tenant, model_id)
        engine = self.rt.engine(row["base_model"])
        name = self._check_name(body.get("path") or f"ckpt-{uuid.uuid4().hex[:8]}")

        def run():
            path = self._write_checkpoint(tenant, engine, model_id, "training", name, body.get("overwrite", False),
                                          body.get("ttl_seconds"), body.get("user_metadata"))
            return "json", {"type": "save_weights", "path": path}

        return self._submit(tenant, engine, model_id, body.get("seq_id"), run, model_id=model_id)

    def save_weights_for_sampler(self, tenant: str, body: dict) -> dict:
        model_id = body.get("model_id")
        row = self._model(tenant, model_id)
        engine = self.rt.engine(row["base_model"])
        if body.get("path"):
            name = self._check_name(body["path"])

            def run():
                path = self._write_checkpoint(tenant, engine, model_id, "sampler", name, True,
                                              body.get("ttl_seconds"), body.get("user_metadata"))
                return "json", {"type": "save_weights_for_sampler", "path": path}
        else:
            seq = body.get("sampling_session_seq_id")
            if not isinstance(seq, int):
                raise BadRequest("save_weights_for_sampler needs a path (named) or sampling_session_seq_id (ephemeral)")
            sampler_id = f"{row['session_id']}:sample:{seq}"

            def run():
                engine.backend.install_sampler_from_adapter(_sampler_name(sampler_id), self._live_adapter(model_id))
                self.rt.store.insert("samplers", sampler_id=sampler_id, tenant=tenant, session_id=row["session_id"],
                                     base_model=engine.entry.name, model_path=None, created_at=time.time(),
                                     ephemeral=1)
                return "json", {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

        return self._submit(tenant, engine, model_id, body.get("seq_id"), run, model_id=model_id)

    def readable_checkpoint(self, tenant: str, path: str, kind: str | None = None) -> dict:
        """A checkpoint the tenant may read (its own, or published); NotFound otherwise."""
        _, path_kind, _ = parse_path(path)
        row = self.rt.store.one("SELECT * FROM checkpoints WHERE tinker_path=? AND (tenant=? OR public=1)",
                                (path, tenant))
        if row is not None and row["expires_at"] and row["expires_at"] < time.time():
            row = None
        if row is None or (kind is not None and path_kind != kind):
            raise NotFound(f"checkpoint {path} not found")
        return row

    def load_weights(self, tenant: str, body: dict) -> dict:
        path = body.get("path")
        ckpt = self.readable_checkpoint(tenant, path, "training")
        meta = json.loads((Path(ckpt["dir"]) / "twinkle_checkpoint.json").read_text())
        with_optimizer = bool(body.get("optimizer"))
        if body.get("session_id") is not None:  # create_training_client_from_state(_with_optimizer)
            spec = LoraSpec(**meta["lora"])
            model_id, engine = self._new_model(tenant, body["session_id"], body.get("model_seq_id"),
                                               meta["base_model"], spec, body.get("user_metadata"))
            seq_id, create = 0, True
        else:  # TrainingClient.load_state: into an existing model
            model_id = body.get("model_id")
            engine = self.rt.engine(self._model(tenant, model_id)["base_model"])
            seq_id, create, spec = body.get("seq_id"), False, None

        def run():
            from safetensors.torch import load_file

            from twinkle.sampler import load_adapter_folder

            weights = load_adapter_folder(ckpt["dir"])
            optimizer = load_file(str(Path(ckpt["dir"]) / "optimizer.safetensors")) if with_optimizer else None
            if create:
                adapter = _adapter_name(model_id)
                engine.backend.create_adapter(adapter, spec)
                with self.rt.live_lock:
                    self.rt.live[model_id] = (engine.entry.name, adapter)
            engine.backend.load_adapter_tensors(self._live_adapter(model_id), weights, optimizer)
            return "json", {"type": "load_weights", "path": path, "model_id": model_id}

        return self._submit(tenant, engine, model_id, seq_id, run, model_id=model_id)

    # ---- sampling ----------------------------------------------------------------------------------
    def create_sampling_session(self, tenant: str, body: dict) -> dict:
        session_id = body.get("session_id")
        self.session(tenant, session_id)
        model_path = body.get("model_path")
        if model_path:
            ckpt = self.readable_checkpoint(tenant, model_path)
            base_model = self._model_any(ckpt["model_id"])["base_model"]
        else:
            base_model = self.rt.engine(body.get("base_model")).entry.name
        sampler_id = f"{session_id}:sample:{body.get('sampling_session_seq_id', 0)}"
        self.rt.store.insert("samplers", sampler_id=sampler_id, tenant=tenant, session_id=session_id,
                             base_model=base_model, model_path=model_path, created_at=time.time())
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def _model_any(self, model_id: str) -> dict:
        return self.rt.store.one("SELECT * FROM models WHERE model_id=?", (model_id,))

    def get_sampler(self, tenant: str, sampler_id: str) -> dict:
        row = self.rt.store.owned("samplers", "sampler_id", sampler_id, tenant)
        if row is None:
            raise NotFound(f"sampler {sampler_id!r} not found")
        return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": row["model_path"]}

    def asample(self, tenant: str, body: dict) -> dict:
        sampler_id = body.get("sampling_session_id")
        row = self.rt.store.owned("samplers", "sampler_id", sampler_id, tenant) if sampler_id else None
        if row is None:
            raise NotFound(f"sampler {sampler_id!r} not found")
        engine = self.rt.engine(row["base_model"])
        model_input = body.get("prompt") or {}
        chunks = model_input.get("chunks", []) if isinstance(model_input, dict) else None
        if not isinstance(chunks, list):
            raise BadRequest("prompt must be a ModelInput: {\"chunks\": [...]}")
        prompt = [t for c in chunks for t in _chunk_tokens(c)]
        num_samples = _int(body, "num_samples", 1, lo=1)
        if num_samples > MAX_NUM_SAMPLES:
            raise BadRequest(f"num_samples must be at most {MAX_NUM_SAMPLES}, got {num_samples}")
        self.rt.limits.input_tokens(tenant, len(prompt))
        params, target_layout = _sample_params(body, len(prompt), engine.backend.vocab_size)
        want_prompt_lps = bool(body.get("prompt_logprobs"))
        if row["model_path"]:
            ckpt = self.readable_checkpoint(tenant, row["model_path"])
            adapter, folder = _sampler_name(row["model_path"] + ckpt["dir"]), ckpt["dir"]
        elif row["ephemeral"]:
            adapter, folder = _sampler_name(sampler_id), None
        else:
            adapter, folder = None, None

        def run():
            if folder is not None:
                engine.backend.install_sampler_from_folder(adapter, folder)
            result = engine.backend.sample(adapter, prompt, num_samples, params, want_prompt_lps)
            usage.record_sampling(self.rt.store, tenant, row, prompt, result)
            return "proto", codec.encode_sample_result(result, params.topk_prompt, params.topk_sample, target_layout)

        out = self._submit(tenant, engine, sampler_id, body.get("seq_id"), run)
        seq = body.get("seq_id")  # a clone's seq_ids start at clone * 1e9: its retrieve_futures queue
        self.rt.store.record_sample_request(out["request_id"], tenant, sampler_id, seq // 10**9 if _is_int(seq) else 0)
        out["sample_sequence_ids"] = [uuid.uuid4().hex for _ in range(num_samples)]
        return out

    # ---- external weights (a PEFT adapter folder to download): tinker/external_weights.py serves it ----
    def save_weights_external(self, tenant: str, body: dict) -> dict:
        if body.get("age_encryption_recipients"):
            raise BadRequest("age_encryption_recipients: encrypted exports are not supported by this server")
        model_id = body.get("model_id")
        engine = self.rt.engine(self._model(tenant, model_id)["base_model"])
        name, ttl = self._check_name(body.get("path")), _int(body, "ttl_seconds", None, lo=1)
        seq_id = _int(body, "seq_id", None, lo=0)

        def run():
            path = self._write_checkpoint(tenant, engine, model_id, "external", name, True, ttl, None)
            size = self.rt.store.one("SELECT size_bytes FROM checkpoints WHERE tinker_path=?", (path,))["size_bytes"]
            return "json", {"type": "save_weights_external", "path": path, "size_bytes": size}

        return self._submit(tenant, engine, model_id, seq_id, run, model_id=model_id)

    def copy_checkpoint(self, tenant: str, source: dict, model_id: str, session_id: str, ttl: int | None) -> str:
        """A readable checkpoint copied (files hard-linked: no bytes duplicated) into a new training run
        `model_id` of `session_id`, which holds it and cannot be trained on. -> the copy's tinker path."""
        import os

        origin = self._model_any(source["model_id"])
        self.rt.store.insert("models", model_id=model_id, tenant=tenant, session_id=session_id,
                             base_model=origin["base_model"], lora=json.loads(origin["lora"]), created_at=time.time(),
                             last_request_time=time.time(), user_metadata={"copied_from": source["tinker_path"]})
        final = self._ckpt_dir(tenant, model_id, source["kind"], source["name"])
        final.mkdir(parents=True)
        for f in Path(source["dir"]).iterdir():
            os.link(f, final / f.name)
        path = f"tinker://{model_id}/{SEGMENT[source['kind']]}/{source['name']}"
        now = time.time()
        self.rt.store.insert("checkpoints", tinker_path=path, tenant=tenant, model_id=model_id, kind=source["kind"],
                             name=source["name"], created_at=now, size_bytes=source["size_bytes"], public=0,
                             expires_at=now + ttl if ttl else None, dir=str(final), user_metadata=None)
        return path


def _chunk_tokens(chunk: dict) -> list[int]:
    if not isinstance(chunk, dict):
        raise BadRequest(f"prompt chunks must be objects, got {chunk!r}")
    if chunk.get("type", "encoded_text") != "encoded_text":
        raise BadRequest(f"{chunk.get('type')} prompt chunks are not supported by this server (text only)")
    tokens = chunk.get("tokens", [])
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise BadRequest("prompt chunk tokens must be a list of integer token ids")
    return tokens


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(d: dict, name: str, default, *, lo: int | None = None, where: str = ""):
    """d[name] as an int (absent or null: `default`), else a 400 naming the field."""
    v = d.get(name)
    if v is None:
        return default
    if not _is_int(v) or (lo is not None and v < lo):
        raise BadRequest(f"{where}{name} must be an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}")
    return v


def _float(d: dict, name: str, default: float) -> float:
    v = d.get(name, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
        raise BadRequest(f"sampling_params.{name} must be a number, got {v!r}")
    return float(v)


def _sample_params(body: dict, prompt_len: int, vocab_size: int) -> tuple[SampleParams, tuple | None]:
    """The asample body's sampling options, checked (a 400 naming the field) -> (SampleParams, the CSR layout
    of a sparse target_prompt_logprobs, to answer in, or None)."""
    if body.get("record_stability_info") not in (None, False):  # refused, never silently ignored
        raise BadRequest("record_stability_info (stable_reinforce provenance) is not supported by this server; "
                         "sample without it and train with importance_sampling")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    stop = sp.get("stop")
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if (not isinstance(items, list) or not all(isinstance(s, str) and s or _is_int(s) and s >= 0 for s in items)
                or not (all(isinstance(s, str) for s in items) or all(_is_int(s) for s in items))):
            raise BadRequest("sampling_params.stop must be a string, a list of non-empty strings, or a list of "
                             f"token ids >= 0, got {stop!r}")
        stop = items
    top_k = _int(sp, "top_k", -1, lo=-1, where="sampling_params.")
    temperature, top_p = _float(sp, "temperature", 1.0), _float(sp, "top_p", 1.0)
    if temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    topk_prompt = _int(body, "topk_prompt_logprobs", 0, lo=0)
    topk_sample = _int(body, "topk_sample_logprobs", 0, lo=0)
    for name, k in (("topk_prompt_logprobs", topk_prompt), ("topk_sample_logprobs", topk_sample)):
        if k > min(vocab_size, MAX_TOPK_LOGPROBS):
            raise BadRequest(f"{name} must be at most {min(vocab_size, MAX_TOPK_LOGPROBS)}, got {k}")
    if prompt_len * topk_prompt > MAX_TOPK_PROMPT_CELLS:
        raise BadRequest(f"topk_prompt_logprobs {topk_prompt} x prompt length {prompt_len} exceeds "
                         f"{MAX_TOPK_PROMPT_CELLS} cells")
    alt_k = _int(body, "prompt_alt_tokens_k", 0, lo=0)
    if prompt_len * alt_k > MAX_TOPK_PROMPT_CELLS:
        raise BadRequest(f"prompt_alt_tokens_k {alt_k} x prompt length {prompt_len} exceeds {MAX_TOPK_PROMPT_CELLS}")
    targets = layout = None
    if body.get("target_prompt_logprobs") is not None:
        try:
            targets, layout = codec.decode_target_ids(body["target_prompt_logprobs"], prompt_len, vocab_size,
                                                      MAX_TOPK_PROMPT_CELLS)
        except UserError as e:
            raise BadRequest(str(e)) from None
    last_n = _int(body, "prompt_logprobs_last_n", None, lo=1)
    if last_n is not None:
        if not body.get("prompt_logprobs"):
            raise BadRequest("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
        if last_n > prompt_len - 1:
            raise BadRequest(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {prompt_len - 1}, "
                             f"got {last_n}")
    return SampleParams(max_tokens=_int(sp, "max_tokens", None, lo=1, where="sampling_params."),
                        temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=_int(sp, "seed", None, where="sampling_params."), stop=stop,
                        topk_prompt=topk_prompt, topk_sample=topk_sample, prompt_logprobs_last_n=last_n,
                        target_prompt_ids=targets, prompt_alt_tokens_k=alt_k), layout


def _str_dict(d) -> dict:
    return {str(k): str(v) for k, v in (d or {}).items()}
