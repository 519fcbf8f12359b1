"""The embedded default models: tiny Qwen3s built offline, bit-identical on every machine.

`twinkle://qwen3-tiny` (test preset, ~0.2M parameters) and `twinkle://qwen3-demo` (~5M) resolve,
with no network, to an ordinary Hugging Face checkpoint folder in the cache, built on first use from
a fixed config, a fixed seed and the byte-level BPE tokenizer shipped in `assets/`. Everything
downstream loads that folder with `from_pretrained(path)`, exactly as it would a hub checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
SCHEME = "twinkle://"
# Bump when the build itself changes (not the presets): it is part of every cache key.
BUILDER_VERSION = 1


@dataclass(frozen=True)
class EmbeddedPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 1024
    seed: int = 0


PRESETS: dict[str, EmbeddedPreset] = {
    "qwen3-tiny": EmbeddedPreset(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    "qwen3-demo": EmbeddedPreset(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}
DEFAULT_MODEL = SCHEME + "qwen3-demo"
TEST_MODEL = SCHEME + "qwen3-tiny"


def cache_root() -> Path:
    """`$TWINKLE_CACHE`, else `$XDG_CACHE_HOME/twinkle`, else `~/.cache/twinkle`."""
    if env := os.environ.get("TWINKLE_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "twinkle"


def _fingerprint(name: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"name": name, "preset": asdict(PRESETS[name]), "builder": BUILDER_VERSION},
                        sort_keys=True).encode())
    for asset in ("tokenizer.json", "chat_template.jinja"):
        h.update((ASSETS / asset).read_bytes())
    return h.hexdigest()[:16]


def build_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(ASSETS / "tokenizer.json"),
        eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
        chat_template=(ASSETS / "chat_template.jinja").read_text(),
        model_max_length=1024, clean_up_tokenization_spaces=False,
    )


def build_model(name: str, tokenizer):
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    p = PRESETS[name]
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads, head_dim=p.head_dim,
        max_position_embeddings=p.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, dtype="float32",
    )
    # Seed a private generator state so building never disturbs the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p.seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad,
                                               bos_token_id=pad, do_sample=False)
    return model


def embedded_path(model_id: str) -> Path:
    """Local folder of an embedded model id, building it on first use (atomic, race-safe)."""
    name = model_id.removeprefix(SCHEME).strip("/")
    if name not in PRESETS:
        raise ValueError(f"unknown embedded model {model_id!r}; known: "
                         f"{', '.join(SCHEME + n for n in PRESETS)}")
    target = cache_root() / "models" / f"{name}-{_fingerprint(name)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        tokenizer = build_tokenizer()
        build_model(name, tokenizer).save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / "twinkle_embedded.json").write_text(
            json.dumps({"model_id": SCHEME + name, "preset": asdict(PRESETS[name])}, indent=2))
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").exists():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
