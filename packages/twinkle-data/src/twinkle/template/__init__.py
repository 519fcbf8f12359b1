"""twinkle.template: chat templates to training rows and sampling prompts."""

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.template.qwen3_5 import Qwen3_5Template
from twinkle.template.template import TEMPLATES, TRUNCATION_STRATEGIES, Template

__all__ = ["IGNORE_INDEX", "TEMPLATES", "TRUNCATION_STRATEGIES", "Qwen3_5Template", "Template"]
