"""twinkle.processor: encoded rows to model tensors (padding or padding-free packing)."""

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.processor.input_processor import INPUT_PROCESSORS, InputProcessor

__all__ = ["IGNORE_INDEX", "INPUT_PROCESSORS", "InputProcessor"]
