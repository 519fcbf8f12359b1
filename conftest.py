"""Warnings are errors in the test folders listed here, member by member as each suite is made clean,
so a deprecation reaches us before it reaches a user's log. A third-party warning we cannot act on is
let through by its message, with why.

The marker goes on those folders' tests only, so a session collecting several members' suites
(`nox -s all_members`) keeps each member's own policy.
"""

from pathlib import Path

import pytest

ROOT = Path(__file__).parent
STRICT_FOLDERS = [ROOT / "packages" / member / "tests" for member in ("twinkle-mesh", "twinkle-client")]
WARNINGS_ARE_ERRORS = pytest.mark.filterwarnings(
    "error",
    # peft's get_peft_model reads transformers' is_gradient_checkpointing, renamed in transformers 5
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.path.is_relative_to(folder) for folder in STRICT_FOLDERS):
            item.add_marker(WARNINGS_ARE_ERRORS)
