"""Peers that the benchmarks time beside ours and that may not be importable here; each is imported
only when a benchmark asks for it, and one that does not import is reported, not fatal.

tokamax      tokamax.dot_product_attention with its sm90 Mosaic GPU kernel
             (../shared/tools/peer-wheels.sh prepares the wheel for a machine without a package
             index). benchmarks/attention.py and features.py run it when it imports.
pallas_mha   JAX's Pallas Triton flash attention, jax.experimental.pallas.ops.gpu.attention.mha:
             deprecated since JAX 0.11 (its import warns), so attention.py runs it only when named
             (--only ...,pallas_mha).
"""
from __future__ import annotations

import functools


@functools.cache
def tokamax_attention():
  """f(q, k, v, **kwargs) -> O: tokamax's dot_product_attention on its Mosaic GPU kernel, or None
  when tokamax is not importable."""
  try:
    import tokamax
  except ImportError:
    return None
  return lambda q, k, v, **kw: tokamax.dot_product_attention(q, k, v, implementation="mosaic", **kw)


TOKAMAX_MISSING = "tokamax is not importable"


@functools.cache
def pallas_mha():
  """(JAX's Pallas Triton `mha`, None), or (None, why it did not import)."""
  try:
    from jax.experimental.pallas.ops.gpu import attention
  except Exception as e:  # pragma: no cover - depends on the installed JAX
    return None, f"{type(e).__name__}: {e}"
  return attention.mha, None
