"""OpenAI's response objects: chat.completion, text_completion, and their SSE chunk streams."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

from fastapi.responses import StreamingResponse

from twinkle.serve.openai.text import Rendered, chat_logprobs, completion_logprobs


def usage(prompts: list[list[int]], results) -> dict:
    n_prompt = sum(len(p) for p in prompts)
    n_sampled = sum(len(s.tokens) for r in results for s in r.sequences)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_sampled, "total_tokens": n_prompt + n_sampled}


def _head(kind: str, model: str) -> dict:
    prefix = "chatcmpl-" if kind.startswith("chat") else "cmpl-"
    return {"id": prefix + uuid.uuid4().hex, "object": kind, "created": int(time.time()), "model": model}


def chat_completion(tokenizer, body, rendered: list[Rendered], usage: dict) -> dict:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": r.text, "refusal": None},
            "logprobs": chat_logprobs(tokenizer, r) if body.logprobs else None,
            "finish_reason": r.finish_reason,
        }
        for i, r in enumerate(rendered)
    ]
    return {**_head("chat.completion", body.model), "choices": choices, "usage": usage}


def completion(tokenizer, body, rendered: list[Rendered], usage: dict) -> dict:
    choices = [
        {
            "index": i,
            "text": r.text,
            "finish_reason": r.finish_reason,
            "logprobs": completion_logprobs(tokenizer, r) if body.logprobs is not None else None,
        }
        for i, r in enumerate(rendered)
    ]
    return {**_head("text_completion", body.model), "choices": choices, "usage": usage}


def chat_chunks(tokenizer, body, rendered: list[Rendered], usage: dict) -> Iterator[dict]:
    head = _head("chat.completion.chunk", body.model)

    def chunk(i, delta, logprobs=None, finish=None):
        return {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    for i, r in enumerate(rendered):
        yield chunk(i, {"role": "assistant", "content": ""})
        for k, piece in enumerate(r.pieces):
            yield chunk(i, {"content": piece}, chat_logprobs(tokenizer, r, k, k + 1) if body.logprobs else None)
        yield chunk(i, {}, finish=r.finish_reason)
    if body.include_usage():
        yield {**head, "choices": [], "usage": usage}


def completion_chunks(tokenizer, body, rendered: list[Rendered], usage: dict) -> Iterator[dict]:
    head = _head("text_completion", body.model)

    def chunk(i, text, logprobs=None, finish=None):
        return {**head, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    for i, r in enumerate(rendered):
        for k, piece in enumerate(r.pieces):
            lps = completion_logprobs(tokenizer, r, k, k + 1) if body.logprobs is not None else None
            yield chunk(i, piece, lps)
        yield chunk(i, "", finish=r.finish_reason)
    if body.include_usage():
        yield {**head, "choices": [], "usage": usage}


def stream(chunks: Iterator[dict]) -> StreamingResponse:
    def events():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
