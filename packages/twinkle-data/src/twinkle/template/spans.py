"""Which characters of a rendered conversation carry loss: one span per assistant message.

With ``{% generation %}`` markers the spans come from the render itself. Without them, each
assistant round is found by rendering the conversation up to it twice: with a generation prompt
(what the model sees before it speaks) and with the reply; the reply's span is the difference, up
to and including the end-of-turn token. That needs the template to be prefix-stable (earlier rounds
render the same whatever follows), which is checked, never assumed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from twinkle.dataset.errors import DataError
from twinkle.template.render import render

TrainedRounds = Literal["all", "last"] | int | Iterable[int]


def marked_spans(text_spans: list[tuple[int, int]], assistant_idx: list[int]) -> dict[int, tuple[int, int]] | None:
    """Pair generation blocks with assistant messages; None if the counts differ."""
    if len(text_spans) != len(assistant_idx):
        return None
    return dict(zip(assistant_idx, text_spans))


def per_round_spans(
    source: str, messages: list[dict], context: dict, full_text: str, end_token: str | None
) -> dict[int, tuple[int, int]]:
    spans: dict[int, tuple[int, int]] = {}
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _ = render(source, messages=messages[:i], add_generation_prompt=True, **context)
        upto, _ = render(source, messages=messages[: i + 1], add_generation_prompt=False, **context)
        if not (upto.startswith(before) and full_text.startswith(upto)):
            raise DataError(
                f"assistant message {i}: the chat template has no {{% generation %}} markers and does not "
                f"render earlier rounds identically as the conversation grows, so the trained tokens cannot "
                f"be located; add generation markers to the template"
            )
        end = len(upto)
        reply = upto[len(before) :]
        if end_token and end_token in reply:  # stop after the end-of-turn token, not at trailing newlines
            end = len(before) + reply.rindex(end_token) + len(end_token)
        spans[i] = (len(before), end)
    return spans


def select_trained(messages: list[dict], trained_rounds: TrainedRounds) -> set[int]:
    """Message indices whose assistant reply is trained: ``'all'``, ``'last'``, or round numbers
    (0 = first assistant reply, -1 = last); a message's own ``loss: true/false`` overrides."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if trained_rounds == "all":
        chosen = set(assistant)
    elif trained_rounds == "last":
        chosen = set(assistant[-1:])
    elif isinstance(trained_rounds, str):
        raise ValueError(f"trained_rounds must be 'all', 'last' or round numbers, got {trained_rounds!r}")
    else:
        rounds = [trained_rounds] if isinstance(trained_rounds, int) else list(trained_rounds)
        chosen = set()
        for r in rounds:
            if not -len(assistant) <= r < len(assistant):
                continue  # a conversation with fewer rounds simply has nothing there to train
            chosen.add(assistant[r])
    for i in assistant:
        flag = messages[i].get("loss")
        if flag is not None:
            (chosen.add if flag else chosen.discard)(i)
    return chosen
