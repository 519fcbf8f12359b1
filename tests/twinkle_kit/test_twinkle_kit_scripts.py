"""twinkle-kit's user scripts (ours, written in its public API style: scripts/) run on our Twinkle with
only the documented rewrite (kit_rewrite.py): each runs, leaves what it saves, trains (its adapter's
loss below the base model's), and does what docs/twinkle-kit-compat.md records."""

from __future__ import annotations

import re
from pathlib import Path

import kit_runner
import kit_table
import pytest
from kit_checks import AdapterJudge, server_checkpoint
from kit_rewrite import RewriteError, rewrite
from kit_scripts import SCRIPTS

from twinkle.hub import TEST_MODEL

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recorded() -> dict[str, str]:
    return kit_table.read((ROOT / "docs" / "twinkle-kit-compat.md").read_text())


@pytest.fixture(scope="module")
def judge():
    return AdapterJudge()


# Two scripts start local Ray clusters (readme_ray, usage_embedding); two booting at once on a loaded machine
# miss Ray's node-startup deadline. This file names Ray, so the root conftest.py's scheduler keeps all its
# tests on one worker (xdist_group marks are ignored under pytest 9).
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_runs_trains_and_saves(script, recorded, request, tmp_path):
    env = request.getfixturevalue("kit_env") if script.server else None
    out = kit_runner.run(script, tmp_path, TEST_MODEL, env)
    if out.status == "needs":
        pytest.skip(out.detail)
    assert out.status == "runs", out.output[-6000:]
    assert recorded.get(script.follows) == "runs", f"docs/twinkle-kit-compat.md records {script.follows!r} otherwise"
    for folder in script.saves:
        assert (tmp_path / folder / "adapter_model.safetensors").is_file(), f"{folder} was not saved"
    if script.trains:
        where, name = script.trains.split(":", 1)
        folder = (
            tmp_path / name if where == "local" else server_checkpoint(**_server(env), name=name, into=tmp_path / "dl")
        )
        judge = request.getfixturevalue("judge")
        tuned, base = judge.losses(folder, judge.rows(script.names))
        assert tuned < base, f"the saved adapter did not learn: loss {tuned:.4f} vs the base model's {base:.4f}"
    for name in script.server_saves:
        folder = server_checkpoint(**_server(env), name=name, into=tmp_path / "saved" / name)
        assert (folder / "adapter_model.safetensors").is_file(), f"the server's {name!r} holds no adapter"
    for pattern in script.learns:
        _assert_learns(pattern, out.output)


def _assert_learns(pattern: str, output: str) -> None:
    """The values `pattern` finds in the output, one per step, move the way its group's name says."""
    found = list(re.finditer(pattern, output))
    assert len(found) >= 2, f"{pattern!r}: fewer than 2 steps logged"
    way = "down" if "down" in found[0].groupdict() else "up"
    first, last = float(found[0][way]), float(found[-1][way])
    assert (last < first) if way == "down" else (last > first), f"{pattern!r} did not go {way}: {first} -> {last}"


def _server(env: dict) -> dict:
    return {"url": env["TWINKLE_SERVER_URL"], "key": env["TWINKLE_SERVER_TOKEN"]}


def test_the_rewrite_substitutes_only_what_it_documents():
    source = (
        "m = 'ms://Qwen/Qwen3.5-4B'\nd = DatasetMeta('ms://swift/self-cognition')\nout = 'output/fsdp2'\n"
        "g = DeviceGroup(name='a', ranks=8, device_type='GPU')\nb = base_model[len('ms://'):]\n"
        "f = f'ms://{base_model}'\nc = init(base_url='http://localhost:8000', api_key='')\n"
    )
    out = rewrite(source, [("ranks=8", "ranks=2")], model="twinkle://qwen3-tiny")
    assert out == (
        "m = 'twinkle://qwen3-tiny'\nd = DatasetMeta('twinkle://self-cognition')\nout = 'output/fsdp2'\n"
        "g = DeviceGroup(name='a', ranks=2, device_type='cpu')\nb = base_model\n"
        "f = base_model\nc = init(base_url=__import__('os').environ['TWINKLE_SERVER_URL'], "
        "api_key=__import__('os').environ['TWINKLE_SERVER_TOKEN'])\n"
    )
    with pytest.raises(RewriteError, match="'ranks=4' does not occur"):
        rewrite(source, [("ranks=4", "ranks=2")])
    tokenizer = rewrite("t = AutoTokenizer.from_pretrained(MODEL_ID, trust_remote_code=True)\n")
    assert (
        "AutoTokenizer.from_pretrained(twinkle.hub.resolve_model_path(MODEL_ID), trust_remote_code=True)" in tokenizer
    )


def test_the_table_lists_every_covered_script(recorded):
    assert {s.follows for s in SCRIPTS} <= set(recorded), "run `uv run python scripts/twinkle_kit_compat.py`"
