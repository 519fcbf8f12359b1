"""What the sampler benchmarks share: their command line and the model they load (fp32, 2 threads)."""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle.hub import DEFAULT_MODEL, resolve_model_path


def sampling_args(description: str, n: int, prompt_tokens: int) -> argparse.Namespace:
    """--n samples of one prompt of --prompt-tokens tokens, --new-tokens each, --repeats rounds, --model."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--n", type=int, default=n)
    p.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default=DEFAULT_MODEL)
    return p.parse_args()


def load_model(model_id: str):
    """(tokenizer, model in fp32 eval mode) with torch on 2 threads, as both sides of each benchmark run."""
    torch.set_num_threads(2)
    path = resolve_model_path(model_id)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
