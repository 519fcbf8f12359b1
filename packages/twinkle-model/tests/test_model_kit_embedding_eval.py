"""twinkle-kit's embedding evaluation calls (cookbook sample/emb_sample.py) on TransformersModel:
forward_only(task='embedding', return_logits=True) gives a tensor of unit rows; rows that are anchors alone
get embeddings and no loss, whole groups their InfoNCE loss; data ranks' embedding tensors concatenate in
rank order; return_logits on a token pass is refused by name."""

from __future__ import annotations

import pytest
import torch

from twinkle.hub import TEST_MODEL

ANCHORS = [{"input_ids": ids, "labels": [1]} for ids in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
GROUPS = [
    {"input_ids": ids, "labels": [mark]} for ids, mark in (([5, 6, 7], 1), ([5, 9], 0), ([8, 9], 1), ([8, 12, 13], 0))
]


@pytest.fixture(scope="module")
def model():
    from twinkle.model import TransformersModel

    m = TransformersModel(model_id=TEST_MODEL)
    m.set_loss("InfonceLoss", temperature=0.5)
    return m


def test_anchors_alone_are_embedded_without_a_loss_and_groups_with_one(model):
    out = model.forward_only(inputs=ANCHORS, task="embedding", return_logits=True)
    emb = out["embeddings"]
    assert isinstance(emb, torch.Tensor) and emb.shape == (3, model.hf_model.config.hidden_size)
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3), rtol=1e-5, atol=1e-6)
    assert out["loss"] is None
    grouped = model.forward_only(inputs=GROUPS, task="embedding")
    assert grouped["loss"] is not None and grouped["loss"] > 0
    torch.testing.assert_close(grouped["embeddings"][0], emb[0], rtol=1e-5, atol=1e-6)


def test_return_logits_on_a_token_pass_is_refused_by_name(model):
    with pytest.raises(NotImplementedError, match=r"return_logits=True.*task='embedding'"):
        model.forward_only(inputs=[{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}], return_logits=True)


def test_ranks_embedding_rows_concatenate_in_rank_order():
    from twinkle.mesh.dispatch import collect_results

    a, b = torch.ones(2, 4), torch.zeros(1, 4)
    merged = collect_results("merge", [{"loss": 1.0, "embeddings": a}, {"loss": 3.0, "embeddings": b}])
    assert merged["loss"] == 2.0 and torch.equal(merged["embeddings"], torch.cat([a, b]))
