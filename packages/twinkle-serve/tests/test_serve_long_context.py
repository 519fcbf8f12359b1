"""Long sequences through the unmodified tinker SDK: an 8K-token datum trains (its per-token log-probs
equal compute_logprobs on the same tokens), the trained weights sample a continuation of it, and the
capabilities report the embedded model's real context (Qwen3's 32,768) and its real LoRA-rank cap."""

from __future__ import annotations

import os

import pytest

TENANT = "lena"
# 8K by default (fast); TWINKLE_LONG_TOKENS=32760 runs the same test at the full context (32,760 prompt
# tokens + 4 sampled + the appended target fit Qwen3's 32,768)
LONG = int(os.environ.get("TWINKLE_LONG_TOKENS", "8192"))


def long_tokens(n):
    return [5 + (i * 7 + i // 13) % 700 for i in range(n)]


@pytest.fixture(scope="module")
def client(server, tenant_key):
    import tinker

    return tinker.ServiceClient(base_url=server.url, api_key=tenant_key)


def test_an_8k_datum_trains_and_its_weights_sample(client, sft):
    from tinker import types

    tokens = long_tokens(LONG + 1)
    tc = client.create_lora_training_client(base_model="twinkle://qwen3-tiny", rank=4, seed=3).result()
    datum = sft(tokens)
    first = tc.forward_backward([datum], "cross_entropy").result()
    logprobs = first.loss_fn_outputs[0]["logprobs"].tolist()
    assert len(logprobs) == LONG
    assert first.metrics["loss:sum"] == pytest.approx(-sum(logprobs), rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    second = tc.forward_backward([datum], "cross_entropy").result()
    assert second.metrics["loss:sum"] < first.metrics["loss:sum"]  # the step learned from 8K tokens

    sampler = tc.save_weights_and_get_sampling_client(name="long").result()
    prompt = types.ModelInput.from_ints(tokens[:LONG])
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert len(out.sequences[0].tokens) == 4
    # the sampler scores the prompt's tokens as the trained weights' forward does (other kernels, so
    # equal relative to magnitude, not bit for bit)
    sampled = sampler.compute_logprobs(prompt).result()
    assert sampled[0] is None and len(sampled) == LONG
    forward = tc.forward([sft(tokens[:LONG])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert sampled[1:] == pytest.approx(forward, rel=1e-4, abs=1e-4)


def test_capabilities_report_real_context_and_rank_cap(server, tenant_key):
    import httpx

    body = httpx.get(
        f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": tenant_key}, timeout=30
    ).json()
    row = next(m for m in body["supported_models"] if m["model_name"] == "twinkle://qwen3-tiny")
    assert row["max_context_length"] == 32768
    assert row["max_lora_rank"] == 96  # the tiny model's hidden size bounds every Linear's rank
