"""Mixing several datasets: concatenate, interleave (round robin), or weighted random choice with a seed.

Orders are computed as (part, row) pairs so map-style data is mixed by index (one ``select``), and
streams by the same rule over iterators: the two agree row for row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

STRATEGIES = ("concat", "interleave", "weighted")


def _check(
    strategy: str, n_parts: int, probabilities: Sequence[float] | None, stopping_strategy: str
) -> np.ndarray | None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown mixing strategy {strategy!r}; expected one of {STRATEGIES}")
    if stopping_strategy not in ("first_exhausted", "all_exhausted"):
        raise ValueError(f"stopping_strategy must be 'first_exhausted' or 'all_exhausted', got {stopping_strategy!r}")
    if strategy != "weighted":
        return None
    if probabilities is None or len(probabilities) != n_parts:
        raise ValueError(f"weighted mixing needs one probability per dataset ({n_parts}), got {probabilities!r}")
    p = np.asarray(probabilities, dtype=np.float64)
    if (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"probabilities must be non-negative with a positive sum, got {probabilities!r}")
    return p / p.sum()


def mix_order(
    lengths: Sequence[int],
    strategy: str = "concat",
    probabilities: Sequence[float] | None = None,
    seed: int = 0,
    stopping_strategy: str = "first_exhausted",
    num_samples: int | None = None,
) -> Iterator[tuple[int, int]]:
    """(part, row-in-part) pairs. ``first_exhausted`` stops when a part runs out; ``all_exhausted``
    restarts exhausted parts until every part has been seen in full at least once."""
    p = _check(strategy, len(lengths), probabilities, stopping_strategy)
    if strategy == "concat":
        for part, n in enumerate(lengths):
            for row in range(n):
                yield part, row
        return
    rng = np.random.default_rng(seed)
    position = [0] * len(lengths)
    finished = [n == 0 or (p is not None and p[i] == 0) for i, n in enumerate(lengths)]
    emitted, turn = 0, 0
    while num_samples is None or emitted < num_samples:
        if strategy == "interleave":
            part, turn = turn, (turn + 1) % len(lengths)
            if lengths[part] == 0:
                continue
        else:
            part = int(rng.choice(len(lengths), p=p))
        if position[part] >= lengths[part]:
            if stopping_strategy == "first_exhausted" or all(finished):
                return
            position[part] = 0  # all_exhausted: oversample this part until the others finish
        yield part, position[part]
        emitted += 1
        position[part] += 1
        if position[part] >= lengths[part]:
            finished[part] = True
            if stopping_strategy == "all_exhausted" and all(finished):
                return


def mix_streams(
    streams: Sequence,
    strategy: str = "concat",
    probabilities: Sequence[float] | None = None,
    seed: int = 0,
    stopping_strategy: str = "first_exhausted",
) -> Iterator[dict]:
    """The same rule over iterables of unknown length (``all_exhausted`` is refused: it needs lengths)."""
    p = _check(strategy, len(streams), probabilities, stopping_strategy)
    if stopping_strategy == "all_exhausted" and strategy != "concat":
        raise ValueError("all_exhausted needs dataset lengths; streamed datasets mix with first_exhausted")
    if strategy == "concat":
        for s in streams:
            yield from s
        return
    iterators = [iter(s) for s in streams]
    rng = np.random.default_rng(seed)
    turn = 0
    while True:
        if strategy == "interleave":
            part, turn = turn, (turn + 1) % len(iterators)
        else:
            part = int(rng.choice(len(iterators), p=p))
        try:
            yield next(iterators[part])
        except StopIteration:
            return
