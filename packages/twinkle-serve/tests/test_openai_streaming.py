"""Streaming over the OpenAI API is incremental: chunks leave while the sampler is still decoding, join
to exactly the non-streamed answer (same seed: same text, tokens and log-probs, with n, stop strings and
logprobs), a reader who disconnects stops the decode loop (its tokens counted once) and leaves the server
serving, and a failure midway ends the stream with an error event. Driven by the official `openai`
client against the real server; a wrapper around the server's TorchSampler counts and paces decode steps."""

from __future__ import annotations

import threading

import pytest

from twinkle.hub import TEST_MODEL

TENANT = "oai-stream"
WAIT_S = 120  # only bounds a failing test; nothing here asserts on time


@pytest.fixture(scope="module")
def oai(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.create_key(TENANT), max_retries=0)


class Decoding:
    """Wraps the server's TorchSampler.sample: counts each call's decode steps, records its tokens, and
    can hold the decode loop after step `pause_at` until `go` is set, or fail at step `fail_at`."""

    def __init__(self, server, monkeypatch, pause_at: int | None = None, fail_at: int | None = None):
        sampler = server.runtime.engines[TEST_MODEL].backend.sampler
        self.steps: list[int] = []  # decode steps of the current call
        self.tokens: list[list[list[int]]] = []  # per call: each sequence's tokens
        self.go, self.closed = threading.Event(), threading.Event()
        real = sampler.sample

        def sample(inputs, params, adapter_name=None, on_tokens=None, **options):  # options: cache_namespace
            self.steps = []

            def hook(step):
                self.steps.append(len(step))
                if len(self.steps) == fail_at:
                    raise RuntimeError("decoder fell over")
                on_tokens(step)
                if len(self.steps) == pause_at and not self.go.wait(WAIT_S):
                    raise AssertionError("the reader never released the decode loop")

            responses = real(
                inputs, params, adapter_name=adapter_name, on_tokens=hook if on_tokens else None, **options
            )
            self.tokens.append([s.tokens for s in responses[0].sequences])
            return responses

        monkeypatch.setattr(sampler, "sample", sample)


def chat(oai, **kw):
    kw = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 24, "seed": 5, **kw}
    return oai.chat.completions.create(model=TEST_MODEL, **kw)


def joined(stream, n: int, field):
    """(text per choice, finish reason per choice, log-prob entries per choice, usage) of a chunk stream."""
    texts, finish, lps, usage = [""] * n, [None] * n, [[] for _ in range(n)], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += field(c) or ""
            finish[c.index] = c.finish_reason or finish[c.index]
            if c.logprobs is not None:  # chat: entries in `content`; completions: one Logprobs per chunk
                lps[c.index] += c.logprobs.content if hasattr(c.logprobs, "content") else [c.logprobs]
    return texts, finish, lps, usage


def test_the_first_chunk_arrives_while_the_sampler_is_still_decoding(server, oai, monkeypatch):
    decoding = Decoding(server, monkeypatch, pause_at=8)
    seen_at = None
    texts = ""
    for chunk in chat(oai, max_tokens=32, temperature=1.0, stream=True):
        content = chunk.choices[0].delta.content if chunk.choices else None
        if content and seen_at is None:
            seen_at = sum(decoding.steps)  # the sampler is held at step 8 until we let it go
            decoding.go.set()
        texts += content or ""
    assert seen_at is not None and seen_at <= 8 < 32
    assert sum(decoding.steps) == 32 and len(decoding.tokens[-1][0]) == 32  # it went on to max_tokens


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_streamed_choices_join_to_the_non_streamed_answer(server, oai, monkeypatch, api):
    decoding = Decoding(server, monkeypatch)
    if api == "chat":
        kw = dict(n=2, temperature=1.0, logprobs=True, top_logprobs=2)
        call, field = lambda **more: chat(oai, **kw, **more), lambda c: c.delta.content
        content = lambda r: r.choices[0].message.content  # noqa: E731
    else:
        kw = dict(model=TEST_MODEL, prompt="once upon a time", max_tokens=24, seed=5, n=2, logprobs=2)
        call, field = lambda **more: oai.completions.create(**kw, **more), lambda c: c.text
        content = lambda r: r.choices[0].text  # noqa: E731
    free = content(call())
    stop = free[10:12]  # a string the seeded answer contains: it must cut choice 0 there
    assert stop.strip() and len(free) > 12
    whole = call(stop=[stop, "zzzq"])
    tokens = decoding.tokens[-1]
    used = server.runtime.store.usage.totals(TENANT).get("sampling_sample", 0)
    streamed = call(stop=[stop, "zzzq"], stream=True, stream_options={"include_usage": True})
    texts, finish, lps, usage = joined(streamed, 2, field)
    assert decoding.tokens[-1] == tokens  # the same seed drew the same token ids
    assert texts[0] == free[: free.index(stop)] and finish[0] == "stop"
    assert texts == [content_of(c, api) for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens == sum(len(t) for t in tokens)
    # the stream's sampled tokens were counted once
    assert server.runtime.store.usage.totals(TENANT)["sampling_sample"] - used == usage.completion_tokens
    for i, c in enumerate(whole.choices):
        if api == "chat":
            expected = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in c.logprobs.content]
            got = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in lps[i]]
        else:
            rows = lambda lp: zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)  # noqa: E731
            expected, got = list(rows(c.logprobs)), [x for lp in lps[i] for x in rows(lp)]
        assert got == expected and len(got) > 0


def content_of(choice, api: str) -> str:
    return choice.message.content if api == "chat" else choice.text


def test_a_reader_who_leaves_stops_the_decode_loop_and_the_server_serves_on(server, oai, monkeypatch):
    from twinkle.serve.openai.generate import StreamClosed

    decoding = Decoding(server, monkeypatch)
    sampler = server.runtime.engines[TEST_MODEL].backend.sampler
    inner = sampler.sample
    stopped = threading.Event()

    def sample(inputs, params, adapter_name=None, on_tokens=None, **options):
        def hook(step):
            on_tokens(step)
            if len(decoding.steps) == 1 and not decoding.go.is_set():
                # held after step 1 until the reader has gone; then the loop must learn that the stream closed
                decoding.go.wait(WAIT_S)
                for _ in range(WAIT_S * 100):
                    try:
                        on_tokens([])
                    except StreamClosed:
                        stopped.set()
                        raise
                    threading.Event().wait(0.01)

        return inner(inputs, params, adapter_name=adapter_name, on_tokens=hook if on_tokens else None, **options)

    monkeypatch.setattr(sampler, "sample", sample)
    used = server.runtime.store.usage.totals(TENANT).get("sampling_sample", 0)
    stream = chat(oai, max_tokens=200, temperature=1.0, stream=True)
    next(iter(stream))  # the role chunk: the decode loop has started
    stream.close()
    decoding.go.set()
    after = chat(oai, max_tokens=5, temperature=0)  # queued behind the abandoned request on the same worker
    assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 5
    assert stopped.is_set()
    # the abandoned request's one decoded token is counted, once, with the follow-up's
    assert server.runtime.store.usage.totals(TENANT)["sampling_sample"] - used == 1 + 5


def test_failures_before_the_first_byte_are_statuses_and_after_it_an_error_event(server, oai, monkeypatch):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, max_tokens=40000, stream=True)  # over the 32,768 context
    assert "exceeds the context" in err.value.body["message"]
    Decoding(server, monkeypatch, fail_at=3)
    received = []
    with pytest.raises(openai.APIError) as err:  # noqa: PT012 - the stream fails part-way: the chunks before it arrive
        for chunk in chat(oai, temperature=1.0, stream=True):
            received.append(chunk)
    # a fault of the server: said so, with the log's reference, and none of the exception's text
    assert received and "internal error" in err.value.message and "decoder fell over" not in err.value.message
    # the server serves on (2 steps: the wrapper, still in place, fails every decode at its third)
    assert chat(oai, max_tokens=2).choices[0].finish_reason in ("length", "stop")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from twinkle.hub import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(TEST_MODEL))


def stream_text(tokenizer, text: str, stop: list[str] | None, eos: bool = False):
    """Feed `text`'s tokens to a ChoiceText one by one -> (the deltas sent, the final rendering)."""
    from twinkle.sampler import SampledSequence
    from twinkle.sampler.decoding import StepToken
    from twinkle.serve.openai.streaming import ChoiceText

    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
    choice = ChoiceText(tokenizer, stop)
    deltas = [choice.add(StepToken(0, t, -0.5, None))[0] for t in ids]
    rest, lo, hi, final = choice.finish(SampledSequence(ids, [-0.5] * len(ids), "stop" if eos else "length"))
    return [*deltas, rest], final, (lo, hi)


def test_a_character_split_over_tokens_waits_until_it_decodes(tokenizer):
    text = "中文 café 🙂 naïve"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode(ids[: k + 1]) for k in range(len(ids)))  # the tokenizer does split them
    deltas, final, _ = stream_text(tokenizer, text, None, eos=True)
    assert "".join(deltas) == final.text == text
    assert not any("\ufffd" in d for d in deltas) and deltas[:3] == ["", "", "中"]


def test_text_that_may_begin_a_stop_string_is_held_back(tokenizer):
    deltas, final, (lo, hi) = stream_text(tokenizer, "a cat sat.", ["sat", "t!"])
    # tokens a| cat| s|at|. : "a cat" may go on as "t!" (its "t" waits), "a cat s" as "sat" ("s" waits), "sat" cuts
    assert deltas == ["a", " ca", "t ", "", "", ""] and final.text == "a cat " and final.finish_reason == "length"
    assert (lo, hi) == (len(final.tokens), len(final.tokens))  # every kept token already went out
    deltas, final, _ = stream_text(tokenizer, "a cat s", ["sat"])  # a held prefix that never completes
    assert "".join(deltas) == final.text == "a cat s" and deltas[-1] == "s"


def test_the_tokens_per_day_quota_refuses_a_stream_before_its_first_byte(server):
    import openai

    c = openai.OpenAI(base_url=server.url + "/v1", api_key=server.create_key("oai-quota"), max_retries=0)
    server.runtime.store.quotas.set("oai-quota", tokens_per_day=5)  # less than the prompt alone
    for stream in (True, False):
        with pytest.raises(openai.RateLimitError) as err:
            chat(c, max_tokens=4, stream=stream)
        assert "tokens_per_day quota: 0 used of 5" in err.value.body["message"]
    server.runtime.store.quotas.set("oai-quota", tokens_per_day=1000)
    _, finish, _, usage = joined(
        chat(c, max_tokens=4, stream=True, stream_options={"include_usage": True}), 1, lambda ch: ch.delta.content
    )
    assert finish == ["length"] and usage.completion_tokens == 4
    assert server.runtime.store.usage.since("oai-quota", 0) == usage.prompt_tokens + 4  # counted once
