"""twinkle-kit's OWN scripts, not ours: its 0.5.1 sdist (pip download from PyPI, at test time) carries no cookbook/,
only a README whose two Python snippets ("Train with Ray" and the Tinker-compatible API) are what a user
copies first. Each runs here with the same documented rewrite as the suite's scripts and trains.
Opt-in (`TWINKLE_KIT_SDIST=1`): it downloads from PyPI."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile

import kit_runner
import pytest
from kit_checks import AdapterJudge, server_checkpoint
from kit_scripts import SCRIPTS

from twinkle.hub import TEST_MODEL

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("TWINKLE_KIT_SDIST"), reason="opt-in: TWINKLE_KIT_SDIST=1 downloads twinkle-kit"
    ),
]
SNIPPETS = {"Train with Ray": "readme_ray", "Access the Serverless Training Services": "tinker_readme"}


@pytest.fixture(scope="module")
def readme(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("sdist")
    pip = [sys.executable, "-m", "pip"] if importlib.util.find_spec("pip") else [shutil.which("pip") or "pip"]
    subprocess.run([*pip, "download", "--no-deps", "--no-binary", ":all:", "twinkle-kit==0.5.1", "-d", str(folder)],
                   check=True, capture_output=True)  # fmt: skip
    (archive,) = folder.glob("twinkle_kit-0.5.1.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        assert not [n for n in names if "/cookbook/" in n], "the sdist now carries cookbook/: run those scripts too"
        return tar.extractfile("twinkle_kit-0.5.1/README.md").read().decode()


def snippet(readme: str, heading: str) -> str:
    section = readme[readme.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("heading", sorted(SNIPPETS))
def test_readme_snippet_runs_and_trains(heading, readme, request, tmp_path):
    script = next(s for s in SCRIPTS if s.name == SNIPPETS[heading])  # ours follows it: the same rewrite
    env = request.getfixturevalue("kit_env") if script.server else None
    out = kit_runner.run(script, tmp_path, TEST_MODEL, env, source=snippet(readme, heading))
    assert out.status == "runs", out.output[-6000:]
    where, name = script.trains.split(":", 1)
    folder = (
        tmp_path / name
        if where == "local"
        else server_checkpoint(env["TWINKLE_SERVER_URL"], env["TWINKLE_SERVER_TOKEN"], name, tmp_path / "dl")
    )
    judge = AdapterJudge()
    tuned, base = judge.losses(folder, judge.rows(script.names))
    assert tuned < base
