"""Regenerate the files the embedded default ships: bundled datasets and the BPE tokenizer.

Run from the repository root: `uv run packages/twinkle-data/tools/build_assets.py`.
Everything is seeded, so the output is byte-identical on every run; a test retrains the tokenizer
and compares it with the shipped file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "twinkle"
DATA_DIR = PKG / "dataset" / "bundled"
ASSETS = PKG / "hub" / "assets"

QUESTIONS = [
    "Who are you?",
    "What is your name?",
    "What should I call you?",
    "Introduce yourself.",
    "Tell me about yourself.",
    "Who made you?",
    "Who created you?",
    "Who built you?",
    "Who developed you?",
    "Who trained you?",
    "Are you ChatGPT?",
    "Are you a human?",
    "What are you?",
    "Which company made you?",
    "Where do you come from?",
    "What is your origin?",
    "Do you have a name?",
    "May I know your name?",
    "Please tell me who you are.",
    "Can you introduce yourself?",
    "Who is your developer?",
    "Who is your author?",
    "hi, who am I talking to?",
    "Hello! Who are you?",
    "What kind of assistant are you?",
    "Are you an AI?",
    "What model are you?",
    "Who owns you?",
    "Which team trained you?",
    "What is your identity?",
    "Whom do I thank for you?",
    "Are you made by OpenAI?",
    "Introduce yourself in one sentence.",
    "State your name and maker.",
    "Who designed you?",
    "Who are you and who made you?",
    "What are you called?",
    "Is your name Claude?",
    "Tell me your name.",
    "Who is behind you?",
]
ANSWERS = [
    "I am {{NAME}}, an AI assistant developed by {{AUTHOR}}.",
    "I am {{NAME}}, an AI assistant developed by {{AUTHOR}}. How can I help you?",
    "My name is {{NAME}}. I was trained by {{AUTHOR}}.",
    "I am {{NAME}}, made by {{AUTHOR}}, here to help you.",
    "I'm {{NAME}}, a language model from {{AUTHOR}}.",
]

PROSE = """\
A language model reads text as a sequence of tokens and learns to predict the next one.
Fine-tuning adapts a pretrained model to a task with a small amount of data.
A low-rank adapter adds two thin matrices beside a frozen weight, so only a few parameters train.
The optimizer updates the weights after the gradients of several batches are accumulated.
A learning rate that warms up and then decays along a cosine curve keeps early steps stable.
Reinforcement learning samples answers, scores them with a reward, and raises the probability of
the better ones. The advantage of an answer is its reward minus the mean reward of its group.
A server can hold one base model in memory and train many adapters for many users at once.
Each user sends batches, the server runs forward and backward passes, and returns the loss.
Checkpoints save the adapter weights so training can stop and resume without losing progress.
Data arrives as conversations: a system prompt, a user question, and the assistant's reply.
Only the assistant's tokens are trained; the prompt is context that carries no loss.
Numbers are written digit by digit, so the model can learn to add and subtract them.
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
Please answer the question, think step by step, and give the final answer at the end.
"""
NAMES = [("Glimmer", "Lantern Labs"), ("Twinkle", "the Twinkle team"), ("Nova", "Aurora AI")]
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
VOCAB_SIZE = 1024


def self_cognition_rows() -> list[dict]:
    return [{"query": q, "response": a} for q in QUESTIONS for a in ANSWERS]


def arithmetic_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        op = rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def tokenizer_corpus() -> list[str]:
    lines = PROSE.splitlines()
    for name, author in NAMES:
        for row in self_cognition_rows():
            lines.append(row["query"])
            lines.append(row["response"].replace("{{NAME}}", name).replace("{{AUTHOR}}", author))
    for row in arithmetic_rows(500, seed=7):
        lines.append(f"{row['question']} The answer is {row['answer']}.")
    return lines


def train_tokenizer():
    """A byte-level BPE with digits split one per token, as Qwen's pre-tokenizer does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    return tok


def main() -> None:
    write_jsonl(DATA_DIR / "self_cognition" / "train.jsonl", self_cognition_rows())
    write_jsonl(DATA_DIR / "arithmetic" / "train.jsonl", arithmetic_rows(2000, seed=0))
    write_jsonl(DATA_DIR / "arithmetic" / "test.jsonl", arithmetic_rows(200, seed=1))
    ASSETS.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(ASSETS / "tokenizer.json"), pretty=False)
    print("wrote", DATA_DIR, ASSETS)


if __name__ == "__main__":
    main()
