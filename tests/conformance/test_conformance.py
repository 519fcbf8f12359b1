"""The conformance matrix: the script in `sequence.py` against every engine x mode, each compared
with the local TransformersModel run (fp32, twinkle://qwen3-tiny, the same initial adapter).

A pair passes when every number is within TOLERANCE of the reference and the greedy samples are
the same tokens; a pair that cannot run says so with its error message (it is listed as refused).
The matrix is printed at the end of the session and written as markdown (see conftest.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import conformance_dpo
import conformance_sequence as sequence
import pytest
import torch
from conformance_matrix import compare, local_mode, refuse

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def torchrun_launch(init_folder, tmp_path_factory):
    """Started first and left running (~1 min): it overlaps the in-process pairs."""
    out = tmp_path_factory.mktemp("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(out / "log.txt", "w")  # noqa: SIM115 - the child process writes to it after this returns
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(HERE / "torchrun_worker.py"),
            init_folder,
            str(out),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.close()


def test_transformers_local_is_the_reference(reference):
    assert len(reference["losses"]) == sequence.MICRO_BATCHES and len(reference["grad_norms"]) == 4
    assert reference["losses"][-1] < reference["losses"][0]  # it trains
    counters = {"data_position": 4, "optimizer_steps": 2, "micro_step": 0}
    kit = {"cur_step": 2, "consumed_train_samples": 0, "gradient_accumulation_steps": sequence.GAS}  # twinkle-kit's
    assert reference["resumed"] == {**counters, **kit}
    assert reference["lrs"][-1] == pytest.approx(0.0, abs=1e-12)  # the schedule reaches its end
    compare("TransformersModel · local", reference, reference)


def test_multi_lora_local(reference, init_folder, tmp_path):
    from twinkle.hub import TEST_MODEL
    from twinkle.model.multi_lora import MultiLoraModel

    record = sequence.run(local_mode(lambda: MultiLoraModel(TEST_MODEL), init_folder, tmp_path))
    compare("MultiLoraModel · local", dataclasses.asdict(record), reference)


@pytest.mark.parametrize("engine", ["TransformersModel", "MultiLoraModel"])
def test_chunked_head_local(reference, init_folder, tmp_path, engine):
    """Every pass through the chunked unembedding (a logits budget of one byte; issue 47): the same numbers."""
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel
    from twinkle.model.multi_lora import MultiLoraModel

    def make():
        model = TransformersModel(model_id=TEST_MODEL) if engine == "TransformersModel" else MultiLoraModel(TEST_MODEL)
        model.logits_budget_bytes = 1
        return model

    record = sequence.run(local_mode(make, init_folder, tmp_path))
    compare(f"{engine} · local, chunked head", dataclasses.asdict(record), reference)


@pytest.fixture(scope="module")
def torchrun_results(torchrun_launch):
    proc, out = torchrun_launch
    code = proc.wait(timeout=900)
    assert code == 0, (out / "log.txt").read_text()[-6000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in ("ddp", "fsdp2", "tp2", "multi_lora")}


@pytest.mark.parametrize(
    "name,pair",
    [
        ("ddp", "TransformersModel · torchrun DDP (2)"),
        ("fsdp2", "TransformersModel · torchrun FSDP2 (2)"),
        ("tp2", "TransformersModel · torchrun TP=2"),
        ("multi_lora", "MultiLoraModel · torchrun (2)"),
    ],
)
def test_torchrun(torchrun_results, reference, name, pair):
    result = torchrun_results[name]
    if "refused" in result:
        refuse(pair, result["refused"])
        pytest.skip(f"{pair} refused: {result['refused']}")
    compare(pair, result["record"], reference)


def test_ray_group(reference, init_folder, tmp_path, ray_group):
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    built = []

    def make():
        for old in built:
            old.remote_shutdown()  # one engine's actors at a time on the 2-CPU group
        built[:] = [TransformersModel(model_id=TEST_MODEL, device_mesh=ray_group, remote_group="model")]
        return built[0]

    record = sequence.run(local_mode(make, init_folder, tmp_path))
    built[0].remote_shutdown()
    compare("TransformersModel · Ray group (2 actors)", dataclasses.asdict(record), reference)


@pytest.fixture(scope="module")
def dpo_reference(init_folder, tmp_path_factory):
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    out = tmp_path_factory.mktemp("dpo")
    return conformance_dpo.run_library(TransformersModel(model_id=TEST_MODEL), init_folder, out)


def test_dpo_through_the_server_ray_group(dpo_reference, init_folder, tmp_path, ray_group):
    """The server's remote backend with its training model on the 2-actor group (data parallel): the same
    DPO numbers as one process (a mean over pairs, whichever rank holds the longer completions)."""
    from twinkle.hub import TEST_MODEL, resolve_model_path
    from twinkle.serve.backend.remote import RemoteBackend

    backend = RemoteBackend(TEST_MODEL, str(resolve_model_path(TEST_MODEL)), remote_group="model")
    try:
        record = conformance_dpo.run_backend(backend, init_folder, tmp_path)
    finally:
        backend.close()
    compare("DPO through the server's Ray group (2 actors)", record, dpo_reference, skip=("resumed", "samples"))


def _is_refusal(error: Exception) -> bool:
    """A clear refusal naming what to use instead, not a crash."""
    return (
        isinstance(error, NotImplementedError)
        or (isinstance(error, ImportError) and "megatron" in str(error))
        or (isinstance(error, RuntimeError) and "needs CUDA" in str(error))
    )


def test_megatron(reference, init_folder, tmp_path):
    """MegatronModel trains full parameters on CUDA: here (and for a LoRA script anywhere) it refuses."""
    from twinkle.hub import TEST_MODEL
    from twinkle.model.megatron.model import MegatronModel

    pair = "MegatronModel · " + ("CUDA" if torch.cuda.is_available() else "local CPU")
    try:
        record = sequence.run(local_mode(lambda: MegatronModel(TEST_MODEL), init_folder, tmp_path))
    except Exception as error:
        if not _is_refusal(error):
            raise
        refuse(pair, f"{type(error).__name__}: {error}")
        pytest.skip(f"{pair} refused: {error}")
    compare(pair, dataclasses.asdict(record), reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (gathered by the gpu session)")
def test_transformers_cuda(reference, init_folder, tmp_path):
    from twinkle.hub import TEST_MODEL
    from twinkle.model import TransformersModel

    record = sequence.run(
        local_mode(lambda: TransformersModel(model_id=TEST_MODEL, device="cuda"), init_folder, tmp_path)
    )
    compare("TransformersModel · CUDA", dataclasses.asdict(record), reference)
