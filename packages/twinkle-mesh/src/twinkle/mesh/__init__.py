"""twinkle.mesh: where a component runs and how its ranks are laid out.

DeviceMesh.from_sizes(dp_size=2, tp_size=2)     # topology of one component over its ranks
DeviceGroup(name="model", ranks=2, device_type="cpu")
initialize(mode="local" | "ray", global_device_mesh=..., groups=[...], seed=42, address=None)
class Trainer(metaclass=RemoteClass): ...        # Trainer(..., remote_group="model"): Ray actors in ray mode
@remote_method(dispatch=..., collect=...)          # how a call fans out over them, how answers come back
"""

from twinkle.mesh.device_group import DeviceGroup
from twinkle.mesh.device_mesh import DeviceMesh
from twinkle.mesh.logger import get_logger
from twinkle.mesh.remote import RemoteClass, RemoteError, WorkerDied, remote_method
from twinkle.mesh.runtime import (
    Runtime,
    get_device_placement,
    get_global_mesh,
    get_runtime,
    initialize,
    rank_generator,
    rank_seed,
    seed_everything,
    shutdown,
)

__all__ = [
    "DeviceGroup",
    "DeviceMesh",
    "RemoteClass",
    "RemoteError",
    "Runtime",
    "WorkerDied",
    "get_device_placement",
    "get_global_mesh",
    "get_logger",
    "get_runtime",
    "initialize",
    "rank_generator",
    "rank_seed",
    "remote_method",
    "seed_everything",
    "shutdown",
]
