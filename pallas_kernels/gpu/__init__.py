"""implementation="pallas_gpu": flash attention in Pallas with the Triton lowering (Ampere, Hopper).

    from pallas_kernels import gpu
    out = gpu.attention(spec, ops)     # spec: stable_attn.spec.AttentionSpec, ops: Operands

Forward, delta pre-pass, dK/dV and dQ kernels live in `kernels.py`; their tile math is
`stable_attn.tile` and their block ranges `stable_attn.blocks`. Block sizes, warps and stages come
from `tuning.py` (a table per head dim and dtype; `tuning.override` for benchmarks).
spec.interpret=True runs the same kernels with pallas_call(interpret=True), e.g. on a CPU.
"""
from __future__ import annotations

import jax

from stable_attn.flash import make_flash_attention
from stable_attn.spec import AttentionSpec, Operands

from pallas_kernels.gpu import tuning
from pallas_kernels.gpu.kernels import backward, forward

__all__ = ["attention", "is_available", "tuning"]

_flash = make_flash_attention(forward, backward)


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


def attention(spec: AttentionSpec, ops: Operands) -> jax.Array:
  """O [B, T, N, H] in the input dtype; differentiable in q, k, v and bias (flash backward)."""
  B, T, N, H = ops.q.shape
  S = ops.k.shape[1]
  if H > tuning.MAX_HEAD_DIM:
    raise ValueError(f"pallas_gpu supports head dims up to {tuning.MAX_HEAD_DIM}, got query "
                     f"{tuple(ops.q.shape)}")
  if not spec.interpret and not is_available():
    raise ValueError("implementation='pallas_gpu' needs an NVIDIA GPU backend (or interpret=True); "
                     f"the default backend is {jax.default_backend()!r}")
  config = tuning.resolve(H, ops.q.dtype, T, S, interpret=spec.interpret,
                          writes_ds=ops.bias is not None)
  return _flash(spec, config, ops)
