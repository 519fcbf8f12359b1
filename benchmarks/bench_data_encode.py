"""Encoding throughput and packing efficiency of twinkle-data, side by side with the usual way.

1. rows/s: Twinkle's `Dataset.encode()` (render once, one batched tokenizer call with offsets, masks
   from generation markers) against `datasets.map(batched=True)` calling `tokenizer.apply_chat_template`
   on each batch of conversations with `return_assistant_tokens_mask=True`: the same ids and masks
   (checked), so the same work, both batched (the tokenizer may use its own threads on either side;
   TOKENIZERS_PARALLELISM is left as the caller set it). ROUNDS rounds, the two sides alternating
   (ABBA...), so a load change on the machine hits both; each side's median round is compared.
2. packing: share of non-pad tokens when the same shuffled rows are collated padded (batch 8,
   right padding) or padding-free packed (InputProcessor(packing=True)).

Prints a final JSON line: `speedup` (encode rows/s, Twinkle / datasets.map) and the raw numbers.
Run: .venv/bin/python benchmarks/bench_data_encode.py
"""

from __future__ import annotations

import json
import random
import statistics
import time

import datasets
import torch

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import TEST_MODEL
from twinkle.preprocessor import ArithmeticProcessor, SelfCognitionProcessor
from twinkle.processor import InputProcessor
from twinkle.template import Template

torch.set_num_threads(2)
datasets.disable_progress_bars()
REPEAT = 5  # (2,200 source rows + 400 multi-turn) x 5 = 13,000 conversations
ROUNDS = 4  # per side, alternating


def conversations() -> list[dict]:
    sc = Dataset(DatasetMeta("twinkle://self-cognition")).map(SelfCognitionProcessor("Glimmer", "Lantern Labs"))
    ar = Dataset(DatasetMeta("twinkle://arithmetic")).map(ArithmeticProcessor(with_answer=True))
    rows = [{"messages": r["messages"]} for r in sc] + [{"messages": r["messages"]} for r in ar]
    # some multi-turn conversations: two single-turn ones joined
    rng = random.Random(0)
    multi = [
        {"messages": a["messages"] + [m for m in b["messages"] if m["role"] != "system"]}
        for a, b in zip(rng.sample(rows, 400), rng.sample(rows, 400))
    ]
    return (rows + multi) * REPEAT


def bench_hf(rows, tokenizer) -> tuple[float, list]:
    data = datasets.Dataset.from_list(rows)

    def encode(batch):
        out = tokenizer.apply_chat_template(
            batch["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    start = time.perf_counter()
    encoded = data.map(encode, batched=True, batch_size=256, remove_columns=["messages"], load_from_cache_file=False)
    return time.perf_counter() - start, encoded


def bench_twinkle(rows, template) -> tuple[float, Dataset]:
    ds = Dataset(DatasetMeta("bench", data=rows))
    ds.set_template(template)
    start = time.perf_counter()
    ds.encode(cache=False)
    return time.perf_counter() - start, ds


def padding_efficiency(rows, batch_size) -> dict:
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    real = padded = packed = 0
    for i in range(0, len(shuffled), batch_size):
        chunk = shuffled[i : i + batch_size]
        pad = InputProcessor()(chunk)
        pack = InputProcessor(packing=True)(chunk)
        real += int(pad["attention_mask"].sum())
        padded += pad["input_ids"].numel()
        packed += pack["input_ids"].numel()
    return {
        "real_tokens": real,
        "padded_tokens": padded,
        "packed_tokens": packed,
        "padding_efficiency": real / padded,
        "packing_efficiency": real / packed,
    }


def main():
    rows = conversations()
    template = Template(model_id=TEST_MODEL)
    tokenizer = template.tokenizer
    bench_twinkle(rows[:200], template)  # warm up both paths (template compile, tokenizer caches)
    bench_hf(rows[:200], tokenizer)
    hf_times, tw_times = [], []
    for r in range(ROUNDS):  # ABBA: neither side always runs first
        sides = ("hf", "twinkle") if r % 2 == 0 else ("twinkle", "hf")
        for side in sides:
            if side == "hf":
                seconds, hf_out = bench_hf(rows, tokenizer)
                hf_times.append(seconds)
            else:
                seconds, tw_out = bench_twinkle(rows, template)
                tw_times.append(seconds)
    hf_s, tw_s = statistics.median(hf_times), statistics.median(tw_times)
    # same work: identical ids and masks on a sample
    for i in range(0, len(rows), 997):
        ref, ours = hf_out[i], tw_out[i]
        assert ours["input_ids"] == ref["input_ids"], i
        assert [lab != -100 for lab in ours["labels"]] == [bool(m) for m in ref["assistant_masks"]], i
    encoded = tw_out.data.to_list()
    packing = padding_efficiency(encoded, batch_size=8)
    result = {
        "benchmark": "bench_data_encode",
        "rows": len(rows),
        "tokenizer": f"{TEST_MODEL} (byte-level BPE, vocab {len(tokenizer)})",
        "twinkle_encode_s": round(tw_s, 3),
        "hf_map_batched_apply_chat_template_s": round(hf_s, 3),
        "rounds": ROUNDS,
        "twinkle_rounds_s": [round(t, 3) for t in tw_times],
        "hf_rounds_s": [round(t, 3) for t in hf_times],
        "twinkle_rows_per_s": round(len(rows) / tw_s, 1),
        "hf_rows_per_s": round(len(rows) / hf_s, 1),
        "speedup": round(hf_s / tw_s, 2),
        "batch_size": 8,
        **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in packing.items()},
        "packed_vs_padded_token_ratio": round(packing["padded_tokens"] / packing["packed_tokens"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
