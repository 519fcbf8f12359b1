"""twinkle-kit's GRPO variants (BNPOLoss, DRGRPOLoss, SAPOLoss) against references written out token by
token here, value and gradient; their kit keywords; and their 'sequence' units composing over slices of a
batch as data ranks and micro-batches cut it. (Chunked head = whole logits: test_loss_chunked_head.py.)"""

import math

import pytest
import torch

from twinkle.loss import BNPOLoss, DRGRPOLoss, LossContext, SAPOLoss, create_loss

B, T, V = 3, 6, 7


def _close(got, want):
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-7)


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[:, :2] = -100  # prompt
    targets[1, 4:] = -100  # a shorter reply
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    fields = {
        # behaviour log-probs a little off the policy's: ratios on both sides of 1 and past the clip
        "logprobs": logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4,
        "advantages": torch.tensor([[0.0] * 2 + [1.5] * 4, [0.0] * 2 + [-0.7] * 4, [0.0] * 2 + [0.4] * 4]),
        "ref_logprobs": logp - torch.rand(B, T, generator=g, dtype=torch.float64),
    }
    fields["advantages"] = fields["advantages"].double()
    return logits, targets, fields


def _lp(row_V, token):
    return row_V[token] - torch.logsumexp(row_V, 0)


def _terms(lg, y, f, term, beta=0.0, c=0.0):
    """{row: [per-token term + β·KL − c·H]} over the loss tokens, one scalar at a time."""
    out = {}
    for b in range(B):
        for t in range(T):
            if y[b, t] == -100:
                continue
            lp = _lp(lg[b, t], y[b, t])
            r = torch.exp(lp - f["logprobs"][b, t])
            value = term(r, f["advantages"][b, t])
            d = f["ref_logprobs"][b, t] - lp
            p = torch.softmax(lg[b, t], 0)
            value = value + beta * (torch.exp(d) - d - 1) + c * (p * torch.log(p)).sum()
            out.setdefault(b, []).append(value)
    return out


def _clip_term(eps_lo, eps_hi):
    return lambda r, a: -torch.min(r * a, r.clamp(1 - eps_lo, 1 + eps_hi) * a)


def _sapo_term(tau_pos, tau_neg):
    def term(r, a):
        tau = tau_pos if a > 0 else tau_neg
        return -(4.0 / tau) / (1 + torch.exp(-tau * (r - 1))) * a

    return term


def ref_bnpo(lg, y, f, eps=0.2, eps_hi=None, beta=0.0, c=0.0):
    rows = _terms(lg, y, f, _clip_term(eps, eps if eps_hi is None else eps_hi), beta, c)
    tokens = [v for vs in rows.values() for v in vs]
    return sum(tokens) / len(tokens)


def ref_dr_grpo(lg, y, f, eps=0.2, beta=0.0, length=1024):
    rows = _terms(lg, y, f, _clip_term(eps, eps), beta)
    return sum(v for vs in rows.values() for v in vs) / (len(rows) * length)


def ref_sapo(lg, y, f, tau_pos=1.0, tau_neg=1.0, beta=0.0):
    rows = _terms(lg, y, f, _sapo_term(tau_pos, tau_neg), beta)
    return sum(sum(vs) / len(vs) for vs in rows.values()) / len(rows)


CASES = [
    ("BNPOLoss", {}, ref_bnpo),
    (
        "bnpo",
        {"epsilon": 0.1, "epsilon_high": 0.3, "beta": 0.05, "entropy_coef": 0.02},
        lambda *a: ref_bnpo(*a, 0.1, 0.3, 0.05, 0.02),
    ),
    ("DRGRPOLoss", {}, ref_dr_grpo),
    ("dr_grpo", {"max_completion_length": 8, "beta": 0.1}, lambda *a: ref_dr_grpo(*a, beta=0.1, length=8)),
    ("SAPOLoss", {}, ref_sapo),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 0.5, "beta": 0.05}, lambda *a: ref_sapo(*a, 2.0, 0.5, 0.05)),
]


@pytest.mark.parametrize("name,kwargs,reference", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_matches_the_reference_value_and_gradient(name, kwargs, reference):
    logits, targets, fields = _setup()
    ours = logits.clone().requires_grad_(True)
    ctx = LossContext.from_logits(ours, targets, **{k: v for k, v in fields.items() if k != "ref_logprobs"})
    ctx.ref_logps_B_T = fields["ref_logprobs"]  # as the engine computes it (adapter off)
    loss = create_loss(name, **kwargs)(ctx).loss
    loss.backward()
    theirs = logits.clone().requires_grad_(True)
    expected = reference(theirs, targets, fields)
    expected.backward()
    # the engine's log-probs are fp32: relative tolerance (the gradient's as a whole, not per element)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)
    assert (ours.grad - theirs.grad).norm() <= 1e-5 * theirs.grad.norm()
    assert ours.grad.abs().sum() > 0


def test_the_three_differ_only_in_what_they_say():
    """BNPO averages tokens, DR-GRPO divides the sum by B·L, SAPO averages row means: on this batch (rows
    of 4, 2 and 4 loss tokens) the three clipped-or-gated sums come apart as those formulas say."""
    logits, targets, fields = _setup(1)
    fields["logprobs"] = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ctx = LossContext.from_logits(logits, targets, **fields)  # on policy: r = 1, no clip, gate 2/τ
    a = fields["advantages"][:, 2]  # one advantage per row
    n = torch.tensor([4.0, 2.0, 4.0], dtype=torch.float64)
    _close(BNPOLoss()(ctx).loss, -(a * n).sum() / n.sum())
    _close(DRGRPOLoss(max_completion_length=10)(ctx).loss, -(a * n).sum() / (3 * 10))
    _close(SAPOLoss()(ctx).loss, -2.0 * a.mean())


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    """g_τ'(1) = 1: at r = 1 SAPO's gradient is −A·∇log p (per-row means), whatever τ."""
    logits, targets, fields = _setup(2)
    fields["logprobs"] = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    x = logits.clone().requires_grad_(True)
    SAPOLoss(tau_pos=3.0, tau_neg=0.25)(LossContext.from_logits(x, targets, **fields)).loss.backward()
    y = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(y, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    mask = (targets != -100).double()
    (-((fields["advantages"] * logp * mask).sum(1) / mask.sum(1)).mean()).backward()
    assert (x.grad - y.grad).norm() <= 1e-5 * y.grad.norm()


@pytest.mark.parametrize("name", ["DRGRPOLoss", "SAPOLoss", "BNPOLoss"])
def test_mean_over_slices_weighted_by_units_is_the_whole_batch(name):
    """What data ranks and micro-batches rely on: each slice's mean times its units, summed, over the
    whole batch's units, is the whole batch's mean (a row without loss tokens counts for none)."""
    logits, targets, fields = _setup(3)
    targets[2, :] = -100  # a row with nothing to score
    loss = create_loss(name)
    whole = loss(LossContext.from_logits(logits, targets, **fields)).loss
    parts, units = [], []
    for rows in (slice(0, 1), slice(1, 3)):
        sliced = {k: v[rows] for k, v in fields.items()}
        parts.append(loss(LossContext.from_logits(logits[rows], targets[rows], **sliced)).loss)
        units.append(loss.units(targets[rows], sliced))
    assert units == ([1.0, 1.0] if loss.unit == "sequence" else [4.0, 2.0])
    _close(sum(p * u for p, u in zip(parts, units)) / sum(units), whole)


def test_sum_reduction_drops_only_the_final_division():
    logits, targets, fields = _setup(4)
    ctx = LossContext.from_logits(logits, targets, **fields)
    _close(SAPOLoss(reduction="sum")(ctx).loss, SAPOLoss()(ctx).loss * 3)
    _close(
        DRGRPOLoss(max_completion_length=5, reduction="sum")(ctx).loss,
        DRGRPOLoss(max_completion_length=5)(ctx).loss * 3,
    )


def test_kit_keywords_and_refusals():
    bnpo = BNPOLoss(epsilon=0.15)
    assert (bnpo.epsilon_low, bnpo.epsilon_high) == (0.15, 0.15)  # twinkle-kit: symmetric unless epsilon_high
    assert BNPOLoss(epsilon=0.1, epsilon_high=0.4).epsilon_high == 0.4
    sapo = SAPOLoss(epsilon=0.2, beta=0.01, tau_pos=1.0, tau_neg=1.05, epsilon_high=0.3, entropy_coef=0.1)
    assert (sapo.tau_neg, sapo.beta, sapo.entropy_coef) == (1.05, 0.01, 0.1)
    assert DRGRPOLoss(max_completion_length=256).needs_reference({}) is False
    assert DRGRPOLoss(beta=0.1).needs_reference({}) is True
    # twinkle-kit's docs write clip_range= and tau=, which its classes swallow unread: ours name them
    with pytest.raises(TypeError, match="clip_range"):
        SAPOLoss(clip_range=0.2)
    with pytest.raises(TypeError, match="tau"):
        create_loss("sapo", tau=1.0)
    with pytest.raises(ValueError, match="temperatures must be positive"):
        SAPOLoss(tau_neg=0.0)
    with pytest.raises(ValueError, match="max_completion_length must be positive"):
        DRGRPOLoss(max_completion_length=0)
    with pytest.raises(TypeError, match="max_completion_length must be an int"):
        DRGRPOLoss(max_completion_length=math.inf)
    with pytest.raises(ValueError, match="advantages"):
        create_loss("dr_grpo")(LossContext.from_logits(*_setup()[:2]))
