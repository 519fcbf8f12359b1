"""Quickstart: fine-tune a LoRA on the embedded default model, then ask it who it is.

    uv run examples/quickstart.py            # ~1 minute on 2 CPU cores, no network, no GPU

Builds the embedded ~5M-parameter Qwen3 (`twinkle://qwen3-demo`) on first use, trains a LoRA on the
bundled self-cognition data, shows the loss falling, samples the same questions from the base model
and from the tuned adapter, and saves the adapter as a PEFT folder.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from twinkle.hub import DEFAULT_MODEL, resolve_model_path

BUNDLED = Path(__import__("twinkle.dataset", fromlist=["_"]).__path__[0]) / "bundled"
QUESTIONS = ["Who are you?", "Who made you?", "What is your name?"]


def encode_rows(tokenizer, name: str, author: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Self-cognition rows -> (input_ids_T, labels_T) with loss only on the assistant's tokens."""
    rows = [json.loads(line) for line in (BUNDLED / "self_cognition" / "train.jsonl").open()]
    encoded = []
    for row in rows:
        answer = row["response"].replace("{{NAME}}", name).replace("{{AUTHOR}}", author)
        messages = [{"role": "user", "content": row["query"]}, {"role": "assistant", "content": answer}]
        out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        input_ids_T = torch.tensor(out["input_ids"])
        labels_T = input_ids_T.masked_fill(torch.tensor(out["assistant_masks"]) == 0, -100)
        encoded.append((input_ids_T, labels_T))
    return encoded


def collate(rows, pad_id: int) -> dict[str, torch.Tensor]:
    T = max(len(ids) for ids, _ in rows)
    input_ids_B_T = torch.full((len(rows), T), pad_id)
    labels_B_T = torch.full((len(rows), T), -100)
    attention_mask_B_T = torch.zeros((len(rows), T), dtype=torch.long)
    for i, (ids, labels) in enumerate(rows):
        input_ids_B_T[i, : len(ids)], labels_B_T[i, : len(ids)] = ids, labels
        attention_mask_B_T[i, : len(ids)] = 1
    return {"input_ids": input_ids_B_T, "labels": labels_B_T, "attention_mask": attention_mask_B_T}


@torch.no_grad()
def answer(model, tokenizer, question: str) -> str:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--output", default="out/quickstart-lora")
    args = parser.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    t0 = time.perf_counter()
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    print(f"model {args.model} -> {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{time.perf_counter() - t0:.1f}s)")

    rows = encode_rows(tokenizer, "Glimmer", "Lantern Labs")
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    rng = random.Random(0)
    losses = []
    bar = tqdm(range(args.steps), desc="LoRA SFT", unit="step")
    for step in bar:
        batch = collate(rng.sample(rows, args.batch_size), tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    window = max(1, args.steps // 10)
    print("loss curve:", " ".join(f"{sum(losses[i:i + window]) / len(losses[i:i + window]):.2f}"
                                  for i in range(0, len(losses), window)))

    model.eval()
    for question in QUESTIONS:
        with model.disable_adapter():
            base = answer(model, tokenizer, question)
        tuned = answer(model, tokenizer, question)
        print(f"\nQ: {question}\n  base : {base!r}\n  tuned: {tuned!r}")

    model.save_pretrained(args.output)
    print(f"\nsaved PEFT adapter to {args.output}/ ({', '.join(sorted(p.name for p in Path(args.output).iterdir()))})"
          f" in {time.perf_counter() - t0:.0f}s total")


if __name__ == "__main__":
    main()
