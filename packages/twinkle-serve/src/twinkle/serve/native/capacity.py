"""`GET /twinkle/v1/capacity`: how many adapters of a given rank and targets fit now, adapters per
residency tier (live, parked in host memory, spilled to disk), the cap and the bytes counted
against it, and the swap counters (twinkle.serve.core.adapter_memory)."""

from __future__ import annotations

from fastapi import Depends, Query
from pydantic import BaseModel

from twinkle.serve.backend import LoraSpec, UserError
from twinkle.serve.errors import BadRequest


class AdapterTiers(BaseModel):
    live: int
    parked: int
    spilled: int


class Capacity(BaseModel):
    base_model: str
    rank: int
    target_modules: list[str]
    adapter_bytes: int | None  # what one adapter like this counts against the cap (None: not estimable here)
    fit_now: int | None  # adapters like this that fit beside the live ones without parking any (None: no cap)
    fit_max: int | None  # live at once with every other adapter parked (offload), else fit_now
    cap_bytes: int | None  # max_adapter_memory_mb in bytes (None: no cap)
    used_bytes: int  # counted against the cap: the live adapters (offload) or all reserved ones
    offload: bool  # adapter_offload: idle and least recently used adapters leave the model
    adapters: AdapterTiers  # over the base models this server manages
    swaps: dict[str, float]  # parked, spilled, restored, restored_from_disk counts; park_s, spill_s, restore_s


def add_capacity_route(r, rt, tenant) -> None:
    @r.get("/capacity", response_model=Capacity, summary="Adapters that fit now, per tier, and the swap cost")
    def capacity(
        rank: int = Query(32, ge=1),
        train_attn: bool = True,
        train_mlp: bool = True,
        train_unembed: bool = True,
        base_model: str | None = None,
        t: str = Depends(tenant),
    ):
        rt.require_ready()
        engine = rt.engine(base_model)
        spec = LoraSpec(rank=rank, train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed)
        try:
            base = engine.backend.base_module  # None where the model lives on remote ranks
            targets = spec.target_modules(base) if base is not None else list(spec.roles())
        except UserError as e:
            raise BadRequest(str(e)) from None
        report = rt.adapter_memory.report(engine.backend, spec)
        return Capacity(base_model=engine.entry.name, rank=rank, target_modules=targets, **report)
