"""HF Qwen3 <-> megatron-core GPTModel: config translation and weight mapping. Pure torch: nothing
here imports megatron, so it is testable (and used for checkpoints) without the extra.

Megatron layout (local layer spec, what MegatronModel builds):
- `linear_qkv` is one matrix whose rows are grouped per query group g (= per KV head):
  [q heads of g (heads/groups x head_dim), k of g (head_dim), v of g (head_dim)], g = 0..G-1;
  megatron splits it per group, so this order is what the attention reads.
- `linear_fc1` is [gate; up] stacked (megatron's GLU chunks its output in two: act(first) * second).
- q/k RMSNorm are `q_layernorm` / `k_layernorm`; tied embeddings have no `output_layer.weight`.
Tensor parallelism cuts column-parallel weights (qkv by whole groups, fc1 gate and up each, the
vocabulary) on dim 0 and row-parallel ones (proj, fc2) on dim 1; pipeline stages own contiguous
layer ranges, renumbered from 0, the first the embedding, the last the final norm and output.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_LAYER = re.compile(r"^(model\.layers|decoder\.layers)\.(\d+)\.(.+)$")
# per-layer names that map one to one (HF suffix -> Megatron suffix)
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def _get(config: PretrainedConfig, name: str, default: Any = None) -> Any:  # a field some configs lack
    return getattr(config, name, default)


def attention_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """(query heads, query groups = KV heads, head_dim)."""
    heads = config.num_attention_heads
    groups = _get(config, "num_key_value_heads") or heads
    head_dim = _get(config, "head_dim") or config.hidden_size // heads
    return heads, groups, head_dim


def rope_theta(config: PretrainedConfig) -> float:
    params = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"MegatronModel maps plain RoPE only; this config has rope_type={params['rope_type']!r}")
    return float(params.get("rope_theta", _get(config, "rope_theta", 10000.0)))


def transformer_config_kwargs(config: PretrainedConfig) -> dict:
    """megatron-core TransformerConfig fields for an HF Qwen3 config (fp32 unless told otherwise).
    The fusions are off: they need CUDA extensions the extra does not install."""
    if _get(config, "model_type") not in ("qwen3", "qwen2"):
        raise ValueError(f"MegatronModel converts Qwen2/Qwen3 configs, got model_type={_get(config, 'model_type')!r}")
    if _get(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"expected a SwiGLU MLP (hidden_act='silu'), got {config.hidden_act!r}")
    heads, groups, head_dim = attention_shape(config)
    return {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": head_dim,
        "ffn_hidden_size": config.intermediate_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": config.rms_norm_eps,
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "add_qkv_bias": bool(_get(config, "attention_bias", False)) or _get(config, "model_type") == "qwen2",
        "qk_layernorm": _get(config, "model_type") == "qwen3",
        "hidden_dropout": 0.0,
        "attention_dropout": float(_get(config, "attention_dropout", 0.0) or 0.0),
        "init_method_std": _get(config, "initializer_range", 0.02),
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
    }


def gpt_model_kwargs(config: PretrainedConfig) -> dict:
    """GPTModel arguments besides the TransformerConfig and the layer spec."""
    return {
        "vocab_size": config.vocab_size,
        "max_sequence_length": config.max_position_embeddings,
        "share_embeddings_and_output_weights": bool(_get(config, "tie_word_embeddings", False)),
        "position_embedding_type": "rope",
        "rotary_base": rope_theta(config),
    }


# -- full (unsharded) state dicts ------------------------------------------------------------------
def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    heads, groups, head_dim = attention_shape(config)
    hidden = q.shape[1:]
    q_G = q.reshape(groups, heads // groups * head_dim, *hidden)
    return torch.cat([q_G, k.reshape(groups, head_dim, *hidden), v.reshape(groups, head_dim, *hidden)], 1).reshape(
        -1, *hidden
    )


def unpack_qkv(qkv: torch.Tensor, config: PretrainedConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, groups, head_dim = attention_shape(config)
    per_group = heads // groups * head_dim
    qkv_G = qkv.reshape(groups, per_group + 2 * head_dim, *qkv.shape[1:])
    q, k, v = qkv_G.split([per_group, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def hf_to_megatron(state: dict[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """An HF Qwen3 state dict as GPTModel's full (tp=pp=1) state dict."""
    tied = bool(_get(config, "tie_word_embeddings", False))
    out, layers = {}, {}
    for name, tensor in state.items():
        m = _LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(2)), {})[m.group(3)] = tensor
        elif name == "lm_head.weight" and tied:
            continue  # the output layer reads the embedding
        elif name in _GLOBAL:
            out[_GLOBAL[name]] = tensor
        elif not name.endswith("rotary_emb.inv_freq"):
            raise KeyError(f"no Megatron name for HF weight {name!r}")
    for i, parts in sorted(layers.items()):
        prefix = f"decoder.layers.{i}."
        qkv = [
            parts.pop(f"self_attn.{p}_proj.{kind}")
            for kind in ("weight", "bias")
            for p in "qkv"
            if f"self_attn.{p}_proj.{kind}" in parts
        ]
        out[prefix + "self_attention.linear_qkv.weight"] = pack_qkv(*qkv[:3], config)
        if len(qkv) == 6:
            out[prefix + "self_attention.linear_qkv.bias"] = pack_qkv(*qkv[3:], config)
        out[prefix + "mlp.linear_fc1.weight"] = torch.cat(
            [parts.pop("mlp.gate_proj.weight"), parts.pop("mlp.up_proj.weight")], 0
        )
        for hf_suffix, tensor in parts.items():
            if hf_suffix not in _DIRECT:
                raise KeyError(f"no Megatron name for HF weight model.layers.{i}.{hf_suffix}")
            out[prefix + _DIRECT[hf_suffix]] = tensor
    return out


def megatron_to_hf(state: dict[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_megatron` (tied models get no separate lm_head.weight)."""
    reverse_global = {v: k for k, v in _GLOBAL.items()}
    reverse_direct = {v: k for k, v in _DIRECT.items()}
    out = {}
    for name, tensor in state.items():
        if name.endswith("_extra_state"):
            continue
        m = _LAYER.match(name)
        if not m:
            if name not in reverse_global:
                raise KeyError(f"no HF name for Megatron weight {name!r}")
            out[reverse_global[name]] = tensor
            continue
        prefix, suffix = f"model.layers.{m.group(2)}.", m.group(3)
        if suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            for p, part in zip("qkv", unpack_qkv(tensor, config)):
                out[f"{prefix}self_attn.{p}_proj.{kind}"] = part
        elif suffix == "mlp.linear_fc1.weight":
            out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = tensor.chunk(2, 0)
        elif suffix in reverse_direct:
            out[prefix + reverse_direct[suffix]] = tensor
        else:
            raise KeyError(f"no HF name for Megatron weight {name!r}")
    return out


# -- tensor and pipeline parallel shards ---------------------------------------------------------
def _split_dim(name: str) -> int | None:
    if name.endswith(COLUMN_PARALLEL) or name.endswith("linear_qkv.bias"):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None  # norms: replicated


def tp_shard(name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor (fc1: its slice of gate and of up)."""
    dim = _split_dim(name)
    if tp_size == 1 or dim is None:
        return tensor
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{name} has {tensor.shape[dim]} rows/cols on dim {dim}: not divisible by tp_size={tp_size}")
    if name.endswith("linear_fc1.weight"):
        return torch.cat([half.chunk(tp_size, 0)[tp_rank] for half in tensor.chunk(2, 0)], 0)
    return tensor.chunk(tp_size, dim)[tp_rank]  # qkv: whole query groups per rank (groups % tp == 0)


def tp_merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `tp_shard` over all TP ranks' slices, in rank order."""
    dim = _split_dim(name)
    if len(shards) == 1 or dim is None:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, 0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)], 0)
    return torch.cat(shards, dim)


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global indices of the decoder layers pipeline stage `pp_rank` owns (even split)."""
    if num_layers % pp_size:
        raise ValueError(f"num_layers={num_layers} is not divisible by pp_size={pp_size}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def stage_state(
    full: dict[str, torch.Tensor],
    config: PretrainedConfig,
    pp_rank: int,
    pp_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The slice of a full Megatron state dict one (pp, tp) rank loads, with local layer numbers."""
    layers = stage_layers(config.num_hidden_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    tied = bool(_get(config, "tie_word_embeddings", False))
    out = {}
    for name, tensor in full.items():
        m = _LAYER.match(name)
        if m:
            if int(m.group(2)) not in layers:
                continue
            name = f"decoder.layers.{int(m.group(2)) - layers.start}.{m.group(3)}"
        elif name.startswith("embedding."):
            if not first:
                if last and tied:  # the last stage keeps its own copy of the tied output weight
                    out["output_layer.weight"] = tp_shard("output_layer.weight", tensor, tp_rank, tp_size)
                continue
        elif not last:
            continue
        out[name] = tp_shard(name, tensor, tp_rank, tp_size)
    return out


def global_layer_name(name: str, pp_rank: int, pp_size: int, num_layers: int) -> str:
    """A stage-local Megatron name with its global layer number."""
    m = _LAYER.match(name)
    if not m:
        return name
    return f"decoder.layers.{int(m.group(2)) + stage_layers(num_layers, pp_rank, pp_size).start}.{m.group(3)}"
