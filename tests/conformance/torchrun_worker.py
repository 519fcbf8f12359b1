"""`torchrun --nproc_per_node=2 torchrun_worker.py INIT OUT`: the conformance sequence under DDP,
FSDP2 and tensor parallel (tp=2), and MultiLoraModel over two data ranks, in one launch; rank 0 writes
OUT/<mode>.json ({"record"} or {"refused": message})."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import conformance_sequence as sequence

# mode -> (mesh sizes, engine options; `engine` names the engine, TransformersModel by default)
MODES = {
    "ddp": (dict(dp_size=2), {}),
    "fsdp2": (dict(dp_size=1, fsdp_size=2), dict(strategy="fsdp2")),
    "tp2": (dict(tp_size=2), {}),
    "multi_lora": (dict(dp_size=2), dict(engine="MultiLoraModel")),
}


def _gather(rows: list) -> list:
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    return [row for part in parts for row in part]


def _tensor_parallel(engine) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) and any(d.is_shard() for d in p.placements) for p in engine.hf_model.parameters())


def run_mode(name: str, init: str, out: Path) -> dict:
    import twinkle.mesh as tm
    import twinkle.model
    from twinkle.hub import TEST_MODEL

    sizes, options = MODES[name]
    engine = getattr(twinkle.model, options.pop("engine", "TransformersModel"))
    mesh = tm.DeviceMesh.from_sizes(**sizes)
    built = []

    def make():
        built.append(engine(model_id=TEST_MODEL, device_mesh=mesh, **options))
        return built[-1]

    data_parallel = mesh.data_world_size > 1
    mode = sequence.Mode(
        make=make,
        init_path=init,
        checkpoint=str(out / name / "ckpt"),
        shard=mesh.slice_for_data_rank if data_parallel else (lambda rows: rows),
        gather=_gather if data_parallel else (lambda rows: rows),
        sample=sequence.sample_locally if mesh.rank == 0 else None,
    )
    record = sequence.run(mode)
    if name == "tp2" and not _tensor_parallel(built[-1]):
        return {
            "refused": "not tensor-parallel: TransformersModel left every weight whole on both tp ranks "
            "(each rank ran the whole model)"
        }
    return {"record": dataclasses.asdict(record)}


def main(init: str, out: Path) -> None:
    import torch

    import twinkle.mesh as tm

    torch.set_num_threads(1)
    tm.initialize(mode="local", seed=0)
    rank = int(os.environ["RANK"])
    for name in os.environ.get("CONFORMANCE_TORCHRUN_MODES", ",".join(MODES)).split(","):
        try:
            result = run_mode(name, init, out)
        except Exception as e:
            result = {"refused": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if rank == 0:
            (out / f"{name}.json").write_text(json.dumps(result))
        torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
