"""Points inside one forward and backward pass where long work may hand the engine to other work.

A server runs one tenant's long pass on a thread of its own and lets other tenants' work run between
its steps (twinkle.serve.core.slices). Between micro-batches is not enough when a single row is
long: one 32K-token row's pass is one forward and one backward. So the pass itself has points where
it may pause: the start of every decoder layer, forward and backward; and where a long row's work
is large, it is cut into chunks of bounded work with a point between chunks (and between their
backward steps): attention by query rows; a dense MLP, the attention projections (their base GEMMs;
a multi-LoRA layer's low-rank update stays whole) and the log-prob head (twinkle.loss.chunked_logps)
by tokens; norms and the rotary embedding (cheap per element, but a whole row's tensors at once: a
32K-token row's q_norm and rotary were ~50 ms without a point) by elements. Residual adds stay whole.

A thread that may pause installs a handler (`handler(fn)`): at each point, `fn(pausing)` decides
whether to pause and, if it does, calls `pausing()` right before it waits and what that returned once
resumed. Elsewhere every point is a no-op and attention is transformers' sdpa, call for call: a
library user's numbers do not change. `pausing()` runs the `save()` of every `preserving(save)`
context open on the thread, and each returns what puts its part back: what other work may change
while this pass waits (the multi-LoRA routing, the train/eval mode), and what it must let go of
while it waits (the engine's lock, its adapters kept resident).

Chunked attention is exact per query row (each row's softmax is over the same keys, masked the same
way); only the order of floating-point sums inside a kernel may differ from one sdpa call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAME = "twinkle_preemptible"
# Multiply-accumulates of one chunk's forward (attention: queries x keys x heads x head_dim; MLP: tokens
# x its weights): a few ms of fp32 on two cores, its backward ~2-4x that; a server's slice is 20 ms.
CHUNK_MACS = 2**25
MIN_CHUNK = 16
# Elements of one chunk of element-wise work over the tokens (norms, the rotary embedding): ~1 ms each.
CHUNK_ELEMENTS = 2**18
CHUNKED_ROTARY: set[Callable] = set()  # the families' apply_rotary_pos_emb, once replaced (never twice)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")

_local = threading.local()
_enabled: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()  # model -> chunked


Pausing = Callable[[], Callable[[], None]]


def handler(fn: Callable[[Pausing], bool] | None) -> None:
    """Install (None: remove) this thread's pause handler."""
    _local.handler = fn
    _local.savers = []


def active() -> bool:
    return getattr(_local, "handler", None) is not None


@contextmanager
def preserving(save: Callable[[], Callable[[], None]]) -> Generator[None]:
    """While open, a pause on this thread calls `save()` first and what it returned after."""
    savers = getattr(_local, "savers", None)
    if savers is None:
        yield
        return
    savers.append(save)
    try:
        yield
    finally:
        savers.remove(save)


def pausing() -> Callable[[], None]:
    """Before this thread waits: every open `preserving` context's save; -> what undoes them all."""
    restores = [save() for save in getattr(_local, "savers", ())]

    def resumed() -> None:
        for restore in restores:
            restore()

    return resumed


def point() -> None:
    """A place the running pass may pause (and raise the handler's error: a cancel)."""
    fn = getattr(_local, "handler", None)
    if fn is not None:
        fn(pausing)


def _point_in_backward(grad: torch.Tensor) -> torch.Tensor:
    point()
    return grad


def pause_before_backward_of(t: torch.Tensor) -> None:
    """A point in backward once `t`'s gradient is computed (where a handler is on at that time)."""
    if t.requires_grad and torch.is_grad_enabled():
        t.register_hook(_point_in_backward)


def _layer_pre_hook(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    point()
    hidden = args[0] if args else kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        pause_before_backward_of(hidden)  # its gradient is ready once this layer's backward is done


def _chunkable(module: torch.nn.Module, query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    return (
        active()
        and bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
        and query.shape[2] > MIN_CHUNK
        and not any(kwargs.get(k) is not None for k in ("position_bias", "s_aux", "sinks", "softcap"))
    )


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function signature, over sdpa ([B, H, T, D] in, [B, T, H, D] out)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    L, S = query.shape[2], key.shape[2]
    rows = max(MIN_CHUNK, CHUNK_MACS // max(1, S * query.shape[1] * query.shape[3]))
    if not _chunkable(module, query, kwargs) or rows >= L:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    offset = S - L  # the cache before these queries: query i is position offset + i
    kwargs.pop("is_causal", None)  # each chunk's causality is its mask
    outs = []
    for lo in range(0, L, rows):
        hi = min(L, lo + rows)
        keys = offset + hi  # causal: nothing past the chunk's last query is seen
        if attention_mask is None:
            q_pos = torch.arange(offset + lo, offset + hi, device=query.device)
            mask = torch.arange(keys, device=query.device)[None, :] <= q_pos[:, None]
        else:
            mask = attention_mask[:, :, lo:hi, :keys]
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, lo:hi],
            key[:, :, :keys],
            value[:, :, :keys],
            mask,
            dropout,
            scaling,
            is_causal=False,
            **kwargs,
        )
        pause_before_backward_of(out)
        outs.append(out)
        point()
    return torch.cat(outs, dim=1), None


def dense_mlp(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's MLP when it works token by token with no routing across tokens (not a mixture of experts)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None or not hasattr(mlp, "down_proj") or any(hasattr(mlp, a) for a in ("experts", "gate", "router")):
        return None
    return mlp


def _chunk_tokens(mlp: torch.nn.Module) -> None:
    """`mlp`'s forward, over [B, T, H], in token chunks with a point between them while a handler is on."""
    whole = mlp.forward
    per_token = sum(p.numel() for p in mlp.parameters())  # multiply-accumulates per token, forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        tokens = max(MIN_CHUNK, CHUNK_MACS // max(1, per_token * x.shape[0]))
        if not active() or args or kwargs or x.dim() != 3 or tokens >= x.shape[1]:
            return whole(x, *args, **kwargs)
        outs = []
        for lo in range(0, x.shape[1], tokens):
            out = whole(x[:, lo : lo + tokens])
            pause_before_backward_of(out)
            outs.append(out)
            point()
        return torch.cat(outs, dim=1)

    mlp.forward = forward


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _norm_forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A norm's forward along dim 1 in chunks, with a point between them while a handler is on: a norm
    reduces only its last dimension, so each chunk's values are the whole's."""
    whole = type(self).forward
    if not active() or args or kwargs or x.dim() < 3:
        return whole(self, x, *args, **kwargs)
    step = max(MIN_CHUNK, CHUNK_ELEMENTS // max(1, x.numel() // x.shape[1]))
    if step >= x.shape[1]:
        return whole(self, x)
    outs = []
    for lo in range(0, x.shape[1], step):
        out = whole(self, x[:, lo : lo + step])
        pause_before_backward_of(out)
        outs.append(out)
        point()
    return torch.cat(outs, dim=1)


def _chunked_rotary(whole: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    """A family's `apply_rotary_pos_emb(q, k, cos, sin)` ([B, H, T, D] and [B, T, D]) over token chunks with
    a point between them while a handler is on (element-wise: each chunk's values are the whole's); any
    other call form (partial rotary, multimodal sections, extra arguments) runs whole."""

    def apply(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = q.shape[2] if q.dim() == 4 else 0
        if not active() or args or kwargs or not tokens or k.dim() != 4 or k.shape[2] != tokens:
            return whole(q, k, cos, sin, *args, **kwargs)
        step = max(MIN_CHUNK, CHUNK_ELEMENTS // max(1, q.numel() // tokens))
        if step >= tokens or cos.dim() != 3 or cos.shape[1] != tokens or sin.shape != cos.shape:
            return whole(q, k, cos, sin)
        qs, ks = [], []
        for lo in range(0, tokens, step):
            hi = lo + step
            q_chunk, k_chunk = whole(q[:, :, lo:hi], k[:, :, lo:hi], cos[:, lo:hi], sin[:, lo:hi])
            pause_before_backward_of(q_chunk)
            qs.append(q_chunk)
            ks.append(k_chunk)
            point()
        return torch.cat(qs, dim=2), torch.cat(ks, dim=2)

    CHUNKED_ROTARY.add(apply)
    return apply


def _chunk_elementwise(hf_model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    """The norms of the decoder layers and the decoder's final norm (a vision tower's, which may normalize
    channels on dim 1, are left alone), and the rotary embedding of the layers' attention's family."""
    import sys
    import types

    get_decoder = getattr(hf_model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    final = getattr(decoder, "norm", None)
    for module in [m for layer in layers for m in layer.modules()] + ([final] if final is not None else []):
        if _is_norm(module):
            module.forward = types.MethodType(_norm_forward, module)
    for layer in layers:
        family = sys.modules.get(type(getattr(layer, "self_attn", layer)).__module__)
        rotary = getattr(family, "apply_rotary_pos_emb", None)
        if callable(rotary) and rotary not in CHUNKED_ROTARY:
            family.apply_rotary_pos_emb = _chunked_rotary(rotary)  # ty: ignore[invalid-assignment]


def enable(hf_model: PreTrainedModel, layers: list[torch.nn.Module]) -> bool:
    """Give `hf_model` its pause points: the decoder `layers`' starts and, where it runs sdpa, chunked
    attention (registered once, by name, with sdpa's masks). -> whether attention is chunked."""
    if hf_model in _enabled:
        return _enabled[hf_model]
    for layer in layers:
        layer.register_forward_pre_hook(_layer_pre_hook, with_kwargs=True)
        mlp = dense_mlp(layer)
        if mlp is not None:
            _chunk_tokens(mlp)
        attn = getattr(layer, "self_attn", None)
        for name in PROJECTIONS:
            projection = getattr(attn, name, None)
            if isinstance(projection, torch.nn.Linear):  # token by token: chunked like the MLP
                _chunk_tokens(projection)
    _chunk_elementwise(hf_model, layers)
    chunked = getattr(hf_model.config, "_attn_implementation", None) == "sdpa"  # eager / flash: layer starts only
    _enabled[hf_model] = chunked
    if not chunked:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    hf_model.set_attn_implementation(NAME)
    return True
