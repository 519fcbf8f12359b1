"""twinkle-kit's routing-replay loop on our model: forward_only(RECORD) returns each row's routed experts
padded to the longest row (-1 past its end); the loop puts them back on the rows and trains on them with
a micro-batched forward_backward, which replays them (a replay of a pass's own routing is that pass)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from twinkle.model import TransformersModel
from twinkle.model.families import tiny_config
from twinkle.model.transformers.moe.router_replay import RouterReplayAction

ROWS = [
    {"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [-100, -100, 7, 8, 9, 10, 11]},
    {"input_ids": [12, 13, 14, 15], "labels": [-100, 13, 14, 15]},
    {"input_ids": [21, 22, 23, 24, 25], "labels": [-100, -100, -100, 24, 25]},
]


def test_padded_recorded_routing_replays_in_micro_batches():
    torch.manual_seed(0)
    model = TransformersModel(config=tiny_config("qwen3_moe"), enable_router_replay=True)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    rows = [dict(r) for r in ROWS]
    routed = model.forward_only(rows, router_replay_action=RouterReplayAction.RECORD)["routed_experts"]
    assert routed.shape[1] == 7 and bool((routed[1, 4:] == -1).all())  # row 1 padded past its 4 tokens
    plain = model.forward_backward([dict(r) for r in ROWS], micro_batch_size=1)
    model.zero_grad()
    for row, experts in zip(rows, routed):
        row["routed_experts"] = experts
    replayed = model.forward_backward(rows, micro_batch_size=1, router_replay_action=RouterReplayAction.REPLAY_FORWARD)
    assert replayed["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    torch.testing.assert_close(replayed["logps"], plain["logps"], rtol=1e-6, atol=1e-7)
