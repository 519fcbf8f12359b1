"""Template: a tokenizer's chat template turned into training rows (``input_ids`` + ``labels``).

Labels are aligned with ``input_ids`` (the model shifts them), -100 wherever no loss is taken: only
the tokens of trained assistant replies carry labels. Text is rendered once and tokenized once, with
offsets, so the ids are exactly what ``tokenizer.apply_chat_template`` gives.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.dataset.errors import DataError, SequenceTooLongError
from twinkle.registry import Registry
from twinkle.template import vision
from twinkle.template.render import END, START, has_generation_markers, render
from twinkle.template.spans import TrainedRounds, marked_spans, per_round_spans, select_trained

logger = logging.getLogger(__name__)
TRUNCATION_STRATEGIES = ("raise", "left", "right", "delete")

if TYPE_CHECKING:
    from transformers import BatchEncoding, PreTrainedTokenizerBase
    from transformers.image_processing_utils import BaseImageProcessor


def _load_tokenizer(model_id: str | None) -> PreTrainedTokenizerBase:
    if model_id is None:
        raise ValueError("Template needs a model_id (e.g. twinkle.hub.TEST_MODEL) or a tokenizer")
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    from twinkle.hub import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model_id))
    if not isinstance(tokenizer, PreTrainedTokenizerBase):  # transformers types this Optional
        raise ValueError(f"no tokenizer found for model {model_id!r}")
    return tokenizer


class Template:
    """Encode conversations for training (``encode``) and prompts for sampling (``encode_prompt``).

    model_id: any id ``twinkle.hub.resolve_model_path`` knows (or pass ``tokenizer=``).
    max_length / truncation_strategy: longer sequences ``raise``, keep the ``left``-truncated end,
        the ``right``-truncated start, or are ``delete``d (encode returns None).
    trained_rounds: ``'all'``, ``'last'`` or assistant round numbers (``[0, -1]``).
    default_system: a system message prepended when a conversation has none.
    chat_template: overrides the tokenizer's template (e.g. one with generation markers).
    template_kwargs / enable_thinking: variables the chat template renders with (Qwen3's
        ``enable_thinking``).
    image_processor: for images in messages (see ``twinkle.template.vision``); by default the one in
        the model's folder. Encoded rows then carry ``pixel_values`` and ``image_grid_thw``.
    """

    def __init__(
        self,
        model_id: str | None = None,
        max_length: int | None = None,
        truncation_strategy: str = "raise",
        trained_rounds: TrainedRounds = "all",
        default_system: str | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
        image_processor: BaseImageProcessor | None = None,
        *,
        enable_thinking: bool | None = None,
    ) -> None:
        if enable_thinking is not None:  # twinkle-kit's keyword: a chat-template variable like any other
            template_kwargs = {**(template_kwargs or {}), "enable_thinking": enable_thinking}
        if truncation_strategy not in TRUNCATION_STRATEGIES:
            raise ValueError(f"truncation_strategy must be one of {TRUNCATION_STRATEGIES}, got {truncation_strategy!r}")
        self._model_path: str | None = None  # known when the tokenizer came from model_id's folder
        if tokenizer is None:
            from twinkle.hub import resolve_model_path

            if model_id is None:
                raise ValueError("Template needs a model_id or a tokenizer")
            tokenizer = _load_tokenizer(model_id)
            self._model_path = resolve_model_path(model_id)  # verified once per process: cheap now
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation_strategy = truncation_strategy
        self.trained_rounds = trained_rounds
        self.default_system = default_system
        self.template_kwargs = dict(template_kwargs or {})
        source = chat_template or tokenizer.chat_template
        if isinstance(source, dict):
            source = source.get("default") or next(iter(source.values()))
        if not source:
            raise ValueError(f"the tokenizer of {model_id!r} has no chat template; pass chat_template=")
        self.chat_template = source
        self.has_generation_markers = has_generation_markers(source)
        self._vocab_hash: str | None = None
        self._image_encoder = vision.ImageEncoder(image_processor, tokenizer) if image_processor else None
        self._probed_images = False

    # ---- input ---------------------------------------------------------------------------------
    def _conversation(
        self, row: Mapping[str, Any] | list[dict], index: int | None, key: str = "messages"
    ) -> tuple[list[dict], list[dict] | None, Mapping[str, Any]]:
        if isinstance(row, list):
            row = {key: row}
        if not isinstance(row, Mapping) or key not in row:
            from twinkle.preprocessor.base import producers_of

            where = f"row {index}" if index is not None else "the row"
            have = ", ".join(row) if isinstance(row, Mapping) else type(row).__name__
            makers = ", ".join(producers_of(key)) or "a Preprocessor"
            raise DataError(
                f"{where} has no {key!r} column (it has: {have}); map a preprocessor that "
                f"produces it first, e.g. {makers}"
            )
        messages = []
        for m in row[key]:
            if not isinstance(m, dict) or not m.get("role"):
                raise DataError(f"row {index}: every message needs a 'role', got {m!r}")
            m = {k: v for k, v in m.items() if v is not None}
            m["content"] = vision.normalise_content(m.get("content", ""))
            text = vision.text_of(m["content"])
            if START in text or END in text:
                raise DataError(f"row {index}: message text contains reserved characters U+E000/U+E001")
            messages.append(m)
        if self.default_system and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": self.default_system})
        self._require_images(messages, index)
        tools = row.get("tools")
        if isinstance(tools, str):
            tools = json.loads(tools) if tools.strip() else None
        return messages, tools or None, row

    def _context(self, tools: list[dict] | None) -> dict:
        special = {k: v for k, v in self.tokenizer.special_tokens_map.items() if isinstance(v, str)}
        return {**special, **self.template_kwargs, "tools": tools}

    def _render_train(
        self, messages: list[dict], tools: list[dict] | None, index: int | None
    ) -> tuple[str, list[tuple[int, int]]]:
        context = self._context(tools)
        text, gen_spans = render(self.chat_template, messages=messages, add_generation_prompt=False, **context)
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        trained = select_trained(messages, self.trained_rounds)
        if self.has_generation_markers:
            by_message = marked_spans(gen_spans, assistant)
            if by_message is None:
                if self.trained_rounds != "all" or any("loss" in messages[i] for i in assistant):
                    raise DataError(
                        f"row {index}: the template emits {len(gen_spans)} generation blocks for "
                        f"{len(assistant)} assistant messages, so rounds cannot be chosen"
                    )
                return text, gen_spans
        else:
            by_message = per_round_spans(self.chat_template, messages, context, text, self.tokenizer.eos_token)
        return text, [by_message[i] for i in sorted(trained)]

    # ---- images ---------------------------------------------------------------------------------
    def _images(
        self, messages: list[dict], text: str, spans: list[tuple[int, int]], index: int | None
    ) -> tuple[str, list[tuple[int, int]], dict[str, list]]:
        """Expand the image placeholders of ``text``; (text, spans, image columns or {})."""
        sources = vision.image_sources(messages)
        if not sources:
            return text, spans, {}
        encoder = self._image_encoder
        if encoder is None:  # _require_images refuses such rows before rendering: a bug if reached
            raise DataError(f"row {index} holds images but no image processor was loaded for {self.model_id!r}")
        pixels, grid, counts = encoder.encode(sources)
        text, spans = vision.expand_placeholders(text, encoder.placeholder, counts, spans)
        # a list of patch rows, not one 2-D array: Arrow stores it as list<list<float>>
        return text, spans, {"pixel_values": list(pixels), "image_grid_thw": grid.tolist()}

    def _require_images(self, messages: list[dict], index: int | None) -> None:
        """Before rendering: a text-only model's template cannot even place an image."""
        n = len(vision.image_sources(messages))
        if not n:
            return
        if self._image_encoder is None and self.model_id is not None:
            from twinkle.hub import resolve_model_path

            self._image_encoder = vision.load_image_encoder(resolve_model_path(self.model_id), self.tokenizer)
        if self._image_encoder is None:
            raise DataError(
                f"row {index} holds {n} image(s) but model {self.model_id!r} is text-only "
                f"(no image processor in its folder); use a vision-language model such as twinkle://qwen2.5-vl-tiny"
            )

    def _check_image_truncation(self, n_tokens: int, images: dict, index: int | None) -> None:
        too_long = images and self.max_length is not None and n_tokens > self.max_length
        if too_long and self.truncation_strategy in ("left", "right"):
            raise SequenceTooLongError(
                f"row {index}: {n_tokens} tokens with images is longer than max_length={self.max_length}; "
                f"cutting it would cut image tokens from their pixels (use 'delete' or raise max_length)"
            )

    # ---- encoding ------------------------------------------------------------------------------
    def _tokenize(self, texts: list[str]) -> BatchEncoding:
        return self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)

    def _truncate(
        self, ids: list[int], labels: list[int] | None, index: int | None
    ) -> tuple[list[int] | None, list[int] | None]:
        limit = self.max_length
        if limit is None or len(ids) <= limit:
            return ids, labels
        if self.truncation_strategy == "raise":
            where = f"row {index}: " if index is not None else ""
            raise SequenceTooLongError(
                f"{where}sequence of {len(ids)} tokens is longer than max_length={limit} "
                f"(truncation_strategy='raise'; use 'left', 'right' or 'delete', "
                f"or raise max_length)"
            )
        if self.truncation_strategy == "delete":
            return None, None
        cut = slice(-limit, None) if self.truncation_strategy == "left" else slice(0, limit)
        return ids[cut], (labels[cut] if labels is not None else None)

    def batch_encode(self, rows: list, add_generation_prompt: bool = False, first_index: int = 0) -> list[dict | None]:
        """Encode rows in one tokenizer call; None marks a row deleted by truncation. A preference row
        in twinkle-kit's form (``positive`` / ``negative`` conversations) gets each side encoded."""
        if rows and all(isinstance(r, dict) and "positive" in r and "negative" in r for r in rows):
            return self._encode_sides(rows, first_index)
        if add_generation_prompt:
            return [self.encode_prompt(r, index=first_index + i) for i, r in enumerate(rows)]
        texts, spans, extras, images = [], [], [], []
        for i, row in enumerate(rows):
            messages, tools, original = self._conversation(row, first_index + i)
            text, trained = self._render_train(messages, tools, first_index + i)
            text, trained, row_images = self._images(messages, text, trained, first_index + i)
            texts.append(text)
            spans.append(trained)
            extras.append(original)
            images.append(row_images)
        if not texts:
            return []
        tokens = self._tokenize(texts)
        out: list[dict | None] = []
        for i, (ids, offsets) in enumerate(zip(tokens["input_ids"], tokens["offset_mapping"])):
            starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
            trained = np.zeros(len(ids), dtype=bool)
            for lo, hi in spans[i]:
                trained |= (starts >= lo) & (starts < hi)
            if images[i] and self._image_encoder is not None:  # image tokens are inputs, never targets
                trained &= np.asarray(ids) != self._image_encoder.token_id
            labels = np.where(trained, np.asarray(ids, dtype=np.int64), IGNORE_INDEX).tolist()
            self._check_image_truncation(len(ids), images[i], first_index + i)
            ids, labels = self._truncate(list(ids), labels, first_index + i)
            if ids is None:
                out.append(None)
                continue
            row = {k: v for k, v in extras[i].items() if k not in ("input_ids", "labels")}
            row.update(input_ids=ids, labels=labels, **images[i])
            if "rejected_messages" in row:  # a preference pair: encode the rejected side alongside
                rejected = self.encode(
                    {"messages": row["rejected_messages"], "tools": row.get("tools")}, index=first_index + i
                )
                if rejected is None:
                    out.append(None)
                    continue
                row.update(rejected_input_ids=rejected["input_ids"], rejected_labels=rejected["labels"])
            out.append(row)
        return out

    def _encode_sides(self, rows: list[dict], first_index: int) -> list[dict | None]:
        sides = {
            side: self.batch_encode([r[side] for r in rows], first_index=first_index)
            for side in ("positive", "negative")
        }
        out: list[dict | None] = []
        for i, row in enumerate(rows):
            pos, neg = sides["positive"][i], sides["negative"][i]
            out.append(None if pos is None or neg is None else {**row, "positive": pos, "negative": neg})
        return out

    def encode(
        self,
        messages_or_trajectory: Mapping[str, Any] | list[dict],
        index: int | None = None,
        *,
        add_generation_prompt: bool = False,
    ) -> dict | None:
        """``{'input_ids', 'labels', ...carried keys}`` for one conversation (a message list or a row
        with ``messages``); None when ``truncation_strategy='delete'`` drops it. ``add_generation_prompt``
        (twinkle-kit's): the sampling prompt (``encode_prompt``), its ``input_ids`` an array as in
        twinkle-kit's InputFeature (its scripts read them with ``.tolist()``)."""
        if add_generation_prompt:
            row = self.encode_prompt(messages_or_trajectory, index)
            return {**row, "input_ids": np.asarray(row["input_ids"], dtype=np.int64)}
        return self.batch_encode([messages_or_trajectory], first_index=index or 0)[0]

    def encode_prompt(self, messages_or_trajectory: Mapping[str, Any] | list[dict], index: int | None = None) -> dict:
        """The generation prompt for sampling: ``{'input_ids', ...carried keys}`` (no labels)."""
        messages, tools, original = self._conversation(messages_or_trajectory, index)
        text, _ = render(self.chat_template, messages=messages, add_generation_prompt=True, **self._context(tools))
        text, _, images = self._images(messages, text, [], index)
        ids = self._tokenize([text])["input_ids"][0]
        self._check_image_truncation(len(ids), images, index)
        ids, _ = self._truncate(list(ids), None, index)
        row = {k: v for k, v in original.items() if k not in ("input_ids", "labels")}
        row.update(input_ids=ids, **images)
        return row

    def render_text(
        self, messages_or_trajectory: Mapping[str, Any] | list[dict], add_generation_prompt: bool = False
    ) -> str:
        messages, tools, _ = self._conversation(messages_or_trajectory, None)
        return render(
            self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt, **self._context(tools)
        )[0]

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def signature(self) -> str:
        """Hash of everything that changes the encoding (tokenizer, template, limits); the cache key."""
        if self._vocab_hash is None:  # hashing a 151k vocabulary takes a moment: once per template
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            vocab = backend.to_str() if backend is not None else json.dumps(self.tokenizer.get_vocab(), sort_keys=True)
            self._vocab_hash = hashlib.sha256(vocab.encode()).hexdigest()
        parts = [
            type(self).__qualname__,
            self._vocab_hash,
            self.chat_template,
            self.max_length,
            self.truncation_strategy,
            repr(self.trained_rounds),
            self.default_system,
            json.dumps(self.template_kwargs, sort_keys=True, default=str),
        ]
        if self._image_encoder is None and self._model_path is not None and not self._probed_images:
            self._probed_images = True  # a VL folder's image processor changes the encoding too
            self._image_encoder = vision.load_image_encoder(self._model_path, self.tokenizer)
        if self._image_encoder is not None:  # appended only then: text-only signatures stay as they were
            parts.append(self._image_encoder.image_processor.to_json_string())
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


TEMPLATES: Registry[Template] = Registry("template", "twinkle.template", Template)
