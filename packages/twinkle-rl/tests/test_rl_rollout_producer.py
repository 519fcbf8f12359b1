"""Rollout -> reward context and training rows; asynchronous sampling with bounded staleness (RolloutProducer)."""

import json
import threading
import time
from contextlib import contextmanager

import pytest

from twinkle.advantage import GRPOAdvantage
from twinkle.reward import ArithmeticAccuracy
from twinkle.rl.producer import RolloutProducer
from twinkle.rl.rollout import Rollout, sample_rollout
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


class VersionedEngine:
    """A CheckpointEngine's publish/apply halves over an integer "model" (its step count): the sampler
    reports the version it applied, as TorchSampler does."""

    def __init__(self):
        self.versions, self.applied = {}, []

    def publish(self, model, adapter_name):
        self.versions[adapter_name] = self.versions.get(adapter_name, 0) + 1
        return self.versions[adapter_name]

    def apply(self, sampler, adapter_name, published):
        sampler.version = published
        self.applied.append((published, threading.current_thread().name))
        return published


@contextmanager
def running(max_staleness, delay=0.0, **kwargs):
    """A producer over a scripted sampler, its starting weights published: (producer, sampler, engine)."""
    sampler, engine = ScriptedSampler([["7", "8"], ["2", "2"]], delay=delay), VersionedEngine()
    sample = kwargs.pop("sample", lambda i: sample_rollout(sampler, PROMPTS, {"num_samples": 2}))
    with RolloutProducer(sample, engine, sampler, "policy", max_staleness=max_staleness, **kwargs) as producer:
        producer.publish(model=None)
        yield producer, sampler, engine


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_producer_samples_ahead_by_at_most_max_staleness_versions(max_staleness):
    with running(max_staleness, delay=0.05) as (producer, _, engine):
        time.sleep(0.3)
        staleness = []
        for step in range(6):
            depth = len(producer._queue)
            rollout = producer.get()
            assert rollout.meta["batch_index"] == step
            staleness.append(rollout.meta["staleness"])
            # queue_size is max(1, S); at S = 0 nothing can be sampled before the step's weights exist
            assert depth == (max_staleness if max_staleness else int(step == 0))
            time.sleep(0.3)  # "training": long enough for the producer to fill what it may
            producer.publish(model=None)
            metrics = producer.step_metrics()
            assert metrics["async/staleness_max"] == rollout.meta["staleness"]
            assert metrics["async/queue_depth"] == depth
    # the producer runs as far ahead as it may: a batch is exactly max_staleness versions old once warm
    assert staleness == [min(step, max_staleness) for step in range(6)]
    assert all(name == "twinkle-rollout-producer" for _, name in engine.applied)
    assert [v for v, _ in engine.applied] == sorted({v for v, _ in engine.applied})  # each version applied once


def _wait_for_calls(sampler, n: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while len(sampler.calls) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    return len(sampler.calls) >= n


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_next_batch_is_sampled_while_the_step_trains_only_when_staleness_allows(max_staleness):
    with running(max_staleness, delay=0.2) as (producer, sampler, _):
        for step in range(3):
            producer.get()
            producer.step_metrics()
            # S >= 1: the sampler starts batch step+1 before this step's weights exist (overlap);
            # S = 0: it must wait for them (the synchronous loop)
            overlapped = _wait_for_calls(sampler, step + 2, timeout=10.0 if max_staleness else 0.3)
            assert overlapped == bool(max_staleness)
            time.sleep(0.2)  # the trainer's step
            producer.publish(model=None)
            metrics = producer.step_metrics()
            assert metrics["time/trainer_busy"] >= 0.2
            if max_staleness:
                assert metrics["time/sampler_busy"] >= 0.1  # the next batch, sampled during the step


def test_producer_refuses_a_get_that_could_never_be_answered_and_reports_sampler_errors():
    with pytest.raises(RuntimeError, match="publish"):  # nothing published: no batch can come
        RolloutProducer(lambda i: None, VersionedEngine(), None, "policy").get()
    with running(0) as (producer, _, _):
        producer.get()
        with pytest.raises(RuntimeError, match=r"deadlock: batch 1 waits .* \(max_staleness=0\)"):
            producer.get()  # batch 1 needs the weights of step 1, which were never published
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        RolloutProducer(lambda i: None, VersionedEngine(), None, "policy", max_staleness=-1)

    def broken(index):
        raise OSError(f"sampler lost at batch {index}")

    with running(1, sample=broken) as (failing, _, _), pytest.raises(RuntimeError, match="sampler lost at batch 0"):
        failing.get()


def test_paused_serves_the_newest_weights_and_samples_nothing():
    with running(2, delay=0.05) as (producer, sampler, _):
        producer.get()
        producer.publish(model=None)  # version 2, not yet applied if the producer is mid-batch
        with producer.paused():
            calls = len(sampler.calls)
            assert sampler.version == 2  # evaluation sees the trainer's newest weights
            time.sleep(0.2)
            assert len(sampler.calls) == calls
            producer._queue.clear()
            with pytest.raises(RuntimeError, match="inside paused"):
                producer.get()


def test_producer_state_round_trips_its_queue_through_json():
    with running(2) as (producer, _, _):
        while len(producer._queue) < 2:
            time.sleep(0.01)
        state = json.loads(json.dumps(producer.state()))
        original = list(producer._queue)
    assert state["next_index"] == 2 and len(state["queued"]) == 2
    restored = [Rollout.from_json(r) for r in state["queued"]]
    assert [r.texts for r in restored] == [r.texts for r in original]
    advantages = [1.0, 0.0, 0.0, 1.0]
    assert [r.training_rows(advantages) for r in restored] == [r.training_rows(advantages) for r in original]
    with running(2, start_index=0, queued=restored) as (resumed, _, _):
        assert [resumed.get().meta["batch_index"] for _ in range(2)] == [0, 1]
        resumed.publish(model=None)
        assert resumed.get().meta["batch_index"] == 2  # sampled after the resume
