"""Warnings are errors in the test folders listed here, member by member as each suite is made clean,
so a deprecation reaches us before it reaches a user's log. A third-party warning we cannot act on is
let through by its message, with why.

The marker goes on those folders' tests only, so a session collecting several members' suites
(`nox -s all_members`) keeps each member's own policy.
"""

import functools
import re
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


# Sessions that run two pytest-xdist workers (`-n 2 --dist loadgroup`, noxfile.py) send each group of tests
# to one worker. A file's tests stay together, so its module-scoped servers, launches and engines start
# once (and tests that build on an earlier test's state find it); every test that may start Ray shares one
# worker, since two Ray clusters booting at once on two cores miss Ray's node-startup deadline (seen
# 2026-12-03). The groups are made here rather than with xdist_group marks: pytest 9 ignores the node-id
# suffix by which xdist 3.8 reads those marks.
RAY_WORD = re.compile(r"(?<![A-Za-z])[Rr]ay(?![A-Za-z])")


@functools.cache
def _mentions_ray(path: Path) -> bool:
    return path.is_file() and bool(RAY_WORD.search(path.read_text(errors="replace")))


def worker_group(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    return "ray" if RAY_WORD.search(name) or _mentions_ray(ROOT / path) else path


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # an xdist hook: absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return Groups(config, log)
