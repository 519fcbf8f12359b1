"""The conformance pairs over HTTP: the native client (`twinkle.client.model.TransformersModel`) and
the unmodified Tinker SDK, against a real server (uvicorn on a loopback port, as the serve tests run
it), compared with the local reference. Both start from the reference's initial adapter: Tinker draws
it from seed 42 exactly as MultiLoraModel does, and the native model loads Tinker's saved copy."""

from __future__ import annotations

import os

import conformance_sequence as sequence
import pytest
from conformance_matrix import compare

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("twinkle.serve")
    import torch

    import twinkle.serve as ts
    from twinkle.hub import TEST_MODEL

    torch.set_num_threads(2)
    srv = ts.initialize(
        mode="http",
        port=0,
        data_dir=tmp_path_factory.mktemp("serve"),
        config={"models": [{"name": TEST_MODEL}]},
        block=False,
        log_level="warning",
    ).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def key(server):
    return server.create_key("conformance")


@pytest.fixture(scope="module")
def tinker_client(server, key):
    tinker = pytest.importorskip("tinker")
    return tinker.ServiceClient(base_url=server.url, api_key=key)


def _new_tinker_model(service):
    from twinkle.hub import TEST_MODEL

    return service.create_lora_training_client(
        base_model=TEST_MODEL, rank=sequence.LORA["r"], seed=sequence.SEED, train_unembed=False
    ).result()


@pytest.fixture(scope="module")
def tinker_init(tinker_client):
    """The initial adapter as a server checkpoint (what the native model loads)."""
    return _new_tinker_model(tinker_client).save_state("init").result().path


def test_native_http_client(reference, server, key, tinker_init, tmp_path):
    from twinkle.client import TwinkleClient
    from twinkle.client.cli import main as cli
    from twinkle.client.model import TransformersModel as RemoteModel
    from twinkle.client.sampler import Sampler
    from twinkle.hub import TEST_MODEL

    client = TwinkleClient(server.url, key)

    def to_folder(path):
        out = tmp_path / path.rsplit("/", 1)[-1]
        assert cli(["--base-url", server.url, "--api-key", key, "download", path, "-o", str(out)]) == 0
        return str(out)

    def sample(engine, _folder):
        sampler = Sampler(model_id=TEST_MODEL, client=client)
        sampler.add_adapter_from_model("final", engine)
        prompts = [row["input_ids"][:6] for row in sequence.PROBE]
        outputs = sampler.sample(prompts, dict(sequence.SAMPLE), adapter_name="final").result()
        return [out.sequences[0].tokens for out in outputs]

    mode = sequence.Mode(
        make=lambda: RemoteModel(model_id=TEST_MODEL, client=client),
        init_path=tinker_init,
        checkpoint="ckpt",
        to_folder=to_folder,
        sample=sample,
    )
    record = sequence.run(mode)
    assert record.resumed["optimizer_steps"] == 2
    # the server answers resume with {'resumed', 'optimizer_steps'}, not the contract's data position
    compare("native HTTP client (twinkle-server)", record.__dict__, reference, skip=("resumed",))


def _datum(row, scale):
    """A Tinker cross-entropy datum whose weighted sum is the row's share of the micro-batch mean."""
    from tinker import types

    ids, labels = row["input_ids"], row["labels"]
    weights = [scale if label != -100 else 0.0 for label in labels[1:]]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}
    )


def _micro_batch(rows, gas):
    tokens = sum(1 for row in rows for label in row["labels"][1:] if label != -100)
    return [_datum(row, 1.0 / (tokens * gas)) for row in rows]


def _tinker_train(tc, batches, record, first_step):
    from tinker import types

    total = sequence.MICRO_BATCHES // sequence.GAS
    for i, batch in enumerate(batches):
        out = tc.forward_backward(_micro_batch(batch, sequence.GAS), "cross_entropy").result()
        record.losses.append(out.metrics["loss:sum"] * sequence.GAS)  # weights carried 1/GAS
        if (i + 1) % sequence.GAS == 0:
            step = first_step + (i + 1) // sequence.GAS - 1
            lr = sequence.OPTIMIZER["lr"] * sequence.lr_factor(step, total)
            result = tc.optim_step(
                types.AdamParams(
                    learning_rate=lr,
                    beta1=0.9,
                    beta2=0.999,
                    eps=1e-8,
                    weight_decay=0.0,
                    grad_clip_norm=sequence.MAX_GRAD_NORM,
                )
            ).result()
            record.grad_norms.append(result.metrics["grad_norm:mean"])


def test_tinker_sdk(reference, tinker_client):
    """The subset the SDK exposes: forward_backward + optim_step (accumulating until the step),
    forward log-probs, save_state / resume with optimizer, sampling. It has no scheduler (the lr is
    given each step), no metrics call and no data position."""
    from tinker import types

    record = sequence.Record()
    batches = sequence.micro_batches()
    half = sequence.STEPS_BEFORE_SAVE * sequence.GAS
    tc = _new_tinker_model(tinker_client)
    _tinker_train(tc, batches[:half], record, first_step=0)
    out = tc.forward(_micro_batch(sequence.PROBE, 1), "cross_entropy").result()
    for row, lps in zip(sequence.PROBE, out.loss_fn_outputs):
        lps = lps["logprobs"].to_numpy().tolist()
        record.logprobs.append([0.0] + [lp if label != -100 else 0.0 for lp, label in zip(lps, row["labels"][1:])])
    path = tc.save_state("mid").result().path
    resumed = tinker_client.create_training_client_from_state_with_optimizer(path).result()
    _tinker_train(resumed, batches[half:], record, first_step=sequence.STEPS_BEFORE_SAVE)
    sampler = resumed.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(
        max_tokens=sequence.SAMPLE["max_tokens"], temperature=0.0, seed=sequence.SAMPLE["seed"]
    )
    for row in sequence.PROBE:
        result = sampler.sample(types.ModelInput.from_ints(row["input_ids"][:6]), 1, params).result()
        record.samples.append(list(result.sequences[0].tokens))
    compare(
        "Tinker SDK (twinkle-server)", record.__dict__, reference, skip=("lrs", "metric_loss", "resumed", "weights")
    )
