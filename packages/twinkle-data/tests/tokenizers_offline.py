"""Test-only: the real 151k Qwen vocabulary, built offline from ``qwen.tiktoken`` (shipped in the
qwen-agent wheel), wrapped as a Hugging Face fast tokenizer with a Qwen-style (ChatML + generation
markers + tools) or a Llama-3-style (header tokens, no markers) chat template we wrote."""

from __future__ import annotations

from pathlib import Path

# the vocabulary builder lives in the library (the shape presets use it); re-exported for the tests
from twinkle.hub.qwen_vocab import NOT_SPECIAL, QWEN_ADDED, base_tokenizer_json  # noqa: F401

LLAMA_ADDED = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

QWEN_TEMPLATE = """{%- if tools %}
<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call functions to help with the request. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

To call one, reply with a JSON object {"name": ..., "arguments": ...} between <tool_call> and </tool_call>.<|im_end|>
{% elif messages[0]['role'] == 'system' %}
<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% else %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}
{{- message['content'] }}
{%- for call in message.get('tool_calls', []) %}
{%- set fn = call['function'] %}
{{- '\\n' if message['content'] or not loop.first else '' }}<tool_call>
{"name": "{{ fn['name'] }}", "arguments": {{ fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson }}}
</tool_call>
{%- endfor %}
<|im_end|>
{%- endgeneration %}

{% elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
<|im_start|>user
{%- endif %}

<tool_response>
{{ message['content'] }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
<|im_end|>
{% endif %}
{%- elif message['role'] != 'system' or not loop.first %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

LLAMA_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def make_tokenizer(base_json: Path, style: str = "qwen"):
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(base_json), clean_up_tokenization_spaces=False)
    for name in QWEN_ADDED + (LLAMA_ADDED if style == "llama" else []):
        tok.add_tokens(
            [AddedToken(name, special=name not in NOT_SPECIAL, normalized=False)],
            special_tokens=name not in NOT_SPECIAL,
        )
    if style == "qwen":
        tok.eos_token, tok.pad_token, tok.chat_template = "<|im_end|>", "<|endoftext|>", QWEN_TEMPLATE
    else:
        tok.bos_token, tok.eos_token, tok.pad_token = "<|begin_of_text|>", "<|eot_id|>", "<|endoftext|>"
        tok.chat_template = LLAMA_TEMPLATE
    return tok
