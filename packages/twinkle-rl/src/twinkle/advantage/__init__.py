"""twinkle.advantage: advantage estimation from grouped rewards (entry-point group `twinkle.advantage`)."""

from twinkle.advantage.base import ADVANTAGES, Advantage, create_advantage, group_index, register_advantage
from twinkle.advantage.estimators import GRPOAdvantage, REINFORCEAdvantage, RLOOAdvantage

__all__ = [
    "ADVANTAGES",
    "Advantage",
    "GRPOAdvantage",
    "REINFORCEAdvantage",
    "RLOOAdvantage",
    "create_advantage",
    "group_index",
    "register_advantage",
]
