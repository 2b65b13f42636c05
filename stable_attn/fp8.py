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
  """x [B, T, N, H] -> [N] fp32: each head's largest |value| (over batch, positions, head dim; 0
  where those are empty)."""
  if x.size == 0:   # T, B or H of 0 (an empty call): jnp.max has no identity to return
    return jnp.zeros(x.shape[2:3], jnp.float32)
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


def _saturated(x: jax.Array, s: jax.Array) -> jax.Array:
  """x * s in fp32, finite values clipped to +-448 (an inf or NaN stays NaN: 0 * y is NaN there,
  so a bad input stays visible). s: the scales broadcast against x."""
  y = x.astype(jnp.float32) * s
  # Not jnp.where(jnp.isfinite(y), ...): with it XLA split V's quantize-transpose-cast fusion and
  # wrote V^T in fp32, 0.5 ms more per FP8 call at B4 T4096 N16 H128 on an H200 (1.23 against
  # 0.71 ms forward).
  return jnp.clip(y, -_MAX, _MAX) + 0 * y


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
  return (tile.round_exact(_saturated(x, s), E4M3) / s).astype(x.dtype)


quantize_under.defvjp(lambda x, s: (quantize_under(x, s), s),
                      lambda s, g: (g, jnp.zeros_like(s)))


def payload_under(x: jax.Array, scales: jax.Array) -> jax.Array:
  """x [B, T, N, H] -> float8_e4m3fn [B, T, N, H]: `quantize_under(x, scales) * scales` (the same
  values, bitwise), made by one cast from x. Not differentiable (an FP8 kernel's operand; the
  gradient reaches x through `quantize_under`'s values)."""
  return _saturated(jax.lax.stop_gradient(x), scales[None, None, :, None]).astype(E4M3)


SCALE_ROWS = ("q_scale", "k_scale", "v_scale")
# q, k and v's e4m3 payloads (`payload_under`), for a backend whose kernels read e4m3: made from
# the unquantized inputs in the pass that reads them, not from the quantized values in a second
# one (XLA cannot see that quantize_under's values times the scale are the payload: its fused
# quantize-and-cast took 250 us for q, k and v at B4 T4096 N16 H128 on an H200, the cast alone
# with V^T 140 us).
PAYLOAD_ROWS = ("q_e4m3", "k_e4m3", "v_e4m3")
ROWS = SCALE_ROWS + PAYLOAD_ROWS   # what only a backend with FP8_SCALES reads


def center(v: jax.Array) -> tuple[jax.Array, jax.Array]:
  """numerics center_v: v [B, S, K, H] -> (v less its mean over the keys, in fp32; the mean
  [B, K, H] fp32), the mean under stop_gradient: the attention of v and that of the centred v
  plus the mean are one function (each row's weights sum to 1), so the mean's own derivative
  cancels and dv is the centred v's gradient. Quantized after this (`quantize_inputs`), v's
  e4m3 values are those of v - mean under their own per-head scale (of v - mean's largest
  |value|; a caller's v_scale applies to v - mean)."""
  v32 = v.astype(jnp.float32)
  # With no keys (S = 0) the mean is 0, not 0 / 0.
  mean = jnp.mean(v32, axis=1) if v.shape[1] else jnp.sum(v32, axis=1)
  mean = jax.lax.stop_gradient(mean)
  return v32 - mean[:, None], mean


def add_mean(out: jax.Array, lse: jax.Array, mean: jax.Array, sinks=None) -> jax.Array:
  """O [B, T, N, H] of the centred v (`center`) -> O of v: the mean [B, K, H] added in fp32 to
  each row as its keys' weights sum: 1, or 0 in a row with no visible key (LSE [B, N, T] fp32 at
  tile.EMPTY_ROW_LSE or -inf there), and with sinks [N] exp(LSE_keys - LSE) = -expm1(sink - LSE)
  (differentiable in LSE and the sinks, as the sink's share of O is); then rounded to O's
  dtype. Query head n reads kv head n // (N // K)."""
  B, T, N, H = out.shape
  K = mean.shape[1]
  # Behind a barrier: XLA otherwise fused this add into the FP8 backward's delta = rowsum(dO * O)
  # (both read the kernel's O), and that fusion took 585 us for 62 at B4 T4096 N16 H128 (H200).
  out = jax.lax.optimization_barrier(out)
  if sinks is None:
    weight = 1.0 - tile.no_visible_key(lse).astype(jnp.float32)
  else:
    weight = -jnp.expm1(sinks.astype(jnp.float32)[None, :, None] - lse)
  # Query heads grouped by kv head ([B, T, K, G, H]): a reshape, which sharded heads allow where
  # a jnp.repeat of the mean would need its sharding spelled out under Explicit mesh axes.
  weight = jnp.swapaxes(weight, 1, 2).reshape(B, T, K, N // K, 1)
  o = out.astype(jnp.float32).reshape(B, T, K, N // K, H) + weight * mean[:, None, :, None]
  return o.reshape(B, T, N, H).astype(out.dtype)


def attended(q, k, v, numerics) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """q, k, v (as a call takes them, with their own scales) -> the values a call under `numerics`
  (a preset name or a Numerics) attends, float64: quantized where qkv="e4m3", and with center_v
  the centred v's quantized values plus its mean (the sum in float64): what a float64 truth of
  that call takes."""
  from stable_attn import numerics as numerics_lib   # numerics does not import fp8: no cycle
  numerics = numerics_lib.resolve(numerics)
  mean = 0.0
  if numerics.center_v:
    v, mean = center(v)
    mean = np.asarray(mean, np.float64)[:, None]   # over the keys' axis
  q, k, v, _ = quantize_inputs(q, k, v, numerics.qkv)
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  return q, k, v + mean


def quantize_inputs(q, k, v, qkv: str, scales=None):
  """-> (q, k, v, fp8_rows): q, k, v as the numerics' `qkv` field says, unchanged ("input") or each
  `quantize_under` its per-head scales ("e4m3"): the given (q_scale, k_scale, v_scale), or None
  for each one's `head_scales`; fp8_rows: {} or, by operand row (ROWS), those per-head scales
  (SCALE_ROWS: [N], [K], [K] fp32) and the e4m3 payloads (PAYLOAD_ROWS: q, k, v's values times
  their scales, `payload_under`), which an FP8 kernel reads; under jit a caller that does not
  read the payloads does not compute them."""
  if qkv == "input":
    return q, k, v, {}
  scales = [jax.lax.stop_gradient(head_scales(x) if scales is None else s)
            for x, s in zip((q, k, v), scales or (None,) * 3)]
  payloads = [payload_under(x, s) for x, s in zip((q, k, v), scales)]
  q, k, v = (quantize_under(x, s) for x, s in zip((q, k, v), scales))
  return q, k, v, dict(zip(ROWS, scales + payloads))
