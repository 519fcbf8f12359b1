"""Chat messages with `image_url` content parts: the prompt's tokens and its images' pixels.

Only `data:image/...;base64,` URLs are taken: the server opens and fetches nothing a request names, so
a path, a remote URL (or anything else) is a 400 naming `messages`, as is an image sent to a text-only
model. The images are resolved and decoded by the one decoder every API uses (twinkle.serve.backend.images),
then the model's own chat template and image processor encode the conversation (twinkle.template),
exactly as for training, so the image becomes the same tokens it was trained on.
"""

from __future__ import annotations

from twinkle.serve.backend import UserError
from twinkle.serve.backend.images import check_encoded, resolve_chats
from twinkle.serve.openai.errors import OpenAIError

_TEMPLATES: dict[str, object] = {}  # a model folder -> its Template (encode_prompt with images)


def _template(backend):
    if backend.tokenizer_path not in _TEMPLATES:
        from twinkle.template import Template

        _TEMPLATES[backend.tokenizer_path] = Template(model_id=backend.tokenizer_path, tokenizer=backend.tokenizer)
    return _TEMPLATES[backend.tokenizer_path]


def image_prompt(backend, messages: list[dict], caps) -> tuple[list[int], dict]:
    """(the generation prompt's ids, {"pixel_values", "image_grid_thw"}) of a chat holding images;
    `caps`: the server's (image bytes and pixels)."""
    try:
        (messages,) = resolve_chats([messages], backend, caps, ["messages"])
        row = _template(backend).encode_prompt({"messages": messages})
        check_encoded(messages, row, backend, "messages")
    except (UserError, ValueError) as e:  # a Template DataError is a ValueError
        raise OpenAIError(400, str(e), "messages") from None
    return list(row["input_ids"]), {k: row[k] for k in ("pixel_values", "image_grid_thw")}
