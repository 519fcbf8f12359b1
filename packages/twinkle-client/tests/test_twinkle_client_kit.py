"""twinkle-kit's client import path without a server: the names exist, the settings twinkle-kit reads are
read, what cannot be honoured is refused by name, and the Tinker helper builds the SDK's own Datum."""

from __future__ import annotations

import pytest


def test_init_tinker_client_reads_twinkle_kit_variables_and_patches_nothing(monkeypatch):
    from twinkle_client import init_tinker_client

    for name in ("TINKER_BASE_URL", "TINKER_API_KEY", "TWINKLE_BASE_URL", "TWINKLE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TWINKLE_SERVER_URL", raising=False)
    monkeypatch.delenv("TWINKLE_SERVER_TOKEN", raising=False)
    assert init_tinker_client() == {}  # nothing given, nothing set: the SDK's own settings stand
    monkeypatch.setenv("TWINKLE_SERVER_URL", "http://h:9/")
    monkeypatch.setenv("TWINKLE_SERVER_TOKEN", "tml-kit")
    assert init_tinker_client() == {"TINKER_BASE_URL": "http://h:9", "TINKER_API_KEY": "tml-kit"}
    monkeypatch.setenv("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN")
    with pytest.raises(ValueError, match="tml-"):
        init_tinker_client()


def test_init_twinkle_client_takes_twinkle_kit_env_names(monkeypatch):
    from twinkle_client import TwinkleClient, init_twinkle_client

    from twinkle.client import get_client

    monkeypatch.setenv("TWINKLE_SERVER_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("TWINKLE_SERVER_TOKEN", "tml-kit")
    client = init_twinkle_client()
    assert isinstance(client, TwinkleClient) and get_client() is client and client.base_url == "http://127.0.0.1:9"
    with pytest.raises(ValueError, match="session_heartbeat_interval must be a positive int"):
        init_twinkle_client(session_heartbeat_interval=0)


def test_sampling_params_map_or_are_refused_by_name():
    from twinkle_client.sampler import _params

    assert _params({"max_tokens": 8, "temperature": 0.5, "logprobs": 1, "top_p": 0.9}, 4) == {
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "num_samples": 4,
    }
    with pytest.raises(NotImplementedError, match="logprobs=5"):
        _params({"logprobs": 5}, None)
    with pytest.raises(NotImplementedError, match="'repetition_penalty'"):
        _params({"repetition_penalty": 1.1}, None)
    with pytest.raises(ValueError, match=r"unknown sampling_params \['beam'\]"):
        _params({"beam": 2}, None)


def test_the_base_model_reference_stands_for_log_probs_kept_on_the_server():
    from twinkle_client.inputs import BASE_MODEL_REFERENCE, with_loss_inputs
    from twinkle_client.types import ModelResult

    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]
    assert with_loss_inputs(rows, ref_outputs=ModelResult(result=BASE_MODEL_REFERENCE)) is rows
    with pytest.raises(KeyError, match="stay on the server"):
        BASE_MODEL_REFERENCE["logprobs"]


def test_loss_inputs_merge_locally_with_twinkle_data_and_name_it_without():
    from twinkle_client.inputs import with_loss_inputs

    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]
    try:
        import twinkle.data_format  # noqa: F401  (the `local-encoding` extra)
    except ImportError:  # twinkle-client alone: the error says what to install
        with pytest.raises(ImportError, match=r"pip install 'twinkle-client\[local-encoding\]'"):
            with_loss_inputs(rows, advantages=[0.5])
        return
    assert with_loss_inputs(rows, advantages=[0.5])[0]["advantages"] == 0.5


def test_input_feature_to_datum_shifts_as_the_tinker_sdk_defines_targets():
    pytest.importorskip("tinker")
    from twinkle.server.common import input_feature_to_datum

    datum = input_feature_to_datum({"input_ids": [7, 8, 9, 10], "labels": [-100, -100, 9, 10]})
    assert datum.model_input.to_ints() == [7, 8, 9]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [0, 9, 10]
    assert datum.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="3 labels for 4 input_ids"):
        input_feature_to_datum({"input_ids": [7, 8, 9, 10], "labels": [1, 2, 3]})


class _Recorder:
    """Stands in for TwinkleClient: keeps what a proxy posts, answers a future's reference."""

    def __init__(self):
        self.posted: list[tuple[str, dict]] = []

    def post(self, path: str, body: dict, seq: int | None = None) -> dict:
        self.posted.append((path, body))
        return {"request_id": f"r{len(self.posted)}", "model_id": "m"}


def test_task_travels_with_the_rows_and_a_reference_embedding_is_refused_by_name():
    from twinkle_client.model import MultiLoraTransformersModel

    from twinkle.client.model import TransformersModel

    recorder = _Recorder()
    proxy = TransformersModel.attach("m", client=recorder)
    rows = [{"input_ids": [5, 6, 7], "labels": [1], "attention_mask": [1, 1, 1]}, {"input_ids": [5, 8], "labels": [0]}]
    proxy.forward_backward(rows, task="embedding")
    proxy.forward_only(rows)
    (path, body), (_, plain) = recorder.posted
    assert path == "/models/m/forward_backward" and body["task"] == "embedding" and plain["task"] == "causal_lm"
    assert [(r["input_ids"], r["labels"]) for r in body["inputs"]["rows"]] == [([5, 6, 7], [1]), ([5, 8], [0])]
    kit = MultiLoraTransformersModel.__new__(MultiLoraTransformersModel)  # no server: only the refusal is asked
    with pytest.raises(NotImplementedError, match=r"disable_lora=True, task='embedding'"):
        kit.forward_only(rows, disable_lora=True, task="embedding")
