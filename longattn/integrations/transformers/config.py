"""The settings ``"longattn_dilated"`` and ``"longattn_block_sparse"`` read from a transformers model config.

Both are optional dicts on the config (``PretrainedConfig`` keeps unknown keyword arguments as attributes and saves
them with the model)::

    config.longattn_dilated = {"segment_lengths": [2048, 4096, 8192, 16384], "dilation_rates": [1, 2, 4, 8],
                               "head_split": False}
    config.longattn_block_sparse = {"block_size": 128, "local_blocks": 2, "global_blocks": 1}

Missing keys take the defaults above. ``config.longattn_backend`` (``"auto"``, ``"triton"`` or ``"torch"``, default
``"auto"``) is passed as ``backend=`` to every longattn call of the three implementations. ``longattn_block_sparse`` may instead hold ``{"pattern": p, "block_size": b}``
with ``p`` any :class:`longattn.patterns.Pattern` (not saved by ``save_pretrained``: JSON cannot hold it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch

from longattn import _validation as V

DILATED_KEY = "longattn_dilated"
BLOCK_SPARSE_KEY = "longattn_block_sparse"
BACKEND_KEY = "longattn_backend"
DILATED_DEFAULTS: Dict[str, Any] = {"segment_lengths": (2048, 4096, 8192, 16384), "dilation_rates": (1, 2, 4, 8),
                                    "head_split": False}
BLOCK_SPARSE_DEFAULTS: Dict[str, Any] = {"block_size": 128, "local_blocks": 2, "global_blocks": 1, "pattern": None}


@dataclass(frozen=True)
class DilatedSettings:
    segment_lengths: Tuple[int, ...]
    dilation_rates: Tuple[int, ...]
    head_split: bool


@dataclass(frozen=True)
class BlockSparseSettings:
    pattern: Any  # a longattn.patterns.Pattern
    block_size: Tuple[int, int]


def _section(config, key: str, defaults: Dict[str, Any]) -> Dict[str, Any]:
    given = setting(config, key, None)
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise TypeError(f"config.{key} must be a dict (keys {sorted(defaults)}), got {type(given).__name__}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"config.{key}: unknown keys {unknown}; allowed: {sorted(defaults)}")
    return {**defaults, **given}


def setting(config, key: str, default: Any) -> Any:
    """``config.<key>``, or ``default``: read from the instance's own attributes first (transformers' configs
    override attribute access, which costs microseconds on every call of every layer)."""
    if config is None:
        return default
    if torch.compiler.is_compiling():  # (Dynamo breaks the graph at object.__getattribute__)
        return getattr(config, key, default)
    own = object.__getattribute__(config, "__dict__")
    return own[key] if key in own else getattr(type(config), key, default)


def backend(config) -> str:
    """``config.longattn_backend``, default ``"auto"``."""
    return V.check_backend(setting(config, BACKEND_KEY, "auto"), f"config.{BACKEND_KEY}")


def dilated_settings(config) -> DilatedSettings:
    """The dilated-attention settings of ``config`` (defaults for what it leaves out), checked."""
    s = _section(config, DILATED_KEY, DILATED_DEFAULTS)
    segs, rates = V.check_dilated_args(s["segment_lengths"], s["dilation_rates"], fn=f"config.{DILATED_KEY}")
    head_split = V.check_flag(s["head_split"], "head_split", f"config.{DILATED_KEY}")
    return DilatedSettings(segs, rates, head_split)


def block_sparse_settings(config) -> BlockSparseSettings:
    """The block-sparse pattern of ``config``: local band plus global blocks, or a given pattern; checked."""
    from longattn.patterns import GlobalTokens, Local, Pattern

    fn = f"config.{BLOCK_SPARSE_KEY}"
    s = _section(config, BLOCK_SPARSE_KEY, BLOCK_SPARSE_DEFAULTS)
    block_size = V.check_block_size(s["block_size"], fn)
    pattern = s["pattern"]
    if pattern is None:
        for name in ("local_blocks", "global_blocks"):
            x = s[name]
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"{fn}: {name} must be an int, got {x!r}")
            if x < 0:
                raise ValueError(f"{fn}: {name} must be >= 0, got {x}")
        pattern = Local(s["local_blocks"]) | GlobalTokens(s["global_blocks"])
    elif not isinstance(pattern, Pattern):
        raise TypeError(f"{fn}: pattern must be a longattn.patterns.Pattern, got {type(pattern).__name__}")
    return BlockSparseSettings(pattern, block_size)
