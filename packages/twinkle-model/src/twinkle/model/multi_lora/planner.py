"""Deciding which queued tenant requests share one pass over the base weights.

Fusing pays where a tenant's batch is small: the base GEMMs of a 64-token batch are too thin to
run the matmul units well, and every pass carries fixed per-layer overheads; stacking several
tenants' rows makes one fatter pass. A large batch already fills the GEMMs, so fusing it only adds
padding and a bigger activation footprint: it runs alone. The planner keeps each tenant's own
order (its forward_backward calls and optimizer steps happen as submitted) and puts at most one
request per tenant in a pass.

It answers on sizes and kinds only: a request is its tenant, its kind and its batch's (rows, longest
row, real tokens). Training and forward-only requests never share a group, because they never share
a pass where they run: `MultiLoraModel.forward_backward_fused` and `forward_fused` are two passes (one
keeps activations for backward, one runs under no_grad), and the server's backend, handed both
kinds at once, runs one of each. A group is therefore exactly one pass, and its limits
(`group_max_tokens`, `max_padding`, `max_fuse`) bound that pass. The server's scheduler
(`twinkle.serve.core.scheduler`) asks it which queue heads join a pass; its thresholds are the
server config's `fusion` section.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# an embedding pass (its rows pooled, no vocabulary) is its own kind: it shares a pass only with others of it
KINDS = ("forward_backward", "forward", "embedding_forward_backward", "embedding_forward", "step")


def batch_shape(rows: Sequence[Any]) -> tuple[int, int, int]:
    """(rows, longest row, real tokens) of a list of row dicts with `input_ids`."""
    lengths = [len(r.get("input_ids", ())) if isinstance(r, dict) else 0 for r in rows]
    return len(lengths), max(lengths, default=0), sum(lengths)


@dataclass(eq=False)
class Request:
    """One queued request as the planner sees it. `shape`: (rows, longest row, real tokens) of its
    batch ((0, 0, 0) for a step)."""

    tenant: str
    kind: str = "forward_backward"
    shape: tuple[int, int, int] = (0, 0, 0)
    request_id: Any = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"request kind must be one of {KINDS}, got {self.kind!r}")
        rows, longest, tokens = self.shape
        if min(rows, longest, tokens) < 0 or tokens > rows * longest:
            raise ValueError(
                f"a request's shape is (rows, longest row, real tokens <= rows * longest), got {self.shape}"
            )

    @property
    def padded_tokens(self) -> int:
        rows, length, _ = self.shape
        return rows * length


@dataclass
class Group:
    """Requests of one kind that run as one pass (a step is a group of one)."""

    kind: str
    requests: list[Request]

    @property
    def fused(self) -> bool:
        return len(self.requests) > 1


@dataclass(frozen=True)
class FusionPlanner:
    """fuse_max_tokens: a request whose padded batch (rows × longest row) exceeds this runs alone.
    group_max_tokens: the most padded tokens one fused pass may hold.
    max_padding: the largest fraction of a fused pass that may be padding (tenants' row lengths differ).
    max_fuse: the most requests (tenants) one fused pass may hold."""

    fuse_max_tokens: int = 512
    group_max_tokens: int = 2048
    max_padding: float = 0.25
    max_fuse: int = 8

    def __post_init__(self):
        if self.fuse_max_tokens < 1 or self.group_max_tokens < 1 or self.max_fuse < 1:
            raise ValueError("fuse_max_tokens, group_max_tokens and max_fuse must be positive")
        if not 0.0 <= self.max_padding < 1.0:
            raise ValueError(f"max_padding must be in [0, 1), got {self.max_padding}")

    def _fits(self, group: list[Request], candidate: Request) -> bool:
        if len(group) >= self.max_fuse:
            return False
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
        left: optimizer steps first (cheap), then small requests fused (each kind apart), then large
        ones alone."""
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
            for kind in KINDS[:-1]:
                of_kind = [r for r in heads if r.kind == kind]
                small = [r for r in of_kind if r.padded_tokens <= self.fuse_max_tokens]
                plan += self._pack(kind, small)
                large += [Group(kind, [r]) for r in of_kind if r.padded_tokens > self.fuse_max_tokens]
            plan += large
        return plan
