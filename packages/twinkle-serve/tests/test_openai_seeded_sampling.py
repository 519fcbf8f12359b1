"""Seeded sampling over HTTP is a function of the request alone: the Tinker SDK's and the OpenAI client's
seeded samples repeat while other requests share the server, and again after the server restarts on its
data dir (same checkpoint, new process state)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from twinkle.hub import TEST_MODEL

PROMPT = [5 + (7 * i) % 60 for i in range(10)]
OTHER = [9, 8, 7, 6, 5]


def tinker_draws(url: str, key: str, path: str, seed: int, noise: bool = False) -> list[list[int]]:
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=key).create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=seed)
    noisy = []
    if noise:  # other requests queued before and after it, on the same sampler and on the base model
        base = tinker.ServiceClient(base_url=url, api_key=key).create_sampling_client(base_model=TEST_MODEL).result()
        noisy = [
            sc.sample(types.ModelInput.from_ints(OTHER), 2, types.SamplingParams(max_tokens=6, seed=seed + 1)),
            base.sample(types.ModelInput.from_ints(PROMPT), 3, params),
        ]
    result = sc.sample(types.ModelInput.from_ints(PROMPT), 3, params)
    noisy.append(sc.sample(types.ModelInput.from_ints(OTHER), 1, types.SamplingParams(max_tokens=6)))
    for f in noisy:
        f.result()
    return [s.tokens for s in result.result().sequences]


def openai_draws(url: str, key: str, path: str, seed: int) -> list[str]:
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    r = c.completions.create(model=path, prompt=PROMPT, n=3, max_tokens=10, temperature=1.0, seed=seed, logprobs=0)
    return [(ch.text, ch.logprobs.tokens) for ch in r.choices]


@pytest.fixture(scope="module")
def first_server(start, tmp_path_factory):
    """A server with a sampler checkpoint of a briefly trained LoRA; (server, key, path, data dir)."""
    import tinker
    from tinker import types

    data_dir = tmp_path_factory.mktemp("seeded")
    srv = start(data_dir)
    key = srv.create_key("seeded")
    tc = (
        tinker.ServiceClient(base_url=srv.url, api_key=key)
        .create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=1)
        .result()
    )
    seq = [*PROMPT, 11, 12, 13]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_weights_for_sampler("seeded").result().path
    yield srv, key, path, data_dir
    if srv._thread.is_alive():  # the restart test stops it itself
        srv.stop()


def test_temperature_zero_is_greedy_over_both_apis(first_server):
    import openai
    import tinker
    from tinker import types

    srv, key, path, _ = first_server
    sc = tinker.ServiceClient(base_url=srv.url, api_key=key).create_sampling_client(model_path=path).result()
    greedy = [
        sc.sample(
            types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=8, temperature=0.0, seed=s)
        ).result()
        for s in (1, 2)
    ]
    seqs = [s.tokens for r in greedy for s in r.sequences]
    assert all(s == seqs[0] for s in seqs)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
    r = c.completions.create(model=path, prompt=PROMPT, n=2, max_tokens=8, temperature=0, logprobs=0, seed=3)
    tok = srv.runtime.engines[TEST_MODEL].backend.tokenizer
    expected = [tok.decode([t]) for t in seqs[0]]
    assert [ch.logprobs.tokens for ch in r.choices] == [expected[: len(r.choices[0].logprobs.tokens)]] * 2


# last in the module: it stops the first server
def test_seeded_samples_repeat_across_load_and_a_restart(start, first_server):
    srv, key, path, data_dir = first_server
    t_alone, o_alone = tinker_draws(srv.url, key, path, 7), openai_draws(srv.url, key, path, 7)
    assert len({tuple(t) for t in t_alone}) > 1 and len({t for t, _ in o_alone}) > 1  # real draws
    with ThreadPoolExecutor(3) as pool:  # while other requests come and go
        busy = [
            pool.submit(tinker_draws, srv.url, key, path, 7, True),
            pool.submit(openai_draws, srv.url, key, path, 7),
            pool.submit(tinker_draws, srv.url, key, path, 8, True),
        ]
        assert busy[0].result() == t_alone and busy[1].result() == o_alone
        assert busy[2].result() != t_alone  # another seed, other draws
    srv.stop()
    again = start(data_dir)  # a new process state on the same data dir: the key and checkpoint persist
    try:
        assert tinker_draws(again.url, key, path, 7) == t_alone
        assert openai_draws(again.url, key, path, 7) == o_alone
    finally:
        again.stop()
