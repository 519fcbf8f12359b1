"""twinkle.checkpoint_engine: adapter-only, versioned weight sync from a trainer to samplers.

In one process (`InProcessCheckpointEngine`, zero copy), between torch.distributed ranks
(`BroadcastCheckpointEngine`), between Ray actors through the object store (`RayCheckpointEngine`), and
through a shared folder in the checkpoint format (`FolderCheckpointEngine`: Ray remote groups).
`CheckpointEngineManager` is twinkle-kit's name and call (`sync_weights()` after each step) over these.
"""

from twinkle.checkpoint_engine.base import CheckpointEngine, get_checkpoint_engine_class
from twinkle.checkpoint_engine.distributed import BroadcastCheckpointEngine
from twinkle.checkpoint_engine.folder import FolderCheckpointEngine
from twinkle.checkpoint_engine.inprocess import InProcessCheckpointEngine
from twinkle.checkpoint_engine.manager import CheckpointEngineManager
from twinkle.checkpoint_engine.ray_engine import RayCheckpointEngine

__all__ = [
    "BroadcastCheckpointEngine",
    "CheckpointEngine",
    "CheckpointEngineManager",
    "FolderCheckpointEngine",
    "InProcessCheckpointEngine",
    "RayCheckpointEngine",
    "get_checkpoint_engine_class",
]
