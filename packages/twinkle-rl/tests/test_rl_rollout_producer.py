"""Rollout -> reward context and training rows; background sampling with bounded staleness."""

import threading
import time

import pytest

from twinkle.advantage import GRPOAdvantage
from twinkle.reward import ArithmeticAccuracy
from twinkle.rl.overlap import OverlappedRollouts, StaleRolloutError
from twinkle.rl.rollout import sample_rollout
from twinkle.rl.timing import PhaseTimer
from twinkle.sampler import SampledSequence, SampleResponse, SamplingParams


class ScriptedSampler:
    """Answers prompt p's sample j with text script[p][j]; token ids are the characters' codes."""

    def __init__(self, script, version=0, delay=0.0):
        self.script, self.version, self.delay, self.calls = script, version, delay, []

    def sample(self, prompts, params, adapter_name=None):
        self.calls.append((prompts, params, adapter_name, threading.current_thread().name))
        time.sleep(self.delay)
        out = []
        for p, prompt in enumerate(prompts):
            seqs = [
                SampledSequence(
                    tokens=[ord(c) for c in text], logprobs=[-0.5] * len(text), stop_reason="stop", text=text
                )
                for text in self.script[p][: params.num_samples]
            ]
            out.append(SampleResponse(seqs, prompt, adapter_name, weight_version=self.version))
        return out


PROMPTS = [
    {"input_ids": [1, 2, 3], "ground_truth": "7", "question": "What is 3 + 4?", "messages": ["dropped"]},
    {"input_ids": [4, 5], "ground_truth": "2", "question": "What is 5 - 3?"},
]


def test_rollout_reward_context_and_training_rows():
    sampler = ScriptedSampler([["7", "8"], ["2", "22"]], version=3)
    rollout = sample_rollout(sampler, PROMPTS, SamplingParams(max_tokens=4, num_samples=2), adapter_name="policy")
    assert sampler.calls[0][0] == [[1, 2, 3], [4, 5]] and sampler.calls[0][2] == "policy"
    assert len(rollout) == 4 and rollout.weight_versions == [3, 3, 3, 3]
    context = rollout.reward_rows()
    assert context[1] == {"ground_truth": "7", "question": "What is 3 + 4?", "num_tokens": 1, "stop_reason": "stop"}
    rewards = ArithmeticAccuracy()(rollout.texts, context)
    assert rewards.values == [1.0, 0.0, 1.0, 0.0]
    adv = GRPOAdvantage()(rewards, group_size=rollout.group_size)
    rows = rollout.training_rows(adv.tolist())
    assert rows[3] == {
        "input_ids": [4, 5, ord("2"), ord("2")],
        "labels": [-100, -100, ord("2"), ord("2")],
        "logprobs": [0.0, 0.0, -0.5, -0.5],
        "advantages": pytest.approx(adv[3].item()),
    }
    assert len(rollout.training_rows([0.0, 1.0, 0.0, -1.0], skip_zero=True)) == 2
    with pytest.raises(ValueError, match="3 advantages for 4"):
        rollout.training_rows([1.0, 2.0, 3.0])


def test_prompt_rows_without_ids_need_a_template():
    with pytest.raises(ValueError, match="pass template="):
        sample_rollout(
            ScriptedSampler([["1"]]), [{"messages": [{"role": "user", "content": "hi"}]}], {"num_samples": 1}
        )


def test_overlapped_rollouts_sample_in_background_and_bound_staleness():
    sampler = ScriptedSampler([["7"], ["2"]], version=1, delay=0.2)
    timer = PhaseTimer()
    rollouts = OverlappedRollouts(
        lambda p: sample_rollout(sampler, p, {"num_samples": 1}), max_staleness=1, timer=timer
    )
    with rollouts:
        t0 = time.perf_counter()
        rollouts.start(PROMPTS)
        assert rollouts.in_flight and time.perf_counter() - t0 < 0.15  # start() does not block
        with pytest.raises(RuntimeError, match="already in flight"):
            rollouts.start(PROMPTS)
        assert rollouts.wait(policy_version=2).meta["staleness"] == 1
        assert sampler.calls[0][3].startswith("twinkle-rollout")
        assert timer.totals["sample"] >= 0.2
        rollouts.start(PROMPTS)
        with pytest.raises(StaleRolloutError, match="2 steps behind"):
            rollouts.wait(policy_version=3)
        with pytest.raises(RuntimeError, match="no rollout in flight"):
            rollouts.wait(policy_version=3)
