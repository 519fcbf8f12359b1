"""One choice's text while its tokens are still being decoded: which part is safe to send now.

A streamed choice must join to exactly the non-streamed one (`text.render`), so a chunk never holds
- the U+FFFD of a character whose UTF-8 bytes are split over tokens (held until it decodes),
- text that may turn out to begin a stop string (held until it cannot, or the stop cuts it off).
Token offsets are computed as `render` computes them, so a token's log-prob goes out with the chunk
that carries the start of its text, and the kept tokens are the ones `render` keeps.
"""

from __future__ import annotations

from twinkle.sampler import SampledSequence
from twinkle.sampler.decoding import StepToken
from twinkle.serve.openai.text import Rendered, render


class ChoiceText:
    def __init__(self, tokenizer, stop: list[str] | None):
        self.tokenizer, self.stop = tokenizer, stop or []
        # every token so far (not only the kept ones): the shape the chunk formatters read log-probs from
        self.partial = Rendered("", [], [], [], None, "length")
        self._end = 0  # text length through the last token, as render measures it
        self.sent_chars = self.sent_tokens = 0

    def add(self, step: StepToken) -> tuple[str, int, int]:
        """Take one decoded token -> (text now safe to send, and the tokens [lo, hi) whose text starts in it)."""
        p = self.partial
        p.tokens.append(step.token)
        p.logprobs.append(step.logprob)
        if step.top_logprobs is not None:
            p.top = (p.top or []) + [step.top_logprobs]
        p.starts.append(self._end)
        text = self.tokenizer.decode(p.tokens, skip_special_tokens=True)
        self._end = max(self._end, len(text))
        return self._send(text, max(self.sent_chars, self._safe(text)), len(p.tokens))

    def finish(self, seq: SampledSequence) -> tuple[str, int, int, Rendered]:
        """The whole sequence is in -> (the rest of its text, its tokens [lo, hi), the final rendering)."""
        final = render(self.tokenizer, seq, self.stop or None)
        sent = self.partial.text
        if not final.text.startswith(sent):  # a tokenizer whose decode rewrites earlier text: say so, loudly
            raise RuntimeError(f"streamed text {sent!r} is not a prefix of the answer {final.text!r}")
        return final.text[self.sent_chars :], self.sent_tokens, len(final.tokens), final

    def _safe(self, text: str) -> int:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:  # the sampler stops here; render cuts at the first one
            return min(hits)
        end = len(text.rstrip("\ufffd"))  # a character still missing bytes decodes as U+FFFD
        held = (k for s in self.stop for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k], 0, end))
        return end - max(held, default=0)

    def _send(self, text: str, upto: int, n_tokens: int) -> tuple[str, int, int]:
        delta = text[self.sent_chars : upto]
        self.partial.text += delta
        lo = self.sent_tokens
        while self.sent_tokens < n_tokens and self.partial.starts[self.sent_tokens] < upto:
            self.sent_tokens += 1
        self.sent_chars = upto
        return delta, lo, self.sent_tokens
