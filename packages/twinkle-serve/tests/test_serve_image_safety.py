"""Images on all three APIs (native, Tinker through the unmodified SDK, OpenAI) against a real server on
twinkle://qwen2.5-vl-tiny. No request makes the server open a path or URL: an existing and a missing
file get the same 400 and the server opens neither (an audit hook watches). One bounded decoder serves
every API: a decompression bomb and a 9000x9000 PNG are refused from the header (the server's RSS
barely moves), GIF, BMP and EPS bytes are refused whatever their label, and image tokens outside the
model's vision markers are a 400 before the model runs."""

from __future__ import annotations

import base64
import io
import os
import struct
import sys
import threading
import zlib
from contextlib import contextmanager

import httpx
import numpy as np
import pytest

from twinkle.hub.embedded_vl import VL_TEST_MODEL

TENANT = "img-safety"
VS, VE, PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
RSS_BOUND_MB = 64  # decoding the 9000x9000 PNG needs 243 MB for its RGB pixels alone
_WATCHED: list[str] = []  # path prefixes whose opening is recorded while a probe runs
_SEEN: list[str] = []  # what was opened or executed


def _audit(event: str, args) -> None:
    if not _WATCHED:
        return
    if event == "open" and isinstance(args[0], (str, bytes)):
        path = os.fsdecode(args[0])
        if any(path.startswith(w) for w in _WATCHED):
            _SEEN.append(path)
    elif event == "subprocess.Popen":
        _SEEN.append(f"exec {args[0]}")


@contextmanager
def watching(*prefixes: str):
    """Records any file under `prefixes` the process opens, and any program it starts, meanwhile."""
    _SEEN.clear()
    _WATCHED[:] = prefixes
    try:
        yield _SEEN
    finally:
        _WATCHED.clear()


@contextmanager
def rss_growth():
    """{"mb": the largest growth of this process's resident memory (the server runs in it)}, sampled
    every 2 ms while the block runs."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, stop, out = rss(), [0], threading.Event(), {}

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            stop.wait(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()
        out["mb"] = (max(peak[0], rss()) - base) / 2**20


# ---- images ---------------------------------------------------------------------------------------------
def _encoded(fmt: str, size=(16, 16)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, fmt)
    return buffer.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _bomb() -> bytes:
    """A valid 1x1 PNG whose header (CRC fixed) declares 40000x40000."""
    png = _encoded("PNG", (1, 1))
    ihdr = struct.pack(">II", 40000, 40000) + png[24:29]
    return png[:8] + _chunk(b"IHDR", ihdr) + png[33:]


def _big_png(side: int) -> bytes:
    """A valid side x side RGB PNG, compressed row by row (never held decoded here): 9000 -> ~250 KB."""
    z, row = zlib.compressobj(9), b"\x00" + bytes(3 * side)
    body = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# ---- the three APIs ---------------------------------------------------------------------------------------
class Apis:
    """Each API's image-carrying requests; every method answers the refusal's message, having checked
    that it was refused as the caller's error (a 400, or a failed future of category "user")."""

    def __init__(self, srv, key: str):
        import tinker

        from twinkle.client import TwinkleClient
        from twinkle.client.model import TransformersModel

        self.http = httpx.Client(base_url=srv.url, headers={"X-API-Key": key}, timeout=120)
        model = TransformersModel(model_id=VL_TEST_MODEL, client=TwinkleClient(srv.url, key), name="img")
        model.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
        self.model_id = model.model_id
        self.tinker = tinker.ServiceClient(base_url=srv.url, api_key=key)
        self.sampler = self.tinker.create_sampling_client(base_model=VL_TEST_MODEL).result()
        self.trainer = self.tinker.create_lora_training_client(base_model=VL_TEST_MODEL, rank=4).result()

    @staticmethod
    def chat(part, text: str = "colour?") -> list[dict]:
        return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]

    def native_train(self, part, text: str = "colour?") -> dict:
        """forward_only on a trajectory: the future's outcome ({"status", "error", "category"})."""
        messages = [*self.chat(part, text), {"role": "assistant", "content": "red"}]
        body = {"inputs": {"trajectories": [{"messages": messages}]}}
        r = self.http.post(f"/twinkle/v1/models/{self.model_id}/forward_only", json=body)
        assert r.status_code == 200, r.text
        while (out := self.http.get(f"/twinkle/v1/futures/{r.json()['request_id']}").json())["status"] == "pending":
            pass
        return {k: out[k] for k in ("status", "error", "category")}

    def native_sample(self, part, text: str = "colour?") -> httpx.Response:
        body = {"base_model": VL_TEST_MODEL, "chats": [self.chat(part, text)], "sampling_params": {"max_tokens": 1}}
        return self.http.post("/twinkle/v1/sample", json=body)

    def openai(self, url, text: str = "colour?") -> httpx.Response:
        messages = self.chat({"type": "image_url", "image_url": {"url": url}}, text)
        return self.http.post(
            "/v1/chat/completions", json={"model": VL_TEST_MODEL, "max_tokens": 1, "messages": messages}
        )

    def refused_native(self, part, text: str = "colour?") -> str:
        trained = self.native_train(part, text)
        assert trained["status"] == "failed" and trained["category"] == "user", trained
        sampled = self.native_sample(part, text)
        assert sampled.status_code == 400, sampled.text
        assert sampled.json()["error"] == trained["error"].replace("trajectory 0", "chat 0")
        return sampled.json()["error"]

    def refused_openai(self, url, text: str = "colour?") -> str:
        r = self.openai(url, text)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        return r.json()["error"]["message"]

    def refused_tinker(self, chunks, train: bool = True) -> str:
        """The same chunks refused by sample and by forward_backward (as a datum's model input)."""
        import tinker
        from tinker import types

        with pytest.raises(tinker.BadRequestError) as sampled:
            self.sampler.sample(types.ModelInput(chunks=chunks), 1, types.SamplingParams(max_tokens=1)).result()
        if not train:  # the SDK's protobuf forward_backward cannot carry asset pointers
            return sampled.value.body["error"]
        n = sum(len(c.tokens) if isinstance(c, types.EncodedTextChunk) else 4 for c in chunks)  # 16x16: 4 tokens
        datum = types.Datum(
            model_input=types.ModelInput(chunks=chunks),
            loss_fn_inputs={"target_tokens": [1] * n, "weights": [1.0] * n},
        )
        with pytest.raises(tinker.BadRequestError) as trained:
            self.trainer.forward_backward([datum], "cross_entropy").result()
        message = sampled.value.body["error"]
        assert trained.value.body["error"] == message.replace("prompt", "datum 0")
        return message

    def tokens(self, text: str) -> list[int]:
        from transformers import AutoTokenizer

        from twinkle.hub import resolve_model_path

        return AutoTokenizer.from_pretrained(resolve_model_path(VL_TEST_MODEL)).encode(text, add_special_tokens=False)

    def framed(self, data: bytes, fmt: str = "png") -> list:
        """A question with one image chunk between the vision markers, as the model's template lays it out."""
        from tinker import types

        return [
            types.EncodedTextChunk(tokens=self.tokens(f"<|im_start|>user\n{VS}")),
            types.ImageChunk(data=data, format=fmt),
            types.EncodedTextChunk(tokens=self.tokens(f"{VE}colour?<|im_end|>\n<|im_start|>assistant\n")),
        ]


@pytest.fixture(scope="module")
def apis(start, tmp_path_factory):
    sys.addaudithook(_audit)  # inert unless `watching` (audit hooks cannot be removed)
    srv = start(tmp_path_factory.mktemp("img-data"), models=[{"name": VL_TEST_MODEL}])
    apis = Apis(srv, srv.create_key(TENANT))
    yield apis
    srv.stop()


def _accepted(apis: Apis, data: bytes) -> None:
    """The positive control: the same bytes inline reach the model on every API."""
    from tinker import types

    url = _url(data)
    assert apis.native_train({"type": "image_url", "image_url": {"url": url}})["status"] == "complete"
    assert apis.native_sample({"type": "image", "image": url}).status_code == 200
    assert apis.openai(url).status_code == 200
    out = apis.sampler.sample(types.ModelInput(chunks=apis.framed(data)), 1, types.SamplingParams(max_tokens=1))
    assert len(out.result().sequences[0].tokens) == 1


# ---- class 1: no request opens a file -------------------------------------------------------------------
def test_no_api_opens_a_path_or_url_and_no_refusal_tells_whether_it_exists(apis, tmp_path):
    from tinker import types

    png = _encoded("PNG")
    secret = tmp_path / "secret.png"
    secret.write_bytes(png)
    _accepted(apis, png)  # the file's bytes are a good image: only its path is refused
    missing = str(tmp_path / "missing.png")
    shapes = [  # the native chat part spellings: typed, untyped (the template adds the type), datasets cells
        lambda p: {"image": p},
        lambda p: {"image_url": {"url": p}},
        lambda p: {"image_url": p},
        lambda p: {"type": "image", "image": p},
        lambda p: {"type": "image_url", "image_url": {"url": p}},
        lambda p: {"type": "image", "image": {"path": p}},
        lambda p: {"type": "image", "image": {"bytes": None, "path": p}},
    ]
    with watching(str(tmp_path)) as seen:
        for shape in shapes:
            here, gone = shape(str(secret)), shape(missing)
            message = apis.refused_native(here)
            assert message == apis.refused_native(gone), here  # identical: the file's existence is not told
            assert "opens no file or URL" in message and "secret" not in message and str(len(png)) not in message
        for spelling in ("{}", "file://{}"):
            url_here, url_gone = (spelling.format(p) for p in (str(secret), missing))
            assert apis.refused_native({"image": url_here}) == apis.refused_native({"image": url_gone})
            assert apis.refused_openai(url_here) == apis.refused_openai(url_gone)
        assert "remote URL; this server fetches nothing" in apis.refused_openai("http://127.0.0.1:1/cat.png")
        assert "remote URL" in apis.refused_native({"image": "https://example.com/cat.png"})
        pointers = [  # Tinker names images only by asset pointer, which this server never follows
            [types.ImageAssetPointerChunk(format="png", location=p, expected_tokens=4)] for p in (str(secret), missing)
        ]
        assert apis.refused_tinker(pointers[0], train=False) == apis.refused_tinker(pointers[1], train=False)
    assert seen == []  # the server opened neither path


# ---- class 2: one bounded decoder ------------------------------------------------------------------------
def test_a_decompression_bomb_is_refused_from_its_header_on_every_api(apis):
    from tinker import types

    bomb = _bomb()
    assert len(bomb) < 70
    want = "image 0: the PNG header declares 40000x40000 = 1600000000 pixels; an image may have 1 to 16777216"
    assert want in apis.refused_native({"type": "image_url", "image_url": {"url": _url(bomb)}})
    assert want in apis.refused_native({"image": _url(bomb)})
    assert want in apis.refused_openai(_url(bomb))
    assert want in apis.refused_tinker(apis.framed(bomb))
    assert "1600000000 pixels" in apis.refused_tinker([types.ImageChunk(data=bomb, format="png")])


def test_a_9000_square_png_is_refused_before_decoding_with_bounded_memory(apis):
    big = _big_png(9000)
    assert len(big) < 400_000
    _accepted(apis, _encoded("PNG"))  # every path warmed: what grows below is the big image's doing
    want = "the PNG header declares 9000x9000 = 81000000 pixels; an image may have 1 to 16777216"
    for name, refuse, arg in [
        ("native", apis.refused_native, {"type": "image_url", "image_url": {"url": _url(big)}}),
        ("openai", apis.refused_openai, _url(big)),
        ("tinker", apis.refused_tinker, apis.framed(big)),
    ]:
        with rss_growth() as grown:
            assert want in refuse(arg), name
        assert grown["mb"] < RSS_BOUND_MB, (name, grown)


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "EPS"])
def test_only_png_jpeg_and_webp_decode_whatever_the_label(apis, fmt):
    data = _encoded(fmt)
    named = {"EPS": "PostScript/EPS"}.get(fmt, fmt)
    want = f"image 0: the bytes are {named}, not a PNG/JPEG/WebP image"
    with watching("/") as seen:
        assert want in apis.refused_native({"type": "image_url", "image_url": {"url": _url(data)}})
        assert want in apis.refused_openai(_url(data))
        assert want in apis.refused_openai(_url(data, "image/jpeg"))
        assert want in apis.refused_tinker(apis.framed(data, "png"))
    assert not [s for s in seen if s.startswith("exec")]  # no plugin ran a program (EPS: Ghostscript)


def test_webp_and_jpeg_decode_on_the_apis_that_take_them(apis):
    from twinkle.client.images import data_url

    for data, mime in ((_encoded("JPEG"), "image/jpeg"), (_encoded("WEBP"), "image/webp")):
        assert apis.openai(_url(data, mime)).status_code == 200
        assert data_url(data) == _url(data, mime)  # the native client sends what the server takes
        assert apis.native_train({"image": data_url(data)})["status"] == "complete"
    with pytest.raises(ValueError, match="are not PNG, JPEG or WebP"):
        data_url(_encoded("GIF"))


def test_one_request_s_images_share_a_pixel_budget(apis):
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4096, 4096)).save(buffer, "PNG", compress_level=1)
    url = _url(buffer.getvalue())  # 16.8 Mpx each: one passes, five are past the request's 67 Mpx
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(5)]
    r = apis.http.post(
        "/v1/chat/completions",
        json={"model": VL_TEST_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": parts}]},
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "the request's 5 images have 83886080 pixels; one request may have at most 67108864 "
        "(caps.max_request_image_pixels)"
    )


def test_image_tokens_outside_the_vision_markers_are_a_400_on_every_api(apis):
    from tinker import types

    png = _encoded("PNG")
    before, after = apis.framed(png)[0], apis.framed(png)[2]
    image = types.ImageChunk(data=png, format="png")
    text = types.EncodedTextChunk
    vs, ve, pad = (apis.tokens(t)[0] for t in (VS, VE, PAD))
    not_framed = "image 0 (tokens 2-6) is not between the model's vision markers <|vision_start|> and <|vision_end|>"
    assert not_framed in apis.refused_tinker([text(tokens=[5, 6]), image, text(tokens=[7])])
    adjacent = "the 2 images' <|image_pad|> tokens form 1 run(s): images next to each other need the model's vision"
    assert adjacent in apis.refused_tinker([before, image, image, after])
    stray = "5 <|image_pad|> tokens, but the 1 image(s) make 4: <|image_pad|> tokens come only from images"
    assert stray in apis.refused_tinker([before, image, text(tokens=[ve, pad])])
    assert "2 <|vision_start|> tokens for 1 image(s)" in apis.refused_tinker([before, image, text(tokens=[ve, vs])])
    # native and OpenAI chats are laid out by the template: a marker written as text is the same 400
    url = _url(png)
    assert "2 <|vision_start|> tokens for 1 image(s)" in apis.refused_native({"image": url}, f"a {VS} b")
    assert "2 <|vision_start|> tokens for 1 image(s)" in apis.refused_openai(url, f"a {VS} b")


def test_image_columns_come_only_from_image_parts(apis):
    import tinker
    from tinker import types

    row = {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "fields": {"image_grid_thw": [1.0, 2.0, 2.0]}}
    r = apis.http.post(f"/twinkle/v1/models/{apis.model_id}/forward_only", json={"inputs": {"rows": [row]}})
    while (out := apis.http.get(f"/twinkle/v1/futures/{r.json()['request_id']}").json())["status"] == "pending":
        pass
    assert out["category"] == "user"
    assert out["error"] == "row 0: image_grid_thw is computed by the server from image parts; it cannot be sent"
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4],
            "pixel_values": types.TensorData.from_numpy(np.zeros(3, np.float32)),
        },
    )
    with pytest.raises(tinker.BadRequestError, match="datum 0: loss_fn_inputs: pixel_values is computed by the server"):
        apis.trainer.forward_backward([datum], "cross_entropy").result()
