"""twinkle-kit's SampledSequence.new_input_feature: the prompt and a sampled continuation as a row that
trains as it was sampled, with the prompt row's own keys."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from twinkle.sampler import SampledSequence, SampleResponse, SamplingParams, TorchSampler
from twinkle.sampler.input_feature import build_input_feature


def test_in_process_samples_are_rows_the_trainer_scores_as_sampled(model_path, prompts):
    from twinkle.model import TransformersModel

    sampler = TorchSampler(model_path)
    responses = sampler.sample(prompts[:3], SamplingParams(max_tokens=5, temperature=1.0, seed=7))
    rows = []
    for prompt, response in zip(prompts, responses):
        sequence = response.sequences[0]
        row = sequence.new_input_feature
        assert row == {"input_ids": prompt + sequence.tokens, "labels": [-100] * len(prompt) + sequence.tokens}
        assert sequence.new_input_feature is row  # built once
        rows.append(row)
    scored = TransformersModel(model_id=model_path).forward_only(rows)["logprobs"]
    for prompt, response, logprobs in zip(prompts, responses, scored):
        sampled = response.sequences[0].logprobs
        assert max(abs(a - b) for a, b in zip(logprobs[len(prompt) :], sampled)) < 1e-3


def test_the_prompt_rows_keys_come_along_and_a_chat_gains_the_reply():
    chat = [{"role": "user", "content": "1+1="}]
    row = {
        "input_ids": [3, 4, 5],
        "labels": [-100, -100, -100],
        "attention_mask": [1, 1, 1],  # the prompt's length: no longer fits, dropped
        "messages": chat,
        "user_data": [["answer", "2"]],
    }
    feature = build_input_feature([3, 4, 5], [9, 2], "2", row)
    assert feature == {
        "input_ids": [3, 4, 5, 9, 2],
        "labels": [-100, -100, -100, 9, 2],
        "messages": [*chat, {"role": "assistant", "content": "2"}],
        "user_data": [["answer", "2"]],
    }
    assert row["messages"] == chat  # the prompt row is not changed
    sequence = SampledSequence(tokens=[9, 2], logprobs=[-0.1, -0.2], stop_reason="stop", text="2")
    SampleResponse(sequences=[sequence], prompt_tokens=[3, 4, 5])
    sequence.follow([3, 4, 5], chat)
    assert sequence.new_input_feature["messages"][-1] == {"role": "assistant", "content": "2"}
    assert "new_input_feature" not in asdict(sequence)  # not a field: the wire and checkpoints carry none
    assert SampledSequence(tokens=[9], logprobs=None, stop_reason="stop").new_input_feature is None


@pytest.mark.parametrize("labels", [None, [-100, 4]])
def test_prompt_labels_of_another_length_become_minus_100(labels):
    row = {"input_ids": [3, 4, 5], **({"labels": labels} if labels else {})}
    assert build_input_feature([3, 4, 5], [7], None, row)["labels"] == [-100, -100, -100, 7]


def test_decoded_is_twinkle_kits_name_for_the_text():
    assert SampledSequence(tokens=[1], logprobs=None, stop_reason="stop", text="hi").decoded == "hi"
    assert SampledSequence(tokens=[1], logprobs=None, stop_reason="stop", text="").decoded == ""
