"""The Reward extension point: a base class, the batch result with per-sample failures, the registry.

A reward scores completions one sample at a time (`score`) or a batch at a time (`score_batch`).
Scoring never aborts a step: a sample whose scoring raises is recorded as failed, with the error,
gets `failure_value`, and is masked out of the advantage (see `RewardResult.valid`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from twinkle.registry import Registry


def completion_text(completion: Any) -> str:
    """The text to score: a string, a `SampledSequence`-like object with `.text`, a chat (the last
    assistant message), or a row with `completion` / `text` / `messages`."""
    if isinstance(completion, str):
        return completion
    text = getattr(completion, "text", None)
    if isinstance(text, str):
        return text
    if isinstance(completion, Mapping):
        for key in ("completion", "text", "response"):
            if isinstance(completion.get(key), str):
                return completion[key]
        if "messages" in completion:
            return completion_text(completion["messages"])
    if isinstance(completion, Sequence) and completion and all(isinstance(m, Mapping) for m in completion):
        for message in reversed(completion):
            if message.get("role") == "assistant":
                return str(message.get("content", ""))
        raise ValueError("the chat has no assistant message to score")
    raise TypeError(
        f"cannot score a {type(completion).__name__}: expected a string, a sampled sequence, "
        "a chat, or a row with 'completion'/'text'/'messages'"
    )


@dataclass
class RewardResult:
    """Scores of one batch. `values[i]` is the total; `components` the named parts (all sum to it
    with their weights); `errors[i]` says why sample i failed ("Name: ExcType: message")."""

    values: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.values)

    # read as the list of totals, as twinkle-kit's rewards return them (zip, sum, indexing)
    def __iter__(self):
        return iter(self.values)

    def __getitem__(self, index):
        return self.values[index]

    @property
    def failed(self) -> list[bool]:
        return [i in self.errors for i in range(len(self.values))]

    @property
    def valid(self) -> list[bool]:
        """Samples whose reward is usable (not failed, finite): the advantage's mask."""
        return [i not in self.errors and math.isfinite(v) for i, v in enumerate(self.values)]

    def tensor(self):
        import torch

        return torch.tensor(self.values, dtype=torch.float32)


class Reward:
    """Base class. Override `score(text, **row) -> float` or `score_batch(texts, rows) -> list[float]`.

    `rows[i]` carries sample i's context (ground truth `answer`, `num_tokens`, anything the dataset
    row held). Call as `reward(completions, rows)`; `rows` may be omitted for context-free rewards.
    """

    aliases: ClassVar[tuple[str, ...]] = ()
    failure_value: float = 0.0

    def __init__(self, name: str | None = None):
        self.name = name or _snake(type(self).__name__)

    def score(self, text: str, **row) -> float:
        raise NotImplementedError(f"{type(self).__name__} implements neither score() nor score_batch()")

    def score_batch(self, texts: list[str], rows: list[dict]) -> list[float]:
        return [self.score(t, **r) for t, r in zip(texts, rows)]

    # What a stateful reward (a running normaliser, a learned scorer's counters) carries across steps,
    # as plain JSON, so an RL checkpoint resumes it (twinkle.rl.checkpoint). Stateless by default.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")

    def __call__(self, completions: Sequence, rows: Sequence[Mapping] | None = None) -> RewardResult:
        """`rows` omitted (or empty, as twinkle-kit passes `[]`): a completion that is a row itself (a
        trajectory with `messages`, twinkle-kit's form) is its own context, `user_data` included."""
        completions = list(completions)
        rows = [row_context(c) for c in completions] if not rows else [dict(r) for r in rows]
        if len(rows) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows of context")
        values: list[float] = [self.failure_value] * len(completions)
        errors: dict[int, str] = {}
        texts: list[str | None] = []
        for i, c in enumerate(completions):
            try:
                texts.append(completion_text(c))
            except Exception as exc:
                texts.append(None)
                errors[i] = f"{self.name}: {type(exc).__name__}: {exc}"
        ok = {i: t for i, t in enumerate(texts) if t is not None}
        try:
            batch = self.score_batch(list(ok.values()), [rows[i] for i in ok])
            if len(batch) != len(ok):
                raise ValueError(
                    f"{type(self).__name__}.score_batch returned {len(batch)} values for {len(ok)} samples"
                )
            for i, v in zip(ok, batch):
                values[i] = _as_float(v)
        except Exception:
            for i in ok:
                try:
                    values[i] = _as_float(self.score_batch([ok[i]], [rows[i]])[0])
                except Exception as exc:
                    values[i] = self.failure_value
                    errors[i] = f"{self.name}: {type(exc).__name__}: {exc}"
        return RewardResult(values, {self.name: list(values)}, errors)


def row_context(completion) -> dict:
    """A trajectory's own fields as a reward's context; twinkle-kit's `user_data` (a list of dicts, or
    of (key, value) pairs) is spread into it. Anything that is not a row has no context."""
    if not isinstance(completion, Mapping):
        return {}
    context = {k: v for k, v in completion.items() if k != "user_data"}
    for item in completion.get("user_data") or ():
        if isinstance(item, Mapping):
            context.update(item)
        elif isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2:
            context[str(item[0])] = item[1]
    return context


def _as_float(value) -> float:
    value = float(value)
    if math.isnan(value):
        raise ValueError("reward is NaN")
    return value


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


REWARDS: Registry[Reward] = Registry("reward", "twinkle.reward", Reward)
register_reward = REWARDS.register


def create_reward(name_or_cls, **kwargs) -> Reward:
    return REWARDS.create(name_or_cls, **kwargs)
