"""The RL losses by name with their loss_fn_config, and forward_backward_custom, checked against their formulas."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.hub import TEST_MODEL

SEQ = [4 + (13 * i) % 90 for i in range(14)]


@pytest.fixture(scope="module")
def policy(alice):
    return alice.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=8).result()


def _rl_datum(logq, adv):
    from tinker import types

    n = len(SEQ) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:], "logprobs": list(map(float, logq)), "advantages": [float(adv)] * n},
    )


def test_rl_losses_follow_their_formulas(policy, sft):
    logp = policy.forward([sft(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    n, A = len(logp), 0.7
    shifted = logp - 0.5  # r_t = e^0.5 ~ 1.65: outside every clip range below
    cases = [
        ("importance_sampling", logp, None, -n * A),
        ("importance_sampling", shifted, None, -np.exp(0.5) * n * A),
        ("ppo", shifted, None, -1.2 * n * A),  # default clip_high_threshold 1.2
        ("ppo", shifted, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, -1.5 * n * A),
        ("cispo", shifted, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, -1.2 * A * logp.sum()),
        ("dro", shifted, {"beta": 0.1}, -(A * logp.sum() - 0.5 * 0.1 * n * 0.25)),
        ("gspo", logp, None, -n * A),
    ]
    for loss_fn, logq, config, expected in cases:
        out = policy.forward([_rl_datum(logq, A)], loss_fn, loss_fn_config=config).result()
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4), (loss_fn, config)
        np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), logp, atol=1e-5)


@pytest.mark.no_float
def test_unknown_loss_config_is_a_user_error(policy, sft):
    import tinker

    with pytest.raises(tinker.RequestFailedError, match="bad loss_fn_config") as err:
        policy.forward([_rl_datum(np.zeros(len(SEQ) - 1), 1.0)], "ppo", loss_fn_config={"epsilon": 0.1}).result()
    assert err.value.category == "user"


def test_forward_backward_custom_matches_cross_entropy(alice, sft):
    from tinker import types

    def neg_loglik(data, logprobs_list):
        loss = sum(-lp.sum() for lp in logprobs_list)
        return loss, {"custom_tokens:sum": float(sum(len(lp) for lp in logprobs_list))}

    adam = types.AdamParams(learning_rate=1e-2)
    custom = alice.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=21).result()
    plain = alice.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=21).result()
    out = custom.forward_backward_custom([sft(SEQ)], neg_loglik).result()
    custom.optim_step(adam).result()
    ref = plain.forward_backward([sft(SEQ)], "cross_entropy").result()
    plain.optim_step(adam).result()
    assert out.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
    assert out.metrics["custom_tokens:sum"] == len(SEQ) - 1
    after = [c.forward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"] for c in (custom, plain)]
    assert after[0] == pytest.approx(after[1], rel=1e-5) and after[0] < ref.metrics["loss:sum"]
