"""The Tinker SDK compatibility table (docs/tinker.md) (written by scripts/tinker_compat.py) stays true: it lists
every public method and CLI subcommand of the installed SDK, and every entry it records as working still
works against a real server (the same calls, re-run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from twinkle.hub import TEST_MODEL

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import tinker_compat  # noqa: E402

TENANT = "compat-table"


@pytest.fixture(scope="module")
def recorded() -> dict[str, str]:
    return tinker_compat.read_table((ROOT / "docs" / "tinker.md").read_text())


def test_the_table_covers_the_installed_sdk(recorded):
    current = set(tinker_compat.sdk_methods()) | set(tinker_compat.sdk_options())
    current |= {f"cli: {c}" for c in tinker_compat.cli_commands()}
    assert set(recorded) == current, (
        "the SDK and docs/tinker.md's table differ: run `uv run python scripts/tinker_compat.py`"
        f" (missing {sorted(current - set(recorded))}, "
        f"gone {sorted(set(recorded) - current)})"
    )


def test_every_entry_recorded_as_working_still_works(server, tenant_key, recorded):
    works = {name for name, status in recorded.items() if status == "works"}
    assert len(works) > 50
    rows = tinker_compat.survey(server.url, tenant_key, TEST_MODEL, only=works)
    assert {r.name.removesuffix(" (+ _async)") for r in rows} == works
    assert [(r.name, r.note) for r in rows if r.status != "works"] == []


def test_the_table_reader_reads_each_status():
    """A row that stopped working reads as its new status, so the check above would see it."""
    text = f"{tinker_compat.BEGIN}\n| `A.b (+ _async)` | works |  |\n| `A.c` | refused | 404: no |\n{tinker_compat.END}"
    assert tinker_compat.read_table(text) == {"A.b": "works", "A.c": "refused"}
