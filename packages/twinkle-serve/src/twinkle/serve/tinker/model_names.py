"""Base-model names as Tinker clients send them, and what the server says about each model.

Tinker names long-context variants with a suffix, `<base>:peft:<context>` (cookbook 0.6.1 model ids
such as `Qwen/Qwen3.5-397B-A17B:peft:262144`; SDK 0.38 itself adds none). Such a name means the base
model, asked to serve at least `<context>` tokens: accepted wherever a base model is named when the
server's backend serves that much (a run or sampler then gets the model's whole context), refused
with a 400 naming the maximum otherwise. Our embedded names contain a ':' already
(`twinkle://qwen3-demo`), so the suffix is matched from the right. A model entry's `aliases` (config)
are more names for the same engine, e.g. the hub ids a cookbook recipe hard-codes.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from twinkle.serve.core import bounds
from twinkle.serve.errors import BadRequest
from twinkle.serve.tinker.sample_params import MAX_TOPK_LOGPROBS

_SUFFIX = re.compile(r"^(?P<base>.+):peft:(?P<context>[^:]*)$")


def split(name) -> tuple[str | None, int | None]:
    """`<base>:peft:<n>` -> (base, n); any other name -> (name, None); a malformed suffix is a 400."""
    if not isinstance(name, str):
        return name, None
    m = _SUFFIX.match(name)
    if m is None:
        return name, None
    ctx = m.group("context")
    if not ctx.isdigit() or int(ctx) < 1:
        raise BadRequest(f"model name {name!r}: the ':peft:' suffix takes a context length in tokens, got {ctx!r}")
    return m.group("base"), int(ctx)


def engine(rt, name):
    """The engine serving `name` (a plain or suffixed base-model name, or the model's local folder: see
    `by_folder`); 400 for a context it cannot serve."""
    base, context = split(name)
    eng = by_folder(rt, base) or by_alias(rt, base) or rt.engine(base)
    served = eng.backend.max_context
    if context is not None and context > served:
        raise BadRequest(
            f"model {name!r} asks for a context of {context} tokens; {eng.entry.name!r} serves at most "
            f"{served} here (name it {eng.entry.name}:peft:{served} or less)"
        )
    return eng


def by_alias(rt, name):
    """The engine whose config entry lists `name` among its `aliases` (a hub id a script hard-codes,
    served by this model): the run or sampler is then recorded under the entry's own name."""
    if not isinstance(name, str) or name in rt.engines:
        return None
    return next((eng for eng in rt.engines.values() if name in eng.entry.aliases), None)


def by_folder(rt, name):
    """The engine whose model folder `name` is. SamplingClient.get_tokenizer() (SDK 0.38) loads
    AutoTokenizer.from_pretrained(base_model.split(":")[0]): for `twinkle://...` names that is
    "twinkle", which resolves nowhere; a sampler created with the folder as its base_model (the path
    get_info returns as tokenizer_id) gets a tokenizer that loads offline, with no SDK patch."""
    if not isinstance(name, str) or not name.startswith("/") or name in rt.engines:
        return None
    for eng in rt.engines.values():
        folder = eng.backend.tokenizer_path
        if folder and Path(folder).resolve() == Path(name).resolve():
            return eng
    return None


@lru_cache(maxsize=64)
def _model_type(folder: str) -> str | None:
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def arch(eng) -> str | None:
    """The model's architecture as its config names it (`model_type`: qwen3, llama, ...)."""
    folder = eng.backend.tokenizer_path or eng.entry.path
    return _model_type(str(folder)) if folder else None


def capabilities(rt) -> list[dict]:
    """get_server_capabilities' rows: each base model with its real context and caps."""
    caps = getattr(rt.config, "caps", None)  # per-request bounds, where this server has them
    rows = []
    for name, eng in rt.engines.items():
        row = {
            "model_name": name,
            "max_context_length": eng.backend.max_context,
            "trainable": True,
            "sampleable": True,
            "arch": arch(eng),
            "max_topk_logprobs": min(eng.backend.vocab_size, MAX_TOPK_LOGPROBS),
            "base_dtype": eng.backend.base_dtype(),
        }
        if caps is not None and getattr(caps, "max_lora_rank", None):
            width = bounds.model_width(eng.backend)  # no LoRA on this model can use a higher rank
            row["max_lora_rank"] = caps.max_lora_rank if width is None else min(caps.max_lora_rank, width)
        rows.append(row)  # (any `name:peft:<n>` up to max_context_length is accepted; not listed twice)
        rows += [{**row, "model_name": alias} for alias in eng.entry.aliases]  # a name clients may send
    return rows
