"""Per-tenant vision weights in the fused multi-LoRA engine (``train_vision``).

The language model's LoRA layers route rows of ``[B, T, D]`` activations to tenants, but the vision
tower runs once over every image of the fused batch, as flat patches. A tenant that trains its
projector or tower (``train_vision=("projector",)`` / ``("tower",)``, full-parameter) therefore gets
its own copy of just those modules' parameters, sharing every other vision weight with the base; the
model's vision tower is replaced by `TenantVision`, which splits the batch's images by segment (each
tenant's images are contiguous, in segment order, as the fused batch concatenates them) and runs each
slice through the base tower with its tenant's parameters swapped in (`torch.func.functional_call`),
or the frozen base as it is. Copies are kept out of the module tree, so the base's parameter list, and
every other tenant, never see them.
"""

from __future__ import annotations

import copy

import torch

from twinkle.model import vision


class TenantVision(torch.nn.Module):
    def __init__(self, base: torch.nn.Module):
        super().__init__()
        self.base = base
        self.__dict__["copies"] = {}  # tenant -> {tower-relative name: its own parameter} (unregistered)
        self.__dict__["segments"] = None  # [(tenant, images)] of the pass in flight

    def __getattr__(self, name):  # dtype, spatial_merge_size...: the base tower's
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def route(self, segments: list[tuple[str | None, int]] | None) -> None:
        """Which tenant's images the next pass holds, in order: [(tenant, images)]; None when done."""
        self.__dict__["segments"] = segments

    def forward(self, pixel_values, grid_thw, **kwargs):
        segments = self.segments
        if not segments or not any(t in self.copies for t, n in segments if n):
            return self.base(pixel_values, grid_thw=grid_thw, **kwargs)
        patches = grid_thw.prod(-1).tolist()
        outs, image, patch = [], 0, 0
        for tenant, n in segments:
            if not n:
                continue
            count = int(sum(patches[image : image + n]))
            args, kw = (pixel_values[patch : patch + count],), {"grid_thw": grid_thw[image : image + n], **kwargs}
            own = self.copies.get(tenant)
            outs.append(self.base(*args, **kw) if own is None else torch.func.functional_call(self.base, own, args, kw))
            image, patch = image + n, patch + count
        first = outs[0]
        return type(first)(
            **{k: torch.cat([getattr(o, k) for o in outs]) for k, v in first.items() if isinstance(v, torch.Tensor)}
        )


def tenant_copy(tower: torch.nn.Module, relative_names: list[str]) -> dict[str, torch.nn.Parameter]:
    """Fresh trainable copies of the tower's modules at `relative_names`, as the parameter overrides
    `torch.func.functional_call` runs the tower with: {name relative to the tower: parameter}."""
    params = {}
    for rel in relative_names:
        fresh = copy.deepcopy(tower.get_submodule(rel))
        fresh.requires_grad_(True)
        params.update({f"{rel}.{n}": p for n, p in fresh.named_parameters()})
    return params


def install(model, tenant: str, train_vision) -> list[tuple[str, torch.nn.Parameter]]:
    """Give `tenant` its trainable vision copies; returns them as (full module path, parameter)."""
    names = vision.vision_module_names(model, train_vision)
    if not names:
        return []
    tower_name = next(n for n, m in model.named_modules() if n.split(".")[-1] + "." in vision.VISION_PREFIXES)
    holder = model.get_submodule(tower_name.rpartition(".")[0]) if "." in tower_name else model
    attr = tower_name.rpartition(".")[2]
    tv = getattr(holder, attr)
    if not isinstance(tv, TenantVision):
        tv = TenantVision(tv)
        setattr(holder, attr, tv)
    outside = [n for n in names if not n.startswith(tower_name + ".")]
    if outside:
        raise ValueError(
            f"train_vision: {outside[0]} lies outside the vision tower; the fused engine copies only its parts"
        )
    params = tenant_copy(tv.base, [n[len(tower_name) + 1 :] for n in names])
    tv.copies[tenant] = params
    return [(f"{tower_name}.{n}", p) for n, p in params.items()]


def tenant_vision(model) -> TenantVision | None:
    return next((m for m in model.modules() if isinstance(m, TenantVision)), None)


def remove(model, tenant: str) -> None:
    tv = tenant_vision(model)
    if tv is not None:
        tv.copies.pop(tenant, None)
