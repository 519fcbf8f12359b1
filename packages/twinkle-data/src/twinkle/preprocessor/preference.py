"""Preference pairs for DPO-style training: one prompt, a chosen and a rejected reply."""

from __future__ import annotations

from twinkle.dataset.errors import DataError
from twinkle.preprocessor.base import Preprocessor


def _as_messages(value, role: str) -> list[dict]:
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

    def __init__(self, system: str | None = None):
        self.system = system

    def process(self, row):
        prompt = _as_messages(row["prompt"], "user") if row.get("prompt") else []
        if self.system and (not prompt or prompt[0]["role"] != "system"):
            prompt = [{"role": "system", "content": self.system}, *prompt]
        chosen = prompt + _as_messages(row["chosen"], "assistant")
        rejected = prompt + _as_messages(row["rejected"], "assistant")
        if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
            raise DataError("PreferenceProcessor: chosen and rejected must each end with an assistant reply")
        extra = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
        return {**extra, "messages": chosen, "rejected_messages": rejected}
