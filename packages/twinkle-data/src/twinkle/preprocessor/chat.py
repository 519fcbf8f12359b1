"""Preprocessors for supervised chat data: self-cognition, Alpaca, and messages / ShareGPT normalisation."""

from __future__ import annotations

import json
from typing import Any

from twinkle.dataset.errors import DataError
from twinkle.preprocessor.base import Preprocessor


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + messages


class SelfCognitionProcessor(Preprocessor):
    """``query`` / ``response`` rows with ``{{NAME}}`` / ``{{AUTHOR}}`` placeholders -> a two-turn
    conversation about who the model is, with the placeholders filled in."""

    required_columns = ("query", "response")

    def __init__(
        self,
        name: str | None = None,
        author: str | None = None,
        system: str | None = None,
        *,
        model_name: str | None = None,
        model_author: str | None = None,
    ) -> None:
        """``model_name`` / ``model_author`` are twinkle-kit's names for ``name`` / ``author``."""
        for ours, theirs, label in ((name, model_name, "name"), (author, model_author, "author")):
            if ours is not None and theirs is not None:
                raise TypeError(f"SelfCognitionProcessor got both {label} and model_{label}: pass one")
            if ours is None and theirs is None:
                raise TypeError(f"SelfCognitionProcessor needs the model's {label} (or model_{label}=)")
        self.name: str = name if name is not None else model_name  # ty: ignore[invalid-assignment] - one is set, checked above
        self.author: str = author if author is not None else model_author  # ty: ignore[invalid-assignment]
        self.system = system

    def _fill(self, text: str) -> str:
        return text.replace("{{NAME}}", self.name).replace("{{AUTHOR}}", self.author)

    def process(self, row: dict) -> dict:
        return {
            "messages": _with_system(
                [
                    {"role": "user", "content": self._fill(row["query"])},
                    {"role": "assistant", "content": self._fill(row["response"])},
                ],
                self.system,
            )
        }


class AlpacaProcessor(Preprocessor):
    """``instruction`` / ``input`` / ``output`` -> user (instruction, then input if any) and assistant."""

    required_columns = ("instruction", "output")

    def __init__(self, system: str | None = None) -> None:
        self.system = system

    def process(self, row: dict) -> dict:
        prompt = row["instruction"]
        if row.get("input"):
            prompt = f"{prompt}\n\n{row['input']}"
        return {
            "messages": _with_system(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}],
                row.get("system") or self.system,
            )
        }


# ShareGPT speaker names and OpenAI-style roles to the roles chat templates know.
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
    "ipython": "tool",
    "function_call": "assistant",
}
CONVERSATION_COLUMNS = ("messages", "conversations", "conversation", "dialog")


class MessagesProcessor(Preprocessor):
    """Any conversation column (``messages``, ``conversations``, ...; ``role/content`` or ShareGPT
    ``from/value``) -> standard ``messages``; a ``system`` column becomes the first message,
    ``tools`` is kept as a JSON string, ShareGPT ``function_call`` turns become assistant tool calls."""

    output_columns = ("messages", "tools")

    def __init__(self, system: str | None = None) -> None:
        self.system = system

    def check_columns(self, row: dict, index: int | None = None) -> None:
        if not any(c in row for c in CONVERSATION_COLUMNS):
            where = f"row {index}" if index is not None else "a row"
            raise DataError(
                f"{where} has no conversation column for {type(self).__name__} (looked for "
                f"{', '.join(CONVERSATION_COLUMNS)}; the row has {', '.join(row)})"
            )

    def _message(self, turn: dict, index_hint: str) -> dict:
        speaker = turn.get("role") or turn.get("from")
        role = ROLE_ALIASES.get(str(speaker).lower())
        if role is None:
            raise DataError(f"{index_hint}: unknown speaker {speaker!r}; expected one of {', '.join(ROLE_ALIASES)}")
        content = turn.get("content", turn.get("value"))
        message: dict[str, Any] = {"role": role, "content": "" if content is None else str(content)}
        if str(speaker).lower() == "function_call":  # ShareGPT keeps the call as JSON text in value
            try:
                call = json.loads(message["content"])
            except json.JSONDecodeError:
                raise DataError(f"{index_hint}: function_call value is not JSON: {message['content'][:80]!r}") from None
            message = {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": call["name"],
                            "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
                        },
                    }
                ],
            }
        elif turn.get("tool_calls"):
            message["tool_calls"] = turn["tool_calls"]
        if turn.get("loss") is not None:
            message["loss"] = bool(turn["loss"])
        return message

    def process(self, row: dict) -> dict:
        column = next(c for c in CONVERSATION_COLUMNS if c in row)
        turns = row[column]
        if isinstance(turns, str):
            turns = json.loads(turns)
        messages = [self._message(t, f"{column}[{i}]") for i, t in enumerate(turns)]
        system = row.get("system") or self.system
        if system and (not messages or messages[0]["role"] != "system"):
            messages = _with_system(messages, system)
        out = {k: v for k, v in row.items() if k not in CONVERSATION_COLUMNS and k != "system"}
        out["messages"] = messages
        if row.get("tools") is not None and not isinstance(row["tools"], str):
            out["tools"] = json.dumps(row["tools"], ensure_ascii=False)
        return out
