"""A long-completion RL task for the demo model: add 1 to every digit of a 64-digit sequence (9 -> 0).

The embedded tokenizer splits digits one per token, so every answer is 64 tokens (plus the end
token): sampling, not the update, is most of an RL step, as in the long rollouts RL frameworks are
built for. The reward is exact match; a position-wise map a 5M model learns, from a short SFT warm
start, to get right on some but not all of the 64 digits. Rows are drawn from a fixed seed per split,
so the held-out split never meets the train one.
"""

from __future__ import annotations

import random

from twinkle.reward import Reward

DIGITS = "digits"
LENGTH = 64
SPLIT_SEEDS, SPLIT_SIZES = {"train": 0, "test": 1}, {"train": 4096, "test": 256}


def digit_rows(split: str, limit: int | None = None, length: int = LENGTH) -> list[dict]:
    """`{"question", "answer"}` rows of `split` (train: 4096, test: 256)."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r} of the digits task; known: {', '.join(SPLIT_SEEDS)}")
    rng = random.Random(f"twinkle-digits/{SPLIT_SEEDS[split]}")
    rows = []
    for _ in range(SPLIT_SIZES[split] if limit is None else min(limit, SPLIT_SIZES[split])):
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        rows.append(
            {
                "question": f"Add 1 to each digit: {digits}",
                "answer": "".join(str((int(d) + 1) % 10) for d in digits),
            }
        )
    return rows


class DigitsExactMatch(Reward):
    """1 when the completion, up to its end token, is exactly the ground truth's digits; else 0."""

    def __init__(self, end: str = "<|im_end|>", name: str | None = None):
        super().__init__(name or "accuracy")
        self.end = end

    def score(self, text: str, **row) -> float:
        return float(text.split(self.end, 1)[0].strip() == str(row["ground_truth"]))
