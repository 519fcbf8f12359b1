"""RL prompt preprocessors: a prompt conversation plus the ``ground_truth`` a reward checks against."""

from __future__ import annotations

import re

from twinkle.dataset.errors import DataError
from twinkle.preprocessor.base import Preprocessor

ARITHMETIC_SYSTEM = "Solve the arithmetic problem. Reply with the final number only."
GSM8K_SYSTEM = (
    "Solve the math problem step by step. End your reply with a line '#### <answer>' "
    "where <answer> is the final number."
)


def _prompt(system: str | None, question: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


class ArithmeticProcessor(Preprocessor):
    """``question`` / ``answer`` -> a prompt with ``ground_truth`` = the answer; ``with_answer=True``
    also appends the answer as the assistant reply (for SFT on the same data)."""

    required_columns = ("question", "answer")
    output_columns = ("messages", "ground_truth")

    def __init__(self, system: str | None = ARITHMETIC_SYSTEM, with_answer: bool = False) -> None:
        self.system = system
        self.with_answer = with_answer

    def process(self, row: dict) -> dict:
        answer = str(row["answer"]).strip()
        messages = _prompt(self.system, row["question"])
        if self.with_answer:
            messages.append({"role": "assistant", "content": answer})
        return {"messages": messages, "ground_truth": answer}


_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def gsm8k_final_answer(solution: str) -> str | None:
    """The number after ``####`` (commas removed), as GSM8K writes its final answers."""
    match = _FINAL.search(solution)
    return match.group(1).replace(",", "") if match else None


class GSM8KProcessor(Preprocessor):
    """GSM8K-style ``question`` / ``answer`` (reasoning ending in ``#### 42``) -> a prompt with
    ``ground_truth='42'``; ``with_answer=True`` keeps the worked solution as the assistant reply."""

    required_columns = ("question", "answer")
    output_columns = ("messages", "ground_truth")

    def __init__(
        self, system: str | None = GSM8K_SYSTEM, with_answer: bool = False, *, add_assistant: bool | None = None
    ) -> None:
        """``add_assistant`` is twinkle-kit's name for ``with_answer``."""
        self.system = system
        self.with_answer = with_answer if add_assistant is None else add_assistant

    def process(self, row: dict) -> dict:
        truth = gsm8k_final_answer(row["answer"])
        if truth is None:
            raise DataError(f"GSM8KProcessor: answer has no '#### <number>' line: {row['answer'][-80:]!r}")
        messages = _prompt(self.system, row["question"])
        if self.with_answer:
            messages.append({"role": "assistant", "content": row["answer"]})
        return {"messages": messages, "ground_truth": truth}


COUNTDOWN_SYSTEM = (
    "You are a helpful assistant. You first think about the reasoning process and then give the user the answer."
)


class CountdownProcessor(Preprocessor):
    """Countdown rows (``nums``, ``target``) -> a prompt asking for an equation of the numbers that
    equals the target, reasoning in <think></think> and the equation in <answer></answer>; the numbers
    and target travel in ``user_data`` (twinkle-kit's place for them) for the reward."""

    required_columns = ("nums", "target")
    output_columns = ("messages", "user_data")

    def __init__(self, system: str | None = COUNTDOWN_SYSTEM) -> None:
        self.system = system

    def process(self, row: dict) -> dict:
        nums, target = list(row["nums"]), row["target"]
        question = (
            f"Using the numbers {nums}, write an equation that equals {target}. Use + - * / and each number "
            "once. Think inside <think> </think>, then give the equation inside <answer> </answer>."
        )
        return {"messages": _prompt(self.system, question), "user_data": [{"target": target, "nums": nums}]}
