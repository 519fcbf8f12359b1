"""Rewards: answer extraction, exact match, format, length, combinations, per-sample failures."""

import math

import pytest

from twinkle.reward import (
    REWARDS,
    AnswerAccuracy,
    ArithmeticAccuracy,
    FormatReward,
    LengthPenalty,
    NumericCloseness,
    Reward,
    WeightedReward,
    create_reward,
    extract_final_answer,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("so the total is \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("The answer is 1,234.", "1,234"),
        ("3 + 4 = 7, then 7 * 2 = 14", "14"),
        ("44<|im_end|>", "44"),
        ("no digits here", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_answer_accuracy_matches_by_value_and_reads_gsm8k_ground_truth():
    acc = AnswerAccuracy()
    rows = [{"answer": "He has 3 + 4 = 7 apples.\n#### 1,000"}] * 4 + [{"ground_truth": "Paris"}]
    completions = ["I think #### 1000", "The answer is $1,000.00", "1000.5", "999", "the answer is paris."]
    assert acc(completions, rows).values == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_arithmetic_accuracy_on_bundled_style_rows_and_computes_missing_truth():
    acc = ArithmeticAccuracy()
    rows = [
        {"question": "What is 8 + 36?", "answer": "44"},
        {"question": "What is 16 - 7?"},
        {"question": "What is 6 * 7?"},
        {"question": "What is 5 + 5?", "answer": "10"},
    ]
    assert acc(["44", "9<|im_end|>", "41", "ten"], rows).values == [1.0, 1.0, 0.0, 0.0]


def test_a_raising_sample_is_recorded_and_the_batch_goes_on():
    acc = AnswerAccuracy(answer_key="answer")
    result = acc(["7", "7", "8"], [{"answer": "7"}, {"question": "no truth"}, {"answer": "8"}])
    assert result.values == [1.0, 0.0, 1.0]
    assert result.failed == [False, True, False] and result.valid == [True, False, True]
    assert "accuracy: KeyError" in result.errors[1] and "'answer'" in result.errors[1]


def test_batch_scorer_failure_is_isolated_to_the_bad_sample():
    class Picky(Reward):
        def score_batch(self, texts, rows):
            if any(t == "boom" for t in texts):
                raise RuntimeError("cannot score boom")
            return [len(t) for t in texts]

    result = Picky()(["ab", "boom", "abc", {"role": "x"}])
    assert result.values == [2.0, 0.0, 3.0, 0.0]
    assert result.errors[1] == "picky: RuntimeError: cannot score boom"
    assert "TypeError" in result.errors[3]


def test_nan_reward_counts_as_failure():
    class Nan(Reward):
        def score(self, text, **row):
            return math.nan

    assert Nan()(["x"]).errors == {0: "nan: ValueError: reward is NaN"}


def test_format_reward_search_and_full():
    assert FormatReward(r"\d+$", reward=1, penalty=-1)(["x 42", "42 x"]).values == [1.0, -1.0]
    think = FormatReward.think_answer()
    assert think(
        ["<think>a\nb</think> <answer>4</answer>", "<answer>4</answer>", "<think>a</think><answer>4</answer> trailing"]
    ).values == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="not a valid regex"):
        FormatReward("(")


def test_length_penalty_is_linear_between_target_and_limit():
    pen = LengthPenalty(target=10, limit=30, scale=0.5)
    rows = [{"num_tokens": n} for n in (5, 10, 20, 30, 99)]
    assert pen(["x"] * 5, rows).values == [0.0, 0.0, -0.25, -0.5, -0.5]
    assert LengthPenalty(2, 4, unit="words")(["a b c"]).values == [-0.5]
    assert "num_tokens" in pen(["x"]).errors[0]


def test_weighted_reward_totals_components_and_failures():
    combo = WeightedReward(
        {
            "acc": (AnswerAccuracy(answer_key="answer"), 1.0),
            "fmt": (FormatReward(r"^\d+$", match="full"), 0.25),
            "len": (LengthPenalty(1, 3, unit="chars"), 2.0),
        }
    )
    rows = [{"answer": "12"}, {"answer": "12"}, {}]
    result = combo(["12", "x 12", "12"], rows)
    # independent: 1 + .25*1 + 2*(-(2-1)/2) ; 1 + 0 + 2*(-1) ; failed (no answer)
    assert result.values == [1.0 + 0.25 - 1.0, 1.0 - 2.0, 0.0]
    assert result.components["acc"] == [1.0, 1.0, 0.0] and result.components["fmt"] == [1.0, 0.0, 1.0]
    assert list(result.errors) == [2] and result.errors[2].startswith("acc: KeyError")


def test_registry_names_pick_classes():
    assert isinstance(create_reward("arithmetic_accuracy"), ArithmeticAccuracy)
    assert REWARDS.get("WeightedReward") is WeightedReward
    combo = WeightedReward([("accuracy", 1.0)])
    assert combo(["1"], [{"answer": "1"}]).values == [1.0]
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        create_reward("nope")


def test_numeric_closeness_decays_with_distance():
    close = NumericCloseness(scale=5.0)
    rows = [{"ground_truth": "44"}] * 4
    assert close(["44", "The answer is 49", "no number", "34"], rows).values == pytest.approx(
        [1.0, math.exp(-1.0), 0.0, math.exp(-2.0)]
    )
