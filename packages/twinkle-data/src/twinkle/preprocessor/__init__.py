"""twinkle.preprocessor: raw rows to the standard format (Preprocessor) and row selection (Filter)."""

from twinkle.preprocessor.base import FILTERS, PREPROCESSORS, Filter, Preprocessor, producers_of
from twinkle.preprocessor.chat import AlpacaProcessor, MessagesProcessor, SelfCognitionProcessor
from twinkle.preprocessor.filters import DedupFilter, EmptyFilter, LengthFilter
from twinkle.preprocessor.preference import PreferenceProcessor
from twinkle.preprocessor.rl import ArithmeticProcessor, GSM8KProcessor, gsm8k_final_answer

__all__ = [
    "FILTERS",
    "PREPROCESSORS",
    "AlpacaProcessor",
    "ArithmeticProcessor",
    "DedupFilter",
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
