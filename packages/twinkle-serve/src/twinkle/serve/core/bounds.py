"""Every request's size and every numeric field, checked before anything is allocated or queued.

The ranges are the wire schema's (`twinkle.client.schema.bounds`); this module adds the server's
side: caps from the config (`caps`), the base model's dimensions, and the cost of a request
(tokens x samples, prompt and stop sizes, JSON nesting, module patterns). Every refusal is a 400
naming the field, the value and the range; nothing here touches a backend's state.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from twinkle.client.schema import bounds as B
from twinkle.client.schema.bounds import OutOfRange, Range
from twinkle.serve.core import cost
from twinkle.serve.errors import BadRequest


class ServerCaps(BaseModel):
    """`caps` in the server config: what one request may cost (defaults: a tenant's single request
    holds the engine for well under a second on the embedded models)."""

    model_config = ConfigDict(extra="forbid")
    max_lora_rank: int = Field(128, ge=1)  # also bounded by the base model's widest Linear
    # prompts x num_samples x (prompt + max_tokens) of one sampling request, every API
    max_sample_tokens: int = Field(1 << 18, ge=1)
    # tokens one request may run through the model, every API (twinkle.serve.core.cost): a training pass's
    # rows x longest row, a sampling request's prompt + num_samples x max_tokens. One full context of the
    # embedded models (32,768) by default; within it long work runs in slices (core/slices.py), so this
    # bounds what no slice splits: one row's pass, one prompt's prefill
    max_request_tokens: int = Field(1 << 15, ge=1)
    max_prompt_chars: int = Field(1 << 18, ge=1)  # text tokenized on the server (OpenAI, native chats)
    max_json_depth: int = Field(32, ge=2)  # nesting of kwargs / loss_fn_config / custom loss graphs
    # idempotency answers: kept this long, and at most this many rows (oldest dropped first)
    idempotency_keep_hours: float = Field(24.0, gt=0)
    idempotency_max_rows: int = Field(200_000, ge=100)
    # points per (run, curve name); past it the older half is thinned to every other point
    max_curve_points: int = Field(100_000, ge=100)
    # curve names per run and characters per name a client may log (native `log`): past them a 400
    # naming the limit (5,000 new 1,000-character names a call grew one run's page to 10.5 MB of JSON)
    max_metric_names: int = Field(256, ge=1)
    max_metric_name_chars: int = Field(128, ge=1)
    # images, checked from each header before any is decoded (twinkle.serve.backend.images): one image's
    # bytes (OpenAI's own limit) and pixels (4096x4096: a 12 Mpx photo or a 4K frame fits; decoding one took
    # 0.28 s and 50 MB here; at most PIL's bomb limit), and all of one request's images' pixels
    max_image_bytes: int = Field(20 * 2**20, ge=1024)
    max_image_pixels: int = Field(1 << 24, ge=1, le=89_478_485)
    max_request_image_pixels: int = Field(1 << 26, ge=1)


def check(rng: Range, field: str, value, default=None):
    """`rng.check` as the server's 400."""
    try:
        return rng.check(field, value, default)
    except OutOfRange as e:
        raise BadRequest(str(e)) from None


# ---- LoRA ---------------------------------------------------------------------------------------------
_WIDTHS: dict[int, int] = {}


def model_width(backend) -> int | None:
    """The largest rank any LoRA on this base model can use: max over its Linears of min(in, out)
    (a rank-r product A @ B of an in x out layer has rank at most min(in, out)). None: not in this process."""
    base = backend.base_module
    if base is None:
        return None
    if id(base) not in _WIDTHS:
        import torch

        dims = [min(m.in_features, m.out_features) for m in base.modules() if isinstance(m, torch.nn.Linear)]
        _WIDTHS[id(base)] = max(dims, default=1)
    return _WIDTHS[id(base)]


def lora_rank(field: str, rank, backend, caps: ServerCaps) -> int:
    hi = caps.max_lora_rank
    width = model_width(backend)
    if width is not None:
        hi = min(hi, width)
    try:
        return B.LORA_RANK.below(hi).check(field, rank)
    except OutOfRange as e:
        raise BadRequest(
            f"{e} (the server's max_lora_rank is {caps.max_lora_rank}"
            + (f", the base model's widest layer {width})" if width is not None else ")")
        ) from None


def target_modules(field: str, value) -> None:
    """A user-supplied module pattern: peft matches a string as `re.fullmatch` against every module
    name; here it must compile on the linear-time matcher (twinkle.model.patterns) that the engine
    matches with, so no pattern costs more than its length times the name's."""
    from twinkle.model.patterns import PatternError, compile_pattern

    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for item in items:
        if not isinstance(item, str):
            continue
        if len(item) > B.MAX_TARGET_PATTERN:
            raise BadRequest(f"{field} = {item[:40]!r}... is {len(item)} characters; at most {B.MAX_TARGET_PATTERN}")
        if isinstance(value, str) and value != "all-linear":
            try:
                compile_pattern(item)
            except PatternError as e:
                raise BadRequest(f"{field}: {e}") from None


# ---- optimizer ----------------------------------------------------------------------------------------
ADAM_FIELDS = {
    "learning_rate": B.LEARNING_RATE,
    "beta1": B.BETA,
    "beta2": B.BETA,
    "eps": B.EPS,
    "weight_decay": B.WEIGHT_DECAY,
    "grad_clip_norm": B.TINKER_GRAD_CLIP,
}
# torch-style keyword names of the native set_optimizer (AdamW, SGD, ...)
OPTIMIZER_KWARGS = {"lr": B.LEARNING_RATE, "eps": B.EPS, "weight_decay": B.WEIGHT_DECAY, "momentum": B.BETA}


def adam_params(where: str, raw: dict) -> dict[str, float]:
    """A Tinker AdamParams object's fields, each in its range; an unknown one is a 400 too."""
    out = {}
    for key, value in raw.items():
        if value is None:
            continue
        if key not in ADAM_FIELDS:
            raise BadRequest(f"{where}.{key} is not an AdamParams field; known: {', '.join(ADAM_FIELDS)}")
        out[key] = check(ADAM_FIELDS[key], f"{where}.{key}", value)
    return out


def optimizer_kwargs(kwargs: dict) -> None:
    for key, rng in OPTIMIZER_KWARGS.items():
        if kwargs.get(key) is not None:
            check(rng, f"kwargs.{key}", kwargs[key])
    betas = kwargs.get("betas")
    if betas is not None:
        if not isinstance(betas, list) or len(betas) != 2:
            raise BadRequest(f"kwargs.betas = {betas!r} must be a list of two numbers, each {B.BETA}")
        for i, beta in enumerate(betas):
            check(B.BETA, f"kwargs.betas[{i}]", beta)


# ---- request cost -------------------------------------------------------------------------------------
def json_depth(field: str, value, caps: ServerCaps) -> None:
    """Nesting of a JSON value (kwargs, loss configs, loss graphs), without recursion."""
    stack, limit = [(value, 1)], caps.max_json_depth
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                raise BadRequest(f"{field} nests deeper than {limit} levels (caps.max_json_depth)")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))


def stops(field: str, stop) -> None:
    items = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(items) > B.MAX_STOP:
        raise BadRequest(f"{field} has {len(items)} entries; at most {B.MAX_STOP}")
    for s in items:
        if isinstance(s, str) and len(s) > B.MAX_STOP_CHARS:
            raise BadRequest(f"{field} has a {len(s)}-character string; at most {B.MAX_STOP_CHARS}")


def prompt_chars(field: str, chars: int, caps: ServerCaps) -> None:
    """Text the server tokenizes (on the event loop or the worker): bounded before it is."""
    if chars > caps.max_prompt_chars:
        raise BadRequest(f"{field} has {chars} characters; at most {caps.max_prompt_chars} (caps.max_prompt_chars)")


def sample_cost(
    prompt_lens: list[int], n: int, max_tokens: int | None, max_context: int, caps: ServerCaps, field="max_tokens"
) -> None:
    """max_tokens (named `field` on the wire) within the context for every prompt, tokens x samples
    under caps.max_sample_tokens, and the request's cost under caps.max_request_tokens."""

    check(B.NUM_SAMPLES, "num_samples", n)
    longest = max(prompt_lens, default=0)
    if max_tokens is not None:
        check(B.MAX_TOKENS, field, max_tokens)
    if longest >= max_context:
        raise BadRequest(f"prompt ({longest}) fills the context of {max_context}: no room to sample")
    if max_tokens is not None and longest + max_tokens > max_context:
        raise BadRequest(
            f"{field} = {max_tokens} is outside its range: prompt ({longest}) + max_tokens ({max_tokens}) "
            f"exceeds the context of {max_context}"
        )
    total = sum(n * (p + (max_tokens if max_tokens is not None else max_context - p)) for p in prompt_lens)
    if total > caps.max_sample_tokens:
        raise BadRequest(
            f"this request would decode up to {total} tokens (prompts x num_samples x (prompt + max_tokens)); "
            f"at most {caps.max_sample_tokens} (caps.max_sample_tokens): lower num_samples or max_tokens"
        )
    cost.admit(cost.sampling(prompt_lens, n, max_tokens, max_context), caps.max_request_tokens, "sampling")
