"""FP8 inputs (numerics qkv="e4m3", the "fp8" preset): q, k and v quantized before any backend.

Each of q, k and v is rounded to float8_e4m3fn with one scale per head: a power of two that puts
the head's largest |value| (over batch, positions and head dim) in e4m3's top binade, (224, 448].
Being a power of two, the scale undoes exactly, so the quantized values are e4m3 values times
2^-e, held in the input dtype (exact in bf16, fp16 and fp32 alike): every backend then computes
the scores and P V of FP8 operands, whose products are exact in the fp32 accumulators. The scales
come from the call's own inputs (current scaling, as an FP8 kernel's caller computes its descale
factors; inside a caller's shard_map each device scales its own shard), or from the caller
(dot_product_attention's fp8_scales: delayed scaling, under which a value past e4m3's range
saturates).

The gradient passes straight through the rounding (d quantize(x) / dx taken as the identity), so
dQ, dK and dV are the gradients of the attention of the quantized inputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stable_attn import tile

E4M3 = jnp.float8_e4m3fn
_MAX = float(jnp.finfo(E4M3).max)                 # 448 = 0.875 * 2^9
_MAX_MANTISSA, _MAX_EXPONENT = np.frexp(_MAX)     # (0.875, 9)


def head_amax(x: jax.Array) -> jax.Array:
  """x [B, T, N, H] -> [N] fp32: each head's largest |value| (over batch, positions, head dim)."""
  return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 1, 3))


def head_scales(x: jax.Array) -> jax.Array:
  """x [B, T, N, H] -> [N] fp32 powers of two s: max |x[:, :, n]| * s in (224, 448], the largest
  such s (1 for a head of zeros or with a non-finite value)."""
  return scales_from_amax(head_amax(x))


def scales_from_amax(amax: jax.Array) -> jax.Array:
  """amax [N] (a head's largest |value|, e.g. the most of an amax history: delayed scaling) ->
  [N] fp32 powers of two s, the largest with amax * s <= 448 (1 for 0 or a non-finite amax)."""
  amax = jnp.asarray(amax, jnp.float32)
  mantissa, exponent = jnp.frexp(amax)   # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
  shift = _MAX_EXPONENT - exponent - (mantissa > _MAX_MANTISSA).astype(exponent.dtype)
  shift = jnp.minimum(shift, 127)   # fp32's largest power of two (a head of subnormals)
  usable = (amax > 0) & jnp.isfinite(amax)
  return jnp.where(usable, jnp.ldexp(jnp.ones_like(amax), jnp.where(usable, shift, 0)), 1.0)


def quantize(x: jax.Array) -> jax.Array:
  """x [B, T, N, H] rounded to e4m3 under its per-head scale (`head_scales`), returned unscaled
  in x's dtype. The gradient is the identity."""
  return quantize_under(x, jax.lax.stop_gradient(head_scales(x)))


@jax.custom_vjp
def quantize_under(x: jax.Array, scales: jax.Array) -> jax.Array:
  """x [B, T, N, H] rounded to e4m3 under `scales` [N] (powers of two, `head_scales` of x or of
  a larger array, or a caller's), returned unscaled in x's dtype: x * scales is then an e4m3
  value, exactly. Where |x| * scales exceeds 448 (a caller's scale from earlier steps) it
  saturates to +-448, as FP8 recipes do; a cast would give NaN there. An inf or NaN input gives
  NaN (no e4m3fn value is infinite). The gradient is the identity in x and zero in the scales."""
  s = scales[None, None, :, None]
  # tile.round_exact, not a cast pair: XLA's excess-precision simplification drops
  # f32 -> e4m3 -> f32 (the compiled kernels then got the unquantized inputs).
  y = x.astype(jnp.float32) * s
  # Saturation for finite values only: 0 * y is NaN where y is inf or NaN, so those stay visible.
  # Not jnp.where(jnp.isfinite(y), ...): with it XLA split V's quantize-transpose-cast fusion and
  # wrote V^T in fp32, 0.5 ms more per FP8 call at B4 T4096 N16 H128 on an H200 (1.23 against
  # 0.71 ms forward).
  rounded = tile.round_exact(jnp.clip(y, -_MAX, _MAX) + 0 * y, E4M3)
  return (rounded / s).astype(x.dtype)


quantize_under.defvjp(lambda x, s: (quantize_under(x, s), s),
                      lambda s, g: (g, jnp.zeros_like(s)))

SCALE_ROWS = ("q_scale", "k_scale", "v_scale")


def quantize_inputs(q, k, v, qkv: str, scales=None):
  """-> (q, k, v, scales): q, k, v as the numerics' `qkv` field says, unchanged ("input") or each
  `quantize_under` its per-head scales ("e4m3"): the given (q_scale, k_scale, v_scale), or None
  for each one's `head_scales`; scales: {} or those per-head scales by operand row (SCALE_ROWS:
  [N], [K], [K] fp32), which an FP8 kernel multiplies by to get its e4m3 payloads without
  measuring the heads again."""
  if qkv == "input":
    return q, k, v, {}
  scales = [jax.lax.stop_gradient(head_scales(x) if scales is None else s)
            for x, s in zip((q, k, v), scales or (None,) * 3)]
  q, k, v = (quantize_under(x, s) for x, s in zip((q, k, v), scales))
  return q, k, v, dict(zip(SCALE_ROWS, scales))
