"""`twinkle-server keys create NAME --operator`: a key that also opens the operator page; `keys list`
marks it, and plain keys stay tenant keys."""

from __future__ import annotations

import subprocess
import sys

from twinkle.serve.core.store import Store
from twinkle.serve.keys import KeyStore

CLI = [sys.executable, "-m", "twinkle_server.cli", "keys"]


def test_cli_creates_operator_keys(tmp_path):
    made = subprocess.run(
        [*CLI, "create", "ops", "--operator", "--data-dir", str(tmp_path)], capture_output=True, text=True
    )
    assert made.returncode == 0 and made.stdout.startswith("tml-")
    subprocess.run([*CLI, "create", "team", "--data-dir", str(tmp_path)], check=True, capture_output=True)
    listed = subprocess.run([*CLI, "list", "--data-dir", str(tmp_path)], capture_output=True, text=True).stdout
    assert "ops\tactive" in listed and listed.split("ops\t")[1].split("\n")[0].endswith("\toperator")
    assert "operator" not in listed.split("team\t")[1].split("\n")[0]
    store = Store(tmp_path)
    assert KeyStore(store).is_operator(made.stdout.strip())
    store.close()
