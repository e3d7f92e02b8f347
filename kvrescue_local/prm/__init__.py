"""Process reward models on GGUF backbones: formats, reward heads, batched scoring, conversion."""

from .formats import FORMATS, PRMFormat, prm_format
from .head import RewardHead, head_path
from .scorer import AGGREGATIONS, PRM, PRMParams, aggregate

__all__ = ["AGGREGATIONS", "FORMATS", "PRM", "PRMFormat", "PRMParams", "RewardHead", "aggregate", "head_path", "prm_format"]
