"""RemoteGroup: a component living as one Ray actor per rank of a DeviceGroup.

The actors are placed in the DeviceGroup's Ray placement group (one bundle per rank; packed, or one
rank per node), form their own torch.distributed world (gloo on CPU, nccl on CUDA) rendezvousing at
rank 0's node, and each runs `twinkle.mesh.initialize(mode='local')` with the component's mesh, so the
component's code is the same code that runs under torchrun.

A rank whose process dies (killed, out of memory, its node lost) fails the call with `WorkerDied`,
naming the rank, node and pid; the group is then unusable until `remote_rebuild()` starts a fresh
set of actors (the state the old ones held is gone: the caller restores it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twinkle.mesh.device_group import DeviceGroup
from twinkle.mesh.device_mesh import DeviceMesh
from twinkle.mesh.dispatch import RemoteError, WorkerDied, collect_results, dispatch_args, method_spec
from twinkle.mesh.runtime import get_runtime, ray_runtime, require_ray

ray = require_ray()
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

PLACEMENT_TIMEOUT_S = float(os.environ.get("TWINKLE_PLACEMENT_TIMEOUT_S", "120"))
ACTOR_SHARE = 0.01  # of a rank's CPU / GPU: up to 100 components per DeviceGroup


class _GroupWorker:
    """One rank. Every method answers ("ok", value) or ("err", type, message, traceback), so the
    driver reports the rank and the real remote traceback rather than Ray's wrapper."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.instance = rank, world_size, None

    def _guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple:
        try:
            return ("ok", fn(*args, **kwargs))
        except BaseException as e:
            return ("err", type(e).__qualname__, str(e), traceback.format_exc())

    def node_info(self) -> dict:
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(
        self, master_addr: str, master_port: int, mesh: DeviceMesh, seed: int, threads: int, cwd: str = ""
    ) -> tuple:
        def run() -> None:
            # A relative path in a call (model.save('last-checkpoint')) means what it means to the
            # driver: its working directory, where the actor's node has it (a local cluster's does).
            if cwd and os.path.isdir(cwd):
                os.chdir(cwd)
            # As many torch threads as the rank reserved CPUs (not whatever OMP_NUM_THREADS the driver
            # had): ranks sharing a machine must not oversubscribe it.
            os.environ["OMP_NUM_THREADS"] = str(threads)
            import torch

            torch.set_num_threads(threads)
            # torchrun's contract, so initialize(mode='local') and the component see a torchrun rank.
            os.environ.update(
                RANK=str(self.rank),
                WORLD_SIZE=str(self.world_size),
                LOCAL_RANK="0",
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port),
            )
            from twinkle.mesh.runtime import initialize

            initialize(mode="local", global_device_mesh=mesh, seed=seed)

        return self._guard(run)

    def construct(self, cls: type, args: tuple, kwargs: dict) -> tuple:
        def run() -> None:
            self.instance = cls(*args, **kwargs)

        return self._guard(run)

    def call(self, name: str, payload: tuple[tuple, dict]) -> tuple:
        args, kwargs = payload
        return self._guard(lambda: getattr(self.instance, name)(*args, **kwargs))


_WorkerActor = ray.remote(_GroupWorker)


def _pickle_class_by_value_if_needed(cls: type) -> None:
    """Actors import classes by module name; a class from a script or a test file (a module no
    worker can import) is shipped by value instead."""
    module = sys.modules.get(cls.__module__)
    if module is None or cls.__module__ == "__main__":
        return  # __main__ is already pickled by value
    file = getattr(module, "__file__", None)
    parts = cls.__module__.split(".")
    importable = False
    if file:
        for entry in sys.path:
            base = Path(entry or os.getcwd())
            candidates = (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py"))
            if any(c.exists() and os.path.samefile(c, file) for c in candidates):
                importable = True
                break
    if not importable:
        ray.cloudpickle.register_pickle_by_value(module)


def group_placement(group: DeviceGroup) -> PlacementGroup:
    """The Ray placement group reserving `group`'s devices (one bundle per rank: 1 CPU, plus 1 GPU
    for cuda, plus `resources_per_rank`; `placement='spread'`: each bundle on its own node), made on
    first use and shared by its components."""
    rt = ray_runtime()
    if group.name not in rt.placements:
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if group.device_type == "cuda" else {}), **group.resources_per_rank}
        strategy = {"pack": "PACK", "spread": "STRICT_SPREAD"}[group.placement]
        pg = placement_group([dict(bundle) for _ in range(group.world_size)], strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(pg)
            nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
            raise RuntimeError(
                f"cannot place DeviceGroup {group.name!r} ({group.world_size} x {bundle}, "
                f"{strategy}) within {PLACEMENT_TIMEOUT_S:.0f}s; live nodes' resources: {nodes}"
            )
        rt.placements[group.name] = pg
    return rt.placements[group.name]


def _process_state(info: dict) -> str:
    """ ", stopped" for a rank's process on this node that is stopped (SIGSTOP, a debugger); else ""."""
    pid = info.get("pid")
    if not isinstance(pid, int) or info.get("node_ip") not in (None, "?", _this_node_ip()):
        return ""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return ", stopped" if state in ("T", "t") else ""


def _this_node_ip() -> str | None:
    try:
        return ray.util.get_node_ip_address()
    except Exception:
        return None


class RemoteGroup:
    """Proxy for `cls` built on every rank of `group`. Methods keep their names and signatures."""

    def __init__(self, cls: type, group: DeviceGroup, args: tuple, kwargs: dict) -> None:
        rt = ray_runtime()
        n = group.world_size
        mesh = kwargs.get("device_mesh")
        if not isinstance(mesh, DeviceMesh):
            mesh = rt.mesh if rt.mesh.world_size == n else DeviceMesh.from_sizes(dp_size=n)
        mesh.check_world_size(n, f"size of DeviceGroup {group.name!r}")
        if mesh.device_type is None:
            mesh = DeviceMesh(dict(mesh.sizes), ep_size=mesh.ep_size, device_type=group.device_type)
            if "device_mesh" in kwargs:  # the component sees the group's device type too
                kwargs = {**kwargs, "device_mesh": mesh}
        self._cls, self._group, self._mesh = cls, group, mesh
        self._infos: list[dict[str, Any]] = []
        self._args, self._kwargs, self._seed = args, kwargs, rt.seed
        _pickle_class_by_value_if_needed(cls)
        self._start()
        rt.remote_groups.setdefault(group.name, []).append(self)

    def _start(self) -> None:
        group, n = self._group, self._group.world_size
        pg = group_placement(group)
        # Each actor takes a sliver of its rank's bundle, so several components built on one
        # DeviceGroup share its devices (colocated, as a model and its sampler often are).
        share = {"num_cpus": ACTOR_SHARE, "num_gpus": ACTOR_SHARE if group.device_type == "cuda" else 0}
        self._actors = [
            _WorkerActor.options(
                **share, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            ).remote(i, n)
            for i in range(n)
        ]
        self._infos = [{"node_ip": "?", "node_id": "?", "pid": "?", "gpu_ids": []} for _ in range(n)]
        try:
            self._infos = self._gather([a.node_info.remote() for a in self._actors], "start", wrapped=False)
            port = ray.get(self._actors[0].free_port.remote())
            threads = max(1, int(group.resources_per_rank.get("CPU", 1)))
            self._gather(
                [
                    a.setup.remote(self._infos[0]["node_ip"], port, self._mesh, self._seed, threads, os.getcwd())
                    for a in self._actors
                ],
                "setup",
            )
            self._gather(
                [a.construct.remote(self._cls, self._args, self._kwargs) for a in self._actors],
                f"{self._cls.__name__}()",
            )
        except BaseException:
            self._kill_actors()
            raise

    def remote_rebuild(self) -> None:
        """Replace every rank by a fresh actor built as the group first was (same class, arguments,
        mesh and placement group): after a rank died, the survivors may be stuck in a collective with
        it, so they go too. What the old actors held is gone."""
        self._kill_actors()
        self._start()

    # Proxy-owned names carry a `remote_` prefix so they cannot shadow the component's own methods.
    @property
    def remote_mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def remote_world_size(self) -> int:
        return len(self._actors)

    # A call's deadline (None: wait forever). A rank that neither answers nor dies -- stopped (SIGSTOP),
    # hung, its node partitioned -- would otherwise hold the caller forever: past it, the call fails
    # with WorkerDied naming the ranks still out, so the caller rebuilds the group.
    remote_call_timeout_s: float | None = None

    def _timed_out(self, what: str, ranks: list[int], timeout: float | None) -> WorkerDied:
        out = "; ".join(
            f"rank {r} (pid {self._infos[r]['pid']} on node {self._infos[r]['node_ip']} "
            f"{str(self._infos[r]['node_id'])[:12]}{_process_state(self._infos[r])})"
            for r in ranks
        )
        return WorkerDied(
            f"{what} timed out: remote group {self._group.name!r} did not answer within {timeout:g} s "
            f"(remote_call_timeout_s); still out: {out}",
            ranks[0],
            "",
            "Timeout",
        )

    def _gather(self, refs: list, what: str, wrapped: bool = True, timeout: float | None = None) -> list:
        """Results in rank order; the first failing rank raises at once (its peers may be stuck in a
        collective waiting for it)."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, object] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                raise self._timed_out(what, sorted(pending.values()), timeout)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    info = self._infos[rank]
                    raise WorkerDied(
                        f"{what} failed: rank {rank} of remote group {self._group.name!r} died (pid "
                        f"{info['pid']} on node {info['node_ip']} {str(info['node_id'])[:12]}): "
                        f"{type(e).__name__}",
                        rank,
                        str(e),
                        type(e).__name__,
                    ) from None
                except ray.exceptions.RayError as e:
                    raise RemoteError(
                        f"{what} failed on rank {rank} of remote group {self._group.name!r}: {type(e).__name__}: {e}",
                        rank,
                        str(e),
                        type(e).__name__,
                    ) from None
                if not wrapped:
                    results[rank] = out
                    continue
                if out[0] == "err":
                    _, exc_type, message, tb = out
                    raise RemoteError(
                        f"{what} failed on rank {rank} of remote group {self._group.name!r}: "
                        f"{exc_type}: {message}\n\nremote traceback (rank {rank}):\n{tb}",
                        rank,
                        tb,
                        exc_type,
                    )
                results[rank] = out[1]
        return [results[r] for r in range(len(refs))]

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        if not self._actors:  # a rebuild failed part-way (e.g. no node to place a rank on yet)
            raise WorkerDied(
                f"{self._cls.__name__}.{name}: remote group {self._group.name!r} has no live actors; "
                "remote_rebuild() it",
                -1,
                "",
                "NoActors",
            )
        dispatch, collect = method_spec(self._cls, name)
        if dispatch == "all":
            payload = ray.put((args, kwargs))  # one copy in the object store, read by every rank
            refs = [a.call.remote(name, payload) for a in self._actors]
        else:
            refs = [
                a.call.remote(name, dispatch_args(dispatch, args, kwargs, self._mesh, rank))
                for rank, a in enumerate(self._actors)
            ]
        what = f"{self._cls.__name__}.{name}"
        return collect_results(collect, self._gather(refs, what, timeout=self.remote_call_timeout_s))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        attr = inspect.getattr_static(self._cls, name, None)
        fn = getattr(attr, "__func__", attr)
        if attr is None or isinstance(attr, property) or not callable(fn):
            raise AttributeError(
                f"{self._cls.__name__} on remote group {self._group.name!r} has no method "
                f"{name!r} (remote groups expose methods only)"
            )

        @functools.wraps(fn)
        def method(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, args, kwargs)

        self.__dict__[name] = method
        return method

    def remote_pids(self) -> list[int]:
        """Each rank's actor process id, in rank order."""
        return [info["pid"] for info in self._infos]

    def remote_node_ids(self) -> list[str]:
        """Each rank's Ray node id, in rank order."""
        return [info["node_id"] for info in self._infos]

    def placement_lines(self) -> list[str]:
        kind = self._group.device_type
        return [
            f"{self._cls.__name__} rank {r}: node {info['node_ip']} {info['node_id'][:12]} pid {info['pid']} "
            f"{kind}{' gpu ' + ','.join(info['gpu_ids']) if info['gpu_ids'] else ''}"
            for r, info in enumerate(self._infos)
        ]

    def _kill_actors(self) -> None:
        for a in getattr(self, "_actors", []):
            ray.kill(a)
        # a stopped process cannot act on Ray's request to exit: SIGKILL the ones on this node as well
        # (SIGKILL ends a stopped process too; Ray's raylet does the same for other nodes' workers)
        for info in getattr(self, "_infos", []):
            if _process_state(info):
                with contextlib.suppress(OSError):
                    os.kill(info["pid"], signal.SIGKILL)
        self._actors = []

    def remote_shutdown(self) -> None:
        """Stop the actors (the DeviceGroup keeps its reservation for other components)."""
        self._kill_actors()
        rt = get_runtime()  # None after shutdown(): nothing to unregister from
        if rt is not None and self in rt.remote_groups.get(self._group.name, []):
            rt.remote_groups[self._group.name].remove(self)

    def __repr__(self) -> str:
        return f"RemoteGroup({self._cls.__name__} on {self._group.name!r}, {len(self._actors)} ranks, {self._mesh!r})"
