"""Every loss against an independent, loop-by-token reference computation: value and gradient."""

import math

import pytest
import torch

from twinkle.loss import LOSSES, ChunkedHead, LossContext, create_loss

B, T, V, K = 4, 5, 11, 3


def _lp(logits_V, token):
    """log softmax at one index, written out by hand."""
    m = max(logits_V.tolist())
    return logits_V[token] - (m + torch.log(sum(torch.exp(x - m) for x in logits_V)))


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :2] = -100
    targets[3, 4] = -100
    fields = {
        "advantages": torch.randn(B, T, generator=g, dtype=torch.float64),
        "logprobs": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        "ref_logprobs": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        "weights": torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.5,
        "teacher_topk_ids": torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * T)]).view(B, T, K),
        "teacher_topk_logprobs": -torch.rand(B, T, K, generator=g, dtype=torch.float64) * 4,
        # stable_reinforce: which targets were sampled (the rest are prompt), and the cookbook's turn mask
        "sampled_mask": (torch.rand(B, T, generator=g) < 0.7).double(),
        "mask": (torch.rand(B, T, generator=g) < 0.9).double(),
    }
    return logits, targets, fields


def _tokens(targets):
    return [(b, t) for b in range(B) for t in range(T) if targets[b, t] != -100]


def _mean(terms):
    return sum(terms) / len(terms)


def ref_ce(lg, y, f):
    return _mean([-f["weights"][b, t] * _lp(lg[b, t], y[b, t]) for b, t in _tokens(y)])


def ref_is(lg, y, f):
    return _mean(
        [-torch.exp(_lp(lg[b, t], y[b, t]) - f["logprobs"][b, t]) * f["advantages"][b, t] for b, t in _tokens(y)]
    )


def _ppo_term(r, a, lo, hi):
    clipped = min(max(r.item(), lo), hi)
    return -torch.min(r * a, torch.where(torch.tensor(True), r * 0 + clipped, r) * a)


def ref_ppo(lg, y, f, lo=0.8, hi=1.2):
    out = []
    for b, t in _tokens(y):
        r = torch.exp(_lp(lg[b, t], y[b, t]) - f["logprobs"][b, t])
        a = f["advantages"][b, t]
        clipped_r = r.clamp(lo, hi)  # gradient flows through the clamp exactly like the PPO objective
        out.append(-torch.min(r * a, clipped_r * a))
    return _mean(out)


def ref_cispo(lg, y, f, lo=0.8, hi=1.2):
    out = []
    for b, t in _tokens(y):
        lp = _lp(lg[b, t], y[b, t])
        w = float(min(max(math.exp(lp.item() - f["logprobs"][b, t].item()), lo), hi))
        out.append(-w * f["advantages"][b, t] * lp)
    return _mean(out)


def ref_dro(lg, y, f, beta=0.05):
    out = []
    for b, t in _tokens(y):
        lp = _lp(lg[b, t], y[b, t])
        out.append(-(lp * f["advantages"][b, t] - 0.5 * beta * (lp - f["logprobs"][b, t]) ** 2))
    return _mean(out)


def ref_gspo(lg, y, f, lo=0.8, hi=1.2):
    out = []
    for b in range(B):
        toks = [t for t in range(T) if y[b, t] != -100]
        lps = [_lp(lg[b, t], y[b, t]) for t in toks]
        s = math.exp(sum(lp.item() - f["logprobs"][b, t].item() for lp, t in zip(lps, toks)) / len(toks))
        for lp, t in zip(lps, toks):
            st = s * torch.exp(lp - lp.detach())
            a = f["advantages"][b, t]
            out.append(-torch.min(st * a, st.clamp(lo, hi) * a))
    return _mean(out)


def ref_grpo(lg, y, f, el=0.2, eh=0.28, beta=0.04, c=0.01):
    out = []
    for b, t in _tokens(y):
        lp = _lp(lg[b, t], y[b, t])
        r = torch.exp(lp - f["logprobs"][b, t])
        a = f["advantages"][b, t]
        d = f["ref_logprobs"][b, t] - lp
        probs = torch.softmax(lg[b, t], -1)
        ent = -(probs * torch.log(probs)).sum()
        out.append(-torch.min(r * a, r.clamp(1 - el, 1 + eh) * a) + beta * (torch.exp(d) - d - 1) - c * ent)
    return _mean(out)


def _seq(lg, y, b, ref=None):
    toks = [t for t in range(T) if y[b, t] != -100]
    if ref is not None:
        return sum(ref[b, t] for t in toks)
    return sum(_lp(lg[b, t], y[b, t]) for t in toks)


def ref_dpo(lg, y, f, beta=0.1, kind="sigmoid", ls=0.0):
    out = []
    for k in range(B // 2):
        c, r = 2 * k, 2 * k + 1
        h = (_seq(lg, y, c) - _seq(lg, y, c, f["ref_logprobs"])) - (_seq(lg, y, r) - _seq(lg, y, r, f["ref_logprobs"]))
        if kind == "sigmoid":
            out.append(
                -(1 - ls) * torch.log(1 / (1 + torch.exp(-beta * h))) - ls * torch.log(1 / (1 + torch.exp(beta * h)))
            )
        elif kind == "ipo":
            out.append((h - 1 / (2 * beta)) ** 2)
        else:
            out.append(torch.clamp(1 - beta * h, min=0))
    return _mean(out)


def ref_simpo(lg, y, f, beta=2.0, gamma=0.5):
    out = []
    for k in range(B // 2):
        c, r = 2 * k, 2 * k + 1
        n_c = sum(1 for t in range(T) if y[c, t] != -100)
        n_r = sum(1 for t in range(T) if y[r, t] != -100)
        z = beta * (_seq(lg, y, c) / n_c - _seq(lg, y, r) / n_r) - gamma
        out.append(torch.log(1 + torch.exp(-z)))
    return _mean(out)


def ref_gkd(lg, y, f, beta=0.5, tau=1.0):
    out = []
    for b, t in _tokens(y):
        ids = f["teacher_topk_ids"][b, t]
        s_raw = torch.stack([_lp(lg[b, t], i) for i in ids]) / tau
        p = torch.exp(f["teacher_topk_logprobs"][b, t] / tau)
        p = p / p.sum()
        q = torch.exp(s_raw) / torch.exp(s_raw).sum()
        if beta == 0:
            out.append((p * torch.log(p / q)).sum())
        elif beta == 1:
            out.append((q * torch.log(q / p)).sum())
        else:
            m = beta * p + (1 - beta) * q
            out.append(beta * (p * torch.log(p / m)).sum() + (1 - beta) * (q * torch.log(q / m)).sum())
    return _mean(out)


def ref_stable(lg, y, f, cap=2.0):
    """Truncated IS: value -s·m·min(r, C)·A, gradient -s·m·min(r, C)·A·dlogp, averaged over s·m."""
    out = []
    for b, t in _tokens(y):
        s = f["sampled_mask"][b, t] * f["mask"][b, t]
        if s == 0:
            continue
        lp = _lp(lg[b, t], y[b, t])
        r = math.exp(lp.item() - f["logprobs"][b, t].item())
        w = min(r, cap)
        # the value is w·A; the gradient of w·(lp - sg(lp)) + w is w·dlp
        out.append(-s * f["advantages"][b, t] * w * (1 + lp - lp.detach()))
    return _mean(out)


CASES = [
    ("CrossEntropyLoss", {}, ref_ce),
    ("importance_sampling", {}, ref_is),
    ("ppo", {}, ref_ppo),
    ("PPOLoss", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, lambda *a: ref_ppo(*a, lo=0.9, hi=1.05)),
    ("cispo", {}, ref_cispo),
    ("dro", {"beta": 0.3}, lambda *a: ref_dro(*a, beta=0.3)),
    ("gspo", {}, ref_gspo),
    ("GRPOLoss", {"beta": 0.04, "entropy_coef": 0.01}, ref_grpo),
    ("dpo", {"beta": 0.1}, ref_dpo),
    ("dpo", {"beta": 0.2, "label_smoothing": 0.1}, lambda *a: ref_dpo(*a, beta=0.2, ls=0.1)),
    ("dpo", {"beta": 0.5, "loss_type": "ipo"}, lambda *a: ref_dpo(*a, beta=0.5, kind="ipo")),
    ("dpo", {"beta": 0.5, "loss_type": "hinge"}, lambda *a: ref_dpo(*a, beta=0.5, kind="hinge")),
    ("SimPOLoss", {}, ref_simpo),
    ("gkd", {}, ref_gkd),
    ("gkd", {"beta": 0.0, "temperature": 2.0}, lambda *a: ref_gkd(*a, beta=0.0, tau=2.0)),
    ("gkd", {"beta": 1.0}, lambda *a: ref_gkd(*a, beta=1.0)),
    ("stable_reinforce", {}, ref_stable),
    ("StableReinforceLoss", {"ratio_cap": 1.1}, lambda *a: ref_stable(*a, cap=1.1)),
]


@pytest.mark.parametrize("name,kwargs,reference", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_loss_matches_reference_value_and_gradient(name, kwargs, reference):
    logits, targets, fields = _setup()
    # the advantage of a PPO-type test must exercise both clip branches: scale log-ratios into range
    fields["logprobs"] = (
        torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        + torch.randn(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.3
    )
    ours_logits = logits.clone().requires_grad_(True)
    loss = create_loss(name, **kwargs)(LossContext.from_logits(ours_logits, targets, **fields)).loss
    loss.backward()

    ref_logits = logits.clone().requires_grad_(True)
    expected = reference(ref_logits, targets, fields)
    expected.backward()

    torch.testing.assert_close(loss.double(), expected.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_logits.grad, ref_logits.grad, rtol=1e-4, atol=1e-6)
    assert ours_logits.grad.abs().sum() > 0


def test_sum_reduction_is_mean_times_token_count():
    logits, targets, fields = _setup(3)
    ctx = LossContext.from_logits(logits, targets, **fields)
    n_tokens = (targets != -100).sum()
    mean = create_loss("ppo")(ctx).loss
    total = create_loss("ppo", reduction="sum")(ctx).loss
    torch.testing.assert_close(total, mean * n_tokens)


def test_chunked_head_equals_full_logits_for_every_quantity():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, T, 8, generator=g, requires_grad=True)
    weight = torch.randn(V, 8, generator=g, requires_grad=True)
    _, targets, fields = _setup()
    for name, kw in [("ce", {}), ("grpo", {"beta": 0.1, "entropy_coef": 0.1}), ("gkd", {})]:
        full = create_loss(name, **kw)(LossContext.from_logits(hidden @ weight.T, targets, **fields)).loss
        grads_full = torch.autograd.grad(full, [hidden, weight])
        chunk_ctx = LossContext(ChunkedHead(hidden, weight, chunk_size=3), targets, fields)
        chunked = create_loss(name, **kw)(chunk_ctx).loss
        grads_chunked = torch.autograd.grad(chunked, [hidden, weight])
        torch.testing.assert_close(chunked, full)
        for a, b in zip(grads_chunked, grads_full):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.no_float
def test_unknown_loss_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="NoSuchLoss") as err:
        create_loss("NoSuchLoss")
    for name in ("CrossEntropyLoss", "GRPOLoss", "DPOLoss", "GKDLoss", "SimPOLoss", "GSPOLoss"):
        assert name in str(err.value)


@pytest.mark.no_float
def test_missing_input_field_names_it():
    logits, targets, _ = _setup()
    with pytest.raises(ValueError, match="advantages"):
        create_loss("ppo")(LossContext.from_logits(logits, targets))


@pytest.mark.no_float
def test_dpo_without_reference_explains_where_it_comes_from():
    logits, targets, _ = _setup()
    with pytest.raises(ValueError, match="adapter disabled"):
        create_loss("dpo")(LossContext.from_logits(logits, targets))


@pytest.mark.no_float
def test_entry_points_declare_every_builtin_loss():
    from importlib.metadata import entry_points

    declared = {ep.name for ep in entry_points(group="twinkle.loss")}
    builtins = {cls.__name__ for cls in set(LOSSES._classes.values())}
    assert builtins <= declared, builtins - declared


def test_stable_reinforce_truncates_both_branches_and_drops_prompt_positions():
    """With a cap of 1.1 some tokens are above it (weight C, not r) and some below (weight r); prompt
    positions (sampled_mask 0) get no gradient at all, whatever their advantage."""
    logits, targets, fields = _setup(7)
    fields["logprobs"] = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    fields["logprobs"] = fields["logprobs"] + torch.linspace(-1, 1, B * T, dtype=torch.float64).view(B, T)
    fields["mask"] = torch.ones(B, T, dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    out = create_loss("stable_reinforce", ratio_cap=1.1)(LossContext.from_logits(x, targets, **fields))
    out.loss.backward()
    assert 0 < out.metrics["truncated_fraction"] < 1
    prompt = (fields["sampled_mask"] == 0) & (targets != -100)
    assert prompt.any() and x.grad[prompt].abs().max() == 0
    assert x.grad[(fields["sampled_mask"] == 1) & (targets != -100)].abs().sum() > 0


def test_stable_reinforce_on_policy_is_reinforce():
    """At r = 1 the loss is -Σ A (summed) and its gradient is REINFORCE's, -A·dlogp."""
    logits, targets, fields = _setup(8)
    fields.update(sampled_mask=torch.ones(B, T, dtype=torch.float64), mask=torch.ones(B, T, dtype=torch.float64))
    fields["logprobs"] = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    a = logits.clone().requires_grad_(True)
    loss = create_loss("stable_reinforce", reduction="sum")(LossContext.from_logits(a, targets, **fields)).loss
    loss.backward()
    m = (targets != -100).double()
    torch.testing.assert_close(loss.double(), -(fields["advantages"] * m).sum(), rtol=1e-5, atol=1e-6)
    b = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(b, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    (-(fields["advantages"] * m * lp).sum()).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.no_float
def test_stable_reinforce_refuses_a_cap_below_one():
    with pytest.raises(ValueError, match="ratio_cap must be >= 1"):
        create_loss("stable_reinforce", ratio_cap=0.5)
