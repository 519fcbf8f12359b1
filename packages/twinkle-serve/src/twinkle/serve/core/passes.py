"""One way to submit a forward(_backward) pass, whichever API sent it.

A facade translates its request into a `Pass` (the engine's rows, or the input error that refuses
them; the tokens its wire counts; how its wire answers an outcome) and calls `submit_pass`, which
does the rest once for every API: the per-request budget (`cost.py`) and the tenant's token rate and
quota, the future in the run's `seq_id` order, the job the scheduler may fuse with other runs'
passes, and, once the pass has run, the usage and throughput counts and the run's curve point.

A pass whose input was refused still takes its place in the run's order and fails its own future
there, as a pipelining client expects. An outcome that is an exception is raised as it is: a
`UserError` fails the future as the tenant's, anything else as the server's, logged with its
traceback (`scheduler.py`).

A training pass's curve point is at the run's next step (`Service.record_step`: its last loss
point's step + 1), for every API alike; a pass whose loss is not finite records none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

from twinkle.serve.backend import RowsPass, UserError
from twinkle.serve.core import cost
from twinkle.serve.core.records import Run
from twinkle.serve.core.service import Service
from twinkle.serve.core.work import PassJob, StoredAnswer


@dataclass(frozen=True)
class Pass:
    """A facade's forward(_backward), translated from its wire format."""

    item: RowsPass | UserError  # the engine's pass (its adapter named at run time), or why its input is refused
    adapter: Callable[[], str]  # the run's engine adapter; UserError while it has none (its creation still queued)
    tokens: int  # the request's input tokens as its API counts them: the rate, quota, usage and throughput
    encode: Callable[[dict], StoredAnswer]  # a pass's outcome as its API answers it (a UserError refuses it after all)
    api: str  # the facade's name (the operator page counts fused requests per API)
    loss_tokens: float | None = None  # what a summed loss sums over (the dashboard's per-token loss); None: a mean
    loss_metric: str | None = None  # the outcome metric the API reports as the loss; None: the loss the pass trained


def submit_pass(svc: Service, tenant: str, run: Run, seq_id: int | None, p: Pass) -> str:
    """Admit and queue `p` on the run's base model; the future's id."""
    engine = svc.rt.engine(run.base_model)
    item = p.item
    if isinstance(item, RowsPass):  # valid rows over the per-request budget: a 400, before they are queued
        lengths = [len(r["input_ids"]) for r in item.rows]
        cost.admit(cost.training(lengths), svc.rt.config.caps.max_request_tokens, "training")
    hold = svc.admit_tokens(tenant, p.tokens)
    svc.store.runs.touch(run.model_id)

    def finish(outcome) -> StoredAnswer:
        if isinstance(outcome, Exception):
            raise outcome
        answer = p.encode(outcome)
        svc.rt.throughput.count_tokens(p.tokens)
        svc.count_training(run, p.tokens)  # usage, as the Tinker billing routes report it
        if isinstance(item, RowsPass) and not item.forward_only and outcome.get("finite"):
            loss = outcome["metrics"][p.loss_metric] if p.loss_metric else outcome["loss"]
            point = {"loss": loss, "loss_tokens": p.loss_tokens, "mfu": outcome.get("mfu"), "tokens": p.tokens}
            svc.record_step(run, point)
        return answer

    def work() -> StoredAnswer:
        if not isinstance(item, RowsPass):
            raise item
        (outcome,) = engine.backend.forward_backward_many([replace(item, adapter=p.adapter())])
        return finish(outcome)

    job = None
    # with its adapter there now the pass may run fused with other runs'; without (its creation is
    # queued before it) it runs on its own, once the adapter exists
    with contextlib.suppress(UserError):
        job = PassJob(replace(item, adapter=p.adapter()), finish, p.api) if isinstance(item, RowsPass) else None
    return svc.submit(tenant, engine, run.model_id, seq_id, work, job, hold)
