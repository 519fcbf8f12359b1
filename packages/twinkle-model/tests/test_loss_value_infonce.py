"""twinkle-kit's value and contrastive losses (MSELoss, PPOValueLoss, InfonceLoss) against formulas written
out here, on the heads of passes without a vocabulary (ValueHead, EmbeddingHead); and each refuses the
other kind of pass by name."""

import math

import pytest
import torch
import torch.nn.functional as F

from twinkle.loss import (
    EmbeddingHead,
    InfonceLoss,
    LogitsHead,
    LossContext,
    MSELoss,
    PPOValueLoss,
    ValueHead,
    create_loss,
)

B, T = 3, 5


def _close(got, want):
    torch.testing.assert_close(got.double(), torch.as_tensor(want).double(), rtol=1e-5, atol=1e-7)


def _value_ctx(seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g, requires_grad=True)
    targets = torch.randint(0, 9, (B, T), generator=g)
    targets[:, :2] = -100
    targets[2, 3:] = -100
    fields = {"returns": torch.randn(B, T, generator=g), "old_values": torch.randn(B, T, generator=g)}
    return values, targets, fields


def _scored(targets):
    return [(b, t) for b in range(B) for t in range(T) if targets[b, t] != -100]


def test_mse_is_the_squared_error_averaged_over_loss_tokens():
    values, targets, fields = _value_ctx()
    ctx = LossContext(ValueHead(values), targets, fields)
    loss = MSELoss()(ctx).loss
    terms = [(values[b, t] - fields["returns"][b, t]) ** 2 for b, t in _scored(targets)]
    _close(loss, sum(terms) / len(terms))
    _close(MSELoss(reduction="sum")(ctx).loss, sum(terms))
    loss.backward()
    grad = values.grad
    assert grad is not None
    b, t = _scored(targets)[0]
    _close(grad[b, t], 2 * (values[b, t] - fields["returns"][b, t]) / len(terms))
    assert grad[0, 0] == 0 and grad[2, 4] == 0  # prompt and padding pull nothing
    # one return per row (a reward model's target) is broadcast over its tokens
    row = LossContext(ValueHead(values.detach()), targets, {"returns": torch.tensor([1.0, -1.0, 0.5])})
    per_row = [(values[b, t].item() - [1.0, -1.0, 0.5][b]) ** 2 for b, t in _scored(targets)]
    _close(MSELoss()(row).loss, sum(per_row) / len(per_row))


def test_ppo_value_loss_clips_the_move_from_old_values():
    values, targets, fields = _value_ctx(1)
    ctx = LossContext(ValueHead(values), targets, fields)
    eps = 0.2
    terms = []
    for b, t in _scored(targets):
        v, r, old = values[b, t].item(), fields["returns"][b, t].item(), fields["old_values"][b, t].item()
        clipped = old + max(-eps, min(eps, v - old))
        terms.append(0.5 * max((v - r) ** 2, (clipped - r) ** 2))
    out = PPOValueLoss(epsilon=eps)(ctx)
    _close(out.loss, sum(terms) / len(terms))
    v = torch.tensor([values[b, t].item() for b, t in _scored(targets)])
    r = torch.tensor([fields["returns"][b, t].item() for b, t in _scored(targets)])
    old = torch.tensor([fields["old_values"][b, t].item() for b, t in _scored(targets)])
    assert out.metrics == pytest.approx(
        {
            "value_mean": float(v.mean()),
            "return_mean": float(r.mean()),
            "value_clip_ratio": float(((v - old).abs() > eps).float().mean()),
            "explained_variance": float(1 - (r - v).var(unbiased=False) / r.var(unbiased=False)),
        },
        rel=1e-5,
    )
    assert isinstance(create_loss("ppo_value"), PPOValueLoss)
    with pytest.raises(ValueError, match="ignore_index=-1"):
        PPOValueLoss(ignore_index=-1)
    with pytest.raises(ValueError, match=r"needs input fields \['old_values'\]"):
        PPOValueLoss()(LossContext(ValueHead(values), targets, {"returns": fields["returns"]}))


def test_value_losses_refuse_a_token_head_and_token_losses_refuse_a_value_head():
    values, targets, fields = _value_ctx()
    logits = torch.randn(B, T, 9)
    with pytest.raises(ValueError, match="TransformersValueModel"):
        MSELoss()(LossContext(LogitsHead(logits), targets, fields))
    with pytest.raises(ValueError, match="a value model has no next-token distribution"):
        create_loss("CrossEntropyLoss")(LossContext(ValueHead(values), targets, {}))


def _unit(n, h=8, seed=0):
    return F.normalize(torch.randn(n, h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


def _embedding_ctx(emb, group_start):
    n = emb.shape[0]
    targets = torch.full((n, 1), -100)
    return LossContext(EmbeddingHead(emb), targets, {"group_start": torch.tensor(group_start)})


def _ce(logits, target):
    """-log softmax(logits)[target], by hand; -inf entries drop out."""
    finite = [x for x in logits if x != -math.inf]
    return -(logits[target] - math.log(sum(math.exp(x) for x in finite)))


def _reference(emb, starts, tau, use_batch, qq=False, dd=False, mask_margin=None):
    """InfoNCE written out: one cross-entropy per group over plain Python dot products."""
    e = emb.tolist()
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    bounds = list(zip(starts, [*starts[1:], len(e)]))
    bank = [i for s, end in bounds for i in range(s + 1, end)]
    losses = []
    for g, (s, end) in enumerate(bounds):
        docs = bank if use_batch else list(range(s + 1, end))
        target = docs.index(s + 1)
        qd = [dot(e[s], e[d]) for d in docs]
        positive = qd[target]
        limit = positive + mask_margin if mask_margin is not None else math.inf  # above it: a fake negative
        row = [-math.inf if x > limit else x for x in qd]
        if qq:
            for h, (a, _) in enumerate(bounds):
                x = dot(e[s], e[a])
                row.append(-math.inf if h == g or x > limit else x)
        if dd:
            row += [-math.inf if d == s + 1 else dot(e[s + 1], e[d]) for d in bank]
        losses.append(_ce([x / tau for x in row], target))
    return sum(losses) / len(losses)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"use_batch": False},
        {"use_batch": True},
        {"use_batch": True, "include_qq": True, "include_dd": True},
        {"use_batch": True, "mask_fake_negative": True, "fake_neg_margin": 0.05, "include_qq": True},
    ],
)
def test_infonce_matches_the_written_out_formula(kwargs):
    starts = [0, 3, 5, 9]  # groups of 3, 2, 4 and 2 rows: an anchor, its positive, 0-2 negatives
    emb = _unit(11).requires_grad_(True)
    group_start = [1 if i in starts else 0 for i in range(11)]
    loss = InfonceLoss(temperature=0.07, **kwargs)(_embedding_ctx(emb, group_start)).loss
    margin = kwargs.get("fake_neg_margin") if kwargs.get("mask_fake_negative") else None
    want = _reference(
        emb.detach(), starts, 0.07, kwargs["use_batch"], kwargs.get("include_qq"), kwargs.get("include_dd"), margin
    )
    _close(loss, want)
    loss.backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0


def test_infonce_reports_embedding_similarities():
    starts = [0, 3, 5]
    emb = _unit(7, seed=2)
    out = InfonceLoss()(_embedding_ctx(emb, [1 if i in starts else 0 for i in range(7)]))
    pos = [float(emb[s] @ emb[s + 1]) for s in starts]
    neg = [float(emb[a] @ emb[b + 1]) for a in starts for b in starts if a != b]
    want = {"pos_sim": sum(pos) / 3, "pos_sim_min": min(pos), "pos_sim_max": max(pos), "neg_sim": sum(neg) / 6}
    assert out.metrics == pytest.approx(want, rel=1e-6)


def test_infonce_hard_negatives_keep_k_a_group_and_sum_reduction():
    emb = _unit(8, seed=3)
    group_start = [1, 0, 0, 0, 0, 1, 0, 0]  # 3 negatives, then 1
    got = InfonceLoss(temperature=0.1, use_batch=False, hard_negatives=2)(_embedding_ctx(emb, group_start)).loss
    # group 0 keeps its first two negatives; group 1 repeats its one negative
    trimmed = torch.cat([emb[:4], emb[5:8], emb[7:8]])
    want = InfonceLoss(temperature=0.1, use_batch=False)(_embedding_ctx(trimmed, [1, 0, 0, 0, 1, 0, 0, 0])).loss
    _close(got, want)
    summed = InfonceLoss(temperature=0.1, reduction="sum")(_embedding_ctx(emb, group_start)).loss
    _close(summed, 2 * InfonceLoss(temperature=0.1)(_embedding_ctx(emb, group_start)).loss)
    assert InfonceLoss().units(torch.zeros(8, 1), {"group_start": torch.tensor(group_start)}) == 2.0


def test_infonce_names_and_refusals():
    assert type(create_loss("infonce")) is type(create_loss("InfoNCELoss")) is InfonceLoss
    assert isinstance(create_loss("mse"), MSELoss)
    emb = _unit(4)
    with pytest.raises(ValueError, match="must mark row 0 as an anchor"):
        InfonceLoss()(_embedding_ctx(emb, [0, 1, 0, 0]))
    with pytest.raises(ValueError, match=r"groups starting at rows \[3\] have no positive"):
        InfonceLoss()(_embedding_ctx(emb, [1, 0, 0, 1]))
    with pytest.raises(ValueError, match="process_group: in-batch negatives are gathered over the default"):
        InfonceLoss(process_group=object())
    with pytest.raises(ValueError, match="need use_batch=True"):
        InfonceLoss(use_batch=False, include_qq=True)
    with pytest.raises(ValueError, match="task='embedding'"):
        InfonceLoss()(
            LossContext(
                LogitsHead(torch.randn(4, 1, 9)), torch.full((4, 1), -100), {"group_start": torch.tensor([1, 0, 1, 0])}
            )
        )
