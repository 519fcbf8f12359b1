"""`get_logger()`: the `twinkle` logger a training script prints its progress with.

INFO and above go to stderr with a timestamp; under torchrun (or any launcher that sets LOCAL_RANK)
only the local rank 0 prints unless `only_local_master=False`, so eight ranks do not print every line
eight times. `LOG_LEVEL` (an env var, as twinkle-kit reads it) sets the level when none is given.
"""

from __future__ import annotations

import logging
import os

LOGGER_NAME = "twinkle"
_FORMAT = "[%(levelname)s:%(name)s] %(asctime)s %(message)s"


def _level(value: int | str | None) -> int:
    if value is None:
        value = os.environ.get("LOG_LEVEL", "INFO")
    if isinstance(value, int):
        return value
    level = logging.getLevelNamesMapping().get(value.upper())
    if level is None:
        raise ValueError(f"unknown log level {value!r}; expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def get_logger(
    log_file: str | None = None,
    log_level: int | str | None = None,
    file_mode: str = "w",
    only_local_master: bool = True,
) -> logging.Logger:
    """The `twinkle` logger with a stderr handler (and a file handler when `log_file` is given)."""
    logger = logging.getLogger(LOGGER_NAME)
    level = _level(log_level)
    quiet = only_local_master and int(os.environ.get("LOCAL_RANK", "0")) != 0
    logger.setLevel(logging.ERROR if quiet else level)
    logger.propagate = False
    formatter = logging.Formatter(_FORMAT)
    if not any(type(h) is logging.StreamHandler for h in logger.handlers):
        stream = logging.StreamHandler()
        stream.setFormatter(formatter)
        logger.addHandler(stream)
    if log_file is not None and not quiet:
        path = os.path.abspath(log_file)
        if not any(getattr(h, "baseFilename", None) == path for h in logger.handlers):
            handler = logging.FileHandler(path, mode=file_mode)
            handler.setFormatter(formatter)
            logger.addHandler(handler)
    return logger
