"""twinkle.preprocessor: raw rows to the standard format (Preprocessor) and row selection (Filter)."""

from twinkle.preprocessor.base import FILTERS, PREPROCESSORS, Filter, Preprocessor, producers_of
from twinkle.preprocessor.chat import AlpacaProcessor, MessagesProcessor, SelfCognitionProcessor
from twinkle.preprocessor.filters import DedupFilter, EmptyFilter, LengthFilter
from twinkle.preprocessor.preference import EmojiDPOProcessor, PreferenceProcessor
from twinkle.preprocessor.rl import ArithmeticProcessor, CountdownProcessor, GSM8KProcessor, gsm8k_final_answer

# twinkle-kit's names, registered here as well as by entry point (a fresh checkout finds them before a reinstall)
for _cls in (CountdownProcessor, EmojiDPOProcessor):
    PREPROCESSORS.register(_cls)

__all__ = [
    "FILTERS",
    "PREPROCESSORS",
    "AlpacaProcessor",
    "ArithmeticProcessor",
    "CountdownProcessor",
    "DedupFilter",
    "EmojiDPOProcessor",
    "EmptyFilter",
    "Filter",
    "GSM8KProcessor",
    "LengthFilter",
    "MessagesProcessor",
    "PreferenceProcessor",
    "Preprocessor",
    "SelfCognitionProcessor",
    "gsm8k_final_answer",
    "producers_of",
]
