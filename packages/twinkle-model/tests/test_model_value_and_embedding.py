"""TransformersValueModel (a scalar value head, trained in full or beside a LoRA) and task='embedding'
(InfonceLoss over pooled hidden states) on the embedded tiny Qwen3: real gradients, shapes, checkpoints
bit-exact, embeddings equal to the model's own last hidden states."""

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.loss import InfonceLoss, LossContext
from twinkle.loss.pass_heads import EmbeddingHead
from twinkle.model import MODELS, TransformersModel, TransformersValueModel

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
# two prompts with completions; `returns` on the completion positions (labels != -100)
ROWS = [
    {"input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, -100, -100, 8, 9, 10], "returns": [0, 0, 0, 1.0, 0.5, 0.25]},
    {"input_ids": [11, 12, 13, 14], "labels": [-100, -100, 13, 14], "returns": [0, 0, -1.0, -0.5]},
]


def _value_model(lora: bool, lr: float):
    torch.manual_seed(0)
    model = TransformersValueModel(model_id=TEST_MODEL)
    if lora:
        model.add_adapter_to_model("critic", LORA)
    model.set_loss("MSELoss")
    model.set_optimizer("AdamW", lr=lr)
    return model


@pytest.mark.parametrize("lora", [False, True])
def test_a_value_step_lowers_mse_on_fixed_returns_and_checkpoints_load_bit_exact(lora, tmp_path):
    model = _value_model(lora, lr=3e-3)
    first = model.forward_only(ROWS)
    # the head starts at zero: every value 0, the loss the mean squared return over 5 completion tokens
    assert first["values"] == [[0.0] * 6, [0.0] * 4]
    assert first["loss"] == pytest.approx((1 + 0.25 + 0.0625 + 1 + 0.25) / 5, rel=1e-6)
    losses = []
    for _ in range(4):
        losses.append(model.forward_backward(ROWS)["loss"])
        model.clip_grad_and_step()
    after = model.forward_only(ROWS)
    assert losses[0] == pytest.approx(first["loss"], rel=1e-6)
    assert after["loss"] < 0.7 * first["loss"]
    # the value head itself moved (it is trained, in full or as the adapter's own copy)
    head = model.hf_model.get_output_embeddings()
    weight = head.modules_to_save["critic"].weight if lora else head.weight
    assert weight.abs().sum() > 0
    saved = model.save(tmp_path / "critic")
    fresh = TransformersValueModel(model_id=TEST_MODEL)
    fresh.load(saved)
    assert fresh.forward_only(ROWS)["values"] == after["values"]  # bit-exact


def test_values_are_per_token_and_aligned_with_labels():
    model = _value_model(lora=False, lr=1e-2)
    model.forward_backward(ROWS)
    model.clip_grad_and_step()
    out = model.forward_only(ROWS)
    assert [len(v) for v in out["values"]] == [6, 4]
    # position t holds V of the prefix before token t: the head applied to hidden state t-1
    batch = torch.tensor([ROWS[0]["input_ids"]])
    with torch.no_grad():
        hidden = model.hf_model.model(input_ids=batch).last_hidden_state
        direct = model.hf_model.get_output_embeddings()(hidden)[0, :, 0]
    torch.testing.assert_close(torch.tensor(out["values"][0][1:]), direct[:-1], rtol=1e-5, atol=1e-6)
    # twinkle-kit's critic keywords: per completion token (or one number a row) onto the label positions
    bare = [{k: r[k] for k in ("input_ids", "labels")} for r in ROWS]
    model.set_loss("PPOValueLoss", epsilon=0.1)
    model.add_metric("PPOValueMetric", epsilon=0.1)
    by_rows = model.forward_only([{**r, "old_values": 0.0} for r in ROWS])["loss"]
    keyword = model.forward_backward(bare, returns=[[1.0, 0.5, 0.25], [-1.0, -0.5]], old_values=[0.0, 0.0])["loss"]
    assert keyword == pytest.approx(by_rows, rel=1e-6)
    critic = model.calculate_metric(is_training=True)
    assert critic["train/return_mean"] == pytest.approx((1.0 + 0.5 + 0.25 - 1.0 - 0.5) / 5, rel=1e-6)
    assert {"train/value_mean", "train/value_clip_ratio", "train/explained_variance"} <= set(critic)
    with pytest.raises(ValueError, match="3 values but 2 completion tokens"):
        model.forward_backward(bare, returns=[[1.0, 0.5, 0.25], [1.0, 2.0, 3.0]], old_values=[0.0, 0.0])
    with pytest.raises(ValueError, match=r"already carry \['returns'\]"):
        model.forward_backward(ROWS, returns=[0.0, 0.0], old_values=[0.0, 0.0])
    model.zero_grad()
    ctx = model.forward(ROWS, _grad=False)
    assert ctx.head.values().shape == ctx.targets_B_T.shape == (2, 5)
    with pytest.raises(ValueError, match="no reference pass"):
        model.forward_only(ROWS, disable_lora=True)
    with pytest.raises(ValueError, match="task='causal_lm' only"):
        model.forward_backward(
            [{"input_ids": [1, 2], "labels": [1]}, {"input_ids": [1, 3], "labels": [0]}], task="embedding"
        )


PAIRS = [  # twinkle-kit's embedding rows: one label, 1 on each anchor
    {"input_ids": [21, 22, 23, 24], "labels": [1]},
    {"input_ids": [21, 22, 25], "labels": [0]},
    {"input_ids": [31, 32], "labels": [1]},
    {"input_ids": [31, 33, 34, 35, 36], "labels": [0]},
    {"input_ids": [41, 42, 43], "labels": [1]},
    {"input_ids": [44, 42, 43], "labels": [0]},
]


def _own_embeddings(model):
    """The model's last hidden state at each row's last token, each row alone (no padding)."""
    out = []
    with torch.no_grad():
        for row in PAIRS:
            hidden = model.hf_model.model(input_ids=torch.tensor([row["input_ids"]])).last_hidden_state
            out.append(F.normalize(hidden[0, -1], dim=-1))
    return torch.stack(out)


def test_embedding_task_pools_the_last_token_and_infonce_trains():
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("emb", LORA)
    model.set_loss("InfonceLoss", temperature=0.5)
    model.set_optimizer("AdamW", lr=1e-2)
    model.add_metric("EmbeddingMetric", is_training=True)
    first = model.forward_only(PAIRS, task="embedding")
    embeddings = first["embeddings"]
    assert embeddings.shape == (6, model.hf_model.config.hidden_size)
    # padded rows pool their own last token: the same as each row run alone
    with model.peft_model.disable_adapter():
        alone = _own_embeddings(model)
    torch.testing.assert_close(embeddings, alone.float(), rtol=1e-5, atol=1e-6)
    ctx = LossContext(EmbeddingHead(embeddings), torch.full((6, 1), -100), {"group_start": torch.tensor([1, 0] * 3)})
    assert first["loss"] == pytest.approx(float(InfonceLoss(temperature=0.5)(ctx).loss), rel=1e-5)
    losses = []
    for _ in range(3):
        losses.append(model.forward_backward(PAIRS, task="embedding")["loss"])
        model.clip_grad_and_step()
    assert losses[0] == pytest.approx(first["loss"], rel=1e-5)
    assert model.forward_only(PAIRS, task="embedding")["loss"] < 0.8 * first["loss"]
    metrics = model.calculate_metric(is_training=True)
    assert metrics["pos_sim_min"] <= metrics["pos_sim"] <= metrics["pos_sim_max"] <= 1.0 + 1e-6
    assert {"loss", "neg_sim", "grad_norm"} <= set(metrics)


def test_embedding_rows_are_checked_and_names_resolve():
    model = TransformersModel(model_id=TEST_MODEL)
    model.set_loss("InfonceLoss")
    with pytest.raises(ValueError, match="embedding row 0: its `labels` must be one number"):
        model.forward_backward([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}], task="embedding")
    with pytest.raises(ValueError, match="task='embedding'"):
        model.forward_backward([{"input_ids": [1, 2], "labels": [-100, 2], "group_start": 1}] * 2)
    with pytest.raises(NotImplementedError, match="task='fused_lm_ce' is not offered"):
        model.forward_only(PAIRS, task="fused_lm_ce")
    assert MODELS.get("TransformersValueModel") is TransformersValueModel
