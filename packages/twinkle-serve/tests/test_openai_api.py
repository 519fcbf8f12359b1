"""The OpenAI-compatible API driven by the official `openai` client against a real server: a LoRA trained
through the Tinker SDK answers chat and text completions (streaming or not) under its checkpoint path or
name, with the model's chat template, n, max_tokens, temperature, seed, stop and logprobs; another
tenant's checkpoint and an unknown model are OpenAI-shaped 404s."""

from __future__ import annotations

import httpx
import pytest
import torch

from twinkle.hub import TEST_MODEL

QUESTION = "hi there"
ANSWER = "a cat sat."


@pytest.fixture(scope="module")
def keys(server):
    return {name: server.create_key(name) for name in ("oai-ann", "oai-ben")}


def client(server, key):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def ann(server, keys):
    return client(server, keys["oai-ann"])


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.runtime.engines[TEST_MODEL].backend.tokenizer


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def trained(server, keys, tokenizer):
    """ann's LoRA, trained through the Tinker SDK until greedy decoding answers QUESTION with ANSWER<|im_end|>."""
    import tinker
    from tinker import types

    prompt = chat_ids(tokenizer, QUESTION)
    seq = prompt + tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={
            "target_tokens": seq[1:],
            "weights": [0.0] * (len(prompt) - 1) + [1.0] * (len(seq) - len(prompt)),
        },
    )
    service = tinker.ServiceClient(base_url=server.url, api_key=keys["oai-ann"])
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=3).result()
    for _ in range(60):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    return tc.save_weights_for_sampler("chat").result().path


@pytest.fixture(scope="module")
def reference(server, trained):
    """tokens -> [T, V] log-softmax of plain transformers + peft on the saved adapter folder (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model_path

    folder = server.runtime.data_dir / server.runtime.store.checkpoints.get(trained).dir
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    return lambda tokens: torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1).detach()


def ask(c, model, **kw):
    kw = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, **kw}
    return c.chat.completions.create(model=model, **kw)


def test_models_lists_the_base_model_and_own_checkpoints(server, keys, ann, trained):
    ids = [m.id for m in ann.models.list().data]
    assert ids[0] == TEST_MODEL and trained in ids
    assert ann.models.retrieve(trained).id == trained
    assert trained not in [m.id for m in client(server, keys["oai-ben"]).models.list().data]


def test_chat_answers_with_the_adapter_through_the_chat_template(ann, trained, tokenizer, reference):
    by_path = ask(ann, trained, temperature=0, logprobs=True, top_logprobs=3)
    choice = by_path.choices[0]
    assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop")
    prompt = chat_ids(tokenizer, QUESTION)
    assert by_path.usage.prompt_tokens == len(prompt) and by_path.model == trained
    # the sampled <|im_end|> is counted in usage but is no part of the content
    answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    assert by_path.usage.completion_tokens == len(answer) + 1
    # log-probs are the adapter's own distribution: equal to a transformers + peft forward
    logp = reference(prompt + answer)
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == ANSWER and len(entries) == len(answer)
    for t, e in enumerate(entries):
        assert abs(e.logprob - logp[len(prompt) - 1 + t, answer[t]].item()) < 1e-3
        assert e.top_logprobs[0].token == e.token and len(e.top_logprobs) == 3  # greedy: the argmax
    by_name = ask(ann, "chat", temperature=0)
    assert by_name.choices[0].message.content == ANSWER
    base = ask(ann, TEST_MODEL, temperature=0)
    assert base.choices[0].message.content != ANSWER


def test_seeded_samples_repeat_and_streaming_carries_the_same_text(ann, trained):
    kw = dict(n=3, temperature=1.0, seed=11, max_tokens=10)
    first, again = ask(ann, TEST_MODEL, **kw), ask(ann, TEST_MODEL, **kw)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # n independent samples, not one repeated
    assert texts != [c.message.content for c in ask(ann, TEST_MODEL, **{**kw, "seed": 12}).choices]
    streamed, finish, usage = ["", "", ""], [None] * 3, None
    for chunk in ask(ann, TEST_MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert streamed == texts and finish == [c.finish_reason for c in first.choices]
    assert usage.completion_tokens == first.usage.completion_tokens


def test_text_completions_stop_strings_and_logprobs(ann, trained, tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    full = ann.completions.create(model=trained, prompt=prompt, temperature=0, max_tokens=12, logprobs=2)
    assert full.choices[0].text == ANSWER
    lp = full.choices[0].logprobs
    assert "".join(lp.tokens) == ANSWER and len(lp.top_logprobs[0]) == 2 and lp.text_offset[0] == 0
    cut = ann.completions.create(model=trained, prompt=prompt, temperature=0, max_tokens=12, stop=["sat"])
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("a cat ", "stop")
    short = ann.completions.create(model=trained, prompt=chat_ids(tokenizer, QUESTION), temperature=0, max_tokens=2)
    assert short.choices[0].finish_reason == "length" and ANSWER.startswith(short.choices[0].text)
    pieces = [
        c.choices[0].text
        for c in ann.completions.create(
            model=trained, prompt=prompt, temperature=0, max_tokens=12, stream=True, logprobs=1
        )
    ]
    assert "".join(pieces) == ANSWER and len([p for p in pieces if p]) > 1


def test_twinkle_export_merges_the_server_checkpoint(server, trained, tokenizer, reference, tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    folder = server.runtime.data_dir / server.runtime.store.checkpoints.get(trained).dir
    out = tmp_path / "merged"
    done = subprocess.run(
        [sys.executable, "-m", "twinkle.client.cli", "export", "--merge", str(folder), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == f"wrote {out}", done.stderr
    tokens = chat_ids(tokenizer, QUESTION) + tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(merged(input_ids=torch.tensor([tokens])).logits[0], -1)
    assert torch.allclose(logp, reference(tokens), atol=1e-4)


def test_both_apis_sample_one_copy_of_a_checkpoint(server, keys, ann, trained, tokenizer):
    """The Tinker sampler and the OpenAI route name a checkpoint alike: its weights load once, and
    the two APIs' greedy tokens agree."""
    import tinker
    from tinker import types

    from twinkle.serve.core.checkpoints import sampler_adapter_name

    sampler = server.runtime.engines[TEST_MODEL].backend.sampler
    name = sampler_adapter_name(server.runtime.store.checkpoints.get(trained))
    prompt = chat_ids(tokenizer, QUESTION)
    answer = ann.completions.create(model=trained, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    loaded = set(sampler.adapter_names)
    assert name in loaded
    sc = (
        tinker.ServiceClient(base_url=server.url, api_key=keys["oai-ann"])
        .create_sampling_client(model_path=trained)
        .result()
    )
    got = sc.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, temperature=0)).result()
    assert set(sampler.adapter_names) == loaded  # nothing loaded a second time
    assert tokenizer.decode(got.sequences[0].tokens) == answer.choices[0].text


def test_unknown_model_and_another_tenants_checkpoint_are_404(server, keys, ann, trained):
    import openai

    ben = client(server, keys["oai-ben"])
    for c, model in (
        (ann, "no-such-model"),
        (ann, "tinker://nope:train:0/sampler_weights/x"),
        (ben, trained),
        (ben, "chat"),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            ask(c, model)
        assert err.value.body["code"] == "model_not_found" and model in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        ben.models.retrieve(trained)


def test_bad_keys_and_unsupported_parameters_are_openai_errors(server, ann):
    import openai

    with pytest.raises(openai.AuthenticationError) as err:
        ask(client(server, "tml-not-a-key"), TEST_MODEL)
    assert err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as err:
        ask(ann, TEST_MODEL, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert err.value.body["param"] == "tools" and "unsupported parameter" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        ask(ann, TEST_MODEL, max_tokens=40000)  # over the 32,768 context
    assert "exceeds the context" in err.value.body["message"]
    # the raw wire: a missing bearer is 401 in OpenAI's shape; nulls (as many clients send) are defaults
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": TEST_MODEL, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {ann.api_key}"},
        json={
            "model": TEST_MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "n": None,
            "logprobs": None,
            "stop": None,
            "temperature": None,
            "seed": None,
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
