"""The HTTP proxy implements the same TwinkleModel contract as the in-process engines (it lives in
twinkle-client, which cannot depend on twinkle-model, so the check runs here with every member)."""

import pytest

from twinkle.client import model as client_model
from twinkle.model.base import contract_mismatches


@pytest.mark.no_float
def test_the_http_proxy_has_the_contract_signatures():
    assert contract_mismatches(client_model.TransformersModel) == []
    assert client_model.MultiLoraModel is client_model.TransformersModel  # the server's engine is multi-LoRA


@pytest.mark.no_float
def test_the_http_proxy_refuses_what_cannot_cross_http_by_name():
    proxy = object.__new__(client_model.TransformersModel)  # refusals need no connection
    with pytest.raises(NotImplementedError, match="cannot return an autograd graph: use forward_only"):
        proxy.forward([])
    with pytest.raises(NotImplementedError, match="cannot back-propagate a local loss: use forward_backward"):
        proxy.backward(None)
    with pytest.raises(NotImplementedError, match="cannot take save\\(data_position=...\\)"):
        proxy.save("ckpt", data_position=3)
