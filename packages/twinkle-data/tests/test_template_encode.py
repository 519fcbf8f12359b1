"""Template encoding, token by token, against the tokenizer's own apply_chat_template."""

import json

import pytest

from twinkle.dataset import DataError, SequenceTooLongError
from twinkle.template import Template

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "It is 8."},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "Add 2 and 3."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}],
    },
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "The sum is 5."},
]


def trained_text(template, row):
    """The decoded runs of trained tokens, one string per contiguous run."""
    runs, current = [], []
    for tok, lab in zip(row["input_ids"], row["labels"]):
        if lab != -100:
            assert lab == tok
            current.append(tok)
        elif current:
            runs.append(template.decode(current))
            current = []
    if current:
        runs.append(template.decode(current))
    return runs


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_ids_and_masks_equal_hf_apply_chat_template(which, tiny_template, qwen_tokenizer):
    template = tiny_template if which == "tiny" else Template(tokenizer=qwen_tokenizer)
    tok = template.tokenizer
    for messages, tools in ((CHAT, None), (TOOL_CHAT, TOOLS)):
        row = template.encode({"messages": messages, "tools": json.dumps(TOOLS) if tools else None})
        ref = tok.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert row["input_ids"] == list(ref["input_ids"])
        expected = [t if m else -100 for t, m in zip(ref["input_ids"], ref["assistant_masks"])]
        assert row["labels"] == expected


def test_qwen_vocab_known_ids(qwen_tokenizer):
    # Ids of the real Qwen2/2.5/3 vocabulary, so the offline build is the true 151k vocabulary.
    assert len(qwen_tokenizer) == 151665
    assert qwen_tokenizer("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]
    assert qwen_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]) == [
        151643,
        151644,
        151645,
        151657,
    ]
    template = Template(tokenizer=qwen_tokenizer)
    row = template.encode([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, world!"}])
    assert trained_text(template, row) == ["Hello, world!<|im_end|>"]
    i = row["labels"].index(9707)
    assert row["input_ids"][i - 3 : i] == [151644, 77091, 198]  # <|im_start|> "assistant" "\n"
    assert row["labels"][i:] == [9707, 11, 1879, 0, 151645, -100]  # the "\n" after <|im_end|> is not trained


def test_tool_calls_trained_tool_responses_masked(qwen_tokenizer):
    template = Template(tokenizer=qwen_tokenizer)
    row = template.encode({"messages": TOOL_CHAT, "tools": TOOLS})
    runs = trained_text(template, row)
    assert runs == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "The sum is 5.<|im_end|>",
    ]
    assert "<tool_response>\n5\n</tool_response>" in template.decode(row["input_ids"])


def test_llama_style_without_markers_falls_back_to_per_round(llama_tokenizer):
    template = Template(tokenizer=llama_tokenizer)
    assert not template.has_generation_markers
    row = template.encode(CHAT)
    assert row["input_ids"] == list(
        llama_tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    )
    assert row["input_ids"][0] == llama_tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert trained_text(template, row) == ["5<|eot_id|>", "It is 8.<|eot_id|>"]
    prompt = template.encode_prompt(CHAT[:2])
    assert template.decode(prompt["input_ids"]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize(
    "rounds,expected",
    [("all", ["5<|im_end|>", "It is 8.<|im_end|>"]), ("last", ["It is 8.<|im_end|>"]), ([0], ["5<|im_end|>"])],
)
def test_choice_of_trained_rounds(rounds, expected, tiny_template):
    template = Template(tokenizer=tiny_template.tokenizer, trained_rounds=rounds)
    assert trained_text(template, template.encode(CHAT)) == expected


def test_unknown_trained_rounds_word_is_refused_by_name(tiny_template):
    template = Template(tokenizer=tiny_template.tokenizer, trained_rounds="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"trained_rounds must be 'all', 'last' or round numbers, got 'first'"):
        template.encode(CHAT)


def test_message_loss_flag_overrides(tiny_template, llama_tokenizer):
    messages = [dict(m) for m in CHAT]
    messages[2]["loss"] = False
    assert trained_text(tiny_template, tiny_template.encode(messages)) == ["It is 8.<|im_end|>"]
    llama = Template(tokenizer=llama_tokenizer, trained_rounds="last")
    messages[2]["loss"] = True
    assert trained_text(llama, llama.encode(messages)) == ["5<|eot_id|>", "It is 8.<|eot_id|>"]


def test_truncation_strategies(tiny_template):
    full = tiny_template.encode(CHAT)
    n = len(full["input_ids"])
    make = lambda s: Template(tokenizer=tiny_template.tokenizer, max_length=10, truncation_strategy=s)  # noqa: E731
    with pytest.raises(SequenceTooLongError, match=rf"sequence of {n} tokens is longer than max_length=10"):
        make("raise").encode(CHAT)
    left, right = make("left").encode(CHAT), make("right").encode(CHAT)
    assert left["input_ids"] == full["input_ids"][-10:] and left["labels"] == full["labels"][-10:]
    assert right["input_ids"] == full["input_ids"][:10] and right["labels"] == full["labels"][:10]
    assert make("delete").encode(CHAT) is None
    with pytest.raises(ValueError, match="truncation_strategy must be one of"):
        Template(tokenizer=tiny_template.tokenizer, truncation_strategy="middle")


def test_encode_prompt_matches_generation_prompt(tiny_template):
    prompt = tiny_template.encode_prompt({"messages": CHAT[:2], "ground_truth": "5"})
    ref = tiny_template.tokenizer.apply_chat_template(
        CHAT[:2], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert prompt["input_ids"] == list(ref)
    assert prompt["ground_truth"] == "5" and "labels" not in prompt


def test_missing_messages_names_column_and_producers(tiny_template):
    with pytest.raises(DataError) as e:
        tiny_template.encode({"query": "Who are you?", "response": "I am X."})
    msg = str(e.value)
    assert "no 'messages' column" in msg and "query, response" in msg and "SelfCognitionProcessor" in msg


def test_default_system_and_preference_pair(tiny_template):
    template = Template(tokenizer=tiny_template.tokenizer, default_system="You are Twinkle.")
    row = template.encode(
        {"messages": CHAT[1:3], "rejected_messages": [CHAT[1], {"role": "assistant", "content": "7"}]}
    )
    assert template.decode(row["input_ids"]).startswith("<|im_start|>system\nYou are Twinkle.<|im_end|>")
    assert trained_text(template, row) == ["5<|im_end|>"]
    assert template.decode([t for t in row["rejected_labels"] if t != -100]) == "7<|im_end|>"
