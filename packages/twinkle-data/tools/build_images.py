"""Regenerate the bundled image set `twinkle://shapes`: coloured shapes with captions and questions.

Run from the repository root: `uv run packages/twinkle-data/tools/build_images.py`.
Each 56x56 picture (the tiny VL preset's smallest size: 4 image tokens) holds one filled circle,
square or triangle in red, green, blue or yellow, at a seeded random place and size on a light
background. Pictures are palette PNGs written by PIL with fixed settings, embedded in the jsonl as
`data:image/png;base64,` URLs, so a row is self-contained and the files come out byte-identical on
every run (a test regenerates them and compares).
"""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "twinkle" / "dataset" / "bundled" / "shapes"
SIZE = 56
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {
    "colour": ("What colour is the shape?", "{colour}"),
    "shape": ("What shape is this?", "{shape}"),
    "caption": ("Describe the image.", "a {colour} {shape}"),
}


def draw(shape: str, colour: str, rng: random.Random) -> bytes:
    from PIL import Image, ImageDraw

    grey = rng.randint(225, 250)
    img = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    r = rng.randint(12, 20)
    cx, cy = rng.randint(r + 2, SIZE - r - 3), rng.randint(r + 2, SIZE - r - 3)
    box = (cx - r, cy - r, cx + r, cy + r)
    pen = ImageDraw.Draw(img)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    buf = io.BytesIO()
    # a fixed 8-colour palette and fixed zlib settings: the same pixels always give the same bytes
    img.quantize(colors=8, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        buf, format="PNG", optimize=False, compress_level=9
    )
    return buf.getvalue()


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        shape, colour = SHAPES[i % len(SHAPES)], list(COLOURS)[(i // len(SHAPES)) % len(COLOURS)]
        kind = rng.choice(sorted(QUESTIONS))
        question, answer = QUESTIONS[kind]
        url = "data:image/png;base64," + base64.b64encode(draw(shape, colour, rng)).decode()
        content = [{"type": "image", "image": url}, {"type": "text", "text": question}]
        out.append(
            {
                "messages": [
                    {"role": "user", "content": content},
                    # a list of parts here too: a jsonl column must hold one type for Arrow
                    {
                        "role": "assistant",
                        "content": [{"type": "text", "text": answer.format(colour=colour, shape=shape)}],
                    },
                ],
                "shape": shape,
                "colour": colour,
                "kind": kind,
                "caption": f"a {colour} {shape}",
            }
        )
    rng.shuffle(out)
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 480, 0), ("test", 96, 1)):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows(n, seed))
        (OUT / f"{split}.jsonl").write_text(text)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
