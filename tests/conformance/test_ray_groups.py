"""A 2-actor Ray group (a real local Ray cluster, `ray_group` in conftest.py): forward_only gathers every rank's rows in order
(it raised TypeError: each rank returns a dict where the collection expected a list), and a sampler
splits the prompts over its ranks (every rank sampled the whole batch, rank 0's answer came back)."""

from __future__ import annotations

import pytest

from twinkle.hub import TEST_MODEL
from twinkle.mesh import remote_method
from twinkle.sampler import TorchSampler
from twinkle.sampler.base import prompt_items

pytestmark = pytest.mark.slow
ROWS = [
    {"input_ids": list(range(5 + i, 14 + 2 * i)), "labels": [-100] * 2 + list(range(7 + i, 14 + 2 * i))}
    for i in range(5)
]  # 5 rows over 2 ranks: shares of 3 and 2


class CountingSampler(TorchSampler):
    """Counts the prompts this rank sampled. Its `sample` is not declared again: it inherits the
    Sampler contract's split."""

    def sample(self, inputs, sampling_params=None, adapter_name=None):
        self.served = getattr(self, "served", 0) + len(prompt_items(inputs))
        return super().sample(inputs, sampling_params, adapter_name)

    @remote_method(collect="all")
    def served_count(self) -> int:
        return getattr(self, "served", 0)


def test_forward_only_on_a_ray_group_returns_every_row_in_order(ray_group):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    remote = TransformersModel(model_id=TEST_MODEL, device_mesh=ray_group, remote_group="model")
    remote.add_adapter_to_model("default", lora)
    local = TransformersModel(model_id=TEST_MODEL)
    local.add_adapter_to_model("default", lora)  # B starts at zero: both compute the base model's numbers
    got, want = remote.forward_only(inputs=ROWS), local.forward_only(inputs=ROWS)
    assert [len(r) for r in got["logprobs"]] == [len(r["input_ids"]) for r in ROWS]
    worst = max(abs(a - b) for g, w in zip(got["logprobs"], want["logprobs"]) for a, b in zip(g, w))
    assert worst <= 1e-5
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)  # the global batch's loss, not a mean of ranks'
    remote.remote_shutdown()


def test_a_sampler_group_splits_the_prompts_over_its_ranks(ray_group):
    prompts = [r["input_ids"][:6] for r in ROWS[:3]]
    params = {"max_tokens": 4, "temperature": 0.0, "seed": 3}
    remote = CountingSampler(model_id=TEST_MODEL, remote_group="model")
    got = remote.sample(prompts, params, adapter_name=[None, None, None])
    want = TorchSampler(model_id=TEST_MODEL).sample(prompts, params)
    assert [r.prompt_tokens for r in got] == prompts  # in prompt order
    assert [r.sequences[0].tokens for r in got] == [r.sequences[0].tokens for r in want]
    assert remote.served_count() == [2, 1]  # each rank its share, not [3, 3]
    got_lps, want_lps = remote.compute_logprobs(prompts), TorchSampler(model_id=TEST_MODEL).compute_logprobs(prompts)
    assert [row[0] for row in got_lps] == [None] * 3
    assert [row[1:] for row in got_lps] == [pytest.approx(row[1:], abs=1e-5) for row in want_lps]
    one = remote.sample(prompts[0], params)  # one prompt, two ranks: rank 1 gets none
    assert [r.sequences[0].tokens for r in one] == [want[0].sequences[0].tokens]
    remote.remote_shutdown()
