"""Errors raised for bad input data; each message names what is wrong and where."""


class DataError(ValueError):
    """Bad input data: a malformed file line, a missing column, an unusable row."""


class SequenceTooLongError(DataError):
    """An encoded sequence is longer than ``max_length`` under ``truncation_strategy='raise'``."""
