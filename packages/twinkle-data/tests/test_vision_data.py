"""Images in messages: the tiny VL preset, the bundled shapes set, the Template against the HF processor."""

from __future__ import annotations

import base64
import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.dataset.errors import DataError
from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.hub.embedded import weights_digest
from twinkle.hub.embedded_vl import PINNED_VL_WEIGHTS, VISION_TOKENS, VL_TEST_MODEL
from twinkle.processor import InputProcessor
from twinkle.template import IGNORE_INDEX, Template
from twinkle.template.vision import text_of

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "build_images.py"


@pytest.fixture(scope="module")
def vl_path() -> str:
    return resolve_model_path(VL_TEST_MODEL)


@pytest.fixture(scope="module")
def template(vl_path) -> Template:
    return Template(VL_TEST_MODEL)


@pytest.fixture(scope="module")
def hf_processor(vl_path):
    """transformers' own Qwen2.5-VL processor over the preset's tokenizer and image processor. Its
    video processor needs torchvision (not installed, and no video is used): only the class check of
    that absent part is skipped; the text expansion under test is the processor's own code."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    mp = pytest.MonkeyPatch()
    mp.setattr(
        ProcessorMixin,
        "check_argument_for_proper_class",
        lambda s, n, a: None if n == "video_processor" else check(s, n, a),
    )
    try:
        yield Qwen2_5_VLProcessor(
            image_processor=AutoImageProcessor.from_pretrained(vl_path),
            tokenizer=AutoTokenizer.from_pretrained(vl_path),
            video_processor=None,
        )
    finally:
        mp.undo()


def _png(colour, size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_the_preset_matches_its_pin_and_knows_the_vision_tokens(vl_path, template):
    assert weights_digest(Path(vl_path) / "model.safetensors") == PINNED_VL_WEIGHTS["qwen2.5-vl-tiny"]
    ids = template.tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    assert len(set(ids)) == 4 and all(i >= 850 for i in ids)  # appended after the embedded BPE
    assert (Path(vl_path) / "preprocessor_config.json").is_file()


def test_bundled_shapes_regenerate_byte_identically():
    spec = importlib.util.spec_from_file_location("build_images", TOOLS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import json

    for split, n, seed in (("train", 480, 0), ("test", 96, 1)):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in module.rows(n, seed))
        assert text == (module.OUT / f"{split}.jsonl").read_text(), split


def test_template_equals_the_hf_processor_token_by_token(template, hf_processor):
    rows = list(Dataset(DatasetMeta("twinkle://shapes", data_slice=range(6))))
    two_images = {
        "messages": [
            {"role": "system", "content": "Look closely."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": _png((255, 0, 0))},
                    {"type": "text", "text": "and"},
                    {
                        "type": "image_url",
                        "image_url": {
                            "url": "data:image/png;base64," + base64.b64encode(_png((0, 0, 255), (112, 84))).decode()
                        },
                    },
                ],
            },
            {"role": "assistant", "content": "red, blue"},
        ]
    }
    for row in [*rows, two_images]:
        ours = template.encode(row)
        text = template.render_text(row)
        images = [Image.open(io.BytesIO(_bytes(src))).convert("RGB") for src in _sources(row)]
        theirs = hf_processor(text=[text], images=images, return_tensors="np")
        assert ours["input_ids"] == theirs["input_ids"][0].tolist()
        np.testing.assert_array_equal(np.asarray(ours["pixel_values"]), theirs["pixel_values"])
        assert ours["image_grid_thw"] == theirs["image_grid_thw"].tolist()
        image_id = hf_processor.image_token_id
        on_image = np.asarray(ours["input_ids"]) == image_id
        assert on_image.sum() == sum(int(np.prod(g)) // 4 for g in ours["image_grid_thw"]) > 0
        labels = np.asarray(ours["labels"])
        assert (labels[on_image] == IGNORE_INDEX).all()
        reply = template.decode([t for t, lab in zip(ours["input_ids"], labels) if lab != IGNORE_INDEX])
        assert reply == text_of(row["messages"][-1]["content"]) + "<|im_end|>"
    # 112x84 -> a 4x3 grid of merged tokens (8x6 patches)
    assert template.encode(two_images)["image_grid_thw"] == [[1, 4, 4], [1, 6, 8]]


def _sources(row):
    from twinkle.template.vision import image_sources, normalise_content

    return image_sources([{**m, "content": normalise_content(m["content"])} for m in row["messages"]])


def _bytes(src):
    return base64.b64decode(src.split(",", 1)[1]) if isinstance(src, str) else src


def test_a_prompt_with_an_image_expands_like_training(template):
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": _png((0, 255, 0))}, {"type": "text", "text": "colour?"}],
            }
        ]
    }
    prompt = template.encode_prompt(row)
    assert prompt["input_ids"].count(template.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4
    assert template.decode(prompt["input_ids"]).endswith("<|im_start|>assistant\n")


def test_bad_images_are_refused_by_name(template):
    def row(src):
        return [{"role": "user", "content": [{"type": "image", "image": src}]}, {"role": "assistant", "content": "x"}]

    with pytest.raises(DataError, match="is remote"):
        template.encode(row("https://example.com/cat.png"))
    with pytest.raises(DataError, match="not a PNG/JPEG"):
        template.encode(row(b"not an image"))
    with pytest.raises(DataError, match="does not exist"):
        template.encode(row("/nonexistent/cat.png"))
    with pytest.raises(DataError, match=r"model 'twinkle://qwen3-tiny' is text-only"):
        Template(TEST_MODEL).encode(row(_png((1, 2, 3))))
    with pytest.raises(DataError, match="cutting it would cut image tokens"):
        Template(VL_TEST_MODEL, max_length=8, truncation_strategy="left").encode(row(_png((1, 2, 3))))


def test_the_library_reads_its_own_files_through_the_servers_decoder(tmp_path, template):
    """Local mode may name its own files (a server takes only bytes); what is read goes through the one
    decoder (twinkle.template.image_decode): format from the magic bytes, whatever the file is called."""

    def row(src):
        return [{"role": "user", "content": [{"type": "image", "image": src}]}, {"role": "assistant", "content": "x"}]

    png = _png((9, 8, 7))
    (tmp_path / "a.png").write_bytes(png)
    from_path = template.encode(row(str(tmp_path / "a.png")))
    assert np.array_equal(np.asarray(from_path["pixel_values"]), np.asarray(template.encode(row(png))["pixel_values"]))
    gif = io.BytesIO()
    Image.new("RGB", (56, 56)).save(gif, format="GIF")
    (tmp_path / "b.png").write_bytes(gif.getvalue())
    with pytest.raises(DataError, match="image: the bytes are GIF, not a PNG/JPEG/WebP image"):
        template.encode(row(str(tmp_path / "b.png")))


def test_encoded_image_rows_collate_padded_and_packed(template):
    ds = Dataset(DatasetMeta("twinkle://shapes", data_slice=range(3)))
    ds.set_template(template)
    ds.encode()  # through the Arrow encoder: pixel rows stored as list<list<float>>
    rows = [ds[i] for i in range(3)]
    batch = InputProcessor()(rows)
    assert batch["pixel_values"].shape == (48, 1176) and batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 3
    np.testing.assert_allclose(
        batch["pixel_values"][:16].numpy(), np.asarray(rows[0]["pixel_values"], dtype=np.float32)
    )
    packed = InputProcessor(packing=True)(rows)
    assert "attention_mask" not in packed and packed["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows))
    assert (
        torch.equal(packed["pixel_values"], batch["pixel_values"])
        and packed["image_grid_thw"].tolist() == [[1, 4, 4]] * 3
    )
    assert (packed["position_ids"][0] == 0).sum() == 3  # restarts at each sequence


def test_the_image_processor_is_part_of_the_encode_cache_key(template):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from twinkle.hub.embedded_vl import build_image_processor

    same = Template(tokenizer=template.tokenizer, image_processor=build_image_processor())
    larger = Template(tokenizer=template.tokenizer, image_processor=Qwen2VLImageProcessorPil(max_pixels=224 * 224))
    assert same.signature() == template.signature() != larger.signature()
    text_only = Template(tokenizer=template.tokenizer)
    assert text_only.signature() not in (same.signature(), larger.signature())


def _chat(image) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        ]
    }


def test_parquet_bytes_columns_and_datasets_image_cells_encode_like_jsonl(tmp_path, template):
    """Images stored as Arrow binary inside the message parts, and as a datasets ``Image`` cell
    (``{bytes, path}``), read from parquet and encode to the same tokens and pixels as the bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    red, blue = _png((220, 30, 30)), _png((30, 60, 220), (84, 112))
    encoded = []
    for name, image in (("bytes", red), ("cells", {"bytes": blue, "path": None})):
        pq.write_table(pa.Table.from_pylist([_chat(image)] * 2), tmp_path / f"{name}.parquet")
        ds = Dataset(DatasetMeta(str(tmp_path / f"{name}.parquet")))
        assert "binary" in str(ds.data.features["messages"])  # the bytes sit in an Arrow binary column
        ds.set_template(template)
        encoded.append(ds.encode(cache=False)[1])
    for got, src in zip(encoded, (red, blue)):
        want = template.encode(_chat(src))
        assert got["input_ids"] == want["input_ids"] and got["image_grid_thw"] == want["image_grid_thw"]
        np.testing.assert_array_equal(np.asarray(got["pixel_values"], np.float32), want["pixel_values"])
    assert encoded[1]["image_grid_thw"] == [[1, 8, 6]]


def test_streaming_image_rows_to_arrow_holds_one_chunk(tmp_path, template):
    """encode_to_arrow over image rows: the rows held at once are one chunk whatever the row count,
    and the file equals the in-memory encoding."""
    from twinkle.dataset import encode_to_arrow

    source = list(Dataset(DatasetMeta("twinkle://shapes", data_slice=range(8))))

    def stream(n):
        for i in range(n):
            yield source[i % len(source)]

    held = []
    for n in (40, 160):
        out, report = encode_to_arrow(stream(n), template, tmp_path / f"{n}.arrow", chunk_rows=20)
        assert report.rows_written == n
        held.append(report.max_rows_held)
    assert held == [20, 20]
    first = out[3]
    want = template.encode(source[3])
    assert first["input_ids"] == want["input_ids"]
    np.testing.assert_array_equal(np.asarray(first["pixel_values"], np.float32), want["pixel_values"])
