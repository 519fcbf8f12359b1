"""Activation checkpointing for the fused multi-tenant pass (`MultiLoraModel(activation_checkpointing=True)`).

Each decoder layer of the language model keeps only its inputs and runs again in backward to rebuild
its activations: torch's non-reentrant checkpoint, reached through transformers' own per-layer hook
(`GradientCheckpointingLayer`, which calls its `_gradient_checkpointing_func`). Plain checkpointing
would get wrong what the multi-LoRA layers read from outside their inputs. Backward runs after the
pass has cleared the model's `Routing` (a custom loss's backward may even come after other passes
set theirs), and a tenant's LoRA dropout draws from that tenant's own generator, which has moved on
by then. So each checkpointed call records both as they were when the layer ran; its recompute
runs under them and then puts back whatever was there. Expert LoRA (`experts.py`) reads the same
`Routing`, so it needs nothing more.

The vision tower is left as it is: a tenant's own vision weights are swapped in only while the
forward call runs (`vision_tenants`), which a recompute in backward would miss.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from twinkle.model.multi_lora.layer import Routing, RoutingState
from twinkle.model.structure import decoder_layer_list

# {tenant names of a pass} -> the generators their LoRA dropout draws from in that pass
GeneratorsFor = Callable[[tuple[str | None, ...]], list[torch.Generator]]


class RoutedCheckpoint:
    """What transformers calls as `fn(layer_forward, *args)` for every checkpointed decoder layer."""

    def __init__(self, routing: Routing, generators_for: GeneratorsFor):
        self.routing = routing
        self.generators_for = generators_for
        self.recomputes = 0  # layer recomputes run so far: proof that checkpointing is really on

    def __call__(self, function: Callable, *args):
        routed = self.routing.state()
        generators = self.generators_for(routed.names) if routed.training else []
        states = [g.get_state() for g in generators]
        ran = False

        def run(*inputs):
            nonlocal ran
            if not ran:  # the forward itself: routing and generators are live
                ran = True
                return function(*inputs)
            self.recomputes += 1
            with _reinstated(self.routing, routed, generators, states):
                return function(*inputs)

        # preserve_rng_state (the default) covers the global generators: the base's own dropout
        return checkpoint(run, *args, use_reentrant=False)


@contextmanager
def _reinstated(
    routing: Routing, routed: RoutingState, generators: list[torch.Generator], states: list[torch.Tensor]
) -> Generator[None]:
    before, now = routing.state(), [g.get_state() for g in generators]
    routing.load(routed)
    for generator, state in zip(generators, states):
        generator.set_state(state)
    try:
        yield
    finally:  # also when torch stops the recompute early, once it has every tensor it needs
        routing.load(before)
        for generator, state in zip(generators, now):
            generator.set_state(state)


def decoder_layers(model: nn.Module) -> list[GradientCheckpointingLayer]:
    """The language model's decoder layers, refused by class when transformers cannot checkpoint them."""
    layers = decoder_layer_list(model)
    if not layers:
        raise TypeError(
            f"{type(model).__name__}: activation checkpointing needs a decoder with a `layers` list "
            "(transformers' get_decoder().layers)"
        )
    for layer in layers:
        if not isinstance(layer, GradientCheckpointingLayer):
            raise TypeError(
                f"{type(layer).__name__} is not a transformers GradientCheckpointingLayer: "
                "activation checkpointing is not supported for this architecture"
            )
    return list(layers)  # ty: ignore[invalid-explicit-return]


def refuse_foreign_checkpointing(model: nn.Module) -> None:
    """transformers' own gradient checkpointing, enabled on the base before it was handed over, would
    recompute layers without the tenants' routing (and the vision tower without their own weights)."""
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is True and not isinstance(
            getattr(module, "_gradient_checkpointing_func", None), RoutedCheckpoint
        ):
            raise ValueError(
                f"{name or type(model).__name__} has transformers' gradient checkpointing on "
                "(activation_checkpointing_enable): its recompute would not see the tenants' routing; "
                "call activation_checkpointing_disable() and pass activation_checkpointing=True to MultiLoraModel"
            )


def enable(model: nn.Module, routing: Routing, generators_for: GeneratorsFor) -> RoutedCheckpoint:
    fn = RoutedCheckpoint(routing, generators_for)
    for layer in decoder_layers(model):
        # transformers' documented per-layer hook; a plain attribute, not a submodule or tensor
        object.__setattr__(layer, "_gradient_checkpointing_func", fn)
        layer.gradient_checkpointing = True
    return fn


def disable(model: nn.Module) -> None:
    for layer in decoder_layers(model):
        layer.gradient_checkpointing = False
