"""The prefill of one batch of prompts for TorchSampler, reusing cached prefixes (prefix_cache.py).

Layout. Row i reuses k_i cached tokens and prefills the other s_i = len_i - k_i >= 1 (at least one,
so the forward still yields the logits that predict the next token). The batch's KV has two
left-padded regions: [pads, cached KV (k_i)] of width K = max k_i, then [pads, suffix (s_i)] of
width S = max s_i. The attention mask zeroes both pad runs and positions follow the mask, so every
row attends to exactly its own tokens at their own positions: a pad run in the middle is masked like
a leading one. One batched forward thus serves hits, misses and partial hits alike; a forward per
row or per group of equal k_i would be as correct but pay one forward (and one LoRA routing) each.
When reuse would not shorten the forward (S equals the longest prompt) it is dropped for the whole
batch: the suffix batch would be as wide as the uncached one, and the KV copy would buy nothing.
With K = 0 the batch is exactly the uncached left-padded prefill (images included).

Log-probs of cached positions (compute_logprobs, prompt_logprobs) come from the hidden states the
entry stored, through the output head: one matmul instead of the layers. The first store checks that
the head reproduces the model's own logits (it does not with e.g. soft-capped logits); if not, entries
keep KV only and a call that needs those log-probs reuses nothing (a full prefill, still stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from twinkle.sampler import vision
from twinkle.sampler.prefix_cache import CacheEntry

Prompt = list[int]


@dataclass
class Prefilled:
    logits_B_S_V: torch.Tensor  # the forward's logits: every fed position, or only the last
    cache: DynamicCache  # over the whole layout, to decode on
    mask_B_T: torch.Tensor  # the whole layout (cached region, then fed region)
    pos_B_S: torch.Tensor  # positions of the fed tokens: [B, S], or [3, B, S] with images
    ids_B_S: torch.Tensor
    prompts: list[Prompt]
    reused: list[int]
    entries: list[CacheEntry | None]


def run(
    sampler,
    prompts: list[Prompt],
    adapters: list,
    images: list,
    all_logits: bool,
    namespace: str | None = None,
    reuse: bool = True,
) -> Prefilled:
    """Prefill `prompts` (inside the caller's LoRA routing for `adapters`) and store what it computed,
    reusing and storing KV only within the prefix cache's `namespace`. `reuse=False` prefills in full
    (and still stores): a prefix taken from the cache changes the logits in their last bits (~5e-7),
    so what a cached prefill computes depends on what ran before it."""
    cache_store = sampler.prefix_cache
    caching = cache_store.enabled and sampler.kv_cacheable is not False and all(im is None for im in images)
    by_adapter = {a: sampler.cache_key(a, namespace) for a in set(adapters)} if caching else {}
    keys = [by_adapter[a] for a in adapters] if caching else []
    looked = caching and reuse
    found = [cache_store.lookup(key, p) for key, p in zip(keys, prompts)] if looked else [(None, 0)] * len(prompts)
    usable = caching and not (all_logits and sampler.head_ok is False)
    # log-probs of reused positions come from the entry's hidden states (see the module docstring)
    reused = [
        min(n, len(p) - 1) if usable and (not all_logits or (e is not None and e.hidden_T_E is not None)) else 0
        for (e, n), p in zip(found, prompts)
    ]
    if max(len(p) - k for p, k in zip(prompts, reused)) == max(len(p) for p in prompts):
        reused = [0] * len(prompts)
    entries = [e if k else None for (e, _), k in zip(found, reused)]
    if caching:
        cache_store.record(reused)
    width_K = max(reused)
    ids_B_S, mask_B_S = sampler.left_pad([p[k:] for p, k in zip(prompts, reused)])
    vis: dict = {}
    if width_K:
        cached_mask_B_K = torch.zeros((len(prompts), width_K), dtype=torch.long, device=sampler.device)
        for b, k in enumerate(reused):
            cached_mask_B_K[b, width_K - k :] = 1
        mask_B_T = torch.cat([cached_mask_B_K, mask_B_S], dim=1)
        pos_B_S = (mask_B_T.cumsum(-1) - 1).clamp(min=0)[:, width_K:]
        cache = DynamicCache(ddp_cache_data=_batch_kv(entries, reused, width_K))
    else:
        mask_B_T = mask_B_S
        vis = vision.prefill_inputs(sampler.model, ids_B_S, mask_B_S, images)
        pos_B_S = vis.pop("position_ids", None)  # 3-D (time, height, width) with images
        if pos_B_S is None:
            pos_B_S = (mask_B_S.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
    hidden: list[torch.Tensor | None] = []
    base = getattr(sampler.model, "base_model", None)
    capture = (
        caching and sampler.head_ok is not False and isinstance(base, torch.nn.Module) and base is not sampler.model
    )
    handle = base.register_forward_hook(lambda _m, _a, out: hidden.append(_last_hidden(out))) if capture else None
    try:
        out = sampler.model(
            input_ids=ids_B_S,
            attention_mask=mask_B_T,
            position_ids=pos_B_S,
            use_cache=True,
            **{sampler.cache_kw: cache},
            logits_to_keep=0 if all_logits else 1,
            **vis,
        )
    finally:
        if handle is not None:
            handle.remove()
    pre = Prefilled(out.logits, cache, mask_B_T, pos_B_S, ids_B_S, prompts, reused, entries)
    if caching:
        _store(sampler, pre, keys, [n for _, n in found], hidden[-1] if capture and hidden else None)
    return pre


def full_attention_only(config) -> bool:
    """Whether every layer attends to the whole prefix. A sliding window is measured on cache slots,
    and a pad run in the middle of the layout would widen it, so such models never reuse a prefix."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return getattr(text, "sliding_window", None) is None or getattr(text, "use_sliding_window", True) is False


def _last_hidden(out) -> torch.Tensor | None:
    return out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", None)


def _batch_kv(entries: list[CacheEntry | None], reused: list[int], width_K: int) -> list[tuple]:
    """Per layer (keys, values) [B, H, K, D]: each row's cached prefix right-aligned, zeros (masked) before."""
    first = next(e for e in entries if e is not None)
    batch = []
    for part in ("keys_N_H_T_D", "values_N_H_T_D"):
        layers, heads, _, dim = getattr(first, part).shape
        out_N_B_H_K_D = getattr(first, part).new_zeros((layers, len(entries), heads, width_K, dim))
        for b, (entry, k) in enumerate(zip(entries, reused)):
            if entry is not None and k:
                out_N_B_H_K_D[:, b, :, width_K - k :] = getattr(entry, part)[:, :, :k]
        batch.append(out_N_B_H_K_D)
    return [(batch[0][n], batch[1][n]) for n in range(batch[0].shape[0])]


def _store(sampler, pre: Prefilled, keys: list, matched: list[int], hidden_B_S_E: torch.Tensor | None) -> None:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(pre.cache, "layers", None)
    if sampler.kv_cacheable is None:
        # Sliding-window, linear-attention or shared-KV layers hold no plain KV prefix; an entry
        # stacks the layers, so they must agree in shape.
        sampler.kv_cacheable = (
            bool(layers)
            and all(type(layer) is DynamicLayer and isinstance(layer.keys, torch.Tensor) for layer in layers)
            and len({(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in layers}) == 1
        )
    if not sampler.kv_cacheable:
        return
    assert layers is not None  # checked above: kv_cacheable needs them
    if sampler.head_ok is None:
        sampler.head_ok = hidden_B_S_E is not None and _head_matches(sampler, hidden_B_S_E, pre.logits_B_S_V)
    width_S = pre.ids_B_S.shape[1]
    for b, prompt in enumerate(pre.prompts):
        if matched[b] == len(prompt):
            continue  # an entry already holds all of it
        real_T = pre.mask_B_T[b].bool()
        keys_N_H_T_D = torch.stack([layer.keys[b][:, real_T] for layer in layers])
        values_N_H_T_D = torch.stack([layer.values[b][:, real_T] for layer in layers])
        hidden_T_E = None
        if sampler.head_ok and hidden_B_S_E is not None:
            k, entry = pre.reused[b], pre.entries[b]
            parts = [entry.hidden_T_E[:k]] if k and entry is not None and entry.hidden_T_E is not None else []
            if len(parts) == bool(k):  # a hit whose entry lacks hidden states cannot rebuild them
                hidden_T_E = torch.cat([*parts, hidden_B_S_E[b, width_S - (len(prompt) - k) :]])
        sampler.prefix_cache.store(keys[b], prompt, keys_N_H_T_D, values_N_H_T_D, hidden_T_E)


def _head_matches(sampler, hidden_B_S_E: torch.Tensor, logits_B_S_V: torch.Tensor) -> bool:
    head = sampler.model.get_output_embeddings()
    if head is None:
        return False
    ref_B_V = logits_B_S_V[:, -1].float()
    got_B_V = head(hidden_B_S_E[:, -1:])[:, -1].float()
    # Not a numerics test: a head the model post-processes (soft-capping, scaling) is off by far more.
    return got_B_V.shape == ref_B_V.shape and torch.allclose(got_B_V, ref_B_V, rtol=1e-3, atol=1e-3)


def prompt_logprobs(sampler, pre: Prefilled, top_k: int = 0) -> tuple[list, list | None]:
    """Per prompt log p(token_t | tokens_<t) (first None) and, with top_k, each position's k most likely
    (id, log-prob) pairs: what `TorchSampler.token_logprobs` returns, cached positions included.
    Needs `run(..., all_logits=True)`."""
    if not any(pre.reused):
        return sampler.token_logprobs(pre.logits_B_S_V, pre.ids_B_S, pre.mask_B_T, top_k)
    head = sampler.model.get_output_embeddings()
    width_S = pre.logits_B_S_V.shape[1]
    lps, tops = [], []
    for b, prompt in enumerate(pre.prompts):
        k, entry = pre.reused[b], pre.entries[b]
        fed = len(prompt) - k
        parts = [pre.logits_B_S_V[b, width_S - fed : width_S - 1].float()]  # predict tokens k+1 .. end
        if k:
            assert entry is not None and entry.hidden_T_E is not None  # run() reuses only such entries here
            parts.insert(0, head(entry.hidden_T_E[:k]).float())  # predict tokens 1 .. k
        logp_T_V = torch.log_softmax(torch.cat(parts), dim=-1)
        ids_T = torch.tensor(prompt[1:], device=logp_T_V.device)
        lps.append([None, *logp_T_V.gather(-1, ids_T[:, None]).squeeze(-1).tolist()])
        if top_k:
            top = logp_T_V.topk(min(top_k, logp_T_V.shape[-1]), dim=-1)
            tops.append([None] + [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())])
    return lps, tops if top_k else None
