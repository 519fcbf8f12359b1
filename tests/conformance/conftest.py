"""Shared by the conformance pairs: the initial adapter and the reference run; the matrix is printed
after the session and written as markdown to $CONFORMANCE_MATRIX when that is set."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import conformance_sequence as sequence
from conformance_matrix import MATRIX, local_mode, markdown


@pytest.fixture(scope="session")
def init_folder(tmp_path_factory):
    import torch

    torch.set_num_threads(2)
    return sequence.save_initial_adapter(str(tmp_path_factory.mktemp("init") / "adapter"))


@pytest.fixture(scope="session")
def reference(init_folder, tmp_path_factory):
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    mode = local_mode(lambda: TransformersModel(model_id=TEST_MODEL), init_folder, tmp_path_factory.mktemp("ref"))
    return dataclasses.asdict(sequence.run(mode))


@pytest.fixture(scope="session")
def ray_group():
    """A real local Ray cluster (2 CPUs) with a 2-rank DeviceGroup 'model', shared by every Ray
    test; yields the data-parallel mesh over it."""
    pytest.importorskip("ray")
    import torch

    import twinkle.mesh as tm
    from twinkle.mesh import runtime as rt_module

    torch.set_num_threads(1)
    rt_module._RUNTIME = None
    tm.initialize(mode="ray", groups=[tm.DeviceGroup("model", 2, "cpu")], seed=42, num_cpus=2)
    yield tm.DeviceMesh.from_sizes(dp_size=2)
    tm.shutdown()


def pytest_sessionfinish(session):
    """Under pytest-xdist (nox runs two workers) each worker holds the cells of the tests it ran: it
    hands them to the controller, whose terminal summary writes the matrices."""
    import arch_cells

    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["conformance"] = json.dumps({"matrix": MATRIX, "arch": arch_cells.ARCH})


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without it
def pytest_testnodedown(node):
    import arch_cells

    cells = json.loads(getattr(node, "workeroutput", {}).get("conformance", "{}"))
    MATRIX.update(cells.get("matrix", {}))
    for family, row in cells.get("arch", {}).items():
        arch_cells.ARCH.setdefault(family, {}).update(row)


def pytest_terminal_summary(terminalreporter):
    arch_matrix(terminalreporter)
    if not MATRIX:
        return
    text = markdown()
    terminalreporter.write_sep("=", "conformance matrix")
    terminalreporter.write(text)
    target = os.environ.get("CONFORMANCE_MATRIX")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(text)


def arch_matrix(terminalreporter):
    """test_architecture_matrix's family x cell table, to $CONFORMANCE_ARCH_MATRIX or the terminal."""
    import arch_cells

    if not arch_cells.ARCH:
        return
    text = arch_cells.markdown()
    target = os.environ.get("CONFORMANCE_ARCH_MATRIX")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(text)
        return
    terminalreporter.write_sep("=", "architecture matrix")
    terminalreporter.write(text)
