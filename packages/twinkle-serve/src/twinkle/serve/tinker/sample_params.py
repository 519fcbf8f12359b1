"""Reading an asample request's prompt and sampling options (Tinker semantics), each field checked:
a bad one is a 400 naming it, never a server error mid-sample."""

from __future__ import annotations

from twinkle.client.schema import bounds as B
from twinkle.sampler import SamplingParams
from twinkle.serve.backend import UserError
from twinkle.serve.core import bounds
from twinkle.serve.core.bounds import ServerCaps
from twinkle.serve.errors import BadRequest
from twinkle.serve.tinker import codec, dmel, images
from twinkle.serve.tinker.bodies import ASampleBody
from twinkle.serve.tinker.prompt_scores import PromptAsks

# A response carries (prompt length or num_samples x max_tokens) x k pairs: bound k, and the prompt's table.
MAX_TOPK_LOGPROBS = 256
MAX_TOPK_PROMPT_CELLS = 1 << 22  # len(prompt) x topk_prompt_logprobs: 32 MB of response
MAX_NUM_SAMPLES = B.NUM_SAMPLES.hi


def prompt_tokens(chunks: list[dict]) -> tuple[list[int], list]:
    """(the prompt's text tokens, its image chunks at their token positions: tinker/images.py)."""
    tokens, pieces = [], []
    for k, c in enumerate(chunks):
        kind = c.get("type", "encoded_text")
        if kind == "image":
            pieces.append(images.from_json(c, len(tokens), f"prompt chunk {k}"))
        elif kind == images.ASSET_POINTER:
            raise images.asset_pointer_refused(f"prompt chunk {k}")
        elif kind == dmel.DMEL:
            raise BadRequest(dmel.refused(f"prompt chunk {k}"))
        elif kind != "encoded_text":
            raise BadRequest(f"{kind} prompt chunks are not supported by this server (text and images)")
        else:
            tokens += _chunk_tokens(c)
    return tokens, pieces


def _chunk_tokens(chunk: dict) -> list[int]:
    tokens = chunk.get("tokens", [])
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise BadRequest("prompt chunk tokens must be a list of integer token ids")
    return tokens


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _at_least(name: str, v: int | None, lo: int) -> None:
    if v is not None and v < lo:
        raise BadRequest(f"{name} must be an integer >= {lo}, got {v!r}")


def _stops(stop) -> list | None:
    """sampling_params.stop as a list (a string is one stop), checked; None: stop at EOS."""
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(items, list)
        or not all((isinstance(s, str) and s) or (_is_int(s) and s >= 0) for s in items)
        or not (all(isinstance(s, str) for s in items) or all(_is_int(s) for s in items))
    ):
        raise BadRequest(
            f"sampling_params.stop must be a string, a list of non-empty strings, or a list of token ids >= 0, got {stop!r}"
        )
    bounds.stops("sampling_params.stop", items)
    return items


def sample_params(
    body: ASampleBody, prompt_len: int, vocab_size: int, max_context: int, caps: ServerCaps | None = None
) -> tuple[SamplingParams, PromptAsks]:
    """The asample body's options, checked beyond their types and ranges (a 400 naming the field) -> (the
    sampler's SamplingParams, what it asks beyond sampling). max_tokens must fit beside the prompt (None:
    what the context leaves), and num_samples x (prompt + max_tokens) under `caps.max_sample_tokens`."""
    sp = body.sampling_params
    stop = _stops(sp.stop)
    bounds.sample_cost([prompt_len], body.num_samples, sp.max_tokens, max_context, caps or ServerCaps())
    topk_prompt, topk_sample = body.topk_prompt_logprobs, body.topk_sample_logprobs
    for name, k in (("topk_prompt_logprobs", topk_prompt), ("topk_sample_logprobs", topk_sample)):
        _at_least(name, k, 0)
        if k > min(vocab_size, MAX_TOPK_LOGPROBS):
            raise BadRequest(f"{name} must be at most {min(vocab_size, MAX_TOPK_LOGPROBS)}, got {k}")
    if prompt_len * topk_prompt > MAX_TOPK_PROMPT_CELLS:
        raise BadRequest(
            f"topk_prompt_logprobs {topk_prompt} x prompt length {prompt_len} exceeds {MAX_TOPK_PROMPT_CELLS} cells"
        )
    alt_k = body.prompt_alt_tokens_k
    _at_least("prompt_alt_tokens_k", alt_k, 0)
    if prompt_len * alt_k > MAX_TOPK_PROMPT_CELLS:
        raise BadRequest(f"prompt_alt_tokens_k {alt_k} x prompt length {prompt_len} exceeds {MAX_TOPK_PROMPT_CELLS}")
    targets = layout = None
    if body.target_prompt_logprobs is not None:
        try:
            targets, layout = codec.decode_target_ids(
                body.target_prompt_logprobs, prompt_len, vocab_size, MAX_TOPK_PROMPT_CELLS
            )
        except UserError as e:
            raise BadRequest(str(e)) from None
    last_n = body.prompt_logprobs_last_n
    _at_least("prompt_logprobs_last_n", last_n, 1)
    if last_n is not None:
        if not body.prompt_logprobs:
            raise BadRequest("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
        if last_n > prompt_len - 1:
            raise BadRequest(
                f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {prompt_len - 1}, got {last_n}"
            )
    stop_nothing = stop == []  # Tinker: an explicit empty list turns off every stop, EOS included
    try:
        params = SamplingParams(
            max_tokens=sp.max_tokens if sp.max_tokens is not None else max_context - prompt_len,  # sample_cost: >= 1
            temperature=sp.temperature,
            top_k=0 if sp.top_k == -1 else sp.top_k,  # Tinker's -1: no top-k, the sampler's 0
            top_p=sp.top_p,
            seed=sp.seed,
            stop=list[str | int](stop) if stop else None,
            ignore_eos=stop_nothing,
            num_samples=body.num_samples,
            logprobs=topk_sample or True,
            prompt_logprobs=topk_prompt or bool(body.prompt_logprobs),
        )
    except ValueError as e:  # SamplingParams' own checks, each naming its field
        raise BadRequest(str(e)) from None
    asks = PromptAsks(
        prompt_logprobs=bool(body.prompt_logprobs),
        topk_prompt=topk_prompt,
        topk_sample=topk_sample,
        prompt_logprobs_last_n=last_n,
        target_prompt_ids=targets,
        target_layout=layout,
        prompt_alt_tokens_k=alt_k,
    )
    return params, asks
