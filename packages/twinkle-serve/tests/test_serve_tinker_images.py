"""Tinker ImageChunk through the unmodified SDK against a real server on twinkle://qwen2.5-vl-tiny:
forward, forward_backward (training moves the answer), sample and compute_logprobs, each against a
plain transformers computation; expected_tokens checked; asset pointers and text-only models refused."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.hub.embedded_vl import VL_TEST_MODEL

TENANT = "vision"


def _shape_png(i: int) -> bytes:
    from twinkle.dataset import Dataset, DatasetMeta

    row = Dataset(DatasetMeta("twinkle://shapes", data_slice=range(i, i + 1)))[0]
    url = row["messages"][0]["content"][0]["image"]
    return base64.b64decode(url.partition(",")[2])


@pytest.fixture(scope="module")
def vl(start, tmp_path_factory):
    import tinker

    srv = start(tmp_path_factory.mktemp("vl-data"), models=[{"name": VL_TEST_MODEL}, {"name": TEST_MODEL}])
    key = srv.create_key(TENANT)
    yield srv, tinker.ServiceClient(base_url=srv.url, api_key=key), key
    srv.stop()


@pytest.fixture(scope="module")
def hf():
    """The tiny VL model, its tokenizer and image encoder, as plain transformers loads them."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from twinkle.template.vision import load_image_encoder

    path = resolve_model_path(VL_TEST_MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok, load_image_encoder(path, tok)


def _pieces(tok, png, expected, answer="red"):
    """(prompt chunks, answer token ids, full token ids with the image's placeholders)."""
    from tinker import types

    before = tok.encode("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)
    after = tok.encode("<|vision_end|>What colour is the shape?<|im_end|>\n<|im_start|>assistant\n")
    ans = tok.encode(answer + "<|im_end|>", add_special_tokens=False)
    image = types.ImageChunk(data=png, format="png", expected_tokens=expected)
    chunks = [types.EncodedTextChunk(tokens=before), image, types.EncodedTextChunk(tokens=after)]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    return chunks, ans, before + [pad] * expected + after


def _datum(tok, png, n):
    """An SFT datum: the image question, then the answer (loss on the answer only)."""
    from tinker import types

    chunks, ans, prompt_ids = _pieces(tok, png, n)
    full = prompt_ids + ans
    model_input = types.ModelInput(chunks=[*chunks, types.EncodedTextChunk(tokens=ans[:-1])])
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(ans)
    return types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": full[1:], "weights": weights}), full


@torch.no_grad()
def _hand_logprobs(model, encoder, full, png):
    pixels, grid, _ = encoder.encode([png])
    ids = torch.tensor([full])
    logits = model(
        input_ids=ids,
        pixel_values=torch.from_numpy(pixels),
        image_grid_thw=torch.from_numpy(grid),
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
    ).logits[0]
    return torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0].numpy()


def test_forward_and_compute_logprobs_equal_transformers(vl, hf):
    _, client, _ = vl
    model, tok, encoder = hf
    png = _shape_png(0)
    n = encoder.encode([png])[2][0]
    datum, full = _datum(tok, png, n)
    tc = client.create_lora_training_client(base_model=VL_TEST_MODEL, rank=4, seed=1).result()
    out = tc.forward([datum], "cross_entropy").result()
    got = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    want = _hand_logprobs(model, encoder, full, png)  # a fresh LoRA (B = 0) is the base model
    assert got.shape == want.shape == (len(full) - 1,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    other = tc.forward([_datum(tok, _shape_png(1), n)[0]], "cross_entropy").result()  # another picture
    assert not np.allclose(other.loss_fn_outputs[0]["logprobs"].to_numpy(), got, atol=1e-4)

    from tinker import types

    sc = client.create_sampling_client(base_model=VL_TEST_MODEL).result()
    chunks, ans, _ = _pieces(tok, png, n)
    model_input = types.ModelInput(chunks=[*chunks, types.EncodedTextChunk(tokens=ans[:-1])])
    lps = sc.compute_logprobs(model_input).result()
    # the prompt is full[:-1]: its positions after the first scored exactly as forward scored them
    assert lps[0] is None and len(lps) == len(full) - 1
    np.testing.assert_allclose(np.array(lps[1:], dtype=np.float32), want[:-1], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained(vl, hf):
    """A LoRA trained through the SDK on one image question until it answers; (its sampler path, losses)."""
    from tinker import types

    _, client, _ = vl
    _, tok, encoder = hf
    png = _shape_png(0)
    datum, _ = _datum(tok, png, encoder.encode([png])[2][0])
    tc = client.create_lora_training_client(base_model=VL_TEST_MODEL, rank=8, seed=2).result()
    losses = []
    for _ in range(30):
        losses.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc.save_weights_for_sampler("img").result().path, losses


def test_training_on_image_chunks_then_sampling_answers(vl, hf, trained):
    from tinker import types

    _, client, _ = vl
    model, tok, encoder = hf
    png = _shape_png(0)
    n = encoder.encode([png])[2][0]
    path, losses = trained
    assert losses[-1] < 0.2 * losses[0]
    sc = client.create_sampling_client(model_path=path).result()
    chunks, ans, _ = _pieces(tok, png, n)
    params = types.SamplingParams(max_tokens=len(ans), temperature=0.0)
    got = sc.sample(types.ModelInput(chunks=chunks), 1, params).result().sequences[0].tokens
    assert got == ans  # the trained answer, greedily, through the sampler's image prefill and decode
    base = client.create_sampling_client(base_model=VL_TEST_MODEL).result()
    plain = base.sample(types.ModelInput(chunks=chunks), 1, params).result().sequences[0].tokens
    ids = torch.tensor([_pieces(tok, png, n)[2]])
    pixels, grid, _ = encoder.encode([png])
    with torch.no_grad():
        want = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=torch.from_numpy(pixels),
            image_grid_thw=torch.from_numpy(grid),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            max_new_tokens=len(ans),
            do_sample=False,
        )[0, ids.shape[1] :].tolist()
    assert plain == want[: len(plain)] and len(plain) >= 1  # the base model: transformers' own generate


def test_expected_tokens_mismatch_names_both_counts(vl, hf):
    import tinker

    _, client, _ = vl
    _, tok, encoder = hf
    png = _shape_png(0)
    n = encoder.encode([png])[2][0]
    datum, _ = _datum(tok, png, n + 3)
    tc = client.create_lora_training_client(base_model=VL_TEST_MODEL, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=rf"expected_tokens is {n + 3} but model .* makes {n} tokens"):
        tc.forward_backward([datum], "cross_entropy").result()


def test_asset_pointers_and_text_only_models_refused(vl, hf):
    import tinker
    from tinker import types

    _, client, _ = vl
    _, tok, encoder = hf
    png = _shape_png(0)
    n = encoder.encode([png])[2][0]
    pointer = types.ImageAssetPointerChunk(format="png", location="s3://bucket/cat.png", expected_tokens=n)
    sc = client.create_sampling_client(base_model=VL_TEST_MODEL).result()
    params = types.SamplingParams(max_tokens=1)
    with pytest.raises(tinker.BadRequestError, match="image_asset_pointer chunks need the hosted service's asset"):
        sc.sample(types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6]), pointer]), 1, params).result()
    datum, _ = _datum(tok, png, n)
    text = client.create_lora_training_client(base_model=TEST_MODEL, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=rf"model '{TEST_MODEL}' is text-only"):
        text.forward_backward([datum], "cross_entropy").result()
    text_sc = client.create_sampling_client(base_model=TEST_MODEL).result()
    chunks, _, _ = _pieces(tok, png, n)
    with pytest.raises(tinker.BadRequestError, match=rf"model '{TEST_MODEL}' is text-only"):
        text_sc.sample(types.ModelInput(chunks=chunks), 1, params).result()
    bad = types.ImageChunk(data=png, format="jpeg", expected_tokens=n)
    with pytest.raises(tinker.BadRequestError, match="says format 'jpeg' but its bytes are PNG"):
        sc.sample(types.ModelInput(chunks=[bad]), 1, params).result()


def _chat(png, answer="red"):
    question = [{"type": "image", "image": png}, {"type": "text", "text": "What colour is the shape?"}]
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def test_native_client_trains_on_chats_with_images(vl, hf):
    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel

    srv, _, key = vl
    _, _tok, _encoder = hf
    model = TransformersModel(model_id=VL_TEST_MODEL, client=TwinkleClient(srv.url, key), name="vl-native")
    # gate/up/down_proj name vision-tower layers too: the engine keeps adapters on the language model
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    model.add_adapter_to_model("default", {"r": 8, "lora_alpha": 32, "target_modules": targets})
    # lr 2e-2 trained chaotically here (losses 0.9 -> 15.7 -> 0.03 -> 3.0): where it ended depended on the
    # last bits of the optimizer kernel; at 5e-3 the loss falls steadily (6.83 -> 0.02 in 20 steps)
    model.set_optimizer("AdamW", lr=5e-3)
    red, blue = _chat(_shape_png(0)), _chat(_shape_png(1))
    first = float(model.forward_only(inputs=[red])["loss"])
    assert first != pytest.approx(float(model.forward_only(inputs=[blue])["loss"]), rel=1e-4)  # the pixels are used
    for _ in range(20):
        model.forward_backward(inputs=[red])
        model.clip_grad_and_step()
    assert float(model.forward_only(inputs=[red])["loss"]) < 0.3 * first
    with pytest.raises(ValueError, match="remote URL: the server fetches nothing"):
        model.forward_only(inputs=[_chat("https://example.com/cat.png")])

    text = TransformersModel(model_id=TEST_MODEL, client=TwinkleClient(srv.url, key), name="text-native")
    text.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    with pytest.raises(Exception, match=rf"model '{TEST_MODEL}' is text-only"):
        float(text.forward_only(inputs=[red])["loss"])


def test_openai_chat_answers_about_an_image_with_the_tenants_adapter(vl, trained):
    import openai

    srv, _, key = vl
    path, _ = trained
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
    url = "data:image/png;base64," + base64.b64encode(_shape_png(0)).decode()

    def ask(model, image_url, **kw):
        question = [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": "What colour is the shape?"},
        ]
        return oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=4, **kw
        )

    assert ask(path, url).choices[0].message.content == "red"  # what the adapter was trained to answer
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(path, url, stream=True) if c.choices)
    assert streamed == "red"
    with pytest.raises(openai.BadRequestError, match="remote URL; this server fetches nothing"):
        ask(path, "https://example.com/cat.png")
    with pytest.raises(openai.BadRequestError, match=rf"model '{TEST_MODEL}' is text-only"):
        ask(TEST_MODEL, url)


def test_native_image_chats_sample_and_check_expected_tokens(vl, hf):
    """The native API's chats with images: sampling from one equals transformers' greedy generate on
    the same prompt, and an image part's expected_tokens is checked like a Tinker ImageChunk's."""
    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel
    from twinkle.client.sampler import Sampler
    from twinkle.template import Template

    srv, _, key = vl
    model, _, encoder = hf
    png = _shape_png(0)
    n = encoder.encode([png])[2][0]
    chat = _chat(png)["messages"][:1]
    sampler = Sampler(VL_TEST_MODEL, client=TwinkleClient(srv.url, key))
    params = {"max_tokens": 5, "temperature": 0.0, "stop": []}
    (out,) = sampler.sample([chat], params).result()
    prompt = Template(VL_TEST_MODEL).encode_prompt({"messages": chat})
    ids = torch.tensor([prompt["input_ids"]])
    want = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=torch.from_numpy(np.asarray(prompt["pixel_values"], np.float32)),
        image_grid_thw=torch.tensor(prompt["image_grid_thw"]),
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
        max_new_tokens=5,
        do_sample=False,
    )[0, ids.shape[1] :].tolist()
    assert out.sequences[0].tokens == want

    def with_expected(k):
        c = _chat(png)
        c["messages"][0]["content"][0]["expected_tokens"] = k
        return c

    mismatch = rf"image 0: expected_tokens is {n + 1} but model '{VL_TEST_MODEL}' makes {n} tokens of this image"
    with pytest.raises(Exception, match="chat 0 " + mismatch):
        sampler.sample([with_expected(n + 1)["messages"][:1]], params).result()
    trainer = TransformersModel(model_id=VL_TEST_MODEL, client=TwinkleClient(srv.url, key), name="vl-expected")
    trainer.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    assert float(trainer.forward_only(inputs=[with_expected(n)])["loss"]) > 0  # the right count passes
    with pytest.raises(Exception, match="trajectory 0 " + mismatch):
        float(trainer.forward_only(inputs=[with_expected(n + 1)])["loss"])
