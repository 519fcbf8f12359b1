"""twinkle-kit's PPO pieces composed on the tiny model, imported as its scripts import them: a critic
(TransformersValueModel) gives per-token values, GAEAdvantage turns sequence rewards into per-token
advantages and returns, the policy trains on the advantages (PPOLoss) and the critic on the returns
(PPOValueLoss), and the critic's error on those returns falls."""

import pytest
import torch
from peft import LoraConfig

from twinkle.advantage import GAEAdvantage
from twinkle.hub import TEST_MODEL
from twinkle.metric import PPOValueMetric
from twinkle.model import TransformersModel, TransformersValueModel

# two rollouts: a prompt (no loss) and a completion; one earned reward 1, the other 0
ROWS = [
    {"input_ids": [5, 6, 7, 30, 31, 32, 33], "labels": [-100, -100, -100, 30, 31, 32, 33]},
    {"input_ids": [8, 9, 40, 41, 42], "labels": [-100, -100, 40, 41, 42]},
]
REWARDS = [1.0, 0.0]


def completion(row_values: list[float], labels: list[int]) -> list[float]:
    return [v for v, label in zip(row_values, labels) if label != -100]


def test_critic_values_gae_and_both_losses_compose():
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    policy = TransformersModel(model_id=TEST_MODEL)
    policy.add_adapter_to_model("actor", lora)
    policy.set_loss("PPOLoss")
    policy.set_optimizer("AdamW", lr=1e-3)
    critic = TransformersValueModel(model_id=TEST_MODEL)
    critic.add_adapter_to_model("critic", lora)
    critic.set_loss("PPOValueLoss", epsilon=0.5)
    critic.add_metric(PPOValueMetric(epsilon=0.5))
    critic.set_optimizer("AdamW", lr=5e-3)

    lengths = [sum(label != -100 for label in r["labels"]) for r in ROWS]
    token_rewards = GAEAdvantage.build_token_rewards(REWARDS, lengths)
    old_logps = [completion(lp, r["labels"]) for lp, r in zip(policy.forward_only(ROWS)["logprobs"], ROWS)]
    errors = []
    for _ in range(4):
        values = [completion(v, r["labels"]) for v, r in zip(critic.forward_only(ROWS)["values"], ROWS)]
        advantages, returns = GAEAdvantage(gamma=1.0, gae_lambda=0.95)(token_rewards, values)
        adv_rows = [advantages[i, :n].tolist() for i, n in enumerate(lengths)]
        ret_rows = [returns[i, :n].tolist() for i, n in enumerate(lengths)]
        errors.append(sum((v - r) ** 2 for vs, rs in zip(values, ret_rows) for v, r in zip(vs, rs)))
        policy.forward_backward(ROWS, old_logps=old_logps, advantages=adv_rows)
        policy.clip_grad_and_step()
        critic.forward_backward(ROWS, returns=ret_rows, old_values=values)
        critic.clip_grad_and_step()
    # the untrained critic says 0 everywhere, so the first returns are the λ-returns 0.95^(L-1-k)·R
    assert errors[0] == pytest.approx(sum(0.95 ** (2 * k) for k in range(lengths[0])), rel=1e-6)
    assert errors[-1] < 0.5 * errors[0]
    metrics = critic.calculate_metric(is_training=True)
    assert {"train/value_mean", "train/return_mean", "train/explained_variance"} <= set(metrics)
    assert policy.optimizer_group["actor"].cur_step == 4
