"""Local data for the recipes that read a dataset, written into the recipe's working folder at the path
the recipe reads. Recipes that load a hub dataset by id (`datasets.load_dataset("org/name", ...)`) get a
folder of that name there: `datasets` loads a local folder first, in the hub's own layout (files per
split, named configs in the README's YAML), so the recipe's loading code runs unchanged. Each set is
small and generated (the recipes run for 1-2 steps); the text comes from Python's own documentation
(pydoc_data) and the cookbook's example data."""

from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path


def _hub_folder(work: Path, repo: str, splits: dict[str, list[dict]], config: str | None = None, features=None):
    """`work/<repo>/` as the hub lays a dataset out: one parquet file per split, under a named config."""
    from datasets import Dataset

    root = work / repo
    sub = root / (config or "data")
    sub.mkdir(parents=True, exist_ok=True)
    files = []
    for split, rows in splits.items():
        Dataset.from_list(rows, features=features).to_parquet(str(sub / f"{split}.parquet"))
        files.append(f"  - split: {split}\n    path: {sub.name}/{split}.parquet")
    name = config or "default"
    (root / "README.md").write_text(
        f"---\nconfigs:\n- config_name: {name}\n  data_files:\n" + "\n".join(files) + "\n---\n"
    )


def english_lines() -> list[str]:
    """Paragraphs of English prose: the Python reference's topic texts (pydoc_data, in the stdlib)."""
    from pydoc_data.topics import topics

    lines = [ln.strip() for text in topics.values() for ln in text.split("\n\n")]
    return [" ".join(ln.split()) for ln in lines if len(ln) > 80 and not ln.startswith((">>>", "   "))]


def wikitext(work: Path) -> list[str]:
    """rl_numerics_check's corpus, `Salesforce/wikitext` config `wikitext-103-raw-v1` (split train)."""
    _hub_folder(work, "Salesforce/wikitext", {"train": [{"text": t} for t in english_lines()]}, "wikitext-103-raw-v1")
    return []


def deepmath(work: Path) -> list[str]:
    """on-policy distillation's prompts, `zwhe99/DeepMath-103K` (split train; it has no test split)."""
    rng = random.Random(0)
    rows = []
    for _ in range(16):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        rows.append({"question": f"What is {a} + {b}?", "final_answer": str(a + b), "difficulty": 1.0})
    _hub_folder(work, "zwhe99/DeepMath-103K", {"train": rows})
    return []


def sciknoweval(work: Path) -> list[str]:
    """sdft's default data, `hicai-zju/SciKnowEval` (split test, Chemistry L3 multiple choice)."""
    rng = random.Random(0)
    elements = [("H", 1), ("He", 2), ("Li", 3), ("C", 6), ("N", 7), ("O", 8), ("Na", 11), ("Cl", 17)]
    rows = []
    for symbol, number in elements * 2:
        options = sorted({number, *rng.sample(range(1, 30), 3)} - {number}, key=lambda _: rng.random())[:3]
        options.insert(rng.randint(0, 3), number)
        rows.append(
            {
                "question": f"What is the atomic number of {symbol}?",
                "choices": {"label": list("ABCD"), "text": [str(o) for o in options]},
                "answerKey": "ABCD"[options.index(number)],
                "domain": "Chemistry",
                "details": {"level": "L3", "task": "atomic_numbers"},
                "type": "mcq-4-choices",
            }
        )
    _hub_folder(work, "hicai-zju/SciKnowEval", {"test": rows})
    return []


SHAPES = ["circle", "square", "triangle"]


def _shape_png(shape: str, rng: random.Random) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (96, 96), tuple(rng.randint(180, 255) for _ in range(3)))
    draw, color = ImageDraw.Draw(img), tuple(rng.randint(0, 120) for _ in range(3))
    x, y, r = rng.randint(30, 66), rng.randint(30, 66), rng.randint(14, 28)
    if shape == "circle":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=color)
    elif shape == "square":
        draw.rectangle([x - r, y - r, x + r, y + r], fill=color)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=color)
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def caltech101(work: Path) -> list[str]:
    """vlm_classifier's default, `dpdl-benchmark/caltech101` (image + ClassLabel label, train/test): local
    images of three drawn shapes."""
    from datasets import ClassLabel, Features, Image

    rng = random.Random(0)
    features = Features({"image": Image(), "label": ClassLabel(names=SHAPES)})

    def rows(n):
        return [{"image": {"bytes": _shape_png(SHAPES[i % 3], rng), "path": None}, "label": i % 3} for i in range(n)]

    _hub_folder(work, "dpdl-benchmark/caltech101", {"train": rows(12), "test": rows(6)}, features=features)
    return []


def prophet_arena(work: Path) -> list[str]:
    """decisions' forecasting data (`data_path=`, the Prophet Arena CSV's columns): yes/no markets on
    generated events, four closing before the recipe's default split date and four opening after it."""
    path = work / "prophet_arena.csv"
    cols = ["submission_id", "event_ticker", "title", "snapshot_time", "close_time", "market_outcome"]
    cols += ["category", "markets", "sources"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        for i in range(8):
            month = "2025-09" if i < 4 else "2025-11"
            market = f"Will the river gauge {i} read above {10 + i} m?"
            w.writerow(
                {
                    "submission_id": f"s{i}",
                    "event_ticker": f"EV{i}",
                    "title": f"River gauge {i}",
                    "snapshot_time": f"{month}-01T00:00:00Z",
                    "close_time": f"{month}-15T00:00:00Z",
                    "market_outcome": json.dumps({market: i % 2}),
                    "category": "Weather",
                    "markets": json.dumps([market]),
                    "sources": json.dumps([{"title": "Gauge log", "summary": f"Gauge {i} read {9 + i} m last week."}]),
                }
            )
    return [f"data_path={path}"]


# The language labels of the first 8 lines of the cookbook's multilingual.txt (one sentence in 8
# languages; Bulgarian is not among the recipe's labels, so 'ot').
MULTILINGUAL_LABELS = ["ar", "ot", "de", "el", "en", "es", "fr", "hi"]


def multilingual(work: Path) -> list[str]:
    """prompt_distillation: create_data reads ./tinker_cookbook/example_data/multilingual.txt (the
    cookbook's own file, 2,100 sentences: its first 8 lines here) and keeps the teacher's answers that
    end in "Final Answer: xx", which the tiny demo model never writes; train then reads the same 8
    sentences with their labels, in the file format create_data writes."""
    import tinker_cookbook

    src = Path(tinker_cookbook.__file__).parent / "example_data" / "multilingual.txt"
    lines = src.read_text().splitlines()[: len(MULTILINGUAL_LABELS)]
    dst = work / "tinker_cookbook" / "example_data" / "multilingual.txt"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(f"{ln}\n" for ln in lines))
    labelled = work / "labelled.jsonl"
    with labelled.open("w") as f:
        for text, label in zip(lines, MULTILINGUAL_LABELS, strict=True):
            messages = [{"role": "user", "content": text}, {"role": "assistant", "content": label}]
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return [f"file_path={labelled}"]
