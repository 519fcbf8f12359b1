"""Fixtures and the end-of-session summary for the reliability suite (helpers live in harness.py).

The suite runs with --import-mode=importlib, which puts no test folder on sys.path: this one is
added so the test modules can share `harness`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from harness import launch, pytest_terminal_summary  # noqa: F401 - a fixture and a hook, used by pytest
