"""The embedded default models: tiny Qwen3s built offline, bit-identical on every machine.

`twinkle://qwen3-tiny` (test preset, ~0.2M parameters), `twinkle://qwen3-demo` (~5M) and
`twinkle://qwen3-small` (~51M, for benchmarks: built only when something asks for it) resolve,
with no network, to an ordinary Hugging Face checkpoint folder in the cache, built on first use from
a fixed config, a fixed seed and the byte-level BPE tokenizer shipped in `assets/`. Everything
downstream loads that folder with `from_pretrained(path)`, exactly as it would a hub checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.hub.cache_folder import publish
from twinkle.hub.checkpoint_files import write_checkpoint
from twinkle.hub.portable_init import portable_init
from twinkle.hub.tokenizer_assets import ASSETS, SCHEME, build_tokenizer, token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

# Bump when the build itself changes (not the presets): it is part of every cache key.
BUILDER_VERSION = 3  # 3: weights drawn by portable_init (bit-identical on any CPU)
EXPECTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "twinkle_embedded.json",
)


@dataclass(frozen=True)
class EmbeddedPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 32768  # Qwen3's own (RoPE); the tiny weights need not be good that far
    seed: int = 0


PRESETS: dict[str, EmbeddedPreset] = {
    "qwen3-tiny": EmbeddedPreset(
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
    ),
    "qwen3-demo": EmbeddedPreset(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    # ~51M: big enough that GEMMs, not per-op overheads, decide a step (benchmarks; never unit tests)
    "qwen3-small": EmbeddedPreset(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
# sha256 over every tensor (`weights_digest`). A build that disagrees is refused, not published: a
# change here means the embedded weights change for everyone (a new init in torch/transformers, or
# an edited preset).
PINNED_WEIGHTS = {
    "qwen3-tiny": "d546a76e9e39e7ee25ab90af7c5572eb6a82f73fcf9e07bc536b0eb93c9932ee",
    "qwen3-demo": "dfca876f16bde7c19e0c23081907fd8c4d42086d871d91e8f5aa7ee60ec74952",
    "qwen3-small": "e17a386121412aa491ebf8e7749ae95ff1a4f67e6db5e14dcf8f5706c8d626b8",
}
DEFAULT_MODEL = SCHEME + "qwen3-demo"
TEST_MODEL = SCHEME + "qwen3-tiny"
SMALL_MODEL = SCHEME + "qwen3-small"


def cache_root() -> Path:
    """`$TWINKLE_CACHE`, else `$XDG_CACHE_HOME/twinkle`, else `~/.cache/twinkle`."""
    if env := os.environ.get("TWINKLE_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "twinkle"


def _fingerprint(name: str, preset: dict, assets: tuple[str, ...] = ("tokenizer.json", "chat_template.jinja")) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"name": name, "preset": preset, "builder": BUILDER_VERSION}, sort_keys=True).encode())
    for asset in assets:
        h.update((ASSETS / asset).read_bytes())
    return h.hexdigest()[:16]


def build_model(name: str, tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    p = PRESETS[name]
    eos, pad = token_ids(tokenizer, ["<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    # Seed a private generator state so building never disturbs the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p.seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    portable_init(model, p.seed, config.initializer_range)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=pad, do_sample=False
    )
    return model


def weights_digest(weights_file: Path) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes) in name order: the weights, not the file."""
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for key, t in sorted(load_file(weights_file).items()):
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_folder(name: str, folder: Path) -> None:
    """Every file of the checkpoint, written by hand.

    transformers' `save_pretrained` decides by itself whether "this rank" should write (with
    torch.distributed initialized, rank 1 writes no weights at all), so it is not used here: an
    embedded build must come out the same from any process.
    """
    from tqdm import tqdm

    bar = tqdm(total=3, desc=f"build {SCHEME}{name}", unit="part", disable=None)  # quiet off a terminal
    tokenizer = build_tokenizer()
    model = build_model(name, tokenizer)
    bar.update()
    write_checkpoint(folder, name, model, tokenizer, asdict(PRESETS[name]), bar)
    bar.close()


def check_folder(name: str, folder: Path, pinned: str | None = None, extra: tuple[str, ...] = ()) -> None:
    pinned = pinned or PINNED_WEIGHTS[name]
    missing = [f for f in EXPECTED_FILES + extra if not (folder / f).is_file()]
    if missing:
        raise RuntimeError(f"building {SCHEME}{name} left out {', '.join(missing)} in {folder}")
    digest = weights_digest(folder / "model.safetensors")
    if digest != pinned:
        import torch
        import transformers

        raise RuntimeError(
            f"building {SCHEME}{name} gave weights {digest[:16]}..., not the pinned "
            f"{pinned[:16]}... (torch {torch.__version__}, transformers "
            f"{transformers.__version__}): this torch/transformers lays the model out differently "
            f"(parameter names or shapes), so results here would not match other machines"
        )


def embedded_path(model_id: str) -> Path:
    """Local folder of an embedded model id, built on first use by exactly one process, verified."""
    from twinkle.hub import embedded_moe as moe  # loaded only when asked
    from twinkle.hub import embedded_vl as vl
    from twinkle.hub import shaped

    name = model_id.removeprefix(SCHEME).strip("/")
    if name in moe.MOE_PRESETS:
        target = cache_root() / "models" / f"{name}-{_fingerprint(name, moe.MOE_PRESETS[name])}"
        return publish(
            target,
            lambda folder: moe.write_moe_folder(name, folder),
            lambda folder: check_folder(name, folder, moe.PINNED_MOE_WEIGHTS[name]),
        )
    if name in vl.VL_PRESETS:
        target = cache_root() / "models" / f"{name}-{_fingerprint(name, vl.VL_PRESETS[name], vl.ASSET_FILES)}"
        return publish(
            target,
            lambda folder: vl.write_vl_folder(name, folder),
            lambda folder: check_folder(name, folder, vl.PINNED_VL_WEIGHTS[name], vl.VL_FILES),
        )
    if name in shaped.SHAPE_PRESETS:  # published shapes, random weights (benchmarks only)
        preset = asdict(shaped.SHAPE_PRESETS[name])
        target = cache_root() / "models" / f"{name}-{_fingerprint(name, preset, ('chat_template.jinja',))}"
        tokenizers = cache_root() / "tokenizers"
        return publish(
            target,
            lambda folder: shaped.write_shape_folder(name, folder, tokenizers),
            lambda folder: shaped.check_shape_folder(name, folder),
        )
    if name not in PRESETS:
        known = [*PRESETS, *moe.MOE_PRESETS, *vl.VL_PRESETS, *shaped.SHAPE_PRESETS]
        raise ValueError(f"unknown embedded model {model_id!r}; known: {', '.join(SCHEME + n for n in known)}")
    target = cache_root() / "models" / f"{name}-{_fingerprint(name, asdict(PRESETS[name]))}"
    return publish(target, lambda folder: write_folder(name, folder), lambda folder: check_folder(name, folder))
