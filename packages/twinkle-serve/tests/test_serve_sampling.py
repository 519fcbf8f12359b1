"""Tinker sampling through the unmodified SDK: top-k log-probs, prompt_logprobs_last_n, target_prompt_logprobs,
prompt_alt_tokens_k, stop (None vs []), max_tokens None, seeds, and 400s for bad requests."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest
import torch

from twinkle.hub import TEST_MODEL, resolve_model_path

PROMPT = [5 + (7 * i) % 60 for i in range(10)]
with open(f"{resolve_model_path(TEST_MODEL)}/config.json") as _f:
    CONTEXT = json.load(_f)["max_position_embeddings"]
ANSWER = [311, 312, 2]  # two tokens, then <|im_end|> (the tiny model's EOS ids are 2 and 0)


@pytest.fixture(scope="module")
def eos_trained(alice):
    """A LoRA trained (loss on the answer only) until greedy decoding of PROMPT answers ANSWER, ending in EOS."""
    from tinker import types

    seq = PROMPT + ANSWER
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * (len(PROMPT) - 1) + [1.0] * len(ANSWER)},
    )
    tc = alice.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=5).result()
    for _ in range(40):  # at 3e-3 greedy decoding answers ANSWER from step 10 on (1e-2 oscillates)
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    path = tc.save_weights_for_sampler("eos").result().path
    return tc, path, tc.create_sampling_client(path).result()


@pytest.fixture(scope="module")
def reference(server, eos_trained):
    """logp(prefix) -> [T, V] log-softmax of a plain transformers + peft forward of the saved adapter (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model_path

    _, path, _ = eos_trained
    folder = (
        server.runtime.data_dir
        / server.runtime.store.db.one("SELECT dir FROM checkpoints WHERE tinker_path=?", (path,))["dir"]
    )
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()

    @torch.no_grad()
    def logp(tokens):
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)

    return logp


def greedy(max_tokens=8, **kw):
    from tinker import types

    return types.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_topk(rows, logp_T_V, k):
    """rows[i] hold the k best token ids of logp_T_V[i], best first, and their log-probs to 1e-5 (fp32: a
    log-prob of -20 carries ~1e-6 of rounding, so 1e-6 relative on top)."""
    assert len(rows) == logp_T_V.shape[0]
    for row, logp_V in zip(rows, logp_T_V):
        want = logp_V.topk(k)
        assert [t for t, _ in row] == want.indices.tolist()
        np.testing.assert_allclose([lp for _, lp in row], want.values.tolist(), atol=1e-5, rtol=1e-6)


def test_topk_prompt_and_sample_logprobs_equal_a_peft_forward(eos_trained, reference):
    from tinker import types

    _, _, sampler = eos_trained
    out = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        2,
        types.SamplingParams(max_tokens=5, temperature=1.0, seed=3, stop=[]),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=6,
        topk_sample_logprobs=4,
    ).result()
    logp = reference(PROMPT)
    tops = out.topk_prompt_logprobs
    assert len(tops) == len(PROMPT) and tops[0] is None and all(len(r) == 6 for r in tops[1:])
    assert_topk(tops[1:], logp[:-1], 6)
    want_prompt = [float(logp[t - 1, PROMPT[t]]) for t in range(1, len(PROMPT))]
    assert out.prompt_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:], want_prompt, atol=1e-5, rtol=1e-6)
    for seq in out.sequences:
        assert len(seq.tokens) == 5 and len(seq.topk_logprobs) == 5
        full = reference(PROMPT + seq.tokens)[len(PROMPT) - 1 : -1]
        assert_topk(seq.topk_logprobs, full, 4)
        np.testing.assert_allclose(
            seq.logprobs, [float(full[i, t]) for i, t in enumerate(seq.tokens)], atol=1e-5, rtol=1e-6
        )


def test_topk_prompt_logprobs_beyond_20_up_to_the_advertised_cap(eos_trained, reference):
    """The hosted service stops at 20; here k goes to capabilities' max_topk_logprobs (256, or the vocabulary)."""
    import tinker
    from tinker import types

    _, _, sampler = eos_trained
    prompt = types.ModelInput.from_ints(PROMPT)
    tops = sampler.sample(prompt, 1, greedy(1), topk_prompt_logprobs=64).result().topk_prompt_logprobs
    assert all(len(r) == 64 for r in tops[1:])
    assert_topk(tops[1:], reference(PROMPT)[:-1], 64)
    with pytest.raises(tinker.BadRequestError, match="at most 256, got 257"):
        sampler.sample(prompt, 1, greedy(1), topk_prompt_logprobs=257).result()


def test_topk_alone_and_absent(eos_trained):
    from tinker import types

    _, _, sampler = eos_trained
    prompt = types.ModelInput.from_ints(PROMPT)
    only_topk = sampler.sample(prompt, 1, greedy(2), topk_prompt_logprobs=3).result()
    assert only_topk.prompt_logprobs is None and len(only_topk.topk_prompt_logprobs) == len(PROMPT)
    assert only_topk.sequences[0].topk_logprobs is None
    plain = sampler.sample(prompt, 1, greedy(2), include_prompt_logprobs=True).result()
    assert plain.topk_prompt_logprobs is None and plain.prompt_logprobs is not None
    # the top-1 sampled alternative under greedy decoding is the token that was chosen
    seq = sampler.sample(prompt, 1, greedy(3, stop=[]), topk_sample_logprobs=1).result().sequences[0]
    assert [row[0][0] for row in seq.topk_logprobs] == seq.tokens


def test_prompt_logprobs_last_n_scores_only_the_suffix(eos_trained):
    from tinker import types

    _, _, sampler = eos_trained
    prompt = types.ModelInput.from_ints(PROMPT)
    full = sampler.compute_logprobs(prompt).result()
    last3 = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert last3[:-3] == [None] * (len(PROMPT) - 3) and last3[-3:] == full[-3:]
    out = sampler.sample(
        prompt, 1, greedy(1), include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=2
    ).result()
    assert out.topk_prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert all(len(row) == 2 for row in out.topk_prompt_logprobs[-2:])
    with pytest.raises(Exception, match=r"prompt_logprobs_last_n must be between 1 and len\(prompt\) - 1 = 9"):
        sampler.compute_logprobs(prompt, prompt_logprobs_last_n=10).result()


def test_stop_none_keeps_eos_and_empty_list_disables_it(eos_trained):
    from tinker import types

    _, _, sampler = eos_trained
    prompt = types.ModelInput.from_ints(PROMPT)
    at_eos = sampler.sample(prompt, 1, greedy(8)).result().sequences[0]
    assert at_eos.tokens == ANSWER and at_eos.stop_reason == "stop"  # EOS kept, as Tinker returns it
    through = sampler.sample(prompt, 1, greedy(8, stop=[])).result().sequences[0]
    assert len(through.tokens) == 8 and through.tokens[:3] == ANSWER and through.stop_reason == "length"
    by_id = sampler.sample(prompt, 1, greedy(8, stop=[ANSWER[0]])).result().sequences[0]
    assert by_id.tokens == ANSWER[:1] and by_id.stop_reason == "stop"
    no_room = sampler.sample(prompt, 1, greedy(2)).result().sequences[0]
    assert no_room.tokens == ANSWER[:2] and no_room.stop_reason == "length"
    # max_tokens None: until a stop (here EOS) or the end of the context
    assert sampler.sample(prompt, 1, greedy(None)).result().sequences[0].tokens == ANSWER


def test_stop_strings(eos_trained):
    from tinker import types

    _, _, sampler = eos_trained  # ANSWER decodes as " develop", " +", then EOS
    prompt = types.ModelInput.from_ints(PROMPT)
    for stop, want in (
        ("elop", ANSWER[:1]),
        (" develop +", ANSWER[:2]),
        ([" +", "never"], ANSWER[:2]),
        (["never"], ANSWER),
    ):
        got = sampler.sample(prompt, 1, greedy(8, stop=stop)).result().sequences[0]
        assert got.tokens == want and got.stop_reason == "stop", stop


def test_max_tokens_none_fills_the_context(eos_trained):
    from tinker import types

    _, _, sampler = eos_trained
    n = CONTEXT  # the embedded model's own (Qwen3's 32,768)
    long_prompt = types.ModelInput.from_ints([7 + i % 50 for i in range(n - 4)])
    seq = sampler.sample(long_prompt, 1, greedy(None, stop=[])).result().sequences[0]
    assert len(seq.tokens) == 4 and seq.stop_reason == "length"
    full = types.ModelInput.from_ints([7 + i % 50 for i in range(n)])
    with pytest.raises(Exception, match=f"fills the context of {n}"):
        sampler.sample(full, 1, greedy(None)).result()


def test_seed_gives_the_same_tokens_and_num_samples_sequences(eos_trained):
    from tinker import types

    _, _, sampler = eos_trained
    prompt = types.ModelInput.from_ints(PROMPT[:4])
    params = lambda seed: types.SamplingParams(max_tokens=10, temperature=1.5, seed=seed, stop=[])  # noqa: E731
    tokens = lambda r: [s.tokens for s in r.sequences]  # noqa: E731
    a, b = sampler.sample(prompt, 4, params(21)).result(), sampler.sample(prompt, 4, params(21)).result()
    c = sampler.sample(prompt, 4, params(22)).result()
    assert len(a.sequences) == 4 and tokens(a) == tokens(b) and tokens(a) != tokens(c)
    assert len({tuple(t) for t in tokens(a)}) > 1  # the samples of one request are independent draws
    assert sampler.sample(prompt, 1, params(21)).result().sequences[0].tokens == tokens(a)[0]


def test_target_prompt_logprobs_dense_and_sparse(eos_trained, reference):
    from tinker import types

    _, _, sampler = eos_trained
    rows = len(PROMPT) - 1
    ids = torch.full((rows, 3), -1, dtype=torch.int64)
    ids[:, 0] = torch.tensor(PROMPT[1:])  # row i scores prompt position i + 1: its own token first
    ids[2, 1], ids[5, 2], ids[rows - 1, 1] = 7, 849, ANSWER[0]
    table = reference(PROMPT)[:-1]
    want = torch.where(ids >= 0, table.gather(1, ids.clamp(min=0)), torch.zeros(())).numpy()
    prompt = types.ModelInput.from_ints(PROMPT)
    dense = sampler.sample(
        prompt, 1, greedy(1), include_prompt_logprobs=True, target_prompt_logprobs=types.TensorData.from_torch(ids)
    ).result()
    got = dense.target_prompt_logprobs
    assert got.shape == [rows, 3] and got.sparse_crow_indices is None
    np.testing.assert_allclose(got.to_numpy(), want, atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(got.to_numpy()[:, 0], dense.prompt_logprobs[1:], atol=1e-6)
    sparse_ids = types.TensorData.from_torch_sparse(ids[:, 1:], pad_value=-1)  # 3 named cells of 18
    assert sparse_ids.sparse_crow_indices is not None
    sparse = sampler.sample(prompt, 1, greedy(1), target_prompt_logprobs=sparse_ids).result().target_prompt_logprobs
    assert sparse.sparse_crow_indices == sparse_ids.sparse_crow_indices
    assert sparse.sparse_col_indices == sparse_ids.sparse_col_indices
    np.testing.assert_allclose(sparse.to_numpy(), want[:, 1:], atol=1e-5, rtol=1e-6)


def test_prompt_alt_tokens_are_seeded_draws_with_their_logprobs(eos_trained, reference):
    from tinker import types

    _, _, sampler = eos_trained
    prompt = types.ModelInput.from_ints(PROMPT)

    def draw(seed, temperature=1.0):
        return (
            sampler.sample(
                prompt,
                1,
                types.SamplingParams(max_tokens=1, temperature=temperature, seed=seed),
                prompt_alt_tokens_k=64,
            )
            .result()
            .prompt_alt_tokens
        )

    a, b, c = draw(1), draw(1), draw(2)
    tokens, logprobs = a.tokens.to_numpy(), a.logprobs.to_numpy()
    assert tokens.shape == logprobs.shape == (len(PROMPT) - 1, 64)
    assert (b.tokens.to_numpy() == tokens).all() and (c.tokens.to_numpy() != tokens).any()
    table = reference(PROMPT)[:-1]
    np.testing.assert_allclose(logprobs, table.gather(1, torch.from_numpy(tokens)).numpy(), atol=1e-5, rtol=1e-6)
    # draws follow the model: the row's most likely token is drawn about as often as its probability says
    top_p, top_id = table.exp().max(-1)
    freq = (tokens == top_id.numpy()[:, None]).mean(axis=1)
    assert np.abs(freq - top_p.numpy()).mean() < 0.12, (freq, top_p)
    for temperature in (0.0, 1e-40):  # greedy; a tiny temperature is greedy too, not a NaN distribution
        assert (draw(None, temperature).tokens.to_numpy() == top_id.numpy()[:, None]).all()


@pytest.fixture(scope="module")
def raw(server, keys):
    """post(body overrides) -> the HTTP response of a hand-written /asample on a base-model sampler."""
    headers = {"X-API-Key": keys["alice"]}

    def call(path, body):
        return httpx.post(f"{server.url}/api/v1/{path}", json=body, headers=headers, timeout=60)

    session = call("create_session", {"tags": [], "sdk_version": "0.38.0", "type": "create_session"}).json()
    sampler = call(
        "create_sampling_session",
        {
            "session_id": session["session_id"],
            "sampling_session_seq_id": 0,
            "base_model": TEST_MODEL,
            "type": "create_sampling_session",
        },
    ).json()

    def post(**overrides):
        body = {
            "sampling_session_id": sampler["sampling_session_id"],
            "seq_id": 0,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 2},
            "type": "sample",
            **overrides,
        }
        return call("asample", body)

    return post


@pytest.mark.parametrize(
    "override, message",
    [
        ({"sampling_params": {"stop": [""]}}, "sampling_params.stop must be"),
        ({"sampling_params": {"stop": ["x", 3]}}, "sampling_params.stop must be"),
        (
            {"sampling_params": {"max_tokens": 0}},
            r"sampling_params.max_tokens = 0 is outside its range: an integer in \[1, ",
        ),
        ({"sampling_params": {"top_k": -2}}, r"sampling_params.top_k = -2 is outside its range: an integer in \[-1, "),
        (
            {"sampling_params": {"temperature": -0.5}},
            r"sampling_params.temperature = -0.5 is outside its range: a finite number in \[0, ",
        ),
        (
            {"sampling_params": {"top_p": 0}},
            r"sampling_params.top_p = 0 is outside its range: a finite number in \(0, 1\]",
        ),
        ({"num_samples": 0}, r"num_samples = 0 is outside its range: an integer in \[1, 1024\]"),
        ({"topk_prompt_logprobs": 257}, "topk_prompt_logprobs must be at most 256"),
        ({"num_samples": 1025}, r"num_samples = 1025 is outside its range: an integer in \[1, 1024\]"),
        ({"sampling_params": "greedy"}, "sampling_params must be an object"),
        ({"prompt": {"chunks": 5}}, "prompt.chunks must be a list"),
        ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k must be an integer >= 0"),
        (
            {"target_prompt_logprobs": {"data": [1] * 8, "dtype": "int64", "shape": [8, 1]}},
            r"target_prompt_logprobs must have shape \[len\(prompt\) - 1 = 9, K >= 1\]",
        ),
        ({"target_prompt_logprobs": {"data": [-1] * 9, "dtype": "int64", "shape": [9, 1]}}, "names no token id"),
        (
            {"target_prompt_logprobs": {"data": [850] * 9, "dtype": "int64", "shape": [9, 1]}},
            r"token ids in \[0, 850\) or -1",
        ),
        (
            {
                "target_prompt_logprobs": {
                    "data": [3],
                    "dtype": "int64",
                    "shape": [9, 2],
                    "sparse_crow_indices": [0, 1],
                    "sparse_col_indices": [0],
                }
            },
            "not a CSR layout of shape",
        ),
        ({"topk_sample_logprobs": -1}, "topk_sample_logprobs must be an integer >= 0"),
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n applies to prompt logprobs"),
        ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, True]}]}}, "integer token ids"),
    ],
)
@pytest.mark.no_float
def test_bad_sampling_requests_are_400s_naming_the_field(raw, override, message):
    r = raw(**override)
    assert r.status_code == 400, r.text
    assert re.search(message, r.text), r.text


def test_a_one_token_prompt_has_no_scored_positions(eos_trained):
    from tinker import types

    _, _, sampler = eos_trained
    out = sampler.sample(
        types.ModelInput.from_ints(PROMPT[:1]),
        1,
        greedy(2),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        prompt_alt_tokens_k=3,
    ).result()
    assert out.prompt_logprobs == [None] and out.topk_prompt_logprobs == [None]
    assert out.prompt_alt_tokens.tokens.to_numpy().shape == (0, 3) and len(out.sequences[0].tokens) == 2


def test_prompt_alt_tokens_at_a_subnormal_temperature_are_the_argmax_not_nan():
    import torch

    from twinkle.serve.tinker.prompt_scores import score_table

    table_T_V = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]]), dim=-1)
    scores, (ids_T_K, logprobs_T_K) = score_table(table_T_V, None, 4, 5e-324, seed=7)  # 5e-324 is 0 in float32
    assert scores is None
    assert ids_T_K.tolist() == [[1] * 4, [0] * 4]
    assert np.isfinite(logprobs_T_K).all()


def test_a_sampler_checkpoint_saved_again_under_its_name_samples_the_new_weights(eos_trained):
    """The same `tinker://` path after more training is new weights: neither a sampling client made
    before the re-save nor one made after it may answer from the old adapter."""
    from tinker import types

    tc, _, _ = eos_trained
    first = tc.save_weights_for_sampler("resaved").result().path
    before = tc.create_sampling_client(first).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    lps_old = before.compute_logprobs(prompt).result()
    seq = [*PROMPT, 400, 401, 402]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * (len(PROMPT) - 1) + [1.0] * 3},
    )
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    second = tc.save_weights_for_sampler("resaved").result().path
    assert second == first
    after = tc.create_sampling_client(second).result()
    expected = tc.save_weights_and_get_sampling_client().compute_logprobs(prompt).result()
    for client in (before, after):
        got = client.compute_logprobs(prompt).result()
        assert got[1:] == pytest.approx(expected[1:], abs=1e-6)
        assert max(abs(a - b) for a, b in zip(got[1:], lps_old[1:])) > 1e-3
