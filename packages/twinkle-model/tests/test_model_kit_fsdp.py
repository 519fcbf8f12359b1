"""twinkle-kit's TransformersModel(strategy='native_fsdp', fsdp_config=...): our FSDP2, and the
fsdp_config keys we cannot honour refused by name."""

from __future__ import annotations

import pytest

from twinkle.hub import TEST_MODEL
from twinkle.mesh import DeviceMesh
from twinkle.model import TransformersModel

# what cookbook/rl/grpo/short_math_grpo_routing_replay.py passes with ep_size 1
SCRIPT_CONFIG = {"expert_parallel": {"enabled": False, "router_dtype": "fp32", "keep_router_logits": False}}


@pytest.mark.parametrize(
    "sizes,expected",
    [(None, "fsdp2"), (dict(dp_size=1, fsdp_size=2), "fsdp2"), (dict(dp_size=2), "fsdp2")],
    ids=["one-process", "fsdp2", "dp2"],
)
def test_native_fsdp_is_our_fsdp2(sizes, expected):
    mesh = DeviceMesh.from_sizes(**sizes) if sizes else None
    model = TransformersModel(model_id=TEST_MODEL, device_mesh=mesh, strategy="native_fsdp", fsdp_config=SCRIPT_CONFIG)
    assert model.strategy == expected
    # expert parallelism off in name: ep_size 1 (the mesh's), or enabled False with any ep_size
    on_in_name = {"expert_parallel": {"enabled": True}, "reshard_after_forward": True, "manual_prefetch": True}
    assert TransformersModel(model_id=TEST_MODEL, strategy="native_fsdp", fsdp_config=on_in_name).strategy == "fsdp2"
    off = {"expert_parallel": {"enabled": False, "ep_size": 4}}
    assert TransformersModel(model_id=TEST_MODEL, strategy="native_fsdp", fsdp_config=off).strategy == "fsdp2"


@pytest.mark.parametrize(
    "strategy,fsdp_config,error,message",
    [
        (
            "native_fsdp",
            {"expert_parallel": {"enabled": True, "ep_size": 2}},
            NotImplementedError,
            r"fsdp_config\['expert_parallel'\] enabled with ep_size=2: TransformersModel does not implement",
        ),
        ("native_fsdp", {"cpu_offload": True}, ValueError, r"fsdp_config \['cpu_offload'\] cannot be honoured"),
        (
            "native_fsdp",
            {"expert_parallel": {"enabled": False, "capacity": 2}},
            ValueError,
            r"fsdp_config\['expert_parallel'\] \['capacity'\] cannot be honoured",
        ),
        ("native_fsdp", {"reshard_after_forward": False}, ValueError, r"'reshard_after_forward'\]=False"),
        (None, {"reshard_after_forward": True}, ValueError, r"pass strategy='native_fsdp' with it \(strategy=None\)"),
    ],
    ids=["expert-parallel", "unknown-key", "unknown-ep-key", "no-reshard", "without-native-fsdp"],
)
def test_what_we_cannot_honour_is_refused_by_name(strategy, fsdp_config, error, message):
    with pytest.raises(error, match=message):
        TransformersModel(model_id=TEST_MODEL, strategy=strategy, fsdp_config=fsdp_config)
