"""TorchSampler from image prompts on twinkle://qwen2.5-vl-tiny: an encoded prompt row carrying its
pixels decodes greedily exactly as transformers' `generate` does, with and without a LoRA adapter."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub.embedded_vl import VL_TEST_MODEL
from twinkle.sampler import TorchSampler
from twinkle.template import Template

MAX_NEW = 6


@pytest.fixture(scope="module")
def prompts():
    template = Template(VL_TEST_MODEL)
    rows = Dataset(DatasetMeta("twinkle://shapes", data_slice=range(2)))
    return [template.encode_prompt({"messages": r["messages"][:1]}) for r in rows]


def _generate(model, row):
    ids = torch.tensor([row["input_ids"]])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=torch.from_numpy(np.asarray(row["pixel_values"], np.float32)),
            image_grid_thw=torch.tensor(row["image_grid_thw"]),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
        )
    return out[0, ids.shape[1] :].tolist()


def test_image_prompts_with_and_without_an_adapter_equal_generate(prompts):
    sampler = TorchSampler(VL_TEST_MODEL)
    params = {"max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    base = copy.deepcopy(sampler.model)
    got = [r.sequences[0].tokens for r in sampler.sample(prompts, params)]  # both prompts in one batch
    assert got == [_generate(base, row) for row in prompts]

    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=32, target_modules=r".*language_model.*\.(q_proj|v_proj)|lm_head", init_lora_weights=False
    )
    peft_model = get_peft_model(copy.deepcopy(base), config).eval()
    sampler.add_adapter_from_model("tuned", peft_model, adapter_name="default")
    tuned = [r.sequences[0].tokens for r in sampler.sample(prompts, params, adapter_name="tuned")]
    assert tuned == [_generate(peft_model, row) for row in prompts]
    assert tuned != got  # the adapter changes the answers
