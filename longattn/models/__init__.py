"""Models built on longattn's modules."""
from longattn.models.longnet import LongNet, LongNetBlock, LongNetConfig

__all__ = ["LongNet", "LongNetBlock", "LongNetConfig"]
