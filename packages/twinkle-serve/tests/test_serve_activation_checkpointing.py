"""Activation checkpointing in the server's multi-LoRA engine, when the operator asks for it
(`models[].activation_checkpointing`): two tenants trained through the unmodified SDK on such a server
equal the same requests on the default server, and the decoder really recomputes in backward."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.hub import TEST_MODEL

SEQS = [[3 + (5 * i + k) % 70 for i in range(n)] for k, n in enumerate((24, 15, 19))]


@pytest.fixture(scope="module")
def checkpointing_server(start, tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("serve-ckpt"), models=[{"name": TEST_MODEL, "activation_checkpointing": True}])
    yield srv
    srv.stop()


def _train(server, sft, tenant: str) -> dict:
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=server.url, api_key=server.create_key(tenant))
    runs = [client.create_lora_training_client(base_model=TEST_MODEL, rank=r, seed=5 + r).result() for r in (2, 4)]
    losses = []
    for _ in range(2):
        futures = [tc.forward_backward([sft(s) for s in SEQS[: 2 + i]], "cross_entropy") for i, tc in enumerate(runs)]
        steps = [tc.optim_step(types.AdamParams(learning_rate=2e-2)) for tc in runs]
        losses.append([f.result().metrics["loss:sum"] for f in futures])
        for s in steps:
            s.result()
    after = runs[0].forward([sft(s) for s in SEQS], "cross_entropy").result()
    client.close("success").result()  # its heartbeats would go on for the rest of the session's shared server
    return {"losses": losses, "logprobs": [o["logprobs"].to_numpy() for o in after.loss_fn_outputs]}


def test_checkpointed_server_trains_like_the_default_one_and_recomputes(server, checkpointing_server, sft):
    engine = checkpointing_server.runtime.engine(TEST_MODEL).backend.engine
    assert engine.activation_checkpointing and engine.checkpointer is not None
    assert not server.runtime.engine(TEST_MODEL).backend.engine.activation_checkpointing
    layers, before = len(engine.base.get_decoder().layers), engine.checkpointer.recomputes
    got, expected = _train(checkpointing_server, sft, "ckpt-a"), _train(server, sft, "ckpt-b")
    # at least one training pass a step, every decoder layer run again in its backward
    assert engine.checkpointer.recomputes - before >= 2 * layers
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
    for g, e in zip(got["logprobs"], expected["logprobs"], strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
