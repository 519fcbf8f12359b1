"""The scheduler's typed work: a queued `Call`, the fusable `PassJob` it may carry, and the
`StoredAnswer` it ends with.

A facade (Tinker, native, OpenAI) turns its request into a Call and its result into a StoredAnswer (a
content type and the bytes it chose); the core queues, fuses, runs and stores these without reading
a wire format. A Call over its tenant's rate carries a `Hold` (`twinkle.serve.limits`): it waits in
its queue until then, and only it and what its queue holds behind it wait. A `sliced` Call may be
paused between its steps so other work runs (`slices.py`). A PassJob's `shape` is what the planner's cost model (`twinkle.model.multi_lora.
planner`) weighs when it decides which runs' passes share one pass over the base weights.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from twinkle.model.multi_lora.planner import batch_shape
from twinkle.serve.backend import RowsPass
from twinkle.serve.limits import Hold

JSON = "application/json"
PROTO = "application/x-protobuf"


@dataclass(frozen=True)
class StoredAnswer:
    """What a finished call tells its client: stored with its future, sent back as it is."""

    content_type: str
    body: bytes

    @classmethod
    def json(cls, value) -> StoredAnswer:
        return cls(JSON, json.dumps(value).encode())

    @classmethod
    def proto(cls, body: bytes) -> StoredAnswer:
        return cls(PROTO, body)


@dataclass(frozen=True)
class PassJob:
    """A forward(_backward) the engine may run fused with other runs' (at most one per run a pass).
    `finish` gets the engine's outcome for this pass (its result, or the exception that failed it);
    `api`: the facade that queued it (the operator page counts fused requests per API)."""

    item: RowsPass
    finish: Callable[[object], StoredAnswer]
    api: str

    @property
    def kind(self) -> str:
        """The planner's kind: passes of one kind may share a pass (an embedding pass is its own kind)."""
        kind = "forward" if self.item.forward_only else "forward_backward"
        return kind if self.item.task == "causal_lm" else f"{self.item.task}_{kind}"

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, longest row, real tokens) of the pass's batch: what the planner weighs."""
        return batch_shape(self.item.rows)


@dataclass(frozen=True)
class Call:
    """One queued request: `run()` on the worker answers it, unless its `job` runs in a fused pass."""

    queue: str  # the run (or sampler) whose requests run in seq_id order
    seq_id: int | None
    request_id: str
    run: Callable[[], StoredAnswer]
    job: PassJob | None = None
    hold: Hold | None = None  # over the tenant's rate: not before hold.until
    # runs on a thread of its own, in turns the scheduler gives it between other work (core/slices.py):
    # work that may run long (sampling); a pass job over the engine's micro-batch size is sliced anyway
    sliced: bool = False
    queued_at: float = field(default_factory=time.monotonic)

    def due(self, now: float) -> bool:
        return self.hold is None or self.hold.until <= now

    def waited(self, now: float) -> float:
        """How long it has been due and waiting (a held call waits from the end of its hold)."""
        return now - max(self.queued_at, self.hold.until if self.hold is not None else 0.0)

    @property
    def order(self) -> int:
        return self.seq_id if self.seq_id is not None else 2**62
