"""DeviceMesh / DeviceGroup / initialize / remote decorators in one process (no launches)."""

from __future__ import annotations

import functools
import operator
import pickle
import sys

import pytest
import torch
import torch.distributed as dist

import twinkle.mesh as tm
from twinkle.mesh import DeviceGroup, DeviceMesh, RemoteClass, remote_method
from twinkle.mesh import runtime as rt_module
from twinkle.mesh.device_group import assign_devices
from twinkle.mesh.dispatch import collect_results, dispatch_args, method_spec


@pytest.fixture(autouse=True)
def fresh_runtime(monkeypatch):
    monkeypatch.setattr(rt_module, "_RUNTIME", None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_coordinates_and_groups_follow_pp_dp_fsdp_cp_tp_row_major():
    mesh = DeviceMesh.from_sizes(pp_size=2, dp_size=2, tp_size=2)
    assert mesh.world_size == 8 and mesh.shape == (2, 2, 1, 1, 2)
    assert mesh.coords(5) == {"pp": 1, "dp": 0, "fsdp": 0, "cp": 0, "tp": 1, "ep": 0}
    assert mesh.all_group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.all_group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.all_group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.all_group_ranks(("dp", "tp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [mesh.get_rank("dp", r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert mesh.get_group_ranks("tp", rank=6) == [6, 7]


def test_data_rank_spans_dp_and_fsdp_and_ep_subdivides_it():
    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=2, tp_size=2, ep_size=2)
    assert mesh.data_world_size == 4 and mesh.get_size("data") == 4
    assert [mesh.get_rank("data", r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert mesh.all_group_ranks("data") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.all_group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [mesh.coords(r)["ep"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"ep_size=3 must divide .* = 4"):
        DeviceMesh.from_sizes(dp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="cannot be combined"):
        mesh.all_group_ranks(("ep", "tp"))


def test_this_process_rank_comes_from_the_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    assert (mesh.rank, mesh.get_rank("dp"), mesh.get_rank("tp"), mesh.data_rank) == (3, 1, 1, 1)
    assert (mesh.get_size("tp"), mesh.get_size("dp"), mesh.get_size("pp")) == (2, 2, 1)
    assert mesh.slice_for_data_rank(list("abcdef")) == ["d", "e", "f"]
    with pytest.raises(ValueError, match="unknown mesh dimension 'xx'"):
        mesh.get_rank("xx")
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="rank 4 is outside"):
        mesh.coords()


def test_inconsistent_sizes_name_the_sizes_and_the_world_size(monkeypatch):
    with pytest.raises(ValueError, match=r"dp=2 x fsdp=1 x cp=1 x tp=2 = 4 do not match the world size 8"):
        DeviceMesh.from_sizes(dp_size=2, tp_size=2, world_size=8)
    with pytest.raises(ValueError, match="tp_size must be a positive integer, got 0"):
        DeviceMesh.from_sizes(tp_size=0)
    with pytest.raises(ValueError, match="world size 6 is not divisible by fsdp x tp x pp x cp = 4"):
        DeviceMesh.from_sizes(dp_size=None, tp_size=4, world_size=6)
    assert DeviceMesh.from_sizes(dp_size=None, tp_size=2, world_size=8).sizes["dp"] == 4
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"dp=4 .* = 4 do not match the torchrun world size \(WORLD_SIZE\) 2"):
        tm.initialize(mode="local", global_device_mesh=DeviceMesh.from_sizes(dp_size=4))
    with pytest.raises(ValueError, match="unknown mesh dimension 'xp'"):
        DeviceMesh.from_sizes().get_group_ranks("xp")


def test_slices_of_a_global_batch_cover_it_once_in_order():
    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=2)
    items = list(range(10))
    parts = [mesh.slice_for_data_rank(items, data_rank=d) for d in range(4)]
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert functools.reduce(operator.iadd, parts, []) == items
    with pytest.raises(ValueError, match="data_rank 4 is outside the data world size 4"):
        mesh.slice_for_data_rank(items, data_rank=4)


def test_a_mesh_pickles_without_its_process_local_state():
    mesh = DeviceMesh.from_sizes(dp_size=2, cp_size=2, device_type="cpu")
    mesh._groups[("dp",)] = object()
    copy = pickle.loads(pickle.dumps(mesh))
    assert copy == mesh and copy._groups == {} and copy.device_type == "cpu"
    assert repr(copy) == "DeviceMesh(dp_size=2, cp_size=2)"


def test_one_rank_mesh_converts_to_torch_without_a_launcher():
    mesh = DeviceMesh.from_sizes(dp_size=1)
    try:
        torch_mesh = mesh.to_torch()
        assert torch_mesh.mesh_dim_names == ("pp", "dp", "fsdp", "cp", "tp")
        assert torch_mesh["dp"].size() == 1
        assert dist.get_world_size(mesh.get_group(("dp", "tp"))) == 1
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="needs torch.distributed: launch with torchrun"):
        DeviceMesh.from_sizes(dp_size=2).get_group("dp")


def test_device_groups_validate_and_take_the_next_free_devices():
    groups = [
        DeviceGroup("model", 2, "cuda"),
        DeviceGroup("sampler", [0, 5], "cuda"),
        DeviceGroup("ref", 2, "cuda"),
        DeviceGroup("reward", 1),
    ]
    assert assign_devices(groups) == {"model": (1, 2), "sampler": (0, 5), "ref": (3, 4), "reward": (0,)}
    assert DeviceGroup("x", [3, 1]).world_size == 2
    with pytest.raises(ValueError, match="device_type 'tpu'"):
        DeviceGroup("x", 1, "tpu")
    with pytest.raises(ValueError, match="ranks must be >= 1, got 0"):
        DeviceGroup("x", 0)
    with pytest.raises(ValueError, match="distinct non-negative"):
        DeviceGroup("x", [1, 1])
    with pytest.raises(ValueError, match="names must be unique"):
        assign_devices([DeviceGroup("a", 1), DeviceGroup("a", 1)])
    assert DeviceGroup("x", 2, placement="spread").placement == "spread"
    with pytest.raises(ValueError, match=r"placement 'strict' is not one of \('pack', 'spread'\)"):
        DeviceGroup("x", 2, placement="strict")


def test_initialize_local_seeds_globally_and_per_rank(monkeypatch, capsys):
    runtime = tm.initialize(mode="local", groups=[DeviceGroup("default", 1)], seed=3)
    assert runtime.mode == "local" and tm.get_global_mesh() == DeviceMesh.from_sizes(dp_size=1)
    drawn = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(3))
    assert tm.rank_seed() == 3
    monkeypatch.setenv("RANK", "1")
    assert tm.rank_seed() == 4
    assert torch.equal(
        torch.rand(2, generator=tm.rank_generator()), torch.rand(2, generator=torch.Generator().manual_seed(4))
    )
    monkeypatch.delenv("RANK")
    text = tm.get_device_placement()
    assert "twinkle mode=local seed=3" in text and "group 'default': 1 x cpu, devices [0]" in text
    assert capsys.readouterr().out.strip() == text
    with pytest.raises(ValueError, match="unknown mode 'http'.*twinkle-serve"):
        tm.initialize(mode="http")
    with pytest.raises(ValueError, match="local mode takes no Ray options"):
        tm.initialize(mode="local", address="ray://x:10001")


def test_ray_mode_without_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an install without the extra looks like
    with pytest.raises(ImportError, match=r"pip install 'twinkle-mesh\[ray\]'"):
        tm.initialize(mode="ray", groups=[DeviceGroup("model", 2)])


class Counter(metaclass=RemoteClass):
    def __init__(self, start: int = 0):
        self.value = start

    @remote_method(dispatch="slice", collect="flatten")
    def double(self, items):
        return [2 * i for i in items]


class LabelledCounter(Counter):
    def __init__(self, label: str, start: int = 0):
        super().__init__(start)
        self.label = label


def test_remote_group_is_accepted_and_ignored_outside_ray_mode():
    tm.initialize(mode="local", groups=[DeviceGroup("model", 1)])
    counter = Counter(5, remote_group="model")
    assert type(counter) is Counter and counter.value == 5
    assert counter.double([1, 2]) == [2, 4]  # the method itself is untouched
    sub = LabelledCounter("a", start=2, remote_group="model")
    assert (type(sub), sub.label, sub.value) == (LabelledCounter, "a", 2)  # its __init__ never sees the keyword
    assert method_spec(Counter, "double") == ("slice", "flatten")
    assert method_spec(LabelledCounter, "__init__") == ("all", "first")
    with pytest.raises(ValueError, match="dispatch='scatter'"):
        remote_method(dispatch="scatter")
    with pytest.raises(ValueError, match="collect='sum'"):
        remote_method(collect="sum")


def test_slice_dispatch_cuts_sequences_by_data_rank_and_leaves_the_rest():
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    batch = {"ids": torch.arange(6).view(3, 2), "n": [1, 2, 3]}
    args, kwargs = dispatch_args("slice", ([10, 11, 12, 13], "scalar"), {"batch": batch, "lr": 0.1}, mesh, rank=1)
    assert args == ([10, 11], "scalar") and kwargs["lr"] == 0.1  # rank 1 is data rank 0 (tp peer of 0)
    assert torch.equal(kwargs["batch"]["ids"], torch.tensor([[0, 1], [2, 3]])) and kwargs["batch"]["n"] == [1, 2]
    args, _ = dispatch_args("slice", ((10, 11, 12),), {}, mesh, rank=3)
    assert args == ((12,),)
    assert dispatch_args("all", ([1, 2],), {}, mesh, rank=3) == (([1, 2],), {})


def test_collect_modes():
    assert collect_results("first", [1, 2]) == 1
    assert collect_results("all", [1, 2]) == [1, 2]
    assert collect_results("mean", [{"loss": 1.0, "acc": 0.5}, {"loss": 3.0, "acc": 1.0}]) == {"loss": 2.0, "acc": 0.75}
    assert torch.equal(collect_results("mean", [torch.tensor([1.0]), torch.tensor([3.0])]), torch.tensor([2.0]))
    assert collect_results("flatten", [[1], [2, 3]]) == [1, 2, 3]
    assert collect_results(max, [1, 4, 2]) == 4
    with pytest.raises(TypeError, match="rank 1 returned int"):
        collect_results("flatten", [[1], 2])
    with pytest.raises(TypeError, match="collect='mean' needs numbers"):
        collect_results("mean", ["a", "b"])
