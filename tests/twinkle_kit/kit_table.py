"""The twinkle-kit compatibility table (docs/twinkle-kit-compat.md): written by
scripts/twinkle_kit_compat.py from real runs, read back by the test that checks it still holds."""

from __future__ import annotations

import re
from collections.abc import Iterable

BEGIN, END = "<!-- twinkle-kit-compat:begin -->", "<!-- twinkle-kit-compat:end -->"
ROW = re.compile(r"^\| `(?P<script>[^`]+)` \| (?P<ours>[^|]*) \| (?P<status>[a-z ]+) \|")


def render(rows: Iterable[tuple[str, str, str, str]], header: str) -> str:
    """rows: (twinkle-kit script, our fixture or '—', status, why / what it shows)."""
    lines = [BEGIN, header, "", "| twinkle-kit script | ours | result | notes |", "|---|---|---|---|"]
    lines += [f"| `{script}` | {ours} | {status} | {note} |" for script, ours, status, note in rows]
    return "\n".join([*lines, END])


def read(text: str) -> dict[str, str]:
    """twinkle-kit script -> recorded result, from the marked block of a document."""
    start, end = text.index(BEGIN), text.index(END)
    out = {}
    for line in text[start:end].splitlines():
        m = ROW.match(line)
        if m:
            out[m["script"]] = m["status"].strip()
    return out


def replace_block(document: str, block: str) -> str:
    if BEGIN not in document:
        return document.rstrip("\n") + "\n\n" + block + "\n"
    start, end = document.index(BEGIN), document.index(END) + len(END)
    return document[:start] + block + document[end:]
