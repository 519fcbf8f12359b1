"""What a caller asks of a sampler (SamplingParams) and what comes back (SampledSequence, SampleResponse)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from twinkle.sampler.input_feature import build_input_feature

StopReason = Literal["stop", "length"]


@dataclass
class SamplingParams:
    """How to sample. `temperature=0` is greedy; `stop` takes strings, token ids, or a mix.

    `logprobs`: True returns the log-prob of each sampled token; an int k > 0 also returns the k most
    likely tokens at each step. Log-probs are always the model's own distribution (temperature 1, no
    top-k/top-p truncation), so they equal a teacher-forced forward of the trainer: the on-policy quantity.
    `prompt_logprobs`: True returns log p(prompt token | prefix) at every prompt position; an int k > 0
    also returns the k most likely tokens at each position (0 is False: nothing).
    `ignore_eos`: keep going past end-of-sequence tokens; stop entries still apply.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0
    seed: int | None = None
    stop: str | int | list[str | int] | None = None
    num_samples: int = 1
    logprobs: bool | int = True
    prompt_logprobs: bool | int = False
    ignore_eos: bool = False

    def __post_init__(self):
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            problems.append(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            problems.append(f"num_samples must be an int >= 1, got {self.num_samples!r}")
        if not isinstance(self.logprobs, (bool, int)) or self.logprobs < 0:
            problems.append(f"logprobs must be a bool or an int >= 0, got {self.logprobs!r}")
        if not isinstance(self.prompt_logprobs, (bool, int)) or self.prompt_logprobs < 0:
            problems.append(f"prompt_logprobs must be a bool or an int >= 0, got {self.prompt_logprobs!r}")
        for item in self.stop_strings + self.stop_token_ids:
            if item == "" or (isinstance(item, int) and item < 0):
                problems.append(f"stop entries must be non-empty strings or token ids >= 0, got {item!r}")
        bad = [s for s in self._stop_list() if not isinstance(s, (str, int)) or isinstance(s, bool)]
        if bad:
            problems.append(f"stop entries must be strings or token ids, got {bad!r}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    def _stop_list(self) -> list:
        if self.stop is None:
            return []
        return list(self.stop) if isinstance(self.stop, (list, tuple)) else [self.stop]

    @property
    def stop_strings(self) -> list[str]:
        return [s for s in self._stop_list() if isinstance(s, str)]

    @property
    def stop_token_ids(self) -> list[int]:
        return [s for s in self._stop_list() if isinstance(s, int) and not isinstance(s, bool)]

    @property
    def top_logprobs(self) -> int:
        """How many alternatives per step to return (0: none). `True` means the sampled token only."""
        return 0 if isinstance(self.logprobs, bool) else int(self.logprobs)

    @property
    def prompt_top_logprobs(self) -> int:
        """How many alternatives per prompt position to return (0: none)."""
        return 0 if isinstance(self.prompt_logprobs, bool) else int(self.prompt_logprobs)

    @classmethod
    def from_dict(cls, data: dict | SamplingParams | None) -> SamplingParams:
        if data is None:
            return cls()
        if isinstance(data, SamplingParams):
            return data
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown SamplingParams fields {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**data)


@dataclass
class SampledSequence:
    """One generated continuation. `tokens` excludes the prompt and keeps the stop text/token."""

    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: StopReason
    text: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def decoded(self) -> str | None:
        """twinkle-kit's name for `text`."""
        return self.text

    # twinkle-kit's new_input_feature is built from the prompt; it is kept off the dataclass fields, so
    # asdict, equality and what goes over the wire stay the continuation's own
    @property
    def new_input_feature(self) -> dict | None:
        """The prompt and this continuation as one row ready for training (`twinkle.sampler.input_feature`);
        None for a sequence built outside a SampleResponse. Built on first read, then the same dict."""
        cached = self.__dict__.get("_new_input_feature")
        if cached is None and "_prompt" in self.__dict__:
            prompt_tokens, prompt = self.__dict__["_prompt"]
            cached = build_input_feature(prompt_tokens, self.tokens, self.text, prompt)
            self.__dict__["_new_input_feature"] = cached
        return cached

    def follow(self, prompt_tokens: list[int], prompt: Any = None) -> None:
        """Say which prompt this continues (`prompt`: the item the sampler was given), for new_input_feature."""
        self.__dict__["_prompt"] = (prompt_tokens, prompt)
        self.__dict__.pop("_new_input_feature", None)


@dataclass
class SampleResponse:
    """The sequences of one prompt (`num_samples` of them) and the weights that produced them.

    `prompt_logprobs[0]` is None (the first token has no context); the rest are log p(token | prefix).
    `prompt_top_logprobs[t]` (when `prompt_logprobs=k`) are the k most likely (token id, log-prob) pairs
    of the distribution that predicts prompt token t, most likely first; `[0]` is None.
    """

    sequences: list[SampledSequence]
    prompt_tokens: list[int]
    adapter_name: str | None = None
    weight_version: int = 0
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    cached_prompt_tokens: int = 0  # prompt tokens whose KV the prefix cache supplied (its first prefill)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for sequence in self.sequences:
            sequence.follow(self.prompt_tokens)
