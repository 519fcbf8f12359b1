"""twinkle.reward: reward functions for RL, registered by name (entry-point group `twinkle.reward`)."""

from twinkle.reward.answers import (
    AnswerAccuracy,
    ArithmeticAccuracy,
    NumericCloseness,
    answers_match,
    extract_final_answer,
    parse_number,
)
from twinkle.reward.base import REWARDS, Reward, RewardResult, completion_text, create_reward, register_reward
from twinkle.reward.gsm8k import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.reward.shaping import FormatReward, LengthPenalty, WeightedReward

__all__ = [
    "REWARDS",
    "AnswerAccuracy",
    "ArithmeticAccuracy",
    "FormatReward",
    "GSM8KAccuracyReward",
    "GSM8KFormatReward",
    "LengthPenalty",
    "NumericCloseness",
    "Reward",
    "RewardResult",
    "WeightedReward",
    "answers_match",
    "completion_text",
    "create_reward",
    "extract_final_answer",
    "parse_number",
    "register_reward",
]
