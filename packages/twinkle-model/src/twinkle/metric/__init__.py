"""twinkle.metric: training/evaluation metrics (entry-point group `twinkle.metric`) and MFU."""

from twinkle.metric.base import METRICS, ForwardRecord, Metric, StepRecord, register_metric
from twinkle.metric.builtin import LossMetric, OptimizerMetric, ThroughputMetric, TokenAccuracy
from twinkle.metric.kit import CompletionRewardMetric, DPOMetric, EmbeddingMetric, GRPOMetric, PPOValueMetric
from twinkle.metric.mfu import attention_dims, matmul_params, measure_matmul_peak, step_flops

__all__ = [
    "METRICS",
    "CompletionRewardMetric",
    "DPOMetric",
    "EmbeddingMetric",
    "ForwardRecord",
    "GRPOMetric",
    "LossMetric",
    "Metric",
    "OptimizerMetric",
    "PPOValueMetric",
    "StepRecord",
    "ThroughputMetric",
    "TokenAccuracy",
    "attention_dims",
    "matmul_params",
    "measure_matmul_peak",
    "register_metric",
    "step_flops",
]
