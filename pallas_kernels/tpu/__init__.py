"""implementation="pallas_tpu": Mosaic TPU flash attention with the max adjustment.

`attention(spec, ops)` is what `stable_attn.dot_product_attention` dispatches to; with
`spec.interpret` (the API's `interpret=True`) the kernels run in TPU interpret mode
(`pltpu.InterpretParams`), which checks Mosaic's memory model (blocks, VMEM scratch, SMEM scalar
prefetch) on CPU. See docs/tpu_kernel.md for what was and was not verified.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels.tpu.kernels import BlockSizes, flash_attention
from stable_attn.spec import AttentionSpec, Operands

# custom_partitioning / shard_map when compiled (stable_attn.partition; not in interpret mode)
SHARDS_ITSELF = True

__all__ = ["attention", "is_available", "covers", "BlockSizes"]


def is_available() -> bool:
  """True when the default backend is a TPU (the kernels compile only there)."""
  try:
    return jax.default_backend() == "tpu"
  except RuntimeError:
    return False


def covers(spec: AttentionSpec, ops: Operands) -> Optional[str]:
  """Every call stable_attn accepts, except float64 inputs (reference runs those), a q_shift, and
  compiled FP8 numerics."""
  if jnp.dtype(ops.q.dtype) == jnp.float64:
    return "float64: TPUs have no float64 arithmetic; float64 runs on reference (or xla)"
  if spec.numerics.fp8 and not spec.interpret:
    return (f"numerics {spec.numerics.name!r}: an FP8 P_bar is emulated by reference and xla "
            f"(and in interpret mode); the compiled TPU kernels do not cast to FP8")
  if ops.q_shift is not None:
    return ("q_shift: the TPU kernels have no context parallelism (a sequence-sharded call); "
            "shard batch or heads, or use pallas_mosaic_gpu / pallas_gpu")
  return None


def attention(spec: AttentionSpec, ops: Operands,
              config: Optional[BlockSizes] = None) -> jax.Array:
  """(O [B, T, N, H] in the input dtype, LSE fp32 [B, N, T]); differentiable in q, k, v and bias
  (flash backward). config: the kernels' BlockSizes (None = defaults)."""
  if not spec.interpret and not is_available():
    raise ValueError("implementation='pallas_tpu' needs a TPU backend (default backend is "
                     f"{jax.default_backend()!r}); pass interpret=True to run it in TPU "
                     "interpret mode on CPU")
  return flash_attention(spec, ops, config)
