"""The regular-expression subset a module pattern may use, parsed the way Python's `re` parses it.

peft matches a string `target_modules` with `re.fullmatch(pattern, module_name)`; this parser reads
the same syntax into a tree that `patterns.machine` runs in linear time, so a pattern means here
exactly what it means to peft. Supported: literals and escapes, `.`, classes (`[a-z_]`, `[^.]`,
`\\d \\w \\s` and their negations), groups (capturing, `(?:...)`, `(?P<name>...)`), `|`, the
quantifiers `* + ? {m} {m,} {,n} {m,n}` (greedy or lazy: the same set of matches), and the anchors
`^ $ \\A \\Z`. Anything whose meaning needs backtracking or context (backreferences, lookaround,
atomic groups, possessive quantifiers, conditionals, inline flags, `\\b`) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Never

MAX_DEPTH = 32  # nested groups


class PatternError(ValueError):
    """The pattern is not a regular expression, or uses a construct this matcher refuses."""


@dataclass(frozen=True)
class CharSet:
    """One character position: literal characters, code-point ranges and `re`'s categories."""

    chars: frozenset[str] = frozenset()
    ranges: tuple[tuple[int, int], ...] = ()
    categories: tuple[str, ...] = ()  # d D s S w W, as `re` defines them for str patterns
    negate: bool = False

    def __contains__(self, ch: str) -> bool:
        hit = (
            ch in self.chars
            or any(lo <= ord(ch) <= hi for lo, hi in self.ranges)
            or any(_in_category(ch, c) for c in self.categories)
        )
        return hit != self.negate


def _in_category(ch: str, category: str) -> bool:
    # `re` on str patterns: \d is Unicode Nd (str.isdecimal), \w alphanumerics and '_', \s str.isspace
    kind = category.lower()
    hit = ch.isdecimal() if kind == "d" else ch.isspace() if kind == "s" else ch.isalnum() or ch == "_"
    return hit != category.isupper()


ANY = CharSet(frozenset("\n"), negate=True)  # `.` without DOTALL


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    item: Node
    lo: int
    hi: int | None  # None: unbounded


@dataclass(frozen=True)
class Anchor:
    kind: str  # start (^, \A), end ($: the end or before a final newline), end_only (\Z)


Node = CharSet | Seq | Alt | Repeat | Anchor  # a parsed pattern's tree


_CONTROL = {"a": "\a", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
_REFUSED_GROUPS = {
    "=": "lookahead (?=...)",
    "!": "negative lookahead (?!...)",
    "<": "lookbehind (?<=...) / (?<!...)",
    ">": "atomic group (?>...)",
    "(": "conditional group (?(...)...)",
    "#": "comment group (?#...)",
}


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.src, self.pos = pattern, 0

    def refuse(self, what: str) -> Never:
        raise PatternError(
            f"pattern {self.src!r} uses {what} at position {self.pos}, which the linear-time module matcher "
            "does not support; use literals, '.', classes, groups, '|', quantifiers and anchors"
        )

    def peek(self, k: int = 0) -> str | None:
        i = self.pos + k
        return self.src[i] if i < len(self.src) else None

    def take(self) -> str:
        ch = self.peek()
        if ch is None:
            raise PatternError(f"pattern {self.src!r} ends unexpectedly")
        self.pos += 1
        return ch

    def alternation(self, depth: int) -> Node:
        options = [self.sequence(depth)]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence(depth))
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self, depth: int) -> Node:
        items: list[Node] = []
        while (ch := self.peek()) is not None and ch not in "|)":
            bounds = self.quantifier()
            if bounds is None:
                items.append(self.atom(depth))
                continue
            if not items or isinstance(items[-1], (Anchor, Repeat)):
                raise PatternError(f"pattern {self.src!r}: nothing to repeat at position {self.pos}")
            if self.peek() == "+":
                self.refuse("a possessive quantifier")
            if self.peek() == "?":  # lazy: another order of trying, the same set of full matches
                self.pos += 1
            items[-1] = Repeat(items[-1], *bounds)
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def quantifier(self) -> tuple[int, int | None] | None:
        """(lo, hi) of a quantifier here, consumed; None (nothing consumed) where `re` reads a literal."""
        ch = self.peek()
        if ch in ("*", "+", "?"):
            self.pos += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        if ch != "{":
            return None
        end = self.src.find("}", self.pos)
        body = self.src[self.pos + 1 : end] if end > self.pos + 1 else None
        lo, comma, hi = (body or "").partition(",")
        if body is None or not (lo + hi).isascii() or not all(p == "" or p.isdigit() for p in (lo, hi)):
            return None  # `{`, `{}`, `{x}`: a literal brace, as in `re`
        if not comma and not lo:
            return None
        self.pos = end + 1
        low = int(lo) if lo else 0
        high = (int(hi) if hi else None) if comma else low
        if high is not None and high < low:
            raise PatternError(f"pattern {self.src!r}: min repeat greater than max repeat at position {self.pos}")
        return low, high

    def atom(self, depth: int) -> Node:
        ch = self.take()
        if ch == "(":
            return self.group(depth)
        if ch == "[":
            return self.char_class()
        if ch == ".":
            return ANY
        if ch == "^":
            return Anchor("start")
        if ch == "$":
            return Anchor("end")
        if ch == "\\":
            return self.escape()
        return CharSet(frozenset(ch))

    def group(self, depth: int) -> Node:
        if depth >= MAX_DEPTH:
            raise PatternError(f"pattern {self.src!r} nests groups deeper than {MAX_DEPTH}")
        if self.peek() == "?":
            self.pos += 1
            kind = self.take()
            if kind == "P" and self.peek() == "<":
                close = self.src.find(">", self.pos)
                if close < 0:
                    raise PatternError(f"pattern {self.src!r}: unterminated group name")
                self.pos = close + 1
            elif kind == "P":
                self.refuse("a named backreference (?P=...)")
            elif kind in _REFUSED_GROUPS:
                self.refuse(f"a {_REFUSED_GROUPS[kind]}")
            elif kind != ":":
                self.refuse(f"inline flags (?{kind}...)")
        inner = self.alternation(depth + 1)
        if self.peek() != ")":
            raise PatternError(f"pattern {self.src!r}: missing ')' at position {self.pos}")
        self.pos += 1
        return Seq((inner,))  # a group is one item: `(a*)*` and `(^)?` repeat it, as `re` does

    def escape(self) -> Node:
        ch = self.take()
        if ch == "A":
            return Anchor("start")
        if ch == "Z":
            return Anchor("end_only")
        if ch in "bB":
            self.refuse(f"the word boundary \\{ch}")
        if ch in "dDsSwW":
            return CharSet(categories=(ch,))
        return CharSet(frozenset(self.escaped_char(ch)))

    def escaped_char(self, ch: str) -> str:
        """The character an escape outside a category stands for."""
        if ch in _CONTROL:
            return _CONTROL[ch]
        if ch in _HEX_WIDTH:
            digits = self.src[self.pos : self.pos + _HEX_WIDTH[ch]]
            self.pos += len(digits)
            return chr(int(digits, 16))
        if ch in "0123456789":
            self.refuse(f"the escape \\{ch} (a backreference or an octal escape)")
        if ch.isascii() and ch.isalpha():
            self.refuse(f"the escape \\{ch}")
        return ch

    def class_item(self) -> CharSet | str:
        ch = self.take()
        if ch == "[" and self.peek() in (":", "=", "."):
            self.refuse("a POSIX-style set [[:...:]]")
        if ch != "\\":
            return ch
        esc = self.take()
        if esc in "dDsSwW":
            return CharSet(categories=(esc,))
        return "\b" if esc == "b" else self.escaped_char(esc)

    def char_class(self) -> CharSet:
        negate = self.peek() == "^"
        self.pos += negate
        chars, ranges, categories = set(), [], []
        first = True
        while True:
            ch = self.peek()
            if ch is None:
                raise PatternError(f"pattern {self.src!r}: unterminated character set")
            if ch == "]" and not first:
                self.pos += 1
                break
            if ch in "-&~|" and self.peek(1) == ch and not first:
                self.refuse(f"the doubled {ch * 2} in a set (Python reserves it for set operations)")
            first = False
            item = self.class_item()
            if self.peek() == "-" and self.peek(1) not in (None, "]"):
                self.pos += 1
                upper = self.class_item()
                if isinstance(item, CharSet) or isinstance(upper, CharSet) or ord(upper) < ord(item):
                    raise PatternError(f"pattern {self.src!r}: bad character range at position {self.pos}")
                ranges.append((ord(item), ord(upper)))
            elif isinstance(item, CharSet):
                categories += item.categories
            else:
                chars.add(item)
        return CharSet(frozenset(chars), tuple(ranges), tuple(categories), negate)


def parse(pattern: str) -> Node:
    """The tree of `pattern` (Seq / Alt / Repeat / Anchor / CharSet); PatternError names what is refused."""
    parser = _Parser(pattern)
    tree = parser.alternation(0)
    if parser.pos != len(pattern):
        raise PatternError(f"pattern {pattern!r}: unbalanced parenthesis at position {parser.pos}")
    return tree
