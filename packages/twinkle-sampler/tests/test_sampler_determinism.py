"""Deterministic sampling: a seeded sequence depends on (weights, prompt, params, seed, sample index) only.
Not on the other rows of its batch (their prompts, lengths, adapters, count, chunking), not on the global
RNG, not on the process: a fresh interpreter draws the same tokens. temperature 0 is greedy whatever the seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from contract_model import hf_greedy

from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter

PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=21, num_samples=3, stop=[], ignore_eos=True)


@pytest.fixture(scope="module")
def samplers(model_path, trainer):
    """Two samplers on the same weights: batches of up to 64 rows, and one row at a time."""
    out = []
    for size in (64, 1):
        s = TorchSampler(model_path, max_batch_size=size)
        s.set_adapter("tenant", extract_adapter(trainer, "tenant"))
        out.append(s)
    return out


def tokens(response) -> list[list[int]]:
    return [s.tokens for s in response.sequences]


def test_a_seeded_request_draws_the_same_tokens_in_any_batch(samplers, prompts):
    wide, narrow = samplers
    target = prompts[1]
    (alone,) = wide.sample([target], PARAMS, adapter_name="tenant")
    assert len({tuple(t) for t in tokens(alone)}) == 3  # three distinct draws: sampling, not greedy
    compositions = [  # (batch, adapters, where the target sits)
        ([prompts[0], target, prompts[3]], [None, "tenant", None], 1),  # shorter and longer neighbours: padding moves
        ([target, target], ["tenant", None], 0),  # the same prompt on the base weights beside it
        ([prompts[2]] * 5 + [target], [None] * 5 + ["tenant"], 5),  # last of 18 rows
    ]
    for batch, adapters, at in compositions:
        for sampler in samplers:  # one 18-row decode, or one row at a time
            got = sampler.sample(batch, PARAMS, adapter_name=adapters)[at]
            assert tokens(got) == tokens(alone), (len(batch), sampler.max_batch_size)
    torch.manual_seed(12345)  # the global RNG plays no part
    assert tokens(narrow.sample([target], PARAMS, adapter_name="tenant")[0]) == tokens(alone)


def test_sample_j_is_the_same_whatever_num_samples(samplers, prompts):
    wide, _ = samplers
    five = wide.sample([prompts[0]], SamplingParams(**{**PARAMS.__dict__, "num_samples": 5}))[0]
    two = wide.sample([prompts[0]], SamplingParams(**{**PARAMS.__dict__, "num_samples": 2}))[0]
    assert tokens(five)[:2] == tokens(two)
    other_seed = wide.sample([prompts[0]], SamplingParams(**{**PARAMS.__dict__, "seed": 22}))[0]
    assert tokens(other_seed) != tokens(five)[:3]


def test_temperature_zero_is_greedy_whatever_the_seed(samplers, trainer, prompts):
    wide, _ = samplers
    runs = [
        wide.sample(prompts, SamplingParams(max_tokens=8, temperature=0, seed=s, num_samples=2), adapter_name="tenant")
        for s in (None, 1, 2)
    ]
    for p, prompt in enumerate(prompts):
        expected = hf_greedy(trainer, prompt, 8, "tenant")
        for run in runs:
            for seq in run[p].sequences:
                assert seq.tokens == expected[: len(seq.tokens)] and (len(seq.tokens) == 8 or seq.stop_reason == "stop")


_CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from contract_model import make_trainer
from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter
torch.manual_seed(999)  # a different global RNG state than the parent's
s = TorchSampler({model!r})
s.set_adapter("tenant", extract_adapter(make_trainer({model!r}), "tenant"))
(r,) = s.sample([{prompt!r}], SamplingParams(**{params!r}), adapter_name="tenant")
print(json.dumps([q.tokens for q in r.sequences]))
"""


def test_a_fresh_process_draws_the_same_tokens(samplers, model_path, prompts):
    wide, _ = samplers
    params = {k: v for k, v in PARAMS.__dict__.items()}
    code = _CHILD.format(tests=str(Path(__file__).parent), model=model_path, prompt=prompts[3], params=params)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == tokens(
        wide.sample([prompts[3]], PARAMS, adapter_name="tenant")[0]
    )
