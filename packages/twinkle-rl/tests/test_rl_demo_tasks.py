"""The bundled RL tasks: every answer is right, the test split is held out of train, "larger" is balanced."""

import re
from collections import Counter

import pytest

from twinkle.rl.demo import TASKS, arithmetic_prompts


def operands(question):
    return [int(n) for n in re.findall(r"\d+", question)][:2]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_no_test_operand_pair_is_trained_on_in_either_order(task):
    train, test = arithmetic_prompts("train", task=task), arithmetic_prompts("test", task=task)
    assert len(test) >= 100 and len(train) > 5 * len(test)
    held_out = {frozenset(operands(r["question"])) for r in test}
    assert not [r["question"] for r in train if frozenset(operands(r["question"])) in held_out]


def test_larger_answers_name_the_larger_two_digit_operand_and_each_answer_is_half_the_split():
    for split in ("train", "test"):
        rows = arithmetic_prompts(split, task="larger")
        for r in rows:
            a, b = operands(r["question"])
            assert r["ground_truth"] == ("1" if a > b else "2") and min(a, b) >= 10, r
            # the question states its answer format: no system prompt, half the tokens per RL row
            assert r["messages"] == [{"role": "user", "content": f"Which is larger, {a} or {b}? Answer 1 or 2."}]
        counts = Counter(r["ground_truth"] for r in rows)
        assert abs(counts["1"] - counts["2"]) <= 0.05 * len(rows), counts  # one answer always scores ~0.5


def test_last_digit_answers_are_the_sums_last_digit():
    rows = arithmetic_prompts("test", task="last-digit")
    assert rows[0]["question"] == "What is the last digit of 8 + 36?" and rows[0]["ground_truth"] == "4"
    assert all(r["ground_truth"] == str(sum(operands(r["question"])) % 10) for r in rows)


def test_limit_and_unknown_task():
    assert [r["question"] for r in arithmetic_prompts("test", limit=2)] == ["What is 8 + 36?", "What is 16 - 7?"]
    with pytest.raises(ValueError, match="unknown arithmetic task 'parity'; known: arithmetic, last-digit, larger"):
        arithmetic_prompts("test", task="parity")
