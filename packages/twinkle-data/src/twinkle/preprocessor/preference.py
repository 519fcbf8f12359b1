"""Preference pairs for DPO-style training: one prompt, a chosen and a rejected reply."""

from __future__ import annotations

from twinkle.dataset.errors import DataError
from twinkle.preprocessor.base import Preprocessor


def _as_messages(value: object, role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return [dict(m) for m in value]
    raise DataError(f"expected a string or a list of messages, got {type(value).__name__}")


class PreferenceProcessor(Preprocessor):
    """``prompt`` + ``chosen`` + ``rejected`` (strings or message lists) -> ``messages`` (prompt +
    chosen) and ``rejected_messages`` (prompt + rejected); the Template encodes both sides.
    Rows whose chosen / rejected already contain the prompt (full conversations) need no ``prompt``."""

    required_columns = ("chosen", "rejected")
    output_columns = ("messages", "rejected_messages")

    def __init__(self, system: str | None = None) -> None:
        self.system = system

    def process(self, row: dict) -> dict:
        prompt = _as_messages(row["prompt"], "user") if row.get("prompt") else []
        if self.system and (not prompt or prompt[0]["role"] != "system"):
            prompt = [{"role": "system", "content": self.system}, *prompt]
        chosen = prompt + _as_messages(row["chosen"], "assistant")
        rejected = prompt + _as_messages(row["rejected"], "assistant")
        if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
            raise DataError("PreferenceProcessor: chosen and rejected must each end with an assistant reply")
        extra = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
        return {**extra, "messages": chosen, "rejected_messages": rejected}


class EmojiDPOProcessor(Preprocessor):
    """twinkle-kit's preference format for shareAI-style rows (``prompt``, a chosen and a rejected
    answer): ``{'positive': {'messages': prompt + chosen}, 'negative': {'messages': prompt + rejected}}``.
    The Template encodes each side into its own row; a training loop interleaves them (chosen, rejected)
    for the preference losses."""

    output_columns = ("positive", "negative")

    def __init__(
        self,
        system: str | None = None,
        chosen_key: str = "answer_zh",
        rejected_key: str = "answer_en",
        prompt_key: str = "prompt",
    ) -> None:
        self.system, self.chosen_key, self.rejected_key, self.prompt_key = system, chosen_key, rejected_key, prompt_key

    def process(self, row: dict) -> dict:
        missing = [k for k in (self.prompt_key, self.chosen_key, self.rejected_key) if k not in row]
        if missing:
            raise DataError(f"EmojiDPOProcessor: the row has no column {missing[0]!r} (it has {', '.join(row)})")
        prompt = [{"role": "system", "content": self.system}] if self.system else []
        prompt.append({"role": "user", "content": row[self.prompt_key]})
        return {
            "positive": {"messages": [*prompt, {"role": "assistant", "content": row[self.chosen_key]}]},
            "negative": {"messages": [*prompt, {"role": "assistant", "content": row[self.rejected_key]}]},
        }
