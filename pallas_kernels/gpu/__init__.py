"""implementation="pallas_gpu": flash attention in Pallas with the Triton lowering (Ampere, Hopper).

    from pallas_kernels import gpu
    out, lse = gpu.attention(spec, ops)   # spec: stable_attn.spec.AttentionSpec, ops: Operands

Forward, delta pre-pass, dK/dV and dQ kernels live in `kernels.py`; their tile math is
`stable_attn.tile` and their block ranges `stable_attn.blocks`. Block sizes, warps and stages come
from `tuning.py` (a table per head dim and dtype), or from a `tuning.Config` passed as `config`.
spec.interpret=True runs the same kernels with pallas_call(interpret=True), e.g. on a CPU.
It covers every call stable_attn accepts with head dims up to 256, except float64 inputs (reference
runs those): it is the fallback of the Hopper kernel and the kernel of other NVIDIA GPUs.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from stable_attn.flash import make_flash_attention
from stable_attn.spec import AttentionSpec, Operands

from pallas_kernels.gpu import tuning
from pallas_kernels.gpu.kernels import backward, forward

__all__ = ["attention", "is_available", "covers", "tuning"]

# The Triton forward writes an fp32 O residual where the numerics ask: a ring step's O merges
# unrounded.
_flash = make_flash_attention(forward, backward, partition=True, context_parallel=True,
                              fp32_residual=True)
SHARDS_ITSELF = True   # custom_partitioning / shard_map (stable_attn.partition)
CONTEXT_PARALLEL = True   # a sequence-sharded call runs context parallel (stable_attn.partition)


def is_available() -> bool:
  """True when the default JAX backend is an NVIDIA GPU (CUDA) and Pallas' Triton lowering loads."""
  try:
    if jax.default_backend() != "gpu":
      return False
    device = jax.devices()[0]
    kind = str(getattr(device, "device_kind", "")).lower()
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    if "nvidia" not in kind and "cuda" not in version:
      return False
    from jax.experimental.pallas import triton  # noqa: F401
    return True
  except Exception:  # any backend probing failure means "not available"
    return False


def covers(spec: AttentionSpec, ops: Operands) -> Optional[str]:
  H = ops.q.shape[-1]
  if jnp.dtype(ops.q.dtype) == jnp.float64:
    return ("float64: the Triton kernels are built and tested for bf16, fp16 and fp32 (float32 "
            "tile math); float64 runs on reference (or xla)")
  if H > tuning.MAX_HEAD_DIM:
    return f"pallas_gpu supports head dims up to {tuning.MAX_HEAD_DIM}, got query {tuple(ops.q.shape)}"
  if spec.numerics.fp8 and not spec.interpret:
    return (f"numerics {spec.numerics.name!r}: an FP8 P_bar is emulated by reference and xla "
            f"(and in interpret mode); the compiled Triton kernels do not cast to FP8")
  return None


def attention(spec: AttentionSpec, ops: Operands, config: Optional[tuning.Config] = None):
  """(O [B, T, N, H] in the input dtype, LSE fp32 [B, N, T]); differentiable in q, k, v and bias
  (flash backward)."""
  reason = covers(spec, ops)
  if reason is not None:
    raise ValueError(reason)
  if not spec.interpret and not is_available():
    raise ValueError("implementation='pallas_gpu' needs an NVIDIA GPU backend (or interpret=True); "
                     f"the default backend is {jax.default_backend()!r}")
  B, T, N, H = ops.q.shape
  config = tuning.resolve(H, ops.q.dtype, T, ops.k.shape[1], interpret=spec.interpret,
                          writes_ds=ops.bias is not None, config=config)
  return _flash(spec, config, ops)
