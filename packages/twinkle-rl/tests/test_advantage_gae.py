"""GAEAdvantage (twinkle-kit's per-token GAE) against a hand-written backward loop, and its two limits:
λ = 1 is discounted returns minus values, λ = 0 the TD errors."""

import pytest
import torch

from twinkle.advantage import GAEAdvantage, create_advantage
from twinkle.reward import RewardResult

# two rows of 6 positions: a prompt (masked), a completion; row 1 has a masked tool output at 3
MASK = [[False, False, True, True, True, True], [False, True, True, False, True, False]]
REWARDS = [[0.0, 0.0, 0.1, -0.2, 0.0, 1.0], [0.0, 0.3, 0.0, 9.0, 2.0, 0.0]]
VALUES = [[0.5, 0.4, 0.3, 0.2, 0.6, 0.9], [0.1, 0.7, -0.4, 5.0, 0.8, 0.2]]


def reference(rewards, values, masks, gamma, lam):
    """Plain Python, one row at a time: the kept positions in order, a backward sweep over them."""
    adv = [[0.0] * len(r) for r in rewards]
    for b, (r, v, m) in enumerate(zip(rewards, values, masks)):
        kept = [t for t, keep in enumerate(m) if keep]
        running = 0.0
        for j in reversed(range(len(kept))):
            t = kept[j]
            next_value = v[kept[j + 1]] if j + 1 < len(kept) else 0.0
            running = r[t] + gamma * next_value - v[t] + gamma * lam * running
            adv[b][t] = running
    return adv


def discounted_return(r, kept, j, gamma):
    return sum(gamma ** (i - j) * r[kept[i]] for i in range(j, len(kept)))


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (0.7, 1.0)])
def test_gae_matches_the_reference_loop(gamma, lam):
    adv, returns = GAEAdvantage(gamma=gamma, gae_lambda=lam, normalize=False)(REWARDS, VALUES, masks=MASK)
    want = reference(REWARDS, VALUES, MASK, gamma, lam)
    assert adv.shape == returns.shape == (2, 6) and adv.dtype == torch.float32
    assert adv.tolist() == [pytest.approx(row, rel=1e-5, abs=1e-6) for row in want]
    want_returns = [[(a + v) if m else 0.0 for a, v, m in zip(*rows)] for rows in zip(want, VALUES, MASK)]
    assert returns.tolist() == [pytest.approx(row, rel=1e-5, abs=1e-6) for row in want_returns]
    assert adv[0, :2].tolist() == [0.0, 0.0] and adv[1, 3] == 0.0  # off the mask: nothing


def test_lambda_one_is_discounted_returns_minus_values_and_lambda_zero_td_errors():
    gamma = 0.9
    one, _ = GAEAdvantage(gamma=gamma, gae_lambda=1.0, normalize=False)(REWARDS, VALUES, masks=MASK)
    zero, _ = GAEAdvantage(gamma=gamma, gae_lambda=0.0, normalize=False)(REWARDS, VALUES, masks=MASK)
    for b in range(2):
        kept = [t for t, keep in enumerate(MASK[b]) if keep]
        for j, t in enumerate(kept):
            ret = discounted_return(REWARDS[b], kept, j, gamma)
            assert one[b, t].item() == pytest.approx(ret - VALUES[b][t], rel=1e-5)
            next_value = VALUES[b][kept[j + 1]] if j + 1 < len(kept) else 0.0
            td = REWARDS[b][t] + gamma * next_value - VALUES[b][t]
            assert zero[b, t].item() == pytest.approx(td, rel=1e-5)
    # the masked tool output of row 1 is skipped: its reward (9.0) and value (5.0) reach nothing
    assert one[1, 2].item() == pytest.approx(0.0 + gamma * 2.0 - (-0.4), rel=1e-5)


def test_normalize_whitens_over_kept_tokens_and_returns_stay_raw():
    raw, raw_returns = GAEAdvantage(normalize=False)(REWARDS, VALUES, masks=MASK)
    adv, returns = GAEAdvantage()(REWARDS, VALUES, masks=MASK)
    keep = torch.tensor(MASK)
    kept = raw[keep]
    want = (kept - kept.mean()) / (kept.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(adv[keep], want)
    assert adv[~keep].abs().sum() == 0
    torch.testing.assert_close(returns, raw_returns)
    assert adv[keep].mean().abs() < 1e-6 and adv[keep].std(unbiased=False) == pytest.approx(1.0, rel=1e-5)
    # the per-call keyword wins over the constructor's
    torch.testing.assert_close(GAEAdvantage()(REWARDS, VALUES, masks=MASK, normalize=False)[0], raw)


def test_ragged_rows_and_token_rewards_from_sequence_rewards():
    rewards = GAEAdvantage.build_token_rewards([1.0, -1.0], [3, 1])
    assert rewards == [[0.0, 0.0, 1.0], [-1.0]]
    assert GAEAdvantage.build_token_rewards(RewardResult([0.5, 2.0]), [1, 2]) == [[0.5], [0.0, 2.0]]
    kl = GAEAdvantage.build_token_rewards(
        torch.tensor([2.0]), [2], old_logps=[[-1.0, -0.5]], ref_logps=[[-1.5, -0.5]], kl_coef=0.1
    )
    assert kl == [[pytest.approx(-0.05), pytest.approx(2.0)]]
    values = [[0.5, 0.25, 0.0], [0.3]]
    adv, returns = GAEAdvantage(gamma=1.0, gae_lambda=1.0, normalize=False)(rewards, values)
    assert adv.tolist() == [pytest.approx([0.5, 0.75, 1.0]), pytest.approx([-1.3, 0.0, 0.0])]
    assert returns.tolist() == [pytest.approx([1.0, 1.0, 1.0]), pytest.approx([-1.0, 0.0, 0.0])]


def test_bad_input_is_named_and_the_name_resolves():
    assert isinstance(create_advantage("gae", gamma=0.5), GAEAdvantage)
    assert isinstance(create_advantage("GAEAdvantage"), GAEAdvantage)
    with pytest.raises(ValueError, match="gae_lambda must be in"):
        GAEAdvantage(gae_lambda=1.5)
    with pytest.raises(ValueError, match="same shape"):
        GAEAdvantage()([[1.0, 2.0]], [[1.0]])
    with pytest.raises(ValueError, match="2 old and 2 ref log-probs for 3 tokens"):
        GAEAdvantage.build_token_rewards([1.0], [3], old_logps=[[0.0, 0.0]], ref_logps=[[0.0, 0.0]])
    with pytest.raises(ValueError, match="go together"):
        GAEAdvantage.build_token_rewards([1.0], [1], old_logps=[[0.0]])
    with pytest.raises(TypeError, match="per token"):
        GAEAdvantage().compute(torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool))
