"""From sampled token ids to OpenAI's choice: the text up to (not including) a stop string or EOS,
the tokens that text came from, where each token's text starts, and their log-probs."""

from __future__ import annotations

from dataclasses import dataclass

from twinkle.sampler import SampledSequence


@dataclass
class Rendered:
    text: str
    starts: list[int]  # each kept token's offset in text
    tokens: list[int]  # the kept tokens
    logprobs: list[float]
    top: list | None  # per kept token: [(id, log-prob), ...] most likely first
    finish_reason: str


def render(tokenizer, seq: SampledSequence, stop: list[str] | None) -> Rendered:
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    text = decode(seq.tokens)
    # each token's end offset: decoding prefixes, so multi-token characters land on the token that completes them
    ends, end = [], 0
    for j in range(len(seq.tokens)):
        end = max(end, len(decode(seq.tokens[: j + 1])))
        ends.append(end)
    cut = min([i for i in (text.find(s) for s in stop or []) if i >= 0], default=len(text))
    text = text[:cut]
    starts = [0, *ends[:-1]]
    kept = [j for j in range(len(seq.tokens)) if starts[j] < cut]  # EOS (no text) and stop-string tokens drop out
    logprobs = seq.logprobs or []  # always asked for (generate: SamplingParams.logprobs)
    return Rendered(
        text,
        [starts[j] for j in kept],
        [seq.tokens[j] for j in kept],
        [logprobs[j] for j in kept],
        [seq.top_logprobs[j] for j in kept] if seq.top_logprobs else None,
        "stop" if seq.stop_reason == "stop" else "length",
    )


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    s = tokenizer.decode([token_id])
    return {"token": s, "logprob": logprob, "bytes": list(s.encode())}


def chat_logprobs(tokenizer, r: Rendered, lo: int = 0, hi: int | None = None) -> dict:
    """`choices[i].logprobs` of a chat completion (tokens lo:hi: one streamed chunk's)."""
    content = []
    for k in range(lo, len(r.tokens) if hi is None else hi):
        entry = _entry(tokenizer, r.tokens[k], r.logprobs[k])
        entry["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in r.top[k]] if r.top else []
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, r: Rendered, lo: int = 0, hi: int | None = None, offset: int = 0) -> dict:
    """`choices[i].logprobs` of a text completion: tokens, token_logprobs, top_logprobs, text_offset."""
    ks = range(lo, len(r.tokens) if hi is None else hi)
    top = None
    if r.top:
        top = [{tokenizer.decode([t]): lp for t, lp in r.top[k]} for k in ks]
    return {
        "tokens": [tokenizer.decode([r.tokens[k]]) for k in ks],
        "token_logprobs": [r.logprobs[k] for k in ks],
        "top_logprobs": top,
        "text_offset": [offset + r.starts[k] for k in ks],
    }
