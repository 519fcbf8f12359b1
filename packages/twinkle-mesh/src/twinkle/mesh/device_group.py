"""DeviceGroup: a named set of devices a component (model, sampler, ...) runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICE_TYPES = ("cpu", "cuda")
# Other spellings of the same devices (twinkle-kit writes 'GPU' and 'CPU'); anything else is refused.
DEVICE_ALIASES = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}
# How a ray-mode group's ranks spread over the cluster's nodes: as few nodes as fit ("pack"), or one
# rank per node ("spread": Ray's STRICT_SPREAD; a group cannot then be larger than the cluster).
PLACEMENTS = ("pack", "spread")


@dataclass(frozen=True)
class DeviceGroup:
    """`ranks` is a count (`4`: the next four free devices) or explicit device indices (`[0, 1]`).

    In ray mode every rank becomes one Ray actor holding one device of `device_type`
    (one logical CPU for 'cpu'); in local mode the group only documents the placement.
    """

    name: str
    ranks: int | list[int] | tuple[int, ...]
    device_type: str = "cpu"
    # Extra Ray resources per rank (e.g. {"CPU": 2}), for when one logical device per rank is not enough.
    resources_per_rank: dict[str, float] = field(default_factory=dict)
    placement: str = "pack"
    # twinkle-kit's: devices one worker holds (a tensor-parallel vLLM engine's); here every rank is one
    # actor holding one device, so only 1 is honoured
    gpus_per_worker: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"DeviceGroup name must be a non-empty string, got {self.name!r}")
        device_type = DEVICE_ALIASES.get(str(self.device_type).lower())
        if device_type is None:
            raise ValueError(
                f"DeviceGroup {self.name!r}: device_type {self.device_type!r} is not one of {DEVICE_TYPES} "
                f"(or 'GPU' / 'CPU')"
            )
        object.__setattr__(self, "device_type", device_type)
        if self.gpus_per_worker != 1:
            raise NotImplementedError(
                f"DeviceGroup {self.name!r}: gpus_per_worker={self.gpus_per_worker!r}: every rank is one actor "
                "holding one device (gpus_per_worker=1)"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"DeviceGroup {self.name!r}: placement {self.placement!r} is not one of {PLACEMENTS}")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, (int, list, tuple)):
            raise ValueError(
                f"DeviceGroup {self.name!r}: ranks must be a count or a list of device indices, got {self.ranks!r}"
            )
        if isinstance(self.ranks, int):
            if self.ranks < 1:
                raise ValueError(f"DeviceGroup {self.name!r}: ranks must be >= 1, got {self.ranks}")
        else:
            ranks = list(self.ranks)
            if (
                not ranks
                or len(set(ranks)) != len(ranks)
                or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks)
            ):
                raise ValueError(
                    f"DeviceGroup {self.name!r}: ranks must be distinct non-negative device indices, got {self.ranks!r}"
                )
            object.__setattr__(self, "ranks", tuple(ranks))

    @property
    def world_size(self) -> int:
        return self.ranks if isinstance(self.ranks, int) else len(self.ranks)


def assign_devices(groups: list[DeviceGroup]) -> dict[str, tuple[int, ...]]:
    """Map each group to device indices: explicit lists as given, counts take the next free indices
    of their device type (so `model` with 4 and `sampler` with 4 land on devices 0-3 and 4-7)."""
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"DeviceGroup names must be unique, got {names}")
    taken: dict[str, set[int]] = {t: set() for t in DEVICE_TYPES}
    for g in groups:
        if not isinstance(g.ranks, int):
            taken[g.device_type].update(g.ranks)
    placement: dict[str, tuple[int, ...]] = {}
    next_free = {t: 0 for t in DEVICE_TYPES}
    for g in groups:
        if not isinstance(g.ranks, int):
            placement[g.name] = tuple(g.ranks)
            continue
        devices = []
        while len(devices) < g.ranks:
            i = next_free[g.device_type]
            next_free[g.device_type] += 1
            if i not in taken[g.device_type]:
                devices.append(i)
        taken[g.device_type].update(devices)
        placement[g.name] = tuple(devices)
    return placement
