"""What a Tinker tenant (the SDK) and a native tenant (twinkle-client's proxies) do on a server, and
the checks that a server whose model group is remote (Ray actors) gives one process's numbers."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.hub import TEST_MODEL

# Four datums of different lengths: the two data ranks get different slices and paddings.
SEQS = [[5 + (7 * i + k) % 60 for i in range(n)] for k, n in enumerate((20, 13, 17, 9))]
PROBE = [11 + (5 * i) % 70 for i in range(16)]


def run_tinker_loop(server, sft):
    """Three SL steps, a step after a failed request, a sampler: the numbers both servers must agree on."""
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=server.url, api_key=server.create_key("ray-tenant"))
    tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=5).result()
    losses = []
    for _ in range(3):
        fb = tc.forward_backward([sft(s) for s in SEQS], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    out = tc.forward([sft(s) for s in SEQS], "cross_entropy").result()
    # A request whose loss overflows only in the last datum (data rank 1's slice) fails as a whole:
    # rank 0's part of it must leave no gradient behind, so the next step equals one process's.
    poisoned = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={
                "target_tokens": s[1:],
                "advantages": [1.0] * (len(s) - 1),  # sampled at logprob -200: ratio e^190
                "logprobs": [-200.0 if k == len(SEQS) - 1 else -1.0] * (len(s) - 1),
            },
        )
        for k, s in enumerate(SEQS)
    ]
    clean = tc.forward_backward([sft(s) for s in SEQS[:2]], "cross_entropy")
    with pytest.raises(Exception, match="not finite"):
        tc.forward_backward(poisoned, "importance_sampling").result()
    clean.result()
    grad_norm = tc.optim_step(types.AdamParams(learning_rate=1e-4)).result().metrics["grad_norm:mean"]
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROBE[:6])
    samples = [
        sampler.sample(
            prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=5, seed=17, temperature=1.0)
        ).result()
        for _ in range(2)
    ]  # both sampler replicas
    # drawn from the prompt's whole distribution where the sampler runs (Backend.reduce_prompt_table)
    alt = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=1, seed=17, temperature=1.0), prompt_alt_tokens_k=3
    ).result()
    return {
        "losses": losses,
        "logprobs": [o["logprobs"].to_numpy() for o in out.loss_fn_outputs],
        "forward_loss": out.metrics["loss:sum"],
        "tc": tc,
        "client": client,
        "grad_norm_after_failure": grad_norm,
        "probe_logprobs": sampler.compute_logprobs(types.ModelInput.from_ints(PROBE)).result(),
        "samples": [[(s.tokens, s.logprobs, s.stop_reason) for s in r.sequences] for r in samples],
        "alt_tokens": alt.prompt_alt_tokens.tokens.to_numpy(),
        "alt_logprobs": alt.prompt_alt_tokens.logprobs.to_numpy(),
    }


# Three rows of different lengths, prompts masked (-100): two data ranks get different row and
# loss-token counts, so their shares of each step must be weighted to equal one process.
LENGTHS, PROMPTS = (21, 14, 9), (5, 0, 3)
ROWS = [
    {
        "input_ids": [4 + (11 * i + 3 * k) % 70 for i in range(n)],
        "labels": [-100] * p + [4 + (11 * i + 3 * k) % 70 for i in range(p, n)],
    }
    for k, (n, p) in enumerate(zip(LENGTHS, PROMPTS))
]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def native_model(client):
    from twinkle.client.model import TransformersModel

    model = TransformersModel(model_id=TEST_MODEL, client=client)
    model.add_adapter_to_model("default", LORA, gradient_accumulation_steps=2).result()
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=2e-2)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10)
    return model


def native_steps(model, steps: int) -> dict:
    """`steps` optimizer steps of two micro-batches each (gradient accumulation over the rows, halves)."""
    losses, norms = [], []
    for _ in range(steps):
        halves = [model.forward_backward(inputs=ROWS[:2]), model.forward_backward(inputs=ROWS[2:])]
        step = model.clip_grad_and_step(max_grad_norm=5.0)
        losses.append([f.result()["loss"] for f in halves])
        norms.append(step.result()["grad_norm"])
    return {"losses": losses, "grad_norms": norms}


def run_native_loop(server, tenant: str = "native-remote") -> dict:
    """Three steps, a forward, the metrics, a saved checkpoint resumed by a second model."""
    from twinkle.client import TwinkleClient

    client = TwinkleClient(server.url, server.create_key(tenant))
    model = native_model(client)
    out = native_steps(model, 3)
    forward = model.forward_only(inputs=ROWS).result()
    metrics = model.calculate_metric(is_training=True).result()
    path = model.save("remote-ckpt", save_training_state=True).result()
    resumed = native_model(client)
    resumed.resume_from_checkpoint(path).result()
    after = {name: native_steps(m, 1) for name, m in (("original", model), ("resumed", resumed))}
    return {
        **out,
        "forward_loss": forward["loss"],
        "logprobs": forward["logprobs"],
        "metrics": metrics,
        "after_resume": after,
    }


WALL_CLOCK = ("tokens_per_s", "mfu")


def assert_native_runs_equal(got: dict, expected: dict, tol: float = 1e-5) -> None:
    """The numbers a native tenant sees on a remote group equal those of one process (fp32 tolerance)."""
    assert got["losses"][-1][0] < got["losses"][0][0]  # it trains
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=tol)
    np.testing.assert_allclose(got["grad_norms"], expected["grad_norms"], rtol=tol)
    assert got["forward_loss"] == pytest.approx(expected["forward_loss"], rel=tol)
    assert [len(lp) for lp in got["logprobs"]] == [len(lp) for lp in expected["logprobs"]]  # row order kept
    for g, e in zip(got["logprobs"], expected["logprobs"]):
        np.testing.assert_allclose(g, e, atol=10 * tol)
    assert set(got["metrics"]) == set(expected["metrics"])
    for key, value in expected["metrics"].items():  # merged over the ranks: loss, token accuracy, grad norm, lr
        if key in WALL_CLOCK:
            assert got["metrics"][key] > 0, key  # measured, not computed: two runs never take the same seconds
            continue
        assert got["metrics"][key] == pytest.approx(value, rel=tol, abs=1e-7), key
    after = got["after_resume"]
    assert after["resumed"] == after["original"]  # resumed on the ranks: the same next step, bit for bit
    np.testing.assert_allclose(after["original"]["losses"], expected["after_resume"]["original"]["losses"], rtol=tol)
