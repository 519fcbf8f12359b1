"""Routing replay (twinkle.model.router_replay, twinkle-kit's enable_router_replay / router_replay_action)
on each mixture-of-experts family of the architecture matrix, tiny random models."""

from __future__ import annotations

import pytest
import torch

from twinkle.model import TransformersModel
from twinkle.model.families import tiny_config
from twinkle.model.transformers.moe.router_replay import RouterReplayAction

MOE_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
ROWS = [
    {"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [-100, -100, 7, 8, 9, 10, 11]},
    {"input_ids": [12, 13, 14, 15], "labels": [-100, 13, 14, 15]},
]


def _model(family: str) -> TransformersModel:
    torch.manual_seed(0)
    return TransformersModel(config=tiny_config(family), enable_router_replay=True)


def _train_pass(model: TransformersModel, rows: list[dict], **kwargs) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model.forward_backward([dict(r) for r in rows], **kwargs)["loss"]
    grads = {n: p.grad.clone() for n, p in model.hf_model.named_parameters() if p.grad is not None}
    return loss, grads


def _with_routed(rows: list[dict], routed: torch.Tensor) -> list[dict]:
    return [{**r, "routed_experts": routed[i]} for i, r in enumerate(rows)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_the_recorded_routing_is_the_plain_pass(family):
    model = _model(family)
    plain_loss, plain_grads = _train_pass(model, ROWS)
    recorded = model.forward_only([dict(r) for r in ROWS], router_replay_action=RouterReplayAction.RECORD)
    routed = recorded["routed_experts"]
    cfg = model.hf_model.config
    moe_layers = cfg.num_hidden_layers - getattr(cfg, "first_k_dense_replace", 0)
    assert routed.shape == (2, 7, moe_layers, cfg.num_experts_per_tok)
    assert bool((routed[1, 4:] == -1).all()) and bool((routed[:, :4] >= 0).all())  # -1 past the short row's end
    loss, grads = _train_pass(model, _with_routed(ROWS, routed), router_replay_action=RouterReplayAction.REPLAY_FORWARD)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, plain_grads[name], rtol=1e-6, atol=1e-9, msg=name)
    # a sampler's record lacks the last sampled token: that token routes itself
    short = [{**r, "routed_experts": routed[i, : len(r["input_ids"]) - 1]} for i, r in enumerate(ROWS)]
    assert _train_pass(model, short, router_replay_action="replay_forward")[0] == pytest.approx(plain_loss, rel=1e-6)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_another_routing_changes_the_pass_and_the_router_still_learns(family):
    model = _model(family)
    plain = model.forward_only([dict(r) for r in ROWS], router_replay_action=RouterReplayAction.RECORD)
    E = model.router_replay.num_experts
    routed = plain["routed_experts"]
    other = torch.where(routed >= 0, (routed + 1) % E, routed)  # every token to other experts
    replayed = model.forward_only(_with_routed(ROWS, other), router_replay_action=RouterReplayAction.REPLAY_FORWARD)
    assert "routed_experts" not in replayed
    moved = torch.tensor(replayed["logprobs"][0]) - torch.tensor(plain["logprobs"][0])
    assert float(moved.abs().max()) > 1e-3  # a tiny random model: its experts differ by little, not by fp noise
    _, grads = _train_pass(model, _with_routed(ROWS, other), router_replay_action=RouterReplayAction.REPLAY_FORWARD)
    router_grads = [g for n, g in grads.items() if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert router_grads and all(bool(g.abs().sum() > 0) for g in router_grads)


def test_a_dense_model_is_refused_by_name():
    with pytest.raises(ValueError, match="'qwen3' has no mixture-of-experts router"):
        TransformersModel(config=tiny_config("qwen3"), enable_router_replay=True)


def test_a_moe_family_without_known_router_weights_is_refused_by_name():
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "mixtral", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="'mixtral'.*not one of them"):
        TransformersModel(config=config, enable_router_replay=True)


def test_bad_routing_and_actions_are_refused_by_name():
    model = _model("qwen3_moe")
    routed = model.forward_only([dict(r) for r in ROWS], router_replay_action="record")["routed_experts"]
    with pytest.raises(ValueError, match="this model routes \\[tokens, 2 moe layers, top-2\\]"):
        model.forward_only(_with_routed(ROWS, routed[:, :, :1]), router_replay_action="replay_forward")
    with pytest.raises(ValueError, match="name expert 9; the model has 4"):
        model.forward_only(_with_routed(ROWS, routed.clamp(min=0) + 9 - 3), router_replay_action="replay_forward")
    longer = torch.cat([routed, routed[:, :1]], 1)  # 8 tokens of routing for a 7-token row
    with pytest.raises(ValueError, match="row 0: routed_experts route 8 tokens, the row has 7"):
        model.forward_only(_with_routed(ROWS, longer), router_replay_action="replay_forward")
    with pytest.raises(ValueError, match="unknown router_replay_action 'replay'"):
        model.forward_only([dict(r) for r in ROWS], router_replay_action="replay")
    dense = TransformersModel(config=tiny_config("qwen3"))
    with pytest.raises(ValueError, match="RECORD: recording or replaying routed_experts needs .*enable_router_replay"):
        dense.forward_only([dict(r) for r in ROWS], router_replay_action=RouterReplayAction.RECORD)
    # twinkle-kit's loop passes REPLAY_FORWARD with replay off: with nothing to replay it is a plain pass
    assert dense.forward_backward([dict(r) for r in ROWS], router_replay_action="replay_forward")["loss"] > 0


def test_under_a_lora_adapter_replay_is_the_plain_pass_and_the_base_records_too():
    from peft import LoraConfig

    model = _model("qwen3_moe")
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    plain_loss, plain_grads = _train_pass(model, ROWS)
    routed = model.forward_only([dict(r) for r in ROWS], router_replay_action="record")["routed_experts"]
    loss, grads = _train_pass(model, _with_routed(ROWS, routed), router_replay_action="replay_forward")
    assert loss == pytest.approx(plain_loss, rel=1e-6) and grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, plain_grads[name], rtol=1e-6, atol=1e-9, msg=name)
    # the reference pass (disable_lora) runs forward_only inside forward_only: it records under the outer action
    base = model.forward_only([dict(r) for r in ROWS], disable_lora=True, router_replay_action="record")
    assert base["routed_experts"].shape == routed.shape


def test_a_forced_routing_holds_in_the_backward_recompute_of_activation_checkpointing():
    def replayed_grads(checkpointing: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model = _model("qwen3_moe")
        if checkpointing:
            model.hf_model.gradient_checkpointing_enable()
        routed = model.forward_only([dict(r) for r in ROWS], router_replay_action="record")["routed_experts"]
        other = torch.where(routed >= 0, (routed + 1) % model.router_replay.num_experts, routed)
        return _train_pass(model, _with_routed(ROWS, other), router_replay_action=RouterReplayAction.REPLAY_BACKWARD)

    loss, grads = replayed_grads(False)
    ckpt_loss, ckpt_grads = replayed_grads(True)  # backward re-runs each layer, its router hook included
    assert ckpt_loss == pytest.approx(loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(ckpt_grads[name], g, rtol=1e-6, atol=1e-9, msg=name)
