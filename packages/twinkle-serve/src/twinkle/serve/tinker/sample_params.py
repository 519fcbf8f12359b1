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
from twinkle.serve.tinker.prompt_scores import PromptAsks

# A response carries (prompt length or num_samples x max_tokens) x k pairs: bound k, and the prompt's table.
MAX_TOPK_LOGPROBS = 256
MAX_TOPK_PROMPT_CELLS = 1 << 22  # len(prompt) x topk_prompt_logprobs: 32 MB of response
MAX_NUM_SAMPLES = B.NUM_SAMPLES.hi


def prompt_tokens(model_input) -> tuple[list[int], list]:
    """(the prompt's text tokens, its image chunks at their token positions: tinker/images.py)."""
    chunks = model_input.get("chunks", []) if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        raise BadRequest('prompt must be a ModelInput: {"chunks": [...]}')
    tokens, pieces = [], []
    for k, c in enumerate(chunks):
        kind = c.get("type") if isinstance(c, dict) else None
        if kind == "image":
            pieces.append(images.from_json(c, len(tokens), f"prompt chunk {k}"))
        elif kind == images.ASSET_POINTER:
            raise images.asset_pointer_refused(f"prompt chunk {k}")
        elif kind == dmel.DMEL:
            raise BadRequest(dmel.refused(f"prompt chunk {k}"))
        else:
            tokens += _chunk_tokens(c)
    return tokens, pieces


def num_samples(body: dict) -> int:
    return bounds.check(B.NUM_SAMPLES, "num_samples", body.get("num_samples"), 1)


def _chunk_tokens(chunk: dict) -> list[int]:
    if not isinstance(chunk, dict):
        raise BadRequest(f"prompt chunks must be objects, got {chunk!r}")
    if chunk.get("type", "encoded_text") != "encoded_text":
        raise BadRequest(f"{chunk.get('type')} prompt chunks are not supported by this server (text and images)")
    tokens = chunk.get("tokens", [])
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise BadRequest("prompt chunk tokens must be a list of integer token ids")
    return tokens


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(d: dict, name: str, default, *, lo: int | None = None, where: str = ""):
    """d[name] as an int (absent or null: `default`), else a 400 naming the field."""
    v = d.get(name)
    if v is None:
        return default
    if not _is_int(v) or (lo is not None and v < lo):
        raise BadRequest(f"{where}{name} must be an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}")
    return v


def sample_params(
    body: dict, prompt_len: int, vocab_size: int, max_context: int, caps: ServerCaps | None = None
) -> tuple[SamplingParams, PromptAsks]:
    """The asample body's options, checked (a 400 naming the field) -> (the sampler's SamplingParams, what it
    asks beyond sampling). max_tokens must fit beside the prompt (None: what the context leaves), and
    num_samples x (prompt + max_tokens) under `caps.max_sample_tokens`."""
    if body.get("record_stability_info") not in (None, False, True):  # recorded by tinker/provenance.py
        raise BadRequest(f"record_stability_info must be a boolean, got {body['record_stability_info']!r}")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    stop = sp.get("stop")
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(items, list)
            or not all((isinstance(s, str) and s) or (_is_int(s) and s >= 0) for s in items)
            or not (all(isinstance(s, str) for s in items) or all(_is_int(s) for s in items))
        ):
            raise BadRequest(
                "sampling_params.stop must be a string, a list of non-empty strings, or a list of "
                f"token ids >= 0, got {stop!r}"
            )
        stop = items
        bounds.stops("sampling_params.stop", stop)
    top_k = bounds.check(B.TOP_K, "sampling_params.top_k", sp.get("top_k"), -1)
    temperature = bounds.check(B.TEMPERATURE, "sampling_params.temperature", sp.get("temperature"), 1.0)
    top_p = bounds.check(B.TOP_P, "sampling_params.top_p", sp.get("top_p"), 1.0)
    max_tokens = (
        None
        if sp.get("max_tokens") is None
        else bounds.check(B.MAX_TOKENS, "sampling_params.max_tokens", sp["max_tokens"])
    )
    seed = None if sp.get("seed") is None else bounds.check(B.SEED, "sampling_params.seed", sp["seed"])
    bounds.sample_cost([prompt_len], num_samples(body), max_tokens, max_context, caps or ServerCaps())
    topk_prompt = _int(body, "topk_prompt_logprobs", 0, lo=0)
    topk_sample = _int(body, "topk_sample_logprobs", 0, lo=0)
    for name, k in (("topk_prompt_logprobs", topk_prompt), ("topk_sample_logprobs", topk_sample)):
        if k > min(vocab_size, MAX_TOPK_LOGPROBS):
            raise BadRequest(f"{name} must be at most {min(vocab_size, MAX_TOPK_LOGPROBS)}, got {k}")
    if prompt_len * topk_prompt > MAX_TOPK_PROMPT_CELLS:
        raise BadRequest(
            f"topk_prompt_logprobs {topk_prompt} x prompt length {prompt_len} exceeds {MAX_TOPK_PROMPT_CELLS} cells"
        )
    alt_k = _int(body, "prompt_alt_tokens_k", 0, lo=0)
    if prompt_len * alt_k > MAX_TOPK_PROMPT_CELLS:
        raise BadRequest(f"prompt_alt_tokens_k {alt_k} x prompt length {prompt_len} exceeds {MAX_TOPK_PROMPT_CELLS}")
    targets = layout = None
    if body.get("target_prompt_logprobs") is not None:
        try:
            targets, layout = codec.decode_target_ids(
                body["target_prompt_logprobs"], prompt_len, vocab_size, MAX_TOPK_PROMPT_CELLS
            )
        except UserError as e:
            raise BadRequest(str(e)) from None
    last_n = _int(body, "prompt_logprobs_last_n", None, lo=1)
    if last_n is not None:
        if not body.get("prompt_logprobs"):
            raise BadRequest("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
        if last_n > prompt_len - 1:
            raise BadRequest(
                f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {prompt_len - 1}, got {last_n}"
            )
    stop_nothing = stop == []  # Tinker: an explicit empty list turns off every stop, EOS included
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max_context - prompt_len,  # sample_cost: >= 1
            temperature=temperature,
            top_k=0 if top_k == -1 else top_k,  # Tinker's -1: no top-k, the sampler's 0
            top_p=top_p,
            seed=seed,
            stop=list[str | int](stop) if stop else None,
            ignore_eos=stop_nothing,
            num_samples=num_samples(body),
            logprobs=topk_sample or True,
            prompt_logprobs=topk_prompt or bool(body.get("prompt_logprobs")),
        )
    except ValueError as e:  # SamplingParams' own checks, each naming its field
        raise BadRequest(str(e)) from None
    asks = PromptAsks(
        prompt_logprobs=bool(body.get("prompt_logprobs")),
        topk_prompt=topk_prompt,
        topk_sample=topk_sample,
        prompt_logprobs_last_n=last_n,
        target_prompt_ids=targets,
        target_layout=layout,
        prompt_alt_tokens_k=alt_k,
    )
    return params, asks
