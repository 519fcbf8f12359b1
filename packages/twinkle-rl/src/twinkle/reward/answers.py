"""Exact-match answer accuracy: arithmetic and GSM8K-style final answers.

The final answer is found, in order, after a GSM8K `####` marker, inside the last `\\boxed{...}`,
after "answer is" / "answer:", else it is the last number in the text. Numbers compare by value
(`1,000` == `1000` == `1000.0`, `$5` == `5`, `1/2` == `0.5`); other answers compare as
case-folded, whitespace-collapsed text.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from twinkle.reward.base import Reward, register_reward

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_SPECIAL = re.compile(r"<\|[^|>]*\|>")  # chat-template control tokens left in decoded text
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(.+)", re.IGNORECASE)
GROUND_TRUTH_KEYS = ("ground_truth", "answer", "solution")


def boxed_content(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer a completion (or a GSM8K solution) states, or None if it states none."""
    text = _SPECIAL.sub(" ", text)
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    if (boxed := boxed_content(text)) is not None:
        return boxed.strip()
    if (m := _ANSWER_IS.search(text)) is not None:
        stated = m.group(1).strip()
        numbers = _NUMBER.findall(stated)
        return numbers[0] if numbers else stated.rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """The exact value of a number as people write it, or None if `text` is not one number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").removesuffix("%").strip()
    try:
        if "/" in cleaned:
            num, den = cleaned.split("/")
            return Fraction(Decimal(num)) / Fraction(Decimal(den))
        return Fraction(Decimal(cleaned))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, truth: str) -> bool:
    if predicted is None:
        return False
    a, b = parse_number(predicted), parse_number(truth)
    if a is not None and b is not None:
        return a == b
    norm = lambda s: " ".join(s.casefold().strip().rstrip(".").split())  # noqa: E731
    return norm(predicted) == norm(truth)


def ground_truth(row: dict, key: str | None) -> str:
    keys = (key,) if key else GROUND_TRUTH_KEYS
    for k in keys:
        if k in row and row[k] is not None:
            value = str(row[k])
            return (extract_final_answer(value) or value) if "####" in value else value.strip()
    raise KeyError(f"no ground truth: the row needs one of {list(keys)}; it has {sorted(row) or 'nothing'}")


@register_reward
class AnswerAccuracy(Reward):
    """1.0 if the completion's final answer equals the row's ground truth, else 0.0."""

    aliases = ("accuracy", "answer_accuracy", "gsm8k_accuracy")

    def __init__(self, answer_key: str | None = None, name: str | None = None):
        super().__init__(name or "accuracy")
        self.answer_key = answer_key

    def score(self, text: str, **row) -> float:
        return float(answers_match(extract_final_answer(text), ground_truth(row, self.answer_key)))


@register_reward
class NumericCloseness(AnswerAccuracy):
    """exp(−|predicted − truth| / scale) for a numeric final answer (1 when exact), 0 when the
    completion states no number: a dense signal for tasks where exact hits are still rare."""

    aliases = ("numeric_closeness",)

    def __init__(self, scale: float = 5.0, answer_key: str | None = None, name: str | None = None):
        super().__init__(answer_key, name or "closeness")
        if scale <= 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale = scale

    def score(self, text: str, **row) -> float:
        truth = parse_number(ground_truth(row, self.answer_key))
        if truth is None:
            raise ValueError(f"ground truth {row!r} is not a number")
        predicted = extract_final_answer(text)
        value = parse_number(predicted) if predicted is not None else None
        return 0.0 if value is None else math.exp(-abs(float(value - truth)) / self.scale)


_QUESTION = re.compile(r"(-?\d+)\s*([-+*/×x])\s*(-?\d+)")


@register_reward
class ArithmeticAccuracy(AnswerAccuracy):
    """Answer accuracy on `a op b` questions; with no ground truth in the row it computes one from
    the row's `question` (the bundled `twinkle://arithmetic` rows carry both)."""

    aliases = ("arithmetic_accuracy",)

    def score(self, text: str, **row) -> float:
        try:
            truth = ground_truth(row, self.answer_key)
        except KeyError:
            truth = _solve(row.get("question"))
        if parse_number(truth) is None:
            raise ValueError(f"arithmetic ground truth {truth!r} is not a number")
        return float(answers_match(extract_final_answer(text), truth))


def _solve(question) -> str:
    m = _QUESTION.search(str(question or ""))
    if m is None:
        raise KeyError(f"no ground truth and no 'a op b' question to compute one from (question={question!r})")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    value = {"+": a + b, "-": a - b, "*": a * b, "×": a * b, "x": a * b}.get(op)
    if value is None:
        value = Fraction(a, b)
    return str(value)
