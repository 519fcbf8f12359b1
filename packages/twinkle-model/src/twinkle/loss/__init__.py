"""twinkle.loss: token-level training losses, registered by name (entry-point group `twinkle.loss`)."""

from twinkle.loss.base import LOSSES, Loss, LossContext, LossOutput, create_loss, register_loss
from twinkle.loss.distill import GKDLoss
from twinkle.loss.grpo_variants import BNPOLoss, DRGRPOLoss, SAPOLoss
from twinkle.loss.head import (
    IGNORE_INDEX,
    LOGITS_BUDGET_BYTES,
    ChunkedHead,
    HeadNeeds,
    LogitsHead,
    ProjectedHead,
    TokenHead,
)
from twinkle.loss.infonce import InfonceLoss
from twinkle.loss.odds import CPOLoss, ORPOLoss
from twinkle.loss.pass_heads import EmbeddingHead, ValueHead
from twinkle.loss.policy import CISPOLoss, DROLoss, GRPOLoss, GSPOLoss, ImportanceSamplingLoss, PPOLoss
from twinkle.loss.preference import DPOLoss, SimPOLoss
from twinkle.loss.sft import CrossEntropyLoss
from twinkle.loss.stable import StableReinforceLoss
from twinkle.loss.value import MSELoss, PPOValueLoss

__all__ = [
    "IGNORE_INDEX",
    "LOGITS_BUDGET_BYTES",
    "LOSSES",
    "BNPOLoss",
    "CISPOLoss",
    "CPOLoss",
    "ChunkedHead",
    "CrossEntropyLoss",
    "DPOLoss",
    "DRGRPOLoss",
    "DROLoss",
    "EmbeddingHead",
    "GKDLoss",
    "GRPOLoss",
    "GSPOLoss",
    "HeadNeeds",
    "ImportanceSamplingLoss",
    "InfonceLoss",
    "LogitsHead",
    "Loss",
    "LossContext",
    "LossOutput",
    "MSELoss",
    "ORPOLoss",
    "PPOLoss",
    "PPOValueLoss",
    "ProjectedHead",
    "SAPOLoss",
    "SimPOLoss",
    "StableReinforceLoss",
    "TokenHead",
    "ValueHead",
    "create_loss",
    "register_loss",
]
