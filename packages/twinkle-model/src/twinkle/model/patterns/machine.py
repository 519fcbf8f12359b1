"""A parsed module pattern as a Thompson automaton, run as a lazily built DFA: linear time, no backtracking.

Matching a name of n characters visits at most n + 1 automaton states, and building one costs at
most the program's size, so a name costs O(n x program) the first time and O(n) dictionary lookups
once its states are cached (module names share most of their prefixes, so nearly all are). `work`
counts those steps, so a test can assert the bound instead of timing it. Pure Python: the GIL is
handed to other threads every few milliseconds, where one `re` call holds it until it returns.
"""

from __future__ import annotations

import threading

from twinkle.model.patterns.syntax import Alt, Anchor, CharSet, Node, PatternError, Repeat, Seq

MAX_PROGRAM = 1024  # instructions once {m,n} is expanded: the per-character bound on work
MAX_CACHED = 1 << 20  # program counters held in cached states before the cache starts over

CHAR, SPLIT, JUMP, ASSERT, MATCH = range(5)
AT_START, AT_END, BEFORE_FINAL_NEWLINE = 1, 2, 4  # where in the name a position is (for anchors)
_ANCHOR_NEEDS = {"start": AT_START, "end": AT_END | BEFORE_FINAL_NEWLINE, "end_only": AT_END}


def program_size(node: Node) -> int:
    if isinstance(node, (CharSet, Anchor)):
        return 1
    if isinstance(node, Seq):
        return sum(program_size(i) for i in node.items)
    if isinstance(node, Alt):
        return sum(program_size(o) for o in node.options) + 2 * (len(node.options) - 1)
    size = program_size(node.item)
    extra = size + 2 if node.hi is None else (node.hi - node.lo) * (size + 1)
    return node.lo * size + extra


class _Program:
    def __init__(self) -> None:
        self.ops: list[int] = []
        self.args: list = []

    def emit(self, op: int, arg: CharSet | int | tuple[int, int] | None = None) -> int:
        self.ops.append(op)
        self.args.append(arg)
        return len(self.ops) - 1

    def build(self, node: Node) -> None:
        if isinstance(node, CharSet):
            self.emit(CHAR, node)
        elif isinstance(node, Anchor):
            self.emit(ASSERT, _ANCHOR_NEEDS[node.kind])
        elif isinstance(node, Seq):
            for item in node.items:
                self.build(item)
        elif isinstance(node, Alt):
            jumps = []
            for option in node.options[:-1]:
                split = self.emit(SPLIT)
                self.build(option)
                jumps.append(self.emit(JUMP))
                self.args[split] = (split + 1, len(self.ops))
            self.build(node.options[-1])
            for j in jumps:
                self.args[j] = len(self.ops)
        else:
            self.repeat(node)

    def repeat(self, node: Repeat) -> None:
        for _ in range(node.lo):
            self.build(node.item)
        if node.hi is None:  # loop: try the item again or leave
            split = self.emit(SPLIT)
            self.build(node.item)
            self.emit(JUMP, split)
            self.args[split] = (split + 1, len(self.ops))
            return
        splits = []
        for _ in range(node.hi - node.lo):  # each optional copy may end the repetition
            splits.append(self.emit(SPLIT))
            self.build(node.item)
        for s in splits:
            self.args[s] = (s + 1, len(self.ops))


class _States:
    """The DFA built so far: interned sets of program counters and the transitions between them."""

    def __init__(self) -> None:
        self.sets: list[frozenset[int]] = []
        self.ids: dict[frozenset[int], int] = {}
        self.moves: dict[tuple, int] = {}
        self.held = 0
        self.lock = threading.Lock()
        self.intern(frozenset())  # state 0: dead, so a name that cannot match stops at its first miss

    def intern(self, pcs: frozenset[int]) -> int:
        sid = self.ids.get(pcs)
        if sid is None:
            sid = self.ids[pcs] = len(self.sets)
            self.sets.append(pcs)
            self.held += len(pcs) + 1
        return sid


class Pattern:
    """`fullmatch(name)`: whether the whole name matches, as `re.fullmatch(source, name)` says."""

    def __init__(self, source: str, tree: Node) -> None:
        size = program_size(tree)
        if size > MAX_PROGRAM:
            raise PatternError(
                f"pattern {source!r} expands to {size} automaton states (its {{m,n}} repeats written out); "
                f"at most {MAX_PROGRAM}"
            )
        program = _Program()
        program.build(tree)
        self.match_pc = program.emit(MATCH)
        self.source, self.ops, self.args = source, program.ops, program.args
        self.anchors = 0
        for op, arg in zip(self.ops, self.args, strict=True):
            self.anchors |= arg if op == ASSERT else 0
        self.work = 0  # states visited: cache misses cost their size, hits one each
        self._states = _States()

    def __len__(self) -> int:
        return len(self.ops)

    def fullmatch(self, name: str) -> bool:
        states = self._states
        if states.held > MAX_CACHED:
            states = self._states = _States()
        n = len(name)
        sid = self._next(states, None, "", self._where(name, 0))
        for i, ch in enumerate(name):
            sid = self._next(states, sid, ch, self._where(name, i + 1) if i + 2 >= n else 0)
            if sid == 0:
                return False
        return self.match_pc in states.sets[sid]

    def _where(self, name: str, i: int) -> int:
        n = len(name)
        where = (AT_START if i == 0 else 0) | (AT_END if i == n else 0)
        if i == n - 1 and name[i] == "\n":
            where |= BEFORE_FINAL_NEWLINE
        return where & self.anchors

    def _next(self, states: _States, sid: int | None, ch: str, where: int) -> int:
        key = (sid, ch, where)
        nxt = states.moves.get(key)
        self.work += 1
        if nxt is not None:
            return nxt
        with states.lock:
            if sid is None:
                moved = [0]
            else:
                held = states.sets[sid]
                self.work += len(held)
                moved = [pc + 1 for pc in held if self.ops[pc] == CHAR and ch in self.args[pc]]
            nxt = states.moves[key] = states.intern(self._closure(moved, where))
        return nxt

    def _closure(self, pcs: list[int], where: int) -> frozenset[int]:
        """The CHAR and MATCH instructions reachable from `pcs` without reading a character."""
        seen, out, stack = set(), set(), list(pcs)
        while stack:
            pc = stack.pop()
            if pc in seen:
                continue
            seen.add(pc)
            op = self.ops[pc]
            if op == SPLIT:
                stack.extend(self.args[pc])
            elif op == JUMP:
                stack.append(self.args[pc])
            elif op == ASSERT:
                if where & self.args[pc]:
                    stack.append(pc + 1)
            else:
                out.add(pc)
        self.work += len(seen)
        return frozenset(out)
