"""Routing replay for mixture-of-experts models: record the experts each token's router chose, and
run a later pass with those experts forced (twinkle-kit's `enable_router_replay` /
`router_replay_action`, behind its names in `twinkle.model.transformers.moe.router_replay`).

An RL step scores its samples with one routing (the sampler's, or the trainer's own no-gradient
recompute) and trains with another unless the trainer's pass is made to route as that one did: a
token's top-k set can flip on a tiny change of the hidden state, and the policy ratio then compares
two different networks. Replay keeps the router's own logits (so the router still learns) and only
replaces which experts a token goes to; the forced experts' weights are what the family's router
computes for them from those logits, so a replay of the pass's own routing is that pass, bit for bit.

Routed experts travel per row as `routed_experts`, [tokens, moe layers, top_k] expert ids (twinkle-kit's
layout), aligned with the row's input_ids; -1 (or a row shorter than its input_ids, as a sampler's
record lacks the last sampled token) leaves a token to route itself.
"""

from __future__ import annotations

import contextlib
from enum import Enum
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from twinkle.model.inputs import sequence_spans
from twinkle.model.structure import describe

if TYPE_CHECKING:
    from collections.abc import Callable, Generator

    from torch import nn

ROUTED_EXPERTS = "routed_experts"  # the row field


class RouterReplayAction(Enum):
    RECORD = "record"  # keep the experts each router chose
    REPLAY_FORWARD = "replay_forward"  # force the rows' recorded experts
    # twinkle-kit's replay in the recompute of backward (activation checkpointing): here the forced
    # routing of a pass also holds in its recompute, so this is REPLAY_FORWARD
    REPLAY_BACKWARD = "replay_backward"


def _softmax_then_topk(router: nn.Module, logits_N_E: torch.Tensor, experts_N_K: torch.Tensor) -> torch.Tensor:
    # Qwen3-MoE: softmax over all experts in fp32, the chosen ones' share, renormalised if configured
    weights = F.softmax(logits_N_E, dtype=torch.float, dim=-1).gather(-1, experts_N_K)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits_N_E.dtype)


def _topk_then_softmax(router: nn.Module, logits_N_E: torch.Tensor, experts_N_K: torch.Tensor) -> torch.Tensor:
    # GPT-OSS: softmax over the chosen experts' logits alone
    del router
    return F.softmax(logits_N_E.gather(-1, experts_N_K), dim=-1, dtype=logits_N_E.dtype)


def _sigmoid_scaled(router: nn.Module, logits_N_E: torch.Tensor, experts_N_K: torch.Tensor) -> torch.Tensor:
    # DeepSeek-V3: sigmoid scores (without the choice bias), renormalised, times the scaling factor
    weights = logits_N_E.sigmoid().gather(1, experts_N_K)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cast("float", router.routed_scaling_factor)


# model_type -> how its router weighs the experts it routes a token to, from its logits
ROUTER_WEIGHTS: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "qwen3_moe": _softmax_then_topk,
    "gpt_oss": _topk_then_softmax,
    "deepseek_v3": _sigmoid_scaled,
}


def coerce_action(action: RouterReplayAction | str | None) -> RouterReplayAction | None:
    if action is None or isinstance(action, RouterReplayAction):
        return action
    try:
        return RouterReplayAction(action)
    except ValueError:
        known = ", ".join(repr(a.value) for a in RouterReplayAction)
        raise ValueError(
            f"unknown router_replay_action {action!r}; expected a RouterReplayAction or one of {known}"
        ) from None


class RouterReplay:
    """Forward hooks on every router of one model: record its choices or replace them."""

    def __init__(self, model: nn.Module) -> None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        routers = [model.get_submodule(p.module) for p in describe(model).of("router")]
        if not routers:
            raise ValueError(
                f"enable_router_replay=True: {model_type!r} has no mixture-of-experts router (a dense model has "
                "no routing to record or replay)"
            )
        if model_type not in ROUTER_WEIGHTS:
            raise NotImplementedError(
                f"enable_router_replay=True: routing replay knows the routers of {', '.join(ROUTER_WEIGHTS)}; "
                f"{model_type!r}'s router ({type(routers[0]).__name__}) is not one of them"
            )
        self.weigh = ROUTER_WEIGHTS[model_type]
        # nn.Module types every attribute as Tensor | Module; these routers hold ints
        self.top_k = cast("int", routers[0].top_k)
        self.num_experts = cast("int", routers[0].num_experts)
        self.action: RouterReplayAction | None = None
        self.depth = 0  # calls inside a call (forward_only_base -> forward_only) keep the outer one's action
        self.targets_N_L_K: torch.Tensor | None = None  # this pass's forced experts, -1: route freely
        self.recorded: dict[int, torch.Tensor] = {}  # moe layer -> [N, K], the first pass's choice
        self.first_batch: tuple[list[tuple[int, int, int]], tuple[int, ...]] | None = None  # its spans, [B, T]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    @property
    def layers(self) -> int:
        return len(self.handles)

    def _hook(self, layer: int) -> Callable[..., Any]:
        def hook(module: nn.Module, _args: tuple, output: tuple) -> tuple | None:
            logits_N_E, _, experts_N_K = output
            if self.action is RouterReplayAction.RECORD:
                # the first pass's choice: a reference pass or a recompute after it routes the same rows again
                self.recorded.setdefault(layer, experts_N_K.detach())
                return None
            if self.action is None or self.targets_N_L_K is None:
                return None
            forced_N_K = self.targets_N_L_K[:, layer]
            if forced_N_K.shape != experts_N_K.shape:
                raise ValueError(
                    f"routed_experts cover {forced_N_K.shape[0]} tokens x top-{forced_N_K.shape[1]}; the router of "
                    f"moe layer {layer} routes {experts_N_K.shape[0]} x top-{experts_N_K.shape[1]}"
                )
            free_N_1 = (forced_N_K < 0).any(-1, keepdim=True)
            chosen_N_K = torch.where(free_N_1, experts_N_K, forced_N_K)
            return logits_N_E, self.weigh(module, logits_N_E, chosen_N_K), chosen_N_K

        return hook

    def prepared(self, batch: dict[str, torch.Tensor], routed: list | None) -> None:
        """A pass's collated batch and its rows' `routed_experts`: what it forces, or where it records."""
        spans, shape = sequence_spans(batch), tuple(batch["input_ids"].shape)
        if self.first_batch is None:
            self.first_batch = (spans, shape)
        replaying = self.action not in (None, RouterReplayAction.RECORD)
        self.targets_N_L_K = None
        if replaying and routed is not None:
            self.set_targets(spans, shape, routed)

    def set_targets(self, spans: list[tuple[int, int, int]], shape_B_T: tuple[int, ...], routed: list) -> None:
        """The batch's forced experts from each row's `routed_experts` (row i is sequence span i)."""
        B, T = shape_B_T
        if len(spans) != len(routed):
            raise ValueError(
                f"routed_experts: {len(routed)} rows became {len(spans)} sequences (packed rows cannot replay routing)"
            )
        targets = torch.full((B, T, self.layers, self.top_k), -1, dtype=torch.long)
        for i, ((b, start, n), row) in enumerate(zip(spans, routed)):
            if row is None:
                continue
            ids = torch.as_tensor(row, dtype=torch.long)
            if ids.dim() != 3 or tuple(ids.shape[1:]) != (self.layers, self.top_k):
                raise ValueError(
                    f"row {i}: routed_experts has shape {tuple(ids.shape)}; this model routes [tokens, "
                    f"{self.layers} moe layers, top-{self.top_k}]"
                )
            if bool((ids[n:] >= 0).any()):
                raise ValueError(f"row {i}: routed_experts route {ids.shape[0]} tokens, the row has {n}")
            if bool((ids >= self.num_experts).any()):
                raise ValueError(
                    f"row {i}: routed_experts name expert {int(ids.max())}; the model has {self.num_experts}"
                )
            ids = ids[:n]
            targets[b, start : start + ids.shape[0]] = ids
        self.targets_N_L_K = targets.flatten(0, 1)

    def routed_experts(self) -> torch.Tensor | None:
        """What the recording pass chose, [rows, longest row, moe layers, top_k] (-1 past a row's end)."""
        if self.action is not RouterReplayAction.RECORD or len(self.recorded) != self.layers or not self.first_batch:
            return None
        spans, (B, T) = self.first_batch
        chosen_B_T_L_K = torch.stack([self.recorded[i] for i in range(self.layers)], 1).view(B, T, self.layers, -1)
        longest = max(n for _, _, n in spans)
        out = torch.full((len(spans), longest, self.layers, self.top_k), -1, dtype=torch.long)
        for i, (b, start, n) in enumerate(spans):
            out[i, :n] = chosen_B_T_L_K[b, start : start + n].cpu()
        return out

    @contextlib.contextmanager
    def acting(self, action: RouterReplayAction | None) -> Generator[None]:
        """`action` for the passes inside (their backward too); nothing recorded or forced after it."""
        if self.depth:
            yield
            return
        self.action, self.targets_N_L_K, self.recorded, self.first_batch = action, None, {}, None
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            self.action, self.targets_N_L_K, self.recorded, self.first_batch = None, None, {}, None


def take_routed(rows: list[dict] | dict) -> list | None:
    """Each row's `routed_experts`, removed from the rows (None where no row carries them)."""
    if isinstance(rows, dict):
        routed = rows.pop(ROUTED_EXPERTS, None)
        return None if routed is None else list(routed)
    routed = [row.pop(ROUTED_EXPERTS, None) for row in rows]
    return routed if any(r is not None for r in routed) else None


def _carries_routed(inputs: Any) -> bool:
    if isinstance(inputs, dict):
        return ROUTED_EXPERTS in inputs
    return isinstance(inputs, list) and any(isinstance(r, dict) and ROUTED_EXPERTS in r for r in inputs)


@contextlib.contextmanager
def acting(replay: RouterReplay | None, action: RouterReplayAction | str | None, inputs: Any) -> Generator[None]:
    """A call's `router_replay_action` on a model with or without `enable_router_replay`: without it, a
    replay with nothing to replay is a plain pass (twinkle-kit's loops pass REPLAY_FORWARD either way)."""
    action = coerce_action(action)
    if replay is None:
        if action is RouterReplayAction.RECORD or (action is not None and _carries_routed(inputs)):
            raise ValueError(
                f"router_replay_action={action.name}: recording or replaying routed_experts needs "
                "TransformersModel(enable_router_replay=True)"
            )
        yield
        return
    with replay.acting(action):
        yield


def install(model: nn.Module, cp_size: int) -> RouterReplay:
    if cp_size > 1:
        raise NotImplementedError(
            "enable_router_replay=True with context parallelism (cp > 1) is not offered: each cp rank routes "
            "its own part of the rows"
        )
    return RouterReplay(model)
