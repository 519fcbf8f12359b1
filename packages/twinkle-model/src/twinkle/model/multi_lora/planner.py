"""Deciding which queued tenant requests share one pass over the base weights.

Fusing pays where a tenant's batch is small: the base GEMMs of a 64-token batch are too thin to
run the matmul units well, and every pass carries fixed per-layer overheads; stacking several
tenants' rows makes one fatter pass. A large batch already fills the GEMMs, so fusing it only adds
padding and a bigger activation footprint: it runs alone. The planner keeps each tenant's own
order (its forward_backward calls and optimizer steps happen as submitted) and puts at most one
request per tenant in a pass. `execute` runs a plan and yields each request's Completion as soon
as its pass is done, small fused passes first so short requests are not held behind long ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

KINDS = ("forward_backward", "forward", "step")


@dataclass
class Request:
    tenant: str
    kind: str = "forward_backward"
    inputs: Any = None  # rows (or a dict of tensors) for the two pass kinds
    options: dict = field(default_factory=dict)  # for 'step': max_grad_norm
    request_id: Any = None
    # (rows, longest row, real tokens) from a caller that knows them without rows here to measure
    # (the server's typed pass jobs); None: measured from `inputs`
    size: tuple[int, int, int] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"request kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "step" and self.inputs is None:
            raise ValueError(f"a {self.kind!r} request needs inputs")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, longest row, real tokens) of this request's batch."""
        if self.size is not None:
            return self.size
        inputs = self.inputs
        if isinstance(inputs, dict) and hasattr(inputs.get("input_ids"), "shape"):
            rows, length = inputs["input_ids"].shape
            mask = inputs.get("attention_mask")
            return rows, length, int(mask.sum()) if mask is not None else rows * length
        rows = [inputs] if isinstance(inputs, dict) else list(inputs or ())
        lengths = [len(r.get("input_ids", ())) if isinstance(r, dict) else 0 for r in rows]
        return len(rows), max(lengths, default=0), sum(lengths)

    @property
    def padded_tokens(self) -> int:
        rows, length, _ = self.shape
        return rows * length


@dataclass
class Group:
    kind: str
    requests: list[Request]

    @property
    def fused(self) -> bool:
        return len(self.requests) > 1


@dataclass
class Completion:
    request: Request
    result: dict | None = None
    error: Exception | None = None
    fused_with: tuple[str, ...] = ()  # the other tenants that shared this pass

    @property
    def ok(self) -> bool:
        return self.error is None


class FusionPlanner:
    """fuse_max_tokens: a request whose padded batch (rows × longest row) exceeds this runs alone.
    group_max_tokens: the most padded tokens one fused pass may hold.
    max_padding: the largest fraction of a fused pass that may be padding (tenants' row lengths differ)."""

    def __init__(self, fuse_max_tokens: int = 512, group_max_tokens: int = 2048, max_padding: float = 0.25):
        if fuse_max_tokens < 1 or group_max_tokens < 1 or not 0.0 <= max_padding < 1.0:
            raise ValueError("fuse_max_tokens and group_max_tokens must be positive and max_padding in [0, 1)")
        self.fuse_max_tokens, self.group_max_tokens, self.max_padding = fuse_max_tokens, group_max_tokens, max_padding

    def _fits(self, group: list[Request], candidate: Request) -> bool:
        members = [*group, candidate]
        length = max(r.shape[1] for r in members)
        padded = sum(r.shape[0] for r in members) * length
        real = sum(r.shape[2] for r in members)
        return padded <= self.group_max_tokens and (padded - real) <= self.max_padding * padded

    def _pack(self, kind: str, small: list[Request]) -> list[Group]:
        groups: list[list[Request]] = []
        for request in sorted(small, key=lambda r: r.shape[1]):  # similar lengths together: less padding
            for group in groups:
                if self._fits(group, request):
                    group.append(request)
                    break
            else:
                groups.append([request])
        return [Group(kind, g) for g in groups]

    def plan(self, requests: list[Request]) -> list[Group]:
        """Passes in execution order. Each round takes the next request of every tenant with work
        left: optimizer steps first (cheap), then small requests fused, then large ones alone."""
        queues: dict[str, deque[Request]] = {}
        for request in requests:
            if not isinstance(request, Request):
                raise TypeError(f"expected Request objects, got {type(request).__name__}")
            queues.setdefault(request.tenant, deque()).append(request)
        plan: list[Group] = []
        while queues:
            heads = [q.popleft() for q in queues.values()]
            queues = {t: q for t, q in queues.items() if q}
            plan += [Group("step", [r]) for r in heads if r.kind == "step"]
            large = []
            for kind in ("forward_backward", "forward"):
                of_kind = [r for r in heads if r.kind == kind]
                small = [r for r in of_kind if r.padded_tokens <= self.fuse_max_tokens]
                plan += self._pack(kind, small)
                large += [Group(kind, [r]) for r in of_kind if r.padded_tokens > self.fuse_max_tokens]
            plan += large
        return plan


def execute(
    model, requests: list[Request], planner: FusionPlanner, on_result: Callable[[Completion], None] | None = None
) -> Iterator[Completion]:
    """Run the plan on a MultiLoraModel; yield (and hand to on_result) each request's Completion
    as soon as its pass finishes. A failing request fails alone: the others in its pass still run."""
    for group in planner.plan(requests):
        tenants = tuple(r.tenant for r in group.requests)
        if group.kind == "step":
            request = group.requests[0]
            try:
                outcomes = {request.tenant: model.clip_grad_and_step(adapter_name=request.tenant, **request.options)}
            except Exception as error:
                outcomes = {request.tenant: error}
        else:
            run = model.forward_backward_fused if group.kind == "forward_backward" else model.forward_fused
            batches = {r.tenant: r.inputs for r in group.requests}
            try:
                outcomes = run(batches, raise_errors=False)
            except Exception as error:
                outcomes = {t: error for t in tenants}
        for request in group.requests:
            outcome = outcomes[request.tenant]
            completion = Completion(
                request,
                None if isinstance(outcome, Exception) else outcome,
                outcome if isinstance(outcome, Exception) else None,
                tuple(t for t in tenants if t != request.tenant),
            )
            if on_result is not None:
                on_result(completion)
            yield completion
