"""The CUDA paths (nccl, Ray GPU placement): one GPU is enough. Skipped on CPU-only machines."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import twinkle.mesh as tm
from twinkle.mesh import runtime as rt_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
]


def test_one_rank_cuda_mesh_uses_nccl():
    mesh = tm.DeviceMesh.from_sizes(dp_size=1, device_type="cuda")
    try:
        assert mesh.to_torch().device_type == "cuda" and dist.get_backend() == "nccl"
        t = torch.ones(2, device="cuda")
        dist.all_reduce(t, group=mesh.get_group("dp"))
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


class CudaProbe(metaclass=tm.RemoteClass):
    @tm.remote_method(collect="all")
    def where(self) -> dict:
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        return {"backend": dist.get_backend(), "sum": x.sum().item(), "devices": torch.cuda.device_count()}


def test_ray_cuda_group_gets_one_gpu_per_rank_and_nccl():
    pytest.importorskip("ray")
    rt_module._RUNTIME = None
    tm.initialize(mode="ray", groups=[tm.DeviceGroup("model", 1, "cuda")], nproc_per_node=1)
    try:
        probe = CudaProbe(remote_group="model")
        assert probe.where() == [{"backend": "nccl", "sum": 4.0, "devices": 1}]
        assert "CudaProbe rank 0: node" in tm.get_device_placement() and " gpu " in tm.get_device_placement()
    finally:
        tm.shutdown()
