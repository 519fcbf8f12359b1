"""One short smoke run of examples/grpo.py on the test model: every phase of both loop shapes runs."""

import importlib.util
import json
from pathlib import Path

import pytest

from twinkle.hub import TEST_MODEL

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("overlap", [True])
def test_grpo_example_runs_overlapped_with_metrics_and_plot(tmp_path, capsys, overlap):
    grpo = load("grpo")
    plot = tmp_path / "curve.png"
    summary = grpo.main(["--model", TEST_MODEL, "--warm-start-steps", "0", "--steps", "3", "--prompts", "2",
                         "--group", "3", "--max-tokens", "3", "--eval-prompts", "4", "--eval-every", "2",
                         "--is-stats", "--plot", str(plot)] + (["--overlap"] if overlap else []))
    out = capsys.readouterr().out
    assert summary["steps"] == 3 and summary["samples_per_step"] == 6 and summary["overlap"] is overlap
    assert 0.0 <= summary["accuracy_start"] <= 1.0 and 0.0 <= summary["accuracy_end"] <= 1.0
    assert json.loads(out.strip().splitlines()[-1]) == summary
    assert "step 3: reward" in out and "kl" in out and "held-out reward curve:   0:" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
