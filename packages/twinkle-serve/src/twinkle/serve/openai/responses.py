"""OpenAI's response objects: chat.completion, text_completion, and their SSE chunk streams."""

from __future__ import annotations

import json
import time
import uuid

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


class ChatChunks:
    """chat.completion.chunk objects, built one delta at a time as a stream produces them."""

    def __init__(self, tokenizer, body):
        self.tokenizer, self.body = tokenizer, body
        self.head = _head("chat.completion.chunk", body.model)

    def _chunk(self, i: int, delta: dict, logprobs=None, finish=None) -> dict:
        return {**self.head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def opening(self, i: int) -> list[dict]:
        return [self._chunk(i, {"role": "assistant", "content": ""})]

    def piece(self, i: int, text: str, r: Rendered, lo: int, hi: int) -> dict:
        logprobs = chat_logprobs(self.tokenizer, r, lo, hi) if self.body.logprobs else None
        return self._chunk(i, {"content": text}, logprobs)

    def finish(self, i: int, reason: str) -> dict:
        return self._chunk(i, {}, finish=reason)

    def usage(self, usage: dict) -> list[dict]:
        return [{**self.head, "choices": [], "usage": usage}] if self.body.include_usage() else []


class CompletionChunks(ChatChunks):
    """text_completion chunks: no role opening; `text` instead of `delta`."""

    def __init__(self, tokenizer, body):
        super().__init__(tokenizer, body)
        self.head = _head("text_completion", body.model)

    def _text(self, i: int, text: str, logprobs=None, finish=None) -> dict:
        return {**self.head, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def opening(self, i: int) -> list[dict]:
        return []

    def piece(self, i: int, text: str, r: Rendered, lo: int, hi: int) -> dict:
        logprobs = completion_logprobs(self.tokenizer, r, lo, hi) if self.body.logprobs is not None else None
        return self._text(i, text, logprobs)

    def finish(self, i: int, reason: str) -> dict:
        return self._text(i, "", finish=reason)


def sse(event: dict | str) -> str:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"
