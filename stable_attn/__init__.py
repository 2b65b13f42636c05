"""stable_attn: flash attention for JAX with the max adjustment of Qiu & Yao (arXiv 2510.04212).

    out = stable_attn.dot_product_attention(q, k, v, is_causal=True, max_adjust="safe")

`stable_attn.flax` (Flax adapters) is imported on first use, so Flax is only loaded by users who
touch it.
"""
import importlib

from stable_attn.api import (IMPLEMENTATIONS, choose_implementation, default_implementation,
                             dot_product_attention, dot_product_attention_qkvpacked)
from stable_attn.numerics import FAST, PAPER, PRESETS, Numerics
from stable_attn.tile import MAX_ADJUST_MODES
from stable_attn import reference

__all__ = ["dot_product_attention", "dot_product_attention_qkvpacked", "choose_implementation",
           "default_implementation", "Numerics", "FAST", "PAPER", "PRESETS", "IMPLEMENTATIONS",
           "MAX_ADJUST_MODES", "reference", "flax"]
__version__ = "0.1.0"


def __getattr__(name):
  if name == "flax":
    return importlib.import_module("stable_attn.flax")
  raise AttributeError(f"module 'stable_attn' has no attribute {name!r}")
