"""twinkle-kit's metric names, ours: RL rollout statistics a loop accumulates itself, and the DPO and
GRPO losses' own numbers under twinkle-kit's keys. A number that was not measured is absent."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, ClassVar

from twinkle.metric.base import ForwardRecord, Metric, register_metric
from twinkle.metric.kit_grpo import RolloutLogps

if TYPE_CHECKING:
    import torch.distributed as dist

    from twinkle.mesh import DeviceMesh


@register_metric
class CompletionRewardMetric(Metric):
    """Completion lengths and named rewards of the rollouts since the last reset:
    `train/<name>_reward` (mean), `train/<name>_reward_std` (sample std), `train/completion_length` (mean)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.rewards: dict[str, list[float]] = defaultdict(list)
        self.completion_lengths: list[int] = []

    def accumulate(
        self,
        inputs: object = None,  # noqa: ARG002 - twinkle-kit's positional slot, not read
        outputs: object = None,  # noqa: ARG002 - twinkle-kit's positional slot, not read
        *,
        completion_lengths: Iterable[int] = (),
        rewards: Mapping[str, Iterable[float]] | None = None,
    ) -> None:
        """`inputs` / `outputs` are twinkle-kit's positional slots; this metric reads neither."""
        for name, values in (rewards or {}).items():
            self.rewards[name].extend(float(v) for v in values)
        self.completion_lengths.extend(int(n) for n in completion_lengths)

    def calculate(self) -> dict[str, float]:
        out = {}
        for name, values in self.rewards.items():
            if values:
                out[f"train/{name}_reward"] = statistics.fmean(values)
                out[f"train/{name}_reward_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        if self.completion_lengths:
            out["train/completion_length"] = statistics.fmean(self.completion_lengths)
        return out

    compute = calculate


class _LossNumbers(Metric):
    """The mean over forward passes of some of the loss's own metrics, renamed."""

    KEYS: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def on_forward(self, record: ForwardRecord) -> None:
        for ours, theirs in self.KEYS.items():
            if ours in record.extras:
                self.sums[theirs] += record.extras[ours]
                self.counts[theirs] += 1

    def compute(self) -> dict[str, float]:
        return {k: self.sums[k] / n for k, n in self.counts.items() if n}


@register_metric
class DPOMetric(_LossNumbers):
    """The DPO loss's rewards and sequence log-probs under TRL's / twinkle-kit's keys. The rewards are
    as the loss computed them (with the loss's own beta); `beta` here is twinkle-kit's argument and
    must equal the loss's to mean the same."""

    KEYS: ClassVar[dict[str, str]] = {
        "reward_accuracy": "rewards/accuracies",
        "reward_margin": "rewards/margins",
        "reward_chosen": "rewards/chosen",
        "reward_rejected": "rewards/rejected",
        "logps_chosen": "logps/chosen",
        "logps_rejected": "logps/rejected",
    }

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__()
        self.beta = beta


@register_metric
class GRPOMetric(_LossNumbers):
    """The policy loss's clipped fraction, KL to the reference and entropy, under twinkle-kit's keys.
    Standalone, as twinkle-kit's GRPO loops use it: `accumulate(inputs, outputs, old_logps=, advantages=)`
    per mini-batch, then `calculate()` (the drift from the sampling policy, kit_grpo.py; resets)."""

    KEYS: ClassVar[dict[str, str]] = {"clip_fraction": "clip_ratio", "kl": "kl", "entropy": "entropy"}

    def __init__(self, epsilon: float = 0.2) -> None:
        self.epsilon = epsilon
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self.rollout = RolloutLogps(self.epsilon)

    def accumulate(
        self, inputs: object, outputs: object, *, old_logps: list | None = None, advantages: list | None = None
    ) -> None:
        self.rollout.add(inputs, outputs, old_logps, advantages)

    def calculate(self) -> dict[str, float]:
        out = {**self.compute(), **self.rollout.result()}
        self.reset()
        return out


@register_metric
class EmbeddingMetric(_LossNumbers):
    """InfonceLoss's similarities under twinkle-kit's keys: `pos_sim` (anchor-positive cosine, mean over
    passes of each pass's mean), `pos_sim_min` / `pos_sim_max` (over every pass), `neg_sim` (an anchor
    against the other groups' positives). The loss and the grad norm are our LossMetric's and
    OptimizerMetric's. twinkle-kit's `device_mesh` / `process_group` are accepted and unused: the loss
    computes the numbers where it sees the batch."""

    KEYS: ClassVar[dict[str, str]] = {"pos_sim": "pos_sim", "neg_sim": "neg_sim"}

    def __init__(
        self,
        device_mesh: DeviceMesh | None = None,  # noqa: ARG002 - twinkle-kit's signature
        process_group: dist.ProcessGroup | None = None,  # noqa: ARG002
    ) -> None:
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self.extremes: dict[str, float] = {}

    def on_forward(self, record: ForwardRecord) -> None:
        super().on_forward(record)
        for key, pick in (("pos_sim_min", min), ("pos_sim_max", max)):
            if key in record.extras:
                seen = self.extremes.get(key)
                self.extremes[key] = record.extras[key] if seen is None else pick(seen, record.extras[key])

    def compute(self) -> dict[str, float]:
        return {**super().compute(), **self.extremes}


@register_metric
class PPOValueMetric(_LossNumbers):
    """PPOValueLoss's critic statistics under twinkle-kit's keys (`train/value_mean`, `train/return_mean`,
    `train/value_clip_ratio`, `train/explained_variance`), each the mean over passes of the pass's own
    over its loss tokens. The clip range is the loss's: `epsilon` here is twinkle-kit's argument, kept
    for its signature."""

    KEYS: ClassVar[dict[str, str]] = {
        "value_mean": "train/value_mean",
        "return_mean": "train/return_mean",
        "value_clip_ratio": "train/value_clip_ratio",
        "explained_variance": "train/explained_variance",
    }

    def __init__(
        self,
        device_mesh: DeviceMesh | None = None,  # noqa: ARG002 - twinkle-kit's signature
        process_group: dist.ProcessGroup | None = None,  # noqa: ARG002
        epsilon: float = 0.2,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        self.epsilon, self.ignore_index = epsilon, ignore_index
