"""The metrics every adapter has: loss, token accuracy, grad norm, learning rate, throughput, MFU."""

from __future__ import annotations

from collections import defaultdict

from twinkle.metric.base import ForwardRecord, Metric, StepRecord, register_metric


@register_metric
class LossMetric(Metric):
    """Mean loss over forward passes since the last report, weighted by loss tokens; plus the
    loss's own metrics (clip fraction, KL, ...) averaged over passes. Non-finite losses are counted
    separately instead of poisoning the mean."""

    aliases = ("loss",)

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total, self.tokens, self.nonfinite = 0.0, 0, 0
        self.extras, self.extra_counts = defaultdict(float), defaultdict(int)

    def on_forward(self, record: ForwardRecord) -> None:
        if record.loss is None:
            return
        if not record.finite:
            self.nonfinite += 1
            return
        self.total += record.loss * max(record.loss_tokens, 1)
        self.tokens += max(record.loss_tokens, 1)
        for k, v in record.extras.items():
            self.extras[k] += v
            self.extra_counts[k] += 1

    def compute(self) -> dict[str, float]:
        out = {"loss": self.total / self.tokens if self.tokens else float("nan")}
        if self.nonfinite:
            out["nonfinite_losses"] = float(self.nonfinite)
        out.update({k: v / self.extra_counts[k] for k, v in self.extras.items()})
        return out


@register_metric
class TokenAccuracy(Metric):
    """Fraction of loss positions whose argmax prediction is the target."""

    aliases = ("accuracy", "token_accuracy")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.correct = self.tokens = 0

    def on_forward(self, record: ForwardRecord) -> None:
        self.correct += record.correct_tokens
        self.tokens += record.loss_tokens

    def compute(self) -> dict[str, float]:
        return {"token_accuracy": self.correct / self.tokens if self.tokens else float("nan")}


@register_metric
class OptimizerMetric(Metric):
    """Last learning rate, mean grad norm over steps taken, and the number of skipped steps."""

    aliases = ("optimizer",)

    def __init__(self) -> None:
        self.reset()
        self.total_skipped = 0

    def reset(self) -> None:
        self.norms, self.lr, self.skipped = [], None, 0

    def on_step(self, record: StepRecord) -> None:
        if record.lr is not None:
            self.lr = record.lr
        if record.skipped:
            self.skipped += 1
            self.total_skipped += 1
        elif record.grad_norm is not None:
            self.norms.append(record.grad_norm)

    def compute(self) -> dict[str, float]:
        out = {"skipped_steps": float(self.total_skipped)}
        if self.norms:
            out["grad_norm"] = sum(self.norms) / len(self.norms)
        if self.lr is not None:
            out["lr"] = self.lr
        return out


@register_metric
class ThroughputMetric(Metric):
    """Tokens per second and model FLOPs utilisation over the window since the last report.

    MFU = (model FLOPs / wall seconds) / peak, the peak being a matmul measured once at start. With
    no known peak (0 or None, e.g. an engine that does not measure one) MFU is absent, not a guess."""

    aliases = ("throughput", "mfu")

    def __init__(self, peak_flops: float) -> None:
        self.peak_flops = peak_flops
        self.reset()

    def reset(self) -> None:
        self.tokens, self.flops, self.seconds = 0, 0.0, 0.0

    def on_forward(self, record: ForwardRecord) -> None:
        self.tokens += record.input_tokens
        self.flops += record.flops
        self.seconds += record.seconds

    def on_step(self, record: StepRecord) -> None:
        self.seconds += record.seconds

    def compute(self) -> dict[str, float]:
        if not self.seconds:
            return {}
        out = {"tokens_per_s": self.tokens / self.seconds}
        if self.peak_flops:
            out["mfu"] = self.flops / self.seconds / self.peak_flops
        return out
