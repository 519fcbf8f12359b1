"""twinkle.cli: twinkle-kit's `CLI.from_args()` and its settings groups, for scripts that take their
settings from flags, the environment, a `.env` file and a YAML file (see `twinkle.cli.cli`)."""

from twinkle.cli.args import Args
from twinkle.cli.cli import CLI

__all__ = ["CLI", "Args"]
