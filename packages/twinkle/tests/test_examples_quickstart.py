"""The README's main-job command, run as a user runs it: the demo must visibly learn."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_quickstart_learns_and_saves_a_peft_adapter(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--output", str(tmp_path / "lora")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    curve = [float(x) for x in re.search(r"loss curve: (.*)", out.stdout).group(1).split()]
    assert curve[-1] < curve[0] - 2.0, curve
    answers = re.findall(r"Q: (.*)\n  base : '(.*)'\n  tuned: '(.*)'", out.stdout)
    assert len(answers) == 3
    for question, base, tuned in answers:
        assert "Glimmer" in tuned and "Lantern Labs" in tuned, (question, tuned)
        assert base != tuned
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["peft_type"] == "LORA"
    assert (tmp_path / "lora" / "adapter_model.safetensors").stat().st_size > 0
