"""The operations both APIs share: sessions, training runs, the live adapter of a run, queued work.

The Tinker and native layers translate their wire formats into these calls; neither holds state of
its own about sessions or runs. Every lookup takes the caller's tenant: another tenant's object is
`NotFound`, like one that does not exist.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from twinkle.client.schema import bounds as B
from twinkle.serve.backend import UserError
from twinkle.serve.core import bounds
from twinkle.serve.core.checkpoints import CheckpointOps
from twinkle.serve.core.inflight import InflightTargets
from twinkle.serve.core.records import Api, LiveAdapter, Run, SamplingSession, Session
from twinkle.serve.core.scheduler import Place
from twinkle.serve.core.usage import UsageLedger
from twinkle.serve.core.work import Call, PassJob, StoredAnswer
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.limits import Hold, LimitExceeded
from twinkle.serve.runtime import Engine, ServerRuntime

# A session not heard from for this long is no longer live (the SDK heartbeats every 10 s): the live-session
# cap counts only live ones, and the Tinker session listing no longer reports it as running.
LIVE_SESSION_S = 60.0


class Service:
    def __init__(self, rt: ServerRuntime):
        self.rt, self.store = rt, rt.store
        self.checkpoints = CheckpointOps(rt)
        self.usage = UsageLedger(rt.store)
        self.inflight = InflightTargets()  # each training model's inflight sampling target (in memory)
        rt.store.curves.max_points = rt.config.caps.max_curve_points

    # ---- sessions ------------------------------------------------------------------------------
    def create_session(self, tenant: str, tags: list | None = None, user_metadata: dict | None = None) -> Session:
        self.rt.limits.created(tenant, "sessions")  # 429 past the key's sessions_per_minute
        now = time.time()
        cap = self.rt.limits.of(tenant).max_live_sessions
        if cap is not None and self.store.sessions.live(tenant, now - LIVE_SESSION_S) >= cap:
            raise LimitExceeded(
                f"this key has {cap} live sessions (limits.max_live_sessions): finish one (ServiceClient "
                f"close, POST /sessions/<id>/finish) or let an idle one lapse ({LIVE_SESSION_S:.0f} s without a heartbeat)",
                LIVE_SESSION_S,
            )
        session = Session(
            uuid.uuid4().hex[:20], tenant, now, now, tags=list(tags or []), user_metadata=dict(user_metadata or {})
        )
        self.store.sessions.create(session)
        return session

    def session(self, tenant: str, session_id) -> Session:
        session = self.store.sessions.owned(session_id, tenant)
        if session is None:
            raise NotFound(f"session {session_id!r} not found")
        return session

    # ---- training runs -------------------------------------------------------------------------
    def run(self, tenant: str, model_id, api: Api | None = None) -> Run:
        run = self.store.runs.owned(model_id, tenant)
        if run is None or (api is not None and run.api != api):
            raise NotFound(f"model {model_id!r} not found")
        return run

    def admit_run(self, tenant: str) -> None:
        """429 when the tenant already holds its limit of live runs."""
        self.rt.limits.models(tenant, self.store.runs.count_owned(tenant, self.rt.live.run_ids()))

    def create_run(
        self,
        tenant: str,
        session_id: str,
        model_id: str,
        engine: Engine,
        api: Api,
        lora: dict,
        user_metadata: dict | None = None,
    ) -> Run:
        if self.store.runs.get(model_id) is not None:
            raise BadRequest(f"model {model_id!r} already exists")
        now = time.time()
        run = Run(model_id, tenant, session_id, engine.entry.name, api, lora, now, now, dict(user_metadata or {}))
        self.store.runs.create(run)
        return run

    def live_adapter(self, model_id: str) -> str:
        """The run's adapter name on its backend (on the worker thread: after its queued creation)."""
        live = self.rt.live.get(model_id)
        if live is None:
            raise UserError(
                f"model {model_id!r} is not loaded (its session finished or the server restarted); "
                "resume it from a checkpoint"
            )
        return live.adapter

    def set_live(self, model_id: str, engine: Engine, adapter: str, name: str = "") -> None:
        """The run holds `adapter` on `engine`'s backend, as its adapter `name` (a native run's; a
        Tinker run's one adapter is unnamed)."""
        self.rt.live.put(model_id, LiveAdapter(engine.entry.name, adapter), name)

    def record_step(self, run: Run, metrics: dict, same_step: bool = False) -> int:
        """Add a training step's numbers to the run's curves (both APIs' runs show on the dashboard)."""
        # the last loss point's step, not a count of points: a long curve is thinned (caps.max_curve_points)
        last = self.store.curves.last(run.model_id, "loss")
        step = (last["step"] if last else 0) + (0 if same_step else 1)
        self.store.curves.add(run.model_id, run.tenant, step, metrics)
        return step

    # ---- usage (per API key and run; the Tinker billing routes, the CLI and dashboard report it) --
    def count_training(self, run: Run, tokens: int) -> None:
        """Model input tokens of a forward or forward_backward that succeeded, in either API."""
        self.usage.count_training(run, tokens)

    def count_sampling(self, sampler: SamplingSession, prompt_tokens: int, sampled_tokens: int) -> None:
        self.usage.count_sampling(sampler, prompt_tokens, sampled_tokens)

    def admit_tokens(self, tenant: str, tokens: int) -> Hold | None:
        """429 past the key's tokens_per_day quota or its per-request cap; over its rate of input
        tokens/s, the Hold its work waits for in the queue (429 only past max_queue_wait_s)."""
        self.usage.check_tokens(tenant, tokens)
        return self.rt.limits.input_tokens(tenant, tokens)

    def admit_adapter(self, tenant: str) -> None:
        """409 when the key already holds its quota of live adapters (a native run may hold several)."""
        live = 0
        for model_id in self.rt.live.run_ids():
            run = self.store.runs.owned(model_id, tenant)
            if run is not None:
                live += len(run.lora.get("adapters") or [None])
        self.usage.check_adapters(tenant, live)
        self.rt.limits.created(tenant, "adapters")  # 429 past the key's adapters_per_minute

    def admit_save(self, tenant: str) -> None:
        """409 when the key's checkpoints already fill its storage_bytes quota."""
        self.usage.check_storage(tenant)
        self.rt.limits.created(tenant, "checkpoints")  # 429 past the key's checkpoints_per_minute

    def admit_sampler(self, tenant: str) -> None:
        """429 past the key's samplers_per_minute (Tinker sampling sessions, named or ephemeral)."""
        self.rt.limits.created(tenant, "samplers")

    # ---- queued work ---------------------------------------------------------------------------
    def submit(
        self,
        tenant: str,
        engine: Engine,
        queue: str,
        seq_id: int | None,
        fn: Callable[[], StoredAnswer],
        job: PassJob | None = None,
        hold: Hold | None = None,
        sliced: bool = False,
    ) -> str:
        """Queue `fn` (or its fusable pass `job`) on the base model's scheduler, not to start before
        `hold` (admit_tokens'); `sliced`: work that may run long (sampling), run in turns between
        other work (core/slices.py). The future's id."""
        if seq_id is not None:  # ordered by the scheduler and stored in SQLite: a signed 64-bit integer
            bounds.check(B.SEQ_ID, "seq_id", seq_id)
        request_id = self.rt.hub.create(tenant)
        engine.scheduler.submit(Call(queue, seq_id, request_id, fn, job, hold, sliced))
        return request_id

    def cancel(self, tenant: str, request_id: str) -> str:
        """Cancel the tenant's request (Tinker cancel_future, the native API's cancel, a stream whose
        reader left): "cancelled" if it had not started (its future fails now) or runs in slices (it
        stops at its next step, a decode step or a micro-batch, and its future fails saying how far
        it got); "running" if it runs whole and will finish; "finished" if it is done."""
        future = self.store.futures.get(request_id, tenant)
        if future is None:
            raise NotFound(f"future {request_id!r} not found")
        for engine in self.rt.engines.values():
            outcome = engine.scheduler.cancel(request_id)
            if outcome == "dropped":
                self.rt.hub.fail(request_id, "cancelled by the client before it ran", "user")
            if outcome is not None:
                return "running" if outcome == "running" else "cancelled"
        return "finished" if future.status != "pending" else "running"

    def where(self, request_id: str) -> Place:
        """Where a pending request is on the workers; on none of them it is finishing (its pass has
        run and its result is being stored)."""
        for engine in self.rt.engines.values():
            if (place := engine.scheduler.where(request_id)) is not None:
                return place
        return Place("active", "finishing", 0, 0.0)

    def unload(self, tenant: str, run: Run, adapters: list[str], finish: Callable[[], dict]) -> str | None:
        """Free a run's adapters (and their memory reservations) once its queued work has run."""
        if run.base_model not in self.rt.engines:
            return None
        engine = self.rt.engines[run.base_model]

        def work():
            for adapter in adapters:
                engine.backend.remove_adapter(adapter)
                self.rt.adapter_memory.release(adapter)
            self.rt.live.pop(run.model_id)
            self.inflight.close(engine.backend, run.model_id)
            return StoredAnswer.json(finish())

        return self.submit(tenant, engine, run.model_id, None, work)
