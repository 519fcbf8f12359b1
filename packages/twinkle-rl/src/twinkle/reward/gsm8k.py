"""twinkle-kit's GSM8K rewards by name, on ours: the accuracy of the stated final answer, and whether
a final answer is stated at all (`\\boxed{...}` or `#### n`)."""

from __future__ import annotations

import re

from twinkle.reward.answers import AnswerAccuracy, boxed_content
from twinkle.reward.base import Reward, register_reward

_HASHES = re.compile(r"####\s*[\-\d,\.]+")


@register_reward
class GSM8KAccuracyReward(AnswerAccuracy):
    """1.0 if the completion's final answer equals the row's `ground_truth` (GSM8KProcessor puts it
    there; twinkle-kit's user_data pair works too), else 0.0."""

    aliases = ()  # AnswerAccuracy keeps its own

    def __init__(self, answer_key: str | None = "ground_truth", name: str | None = None):
        super().__init__(answer_key, name or "accuracy")


@register_reward
class GSM8KFormatReward(Reward):
    """1.0 if the completion states a final answer as `\\boxed{...}` or `#### <number>`, else 0.0."""

    def __init__(self, name: str | None = None):
        super().__init__(name or "format")

    def score(self, text: str, **row) -> float:
        return float(bool(boxed_content(text)) or bool(_HASHES.search(text)))
