"""The request bodies this server understands. Unknown fields are refused by name (400), never ignored:
a caller who sends `tools` or `logit_bias` must learn that they did nothing."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from twinkle.client.schema import bounds as B

MAX_N = 64
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        # many OpenAI-compatible clients send every field, unset ones as null: null means "the default"
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = B.MAX_TOKENS.field(None)  # and within the context (core.bounds.sample_cost)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI's own range
    top_p: float = B.TOP_P.field(1.0)
    seed: B.Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None  # an end-user id for abuse tracking: accepted, not used

    # penalties are accepted at their no-op value only
    presence_penalty: Literal[0, 0.0] | None = None  # ty: ignore[invalid-type-form] - pydantic matches 0.0 too
    frequency_penalty: Literal[0, 0.0] | None = None  # ty: ignore[invalid-type-form] - pydantic matches 0.0 too

    def stop_list(self) -> list[str] | None:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (len(stop) > 4 or not all(stop) or max(map(len, stop)) > B.MAX_STOP_CHARS):
            from twinkle.serve.openai.errors import OpenAIError

            raise OpenAIError(
                400, f"stop must be up to 4 non-empty strings of at most {B.MAX_STOP_CHARS} characters", "stop"
            )
        return stop or None

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    url: str  # a data:image/...;base64 URL (openai/images.py: the server fetches nothing)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart | ImagePart]
    name: str | None = None

    def texts(self) -> list[TextPart]:
        return [] if isinstance(self.content, str) else [p for p in self.content if isinstance(p, TextPart)]

    def has_images(self) -> bool:
        return not isinstance(self.content, str) and any(isinstance(p, ImagePart) for p in self.content)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.texts())

    def chars(self) -> int:  # image bytes are bounded by the body limit
        return len(self.content) if isinstance(self.content, str) else sum(len(p.text) for p in self.texts())

    def template_content(self):
        """The content as the chat template reads it: the string, or its parts (images as image_url)."""
        if isinstance(self.content, str) or not self.has_images():
            return self.text()
        return [p.model_dump(exclude_none=True) for p in self.content]


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = B.MAX_TOKENS.field(None)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_chars(self) -> int:
        return sum(m.chars() for m in self.messages)


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = B.MAX_TOKENS.field(16)  # OpenAI's default for this route
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False

    def prompt_chars(self) -> int:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompts)
