"""The remote backend's shards built in this process (`remote_group=None`): the same calls, the same
numbers as the plain multi-LoRA backend, and the per-rank fan-in (slices, metrics, failures)."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.sampler import SamplingParams
from twinkle.serve.backend import AdamParams, LoraSpec, UserError
from twinkle.serve.tinker.datums import Datum, train


def datum(tokens):
    return Datum(
        tokens[:-1],
        {"target_tokens": np.array(tokens[1:], dtype=np.int64), "weights": np.ones(len(tokens) - 1, dtype=np.float32)},
    )


SEQS = [[3 + (5 * i + k) % 50 for i in range(n)] for k, n in enumerate((12, 7, 10))]


@pytest.fixture(scope="module")
def backends():
    from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend
    from twinkle.serve.backend.remote import RemoteBackend

    path = str(resolve_model_path(TEST_MODEL))
    return MultiLoraBackend(TEST_MODEL, path), RemoteBackend(TEST_MODEL, path)


def test_in_process_shards_equal_plain_backend(backends):
    spec = LoraSpec(rank=4, seed=9)
    for b in backends:
        b.create_adapter("t1", spec)
    results = []
    for b in backends:
        losses = []
        for _ in range(2):
            losses.append(train(b, "t1", [datum(s) for s in SEQS], "cross_entropy", {}, False).metrics["loss:sum"])
            b.optim_step("t1", AdamParams(learning_rate=5e-2))
        b.install_sampler_from_adapter("s1", "t1")
        sample = b.sample("s1", SEQS[0][:5], SamplingParams(max_tokens=4, seed=3, num_samples=2))
        results.append((losses, [s.tokens for s in sample.sequences]))
    (plain_losses, plain_tokens), (remote_losses, remote_tokens) = results
    np.testing.assert_allclose(remote_losses, plain_losses, rtol=1e-6)
    assert remote_tokens == plain_tokens


def test_a_prompt_table_is_reduced_on_the_sampler_rank_alike(backends):
    """Backend.reduce_prompt_table on the remote backend's sampler shard equals the in-process one, and
    scoring the prompt's own next tokens gives the sampler's prompt log-probs."""
    import functools

    from twinkle.serve.tinker.prompt_scores import score_table

    prompt = SEQS[0]
    targets_T_K = np.stack([np.array(prompt[1:]), np.full(len(prompt) - 1, -1)], axis=1)
    reduce = functools.partial(score_table, targets=targets_T_K, k=3, temperature=1.0, seed=11)
    answers = [b.reduce_prompt_table(None, prompt, reduce) for b in backends]
    (plain_scores, (plain_ids, plain_lps)), (remote_scores, (remote_ids, remote_lps)) = answers
    np.testing.assert_allclose(remote_scores, plain_scores, rtol=1e-5)
    assert remote_ids.tolist() == plain_ids.tolist() and plain_ids.shape == (len(prompt) - 1, 3)
    np.testing.assert_allclose(remote_lps, plain_lps, rtol=1e-5)
    assert (plain_scores[:, 1] == 0.0).all()  # -1: no id asked there
    response = backends[0].sample(None, prompt, SamplingParams(max_tokens=1, prompt_logprobs=True))
    np.testing.assert_allclose(plain_scores[:, 0], response.prompt_logprobs[1:], rtol=1e-5)


def test_user_errors_come_back_as_user_errors(backends):
    _, remote = backends
    with pytest.raises(UserError, match="not loaded"):
        train(remote, "nobody", [datum(SEQS[0])], "cross_entropy", {}, False)
    with pytest.raises(UserError, match="unknown loss_fn"):
        train(remote, "t1", [datum(SEQS[0])], "hinge", {}, False)
    with pytest.raises(UserError, match="lora rank"):
        remote.create_adapter("t2", LoraSpec(rank=0))
    with pytest.raises(UserError, match="weights are gone"):
        remote.sample("never-installed", [1, 2], SamplingParams(max_tokens=2))


def test_rank_results_merge_in_row_order_and_fail_together():
    from twinkle.serve.backend.shards import merge_rank_results

    r0 = {"loss": 3.0, "finite": True, "logprobs": [[-1.0], [-2.0]]}
    r1 = {"loss": 3.0, "finite": True, "logprobs": [[-4.0]]}
    empty = {"loss": 3.0, "finite": True, "logprobs": []}
    nan = UserError("loss is nan")  # the ranks agreed on the failure: each answers with its message
    ok, failed, tiny = merge_rank_results([[r0, nan, r0], [r1, UserError("loss is nan"), empty]])
    assert ok == {"loss": 3.0, "finite": True, "logprobs": [[-1.0], [-2.0], [-4.0]]}
    assert failed is nan
    assert tiny == r0  # a request smaller than the group: the empty rank adds no rows


def test_the_remote_backend_is_chosen_in_config_from_the_one_registry():
    from twinkle.serve.backend import BACKENDS
    from twinkle.serve.backend.remote import RemoteBackend
    from twinkle.serve.config import ServeConfig

    assert BACKENDS.get("multi_lora_remote") is RemoteBackend
    ray = {"ray": {"groups": [{"name": "model", "ranks": 2}]}}
    entries = [
        {"name": TEST_MODEL, "remote_group": "model"},  # a config written before the backend was named
        {"name": "b", "sampler_remote_group": "model", "backend": "multi_lora_remote"},
        {"name": "c"},
    ]
    config = ServeConfig.model_validate({**ray, "models": entries})
    assert [m.backend for m in config.models] == ["multi_lora_remote", "multi_lora_remote", "multi_lora"]
    with pytest.raises(ValueError, match="backend 'multi_lora' does not run on Ray remote groups .remote_group.; "):
        ServeConfig.model_validate({**ray, "models": [{**entries[0], "backend": "multi_lora"}]})
