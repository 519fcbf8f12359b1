"""twinkle.advantage: advantage estimation from grouped rewards (entry-point group `twinkle.advantage`)."""

from twinkle.advantage.base import ADVANTAGES, Advantage, create_advantage, group_index, register_advantage
from twinkle.advantage.estimators import GRPOAdvantage, REINFORCEAdvantage, RLOOAdvantage
from twinkle.advantage.gae import GAEAdvantage

__all__ = [
    "ADVANTAGES",
    "Advantage",
    "GAEAdvantage",
    "GRPOAdvantage",
    "REINFORCEAdvantage",
    "RLOOAdvantage",
    "create_advantage",
    "group_index",
    "register_advantage",
]
