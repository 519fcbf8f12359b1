"""Preprocessors and filters row by row, and the registries filled from entry points."""

import json

import pytest

from twinkle.dataset import DataError
from twinkle.preprocessor import (
    FILTERS,
    PREPROCESSORS,
    AlpacaProcessor,
    ArithmeticProcessor,
    DedupFilter,
    EmptyFilter,
    GSM8KProcessor,
    LengthFilter,
    MessagesProcessor,
    PreferenceProcessor,
    SelfCognitionProcessor,
)
from twinkle.processor import INPUT_PROCESSORS, InputProcessor
from twinkle.template import TEMPLATES, Template


def test_registries_come_from_entry_points():
    assert PREPROCESSORS.get("SelfCognitionProcessor") is SelfCognitionProcessor
    assert set(PREPROCESSORS.names()) >= {
        "AlpacaProcessor",
        "MessagesProcessor",
        "ArithmeticProcessor",
        "GSM8KProcessor",
        "PreferenceProcessor",
    }
    assert set(FILTERS.names()) >= {"LengthFilter", "EmptyFilter", "DedupFilter"}
    assert TEMPLATES.get("Template") is Template and INPUT_PROCESSORS.get("InputProcessor") is InputProcessor
    with pytest.raises(KeyError, match="unknown preprocessor 'Nope'; known: AlpacaProcessor"):
        PREPROCESSORS.get("Nope")


def test_self_cognition_fills_placeholders():
    [row] = SelfCognitionProcessor("Glimmer", "Lantern Labs")(
        [{"query": "Who made {{NAME}}?", "response": "{{AUTHOR}} made {{NAME}}."}]
    )
    assert row == {
        "messages": [
            {"role": "user", "content": "Who made Glimmer?"},
            {"role": "assistant", "content": "Lantern Labs made Glimmer."},
        ]
    }


def test_alpaca():
    [row] = AlpacaProcessor()([{"instruction": "Translate", "input": "bonjour", "output": "hello"}])
    assert row["messages"] == [
        {"role": "user", "content": "Translate\n\nbonjour"},
        {"role": "assistant", "content": "hello"},
    ]
    [row] = AlpacaProcessor(system="Be nice")([{"instruction": "Hi", "input": "", "output": "Hey"}])
    assert row["messages"][0] == {"role": "system", "content": "Be nice"} and row["messages"][1]["content"] == "Hi"


def test_sharegpt_and_messages_normalisation():
    sharegpt = {
        "system": "S",
        "tools": [{"name": "f"}],
        "conversations": [
            {"from": "human", "value": "call f"},
            {"from": "function_call", "value": json.dumps({"name": "f", "arguments": {"x": 1}})},
            {"from": "observation", "value": "42"},
            {"from": "gpt", "value": "It is 42."},
        ],
        "id": 7,
    }
    [row] = MessagesProcessor()([sharegpt])
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert row["messages"][2]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert json.loads(row["tools"]) == [{"name": "f"}] and row["id"] == 7
    [same] = MessagesProcessor()(
        [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    )
    assert same["messages"][1] == {"role": "assistant", "content": "b"}
    with pytest.raises(DataError, match="unknown speaker 'narrator'"):
        MessagesProcessor()([{"conversations": [{"from": "narrator", "value": "x"}]}])
    with pytest.raises(DataError, match="row 0 has no conversation column for MessagesProcessor"):
        MessagesProcessor()([{"text": "x"}])


def test_rl_prompts_carry_ground_truth():
    [row] = ArithmeticProcessor()([{"question": "What is 8 + 36?", "answer": "44"}])
    assert row["ground_truth"] == "44" and row["messages"][-1] == {"role": "user", "content": "What is 8 + 36?"}
    [sft] = ArithmeticProcessor(system=None, with_answer=True)([{"question": "q", "answer": 7}])
    assert sft["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "7"}]
    gsm = {"question": "Tom has 3 apples...", "answer": "3 * 400 = 1200\n#### 1,200"}
    [row] = GSM8KProcessor()([gsm])
    assert row["ground_truth"] == "1200" and row["messages"][0]["role"] == "system"
    with pytest.raises(DataError, match="no '#### <number>' line"):
        GSM8KProcessor()([{"question": "q", "answer": "no final line"}])


def test_preference_pairs():
    [row] = PreferenceProcessor()([{"prompt": "2+2?", "chosen": "4", "rejected": "5"}])
    assert row["messages"] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert row["rejected_messages"][-1] == {"role": "assistant", "content": "5"}
    with pytest.raises(DataError, match="no column 'rejected', which PreferenceProcessor reads"):
        PreferenceProcessor()([{"prompt": "p", "chosen": "c"}])


def test_filters():
    empty, dedup = EmptyFilter(), DedupFilter(columns=["q"])
    assert not empty.keep({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]})
    assert not empty.keep({"messages": []}) and not empty.keep({"text": ""})
    assert not empty.keep({"input_ids": [1, 2], "labels": [-100, -100]})
    assert empty.keep(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]},
            ]
        }
    )
    assert dedup([{"q": 1, "a": 1}, {"q": 1, "a": 2}, {"q": 2}]) == [{"q": 1, "a": 1}, {"q": 2}]
    assert LengthFilter(max_length=2).keep({"input_ids": [1, 2]}) and not LengthFilter(max_length=1).keep(
        {"input_ids": [1, 2]}
    )
    with pytest.raises(DataError, match=r"call dataset.encode\(\) before filtering by length"):
        LengthFilter(8).keep({"messages": []})
