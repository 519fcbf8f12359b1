"""Native compute: forward / forward_backward (fused with every other tenant's, native or Tinker, on the
base model's scheduler), clip_grad_and_step, metrics, and client-logged curve points."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import TypeVar

from twinkle.client.schema import ForwardRequest, ForwardResult, LogRequest, MetricRequest, StepRequest
from twinkle.model.embedding_pass import EMBEDDING, task_inputs
from twinkle.serve.backend import RowsPass, UserError
from twinkle.serve.backend.images import IMAGE_KEYS, check_encoded, refuse_image_fields, resolve_chats
from twinkle.serve.core.curve_names import CurveNames
from twinkle.serve.core.passes import Pass, submit_pass
from twinkle.serve.core.work import StoredAnswer
from twinkle.serve.native.models import NativeModels

T = TypeVar("T")


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
            if key in ("input_ids", *IMAGE_KEYS):  # image columns come from the server's own encoding
                continue
            values = value if isinstance(value, list) else [value]
            if key != "labels" and not all(math.isfinite(v) for v in values):
                raise UserError(f"row {i}: {key} contains NaN or inf")
            if isinstance(value, list) and len(value) != n:
                raise UserError(f"row {i}: {key} has {len(value)} values for {n} input_ids (shape mismatch)")


def task_of(req: ForwardRequest) -> str:
    """The request's task, or a 400 naming the one asked for and those offered."""
    from twinkle.model.kit import check_task

    try:
        check_task(req.task)
    except NotImplementedError as e:
        raise UserError(str(e)) from None
    return req.task


def user_rows(convert: Callable[[], list[dict]]) -> list[dict]:
    """Rows a library function converts; what it refuses in them is the tenant's error."""
    try:
        return convert()
    except ValueError as e:
        raise UserError(str(e)) from None


def encoded_chat(encode: Callable[[dict], T], messages: list[dict], where: str) -> T:
    """The chat template's encoding of a client's chat; what the template refuses in it is a 400 naming it."""
    from twinkle.dataset.errors import DataError  # loaded with the template already

    try:
        return encode({"messages": messages})
    except DataError as e:
        raise UserError(f"{where}: {e}") from None


class NativeCompute:
    def __init__(self, models: NativeModels):
        self.models, self.svc, self.rt = models, models.svc, models.rt
        self.curve_names = CurveNames(self.rt.store.curves, self.rt.config.caps)  # what `log` may name
        self._templates: dict[str, object] = {}
        self._lock = threading.Lock()

    def template(self, backend):
        with self._lock:
            if backend.base_model not in self._templates:
                from twinkle.template import Template

                self._templates[backend.base_model] = Template(
                    model_id=backend.tokenizer_path, tokenizer=backend.tokenizer
                )
            return self._templates[backend.base_model]

    def resolve(self, backend, chats, where: str) -> list[list[dict]]:
        """The chats' messages with their images decoded (twinkle.serve.backend.images: bytes only, bounded)."""
        messages = [[m.model_dump(exclude_none=True) for m in chat] for chat in chats]
        return resolve_chats(messages, backend, self.rt.config.caps, [f"{where} {i}" for i in range(len(chats))])

    def chat_prompts(self, backend, chats) -> list[tuple[list[int], dict | None]]:
        """Each chat's prompt ids (ending with the assistant's header) and its images' pixels, or None."""
        import numpy as np

        out = []
        for i, messages in enumerate(self.resolve(backend, chats, "chat")):
            encoded = encoded_chat(self.template(backend).encode_prompt, messages, f"chat {i}")
            if "pixel_values" not in encoded:
                out.append((encoded["input_ids"], None))
                continue
            check_encoded(messages, encoded, backend, f"chat {i}")
            images = {
                "pixel_values": np.asarray(encoded["pixel_values"], np.float32),
                "image_grid_thw": np.asarray(encoded["image_grid_thw"], np.int64),
            }
            out.append((encoded["input_ids"], images))
        return out

    def rows(self, backend, req: ForwardRequest) -> list[dict]:
        inputs = req.inputs
        if (inputs.rows is None) == (inputs.trajectories is None):
            raise UserError("inputs needs exactly one of 'rows' (encoded) or 'trajectories' (chat messages)")
        for i, r in enumerate(inputs.rows or inputs.trajectories or ()):
            refuse_image_fields(r.fields, f"{'row' if inputs.rows is not None else 'trajectory'} {i}")
        if inputs.rows is not None:
            return [
                {"input_ids": r.input_ids, **({"labels": r.labels} if r.labels is not None else {}), **r.fields}
                for r in inputs.rows
            ]
        template, rows = self.template(backend), []
        assert inputs.trajectories is not None  # exactly one of the two, checked above
        chats = self.resolve(backend, [t.messages for t in inputs.trajectories], "trajectory")
        for i, (traj, messages) in enumerate(zip(inputs.trajectories, chats)):
            encoded = encoded_chat(template.encode, messages, f"trajectory {i}")
            if encoded is None:
                raise UserError(f"trajectory {i} is longer than the template's max_length")
            check_encoded(messages, encoded, backend, f"trajectory {i}")
            images = {k: encoded[k] for k in IMAGE_KEYS if k in encoded}
            rows.append({"input_ids": encoded["input_ids"], "labels": encoded["labels"], **images, **traj.fields})
        return rows

    def forward(self, tenant: str, model_id: str, seq, req: ForwardRequest, backward: bool) -> dict:
        run = self.models.model(tenant, model_id)
        backend = self.rt.engine(run.base_model).backend
        embedding = task_of(req) == EMBEDDING  # a task not offered is a 400 here, before anything is queued
        try:  # checked before any compute, but answered on the future, like every request's outcome
            rows = self.rows(backend, req)
            if embedding:  # twinkle-kit's one-number labels become the rows' group marks
                rows = user_rows(lambda: task_inputs(EMBEDDING, rows))
            check_rows(rows, backend.vocab_size, backend.max_context)
            item: RowsPass | UserError = RowsPass("", rows, not backward, task=req.task)
        except UserError as e:
            rows, item = [], e

        def encode(out: dict) -> StoredAnswer:  # a forward's non-finite loss is None; it returns the log-probs
            loss = out["loss"] if backward or out.get("finite") else None
            logprobs = None if backward or embedding else [[0.0, *lps] for lps in out["logprobs"]]
            embeddings = out["embeddings"] if embedding and not backward else None
            result = ForwardResult(loss=loss, metrics=out.get("metrics", {}), logprobs=logprobs, embeddings=embeddings)
            return StoredAnswer.json(result.model_dump(exclude=set() if embedding else {"embeddings"}))

        tokens = sum(len(r["input_ids"]) for r in rows)
        adapter = functools.partial(self.models.adapter, model_id, req.adapter_name)
        request_id = submit_pass(
            self.svc, tenant, run, self.models.seq(model_id, seq), Pass(item, adapter, tokens, encode, "native")
        )
        return {"request_id": request_id, "model_id": model_id}

    def clip_grad_and_step(self, tenant: str, model_id: str, seq, req: StepRequest) -> dict:
        from twinkle.client.schema import StepResult

        def work(backend, run):
            internal = self.models.adapter(model_id, req.adapter_name)
            out = backend.clip_grad_and_step(
                internal, req.max_grad_norm, gradient_accumulation_steps=req.gradient_accumulation_steps
            )
            if out.get("stepped"):
                self.rt.store.curves.add(
                    model_id, tenant, out["step"], {"grad_norm": out["grad_norm"], "lr": out["lr"]}
                )
            return StepResult(
                stepped=bool(out.get("stepped")), grad_norm=out.get("grad_norm"), lr=out.get("lr"), step=out.get("step")
            ).model_dump()

        return self.models.submit(tenant, model_id, seq, work)

    def calculate_metric(self, tenant: str, model_id: str, seq, req: MetricRequest) -> dict:
        def work(backend, run):
            internal = self.models.adapter(model_id, req.adapter_name)
            return backend.calculate_metric(internal, req.is_training)

        return self.models.submit(tenant, model_id, seq, work)

    def log(self, tenant: str, model_id: str, req: LogRequest) -> dict:
        self.models.model(tenant, model_id)
        self.curve_names.admit(model_id, req.metrics)
        step = req.step if req.step is not None else self.rt.store.curves.max_step(model_id)
        self.rt.store.curves.add(model_id, tenant, step, req.metrics)
        return {"logged": len(req.metrics), "step": step}
