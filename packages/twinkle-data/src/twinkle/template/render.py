"""Rendering a Jinja chat template while recording the character spans of ``{% generation %}`` blocks.

The generation tag wraps its output in two private-use sentinel characters; after rendering, the
sentinels are located and removed, giving exact spans in the final text whatever the template does
around them. The environment matches what Hugging Face chat templates expect (trim_blocks,
lstrip_blocks, loop controls, ``tojson``, ``raise_exception``, ``strftime_now``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Never

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from jinja2.parser import Parser

START, END = "\ue000", "\ue001"  # Unicode private use: never produced by a tokenizer's text


class _GenerationTag(Extension):
    tags = {"generation"}  # noqa: RUF012 - jinja2.ext.Extension declares it a plain class attribute

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Callable[[], str]) -> str:
        return START + caller() + END


def _raise_exception(message: str) -> Never:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    return env.from_string(source, globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now})


def has_generation_markers(source: str) -> bool:
    return "generation" in source and "endgeneration" in source


def render(source: str, **context: Any) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and the ``[start, end)`` character spans of each generation block, in order."""
    raw = compile_template(source).render(**context)
    text_parts: list[str] = []
    spans: list[tuple[int, int]] = []
    length, start = 0, None
    pos = 0
    while pos < len(raw):
        nxt = min((i for i in (raw.find(START, pos), raw.find(END, pos)) if i != -1), default=len(raw))
        text_parts.append(raw[pos:nxt])
        length += nxt - pos
        if nxt < len(raw):
            if raw[nxt] == START:
                start = length
            elif start is not None:
                spans.append((start, length))
                start = None
        pos = nxt + 1
    return "".join(text_parts), spans
