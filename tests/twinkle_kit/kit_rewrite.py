"""The edits a twinkle-kit user on a CPU machine without a hub makes to one of its scripts, as a function.

`rewrite(source, sizes)` applies, in order:

1. model ids: every quoted hub model id (`'ms://Qwen/Qwen3.5-4B'`, `'hf://...'`, or a bare `'Qwen/...'`
   of a known model organisation) becomes the embedded model (`twinkle://qwen3-demo`). Where a script
   wraps a model variable in a hub prefix itself (`f'ms://{base_model}'`, `base_model[len('ms://'):]`),
   the prefix goes with the id. transformers' own loaders (`AutoTokenizer.from_pretrained(X)`) cannot
   read `twinkle://` ids, so their argument is passed through `twinkle.hub.resolve_model_path`.
2. dataset ids: a hub dataset id becomes a local file with the same columns (`DATASETS`).
3. devices: `device_type='cuda'` / `'GPU'` / `'gpu'` / `'npu'` becomes `'cpu'`.
4. endpoint: a literal `base_url='...'` / `api_key='...'` becomes the test server's
   (`TWINKLE_SERVER_URL` / `TWINKLE_SERVER_TOKEN`, the variables twinkle-kit's scripts read).
5. checkpoint: a literal checkpoint path given as `model_path='twinkle://...'` (one on the
   maintainers' own server) becomes a checkpoint this suite's own run saved (`TWINKLE_KIT_CHECKPOINT`:
   the tinker:// path of the Tinker LoRA script's last checkpoint on the test server).
6. sizes: the per-script pairs `(old, new)` replace literal sizes (ranks, mesh sizes, slices, steps,
   batch sizes) with smaller ones; for flags (a cookbook .sh's), `rewrite_flags` gives the named flags
   smaller values, and model / dataset ids in flag values go as in 1 and 2.

Every per-script size pair must match, and a script with nothing to rewrite in a category it declares
is an error, so a script that changed upstream fails here instead of silently running unrewritten.
Nothing else in a script changes.
"""

from __future__ import annotations

import re
from pathlib import Path

MODEL = "twinkle://qwen3-demo"
DATA = Path(__file__).parent / "data"
# hub dataset id -> a local file with the same columns (bundled or written for this suite)
DATASETS = {
    "swift/self-cognition": "twinkle://self-cognition",
    "zouxuhong/Countdown-Tasks-3to4": str(DATA / "countdown.jsonl"),
    "modelscope/gsm8k": str(DATA / "gsm8k.jsonl"),
    "hjh0119/shareAI-Llama3-DPO-zh-en-emoji": str(DATA / "dpo_emoji.jsonl"),
}
MODEL_ORGS = ("Qwen", "deepseek-ai", "google", "ZhipuAI", "Shanghai_AI_Laboratory", "meta-llama")

_HUB_ID = re.compile(r"""(['"])(?:(?:ms|hf)://)?([\w.\-]+/[\w.\-]+)\1""")
_PREFIXED_VAR = re.compile(r"""f(['"])(?:ms|hf)://\{(\w+)\}\1""")
_PREFIX_SLICE = re.compile(r"""(\w+)\[len\((['"])(?:ms|hf)://\2\)\s*:\s*\]""")
_DEVICE = re.compile(r"""device_type\s*=\s*(['"])(?:cuda|GPU|gpu|npu|NPU)\1""")
_BASE_URL = re.compile(r"""base_url\s*=\s*(['"])[^'"]*\1""")
_API_KEY = re.compile(r"""api_key\s*=\s*(['"])[^'"]*\1""")
_TOKENIZER = re.compile(r"AutoTokenizer\.from_pretrained\(")
_CHECKPOINT = re.compile(r"""model_path\s*=\s*(['"])(?:twinkle|tinker)://[^'"]*\1""")


class RewriteError(ValueError):
    pass


def _ids(match: re.Match, model: str) -> str:
    quote, name = match.group(1), match.group(2)
    prefixed = match.group(0)[1:].startswith(("ms://", "hf://"))
    if name in DATASETS:
        return f"{quote}{DATASETS[name]}{quote}"
    if prefixed or name.split("/")[0] in MODEL_ORGS:
        return f"{quote}{model}{quote}"
    return match.group(0)  # a path like 'output/fsdp2' or any other string with one slash


def rewrite(source: str, sizes: list[tuple[str, str]] = (), model: str = MODEL) -> str:
    out = _HUB_ID.sub(lambda m: _ids(m, model), source)
    out = _PREFIXED_VAR.sub(lambda m: m.group(2), out)
    out = _PREFIX_SLICE.sub(lambda m: m.group(1), out)
    if _TOKENIZER.search(out):
        out = "import twinkle.hub\n" + _TOKENIZER.sub(
            "AutoTokenizer.from_pretrained(twinkle.hub.resolve_model_path(", out
        )
        out = _close_resolve(out)
    out = _DEVICE.sub("device_type='cpu'", out)
    out = _BASE_URL.sub("base_url=__import__('os').environ['TWINKLE_SERVER_URL']", out)
    out = _API_KEY.sub("api_key=__import__('os').environ['TWINKLE_SERVER_TOKEN']", out)
    out = _CHECKPOINT.sub("model_path=__import__('os').environ['TWINKLE_KIT_CHECKPOINT']", out)
    for old, new in sizes:
        if old not in out:
            raise RewriteError(f"size substitution {old!r} does not occur in the script")
        out = out.replace(old, new)
    for name in DATASETS:
        if name in out:
            raise RewriteError(f"dataset id {name!r} is still in the script after the rewrite")
    return out


def _close_resolve(text: str) -> str:
    """`...from_pretrained(twinkle.hub.resolve_model_path(X, ...)` -> `...(X), ...)`: close the inner
    call after the first argument."""
    marker = "resolve_model_path("
    out, i = [], 0
    while (j := text.find(marker, i)) >= 0:
        out.append(text[i : j + len(marker)])
        k, depth = j + len(marker), 0
        while k < len(text) and not (depth == 0 and text[k] in ",)"):
            depth += text[k] in "([{"
            depth -= text[k] in ")]}"
            k += 1
        out.append(text[j + len(marker) : k] + ")")
        i = k
    out.append(text[i:])
    return "".join(out)


def rewrite_flags(flags: list[str], sizes: dict[str, str] | None = None, model: str = MODEL) -> list[str]:
    """A .sh's flags with hub ids substituted (rules 1-2) and the `sizes` flags given smaller values."""
    sizes = dict(sizes or {})
    out, previous = [], None
    for token in flags:
        given = sizes.pop(previous) if previous in sizes else _HUB_ID.sub(lambda m: _ids(m, model), f"'{token}'")[1:-1]
        out.append(given)
        previous = token
    if sizes:
        raise RewriteError(f"size flags {sorted(sizes)} are not among the script's flags")
    return out
