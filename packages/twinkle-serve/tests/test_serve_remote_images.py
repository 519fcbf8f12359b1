"""Image prompts through the remote (shard) backend's sample on twinkle://qwen2.5-vl-tiny: the pixels
reach the sampler shard, and its prompt log-probs and greedy tokens equal plain transformers'."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from twinkle.hub import resolve_model_path
from twinkle.hub.embedded_vl import VL_TEST_MODEL


@pytest.fixture(scope="module")
def setup():
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.template import Template

    row = Dataset(DatasetMeta("twinkle://shapes", data_slice=range(1)))[0]
    template = Template(VL_TEST_MODEL)
    prompt = template.encode_prompt({"messages": row["messages"][:1]})
    png = base64.b64decode(row["messages"][0]["content"][0]["image"].partition(",")[2])
    return resolve_model_path(VL_TEST_MODEL), prompt, png


@torch.no_grad()
def _hand(path, prompt):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt["input_ids"]])
    kwargs = {
        "pixel_values": torch.from_numpy(np.asarray(prompt["pixel_values"], np.float32)),
        "image_grid_thw": torch.tensor(prompt["image_grid_thw"]),
        "mm_token_type_ids": (ids == model.config.image_token_id).int(),
    }
    logits = model(input_ids=ids, **kwargs).logits[0]
    lps = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs, max_new_tokens=4, do_sample=False
    )
    return lps.numpy(), out[0, ids.shape[1] :].tolist()


def test_remote_backend_samples_from_an_image_prompt_like_transformers(setup):
    from twinkle.sampler import SamplingParams
    from twinkle.serve.backend.remote import RemoteBackend

    path, prompt, _ = setup
    images = {
        "pixel_values": np.asarray(prompt["pixel_values"], np.float32),
        "image_grid_thw": np.asarray(prompt["image_grid_thw"], np.int64),
    }
    backend = RemoteBackend(VL_TEST_MODEL, str(path))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    result = backend.sample(None, list(prompt["input_ids"]), params, images=images)
    want_lps, want_tokens = _hand(path, prompt)
    got = np.asarray(result.prompt_logprobs[1:], np.float64)
    np.testing.assert_allclose(got, want_lps, rtol=1e-4, atol=1e-5 * np.abs(want_lps).max())
    assert result.sequences[0].tokens == want_tokens
    blank = {**images, "pixel_values": np.zeros_like(images["pixel_values"])}
    other = backend.sample(None, list(prompt["input_ids"]), params, images=blank)
    assert not np.allclose(np.asarray(other.prompt_logprobs[1:], np.float64), got, rtol=1e-4)  # pixels used
