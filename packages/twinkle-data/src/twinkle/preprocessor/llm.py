"""twinkle-kit's `twinkle.preprocessor.llm` import path: the text preprocessors, ours."""

from twinkle.preprocessor.chat import AlpacaProcessor, SelfCognitionProcessor
from twinkle.preprocessor.rl import CountdownProcessor, GSM8KProcessor

__all__ = ["AlpacaProcessor", "CountdownProcessor", "GSM8KProcessor", "SelfCognitionProcessor"]
