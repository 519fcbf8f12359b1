"""twinkle-kit's RL names on ours: rewards called on trajectories read as lists, GSM8K rewards, the
default FormatReward, GRPOAdvantage(num_generations=, scale=)."""

from __future__ import annotations

import pytest
import torch

from twinkle.advantage import GRPOAdvantage, RLOOAdvantage
from twinkle.reward import FormatReward, GSM8KAccuracyReward, GSM8KFormatReward


def _trajectory(reply: str, **row) -> dict:
    return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}], **row}


def test_rewards_score_trajectories_with_their_own_context_and_read_as_lists():
    trajectories = [
        _trajectory("so \\boxed{42}", ground_truth="42"),
        _trajectory("#### 41", user_data=[("ground_truth", "42")]),  # twinkle-kit's (key, value) pairs
        _trajectory("no answer", user_data=[{"ground_truth": "7"}]),
    ]
    accuracy = GSM8KAccuracyReward()(trajectories)
    fmt = GSM8KFormatReward()(trajectories, [])
    assert list(accuracy) == [1.0, 0.0, 0.0] and list(fmt) == [1.0, 1.0, 0.0]
    assert [a + f for a, f in zip(accuracy, fmt)] == [2.0, 1.0, 0.0] and accuracy[0] == 1.0


def test_format_reward_without_a_pattern_wants_think_then_answer():
    reward = FormatReward()
    assert list(reward(["<think>a</think> then <answer>b</answer>", "<answer>b</answer>"])) == [1.0, 0.0]


def test_grpo_advantage_takes_num_generations_and_scale():
    rewards = [1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0]
    ours = GRPOAdvantage(scale_by="batch")(rewards, group_size=4)
    theirs = GRPOAdvantage()(rewards, num_generations=4, scale="batch")
    torch.testing.assert_close(theirs, ours)
    group = torch.tensor([1.0, 0.0, 0.0, 0.0])
    expected = (group - group.mean()) / (group.std() + 1e-6)
    torch.testing.assert_close(GRPOAdvantage()(rewards, num_generations=4)[:4], expected)
    with pytest.raises(ValueError, match="group_size=2 and num_generations=4 disagree"):
        GRPOAdvantage()(rewards, group_size=2, num_generations=4)
    with pytest.raises(ValueError, match="RLOOAdvantage takes no scale"):
        RLOOAdvantage()(rewards, num_generations=4, scale="group")
