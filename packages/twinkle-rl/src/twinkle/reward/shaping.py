"""Format (regex) rewards, a length penalty, and weighted combinations of rewards."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from twinkle.reward.base import Reward, RewardResult, create_reward, register_reward


@register_reward
class FormatReward(Reward):
    """`reward` if the completion matches `pattern` (`match='search'` anywhere, `'full'` the whole
    stripped text), else `penalty`. Without a pattern: a `<think>` block then an `<answer>` block
    (twinkle-kit's FormatReward())."""

    aliases = ("format",)

    def __init__(
        self,
        pattern: str = r"<think>.*?</think>.*?<answer>.*?</answer>",
        match: str = "search",
        flags: int = re.DOTALL,
        reward: float = 1.0,
        penalty: float = 0.0,
        name: str | None = None,
    ):
        super().__init__(name or "format")
        if match not in ("search", "full"):
            raise ValueError(f"match must be 'search' or 'full', got {match!r}")
        try:
            self.regex = re.compile(pattern, flags)
        except re.error as exc:
            raise ValueError(f"FormatReward pattern {pattern!r} is not a valid regex: {exc}") from None
        self.match, self.reward, self.penalty = match, reward, penalty

    @classmethod
    def think_answer(cls, **kw) -> FormatReward:
        """`<think>...</think>` followed by `<answer>...</answer>` and nothing else."""
        return cls(r"<think>.*?</think>\s*<answer>.*?</answer>", match="full", **kw)

    def score(self, text: str, **row) -> float:
        found = self.regex.fullmatch(text.strip()) if self.match == "full" else self.regex.search(text)
        return self.reward if found else self.penalty


@register_reward
class LengthPenalty(Reward):
    """0 up to `target` length, falling linearly to `-scale` at `limit` and staying there.

    `unit='tokens'` reads the row's `num_tokens` (the rollout helpers fill it); `'chars'` and
    `'words'` measure the text.
    """

    aliases = ("length_penalty",)

    def __init__(self, target: int, limit: int, unit: str = "tokens", scale: float = 1.0, name: str | None = None):
        super().__init__(name or "length_penalty")
        if not 0 <= target < limit:
            raise ValueError(f"LengthPenalty needs 0 <= target < limit, got target={target}, limit={limit}")
        if unit not in ("tokens", "chars", "words"):
            raise ValueError(f"unit must be 'tokens', 'chars' or 'words', got {unit!r}")
        self.target, self.limit, self.unit, self.scale = target, limit, unit, scale

    def score(self, text: str, **row) -> float:
        if self.unit == "tokens":
            if "num_tokens" not in row:
                raise KeyError("LengthPenalty(unit='tokens') needs the row's 'num_tokens'")
            length = int(row["num_tokens"])
        else:
            length = len(text) if self.unit == "chars" else len(text.split())
        over = min(max(length - self.target, 0), self.limit - self.target)
        return -self.scale * over / (self.limit - self.target)


@register_reward
class WeightedReward(Reward):
    """total_i = Σ_k w_k · reward_k(sample_i). Components keep their own (unweighted) values.

    A sample fails if any component failed on it: it gets `failure_value` as its total and every
    component's error is recorded.
    """

    aliases = ("weighted",)

    def __init__(self, rewards: Mapping[str, tuple] | Sequence[tuple], name: str | None = None):
        super().__init__(name or "reward")
        items = list(rewards.items()) if isinstance(rewards, Mapping) else [(None, rw) for rw in rewards]
        if not items:
            raise ValueError("WeightedReward needs at least one (reward, weight)")
        self.parts: list[tuple[Reward, float]] = []
        for key, spec in items:
            reward, weight = spec if isinstance(spec, tuple) else (spec, 1.0)
            reward = create_reward(reward) if isinstance(reward, (str, type)) else reward
            if not isinstance(reward, Reward):
                raise TypeError(f"WeightedReward parts must be Rewards, got {type(reward).__name__}")
            if key is not None:
                reward.name = key
            self.parts.append((reward, float(weight)))
        names = [r.name for r, _ in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"WeightedReward component names must be distinct, got {names}")

    def state_dict(self) -> dict:
        return {reward.name: state for reward, _ in self.parts if (state := reward.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        for reward, _ in self.parts:
            reward.load_state_dict(state.get(reward.name, {}))

    def __call__(self, completions, rows=None) -> RewardResult:
        completions = list(completions)
        totals = [0.0] * len(completions)
        components, errors = {}, {}
        for reward, weight in self.parts:
            part = reward(completions, rows)
            components[reward.name] = part.values
            for i, v in enumerate(part.values):
                totals[i] += weight * v
            for i, err in part.errors.items():
                errors[i] = f"{errors[i]}; {err}" if i in errors else err
        for i in errors:
            totals[i] = self.failure_value
        return RewardResult(totals, components, errors)
