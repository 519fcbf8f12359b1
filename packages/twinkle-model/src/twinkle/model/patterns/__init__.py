"""Module-name patterns (peft's string `target_modules`) matched in linear time.

peft selects the modules an adapter wraps with `re.fullmatch(target_modules, name)` for every module
of the base model. Python's `re` backtracks: `model\\.lay(.|.)*X` takes seconds a name, holding the
GIL the whole time, so on a shared server one tenant's adapter stalls every other tenant's request.
`compile_pattern` accepts the same syntax peft users write (see `patterns.syntax` for the subset) and
answers exactly what `re.fullmatch` answers, by an automaton whose work is linear in the name.
"""

from __future__ import annotations

import re
from functools import lru_cache

from twinkle.model.patterns.machine import MAX_PROGRAM, Pattern
from twinkle.model.patterns.syntax import PatternError, parse

MAX_PATTERN_CHARS = 1024

__all__ = ["MAX_PATTERN_CHARS", "MAX_PROGRAM", "Pattern", "PatternError", "compile_pattern", "fullmatch"]


@lru_cache(maxsize=64)
def compile_pattern(pattern: str) -> Pattern:
    """The linear-time matcher of `pattern`; PatternError (a ValueError) names why one is refused."""
    if not isinstance(pattern, str):
        raise PatternError(f"a module pattern must be a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"pattern {pattern[:40]!r}... is {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    try:
        re.compile(pattern)  # only to be refused exactly where peft's re.fullmatch would raise
    except (re.error, OverflowError, RecursionError) as e:
        raise PatternError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None
    return Pattern(pattern, parse(pattern))


def fullmatch(pattern: str, name: str) -> bool:
    """`re.fullmatch(pattern, name) is not None`, in time linear in `name`."""
    return compile_pattern(pattern).fullmatch(name)
