"""The whole fix in one place: the max adjustment and the online-softmax step, on tiles.

Every implementation (the blockwise reference, the XLA path, the Pallas GPU, Mosaic GPU and TPU
kernels) calls these functions on score tiles; they differ only in how tiles reach memory and in
who does the matmuls. The shape is FlashAttention-3's (hopper/softmax.h): the caller computes
QK^T, `scores` turns it into masked logits, `rescale` does the softmax step up to the PV product
(P in the P dtype, the rescale factor alpha, the new row max and sum), the caller computes PV, and
`accumulate` folds it into O. The backward tile is `backward_tile`. Everything is plain jnp on
fp32 values with explicit rounding points taken from `numerics.Dtypes`; row statistics are 1-D.

Options carried by the tile functions: segment ids (packed documents) are part of `visible`, the
logit soft cap of `scores` (cap * tanh(logits / cap), its derivative kept for `backward_ds`).

Orientation. A tile is [query rows, key columns] (q_axis=0) or transposed [keys, queries]
(q_axis=1, FA3's SwapAB: the dK/dV side computes S^T = K Q^T). Elementwise helpers do not care;
functions with row statistics take `q_axis`, the axis along which the query index runs.

Base 2. With base2=True scores are in log2 units (log2(e) folded into the softmax scale, so a
kernel evaluates exp2 with one FMA per element) and the row max follows; the log-sum-exp a kernel
returns is always in natural units. Only fp32 scores may run in base 2: it moves the rounding
points of the "paper" preset.

Max adjustment (`max_adjust`):
  "off"    m = running row max (standard safe softmax).
  "paper"  Qiu & Yao, Algorithm 1 as their code does it: per key block, if more than one score is
           within 1e-3 of the block-row max r, use beta * r when r > 0 and 0 when r < 0; the running
           max is max(adjusted, old) and the log-sum-exp uses it. Holes: r == 0 or |r| tiny, beta * r
           large (exp underflows, l = 0), masked entries counted as ties, ties split over blocks.
  "safe"   ours. Every row's exponent is shifted by a per-row offset c: P_bar = exp(S - m - c), so
           the largest P_bar of a row is w = exp(-c) in [0.55, 0.95] -- never 1, never a power of
           two, never underflowing, whatever the max (zero, tiny, huge), the masking or the tie
           placement, and without detecting ties. w is chosen per row (from the query position
           and head) as a pseudo-random cell of the P dtype's rounding grid plus a stratified
           position u inside the cell, so rounding w (in P as fed to PV, or in the block product)
           errs up in some rows and down in others, and over consecutive rows those errors cancel:
           the tie's half-way cases round both ways instead of always outward. (A fixed offset
           rounds the same way in every row: the paper's appendix C.) In exact arithmetic nothing
           changes: softmax is shift invariant and the log-sum-exp is m + c + log l. With fp32
           scores the offset is folded into the row max (one add per row, not per element).
           With Numerics.dither="out" (the "fp8_fast" preset) the exponent's weight is w
           rounded to P's grid (`p_grid_offset`: the maximum's P_bar exact in e4m3, the other
           keys still moved on that grid row to row), and `finalize` multiplies each row's O by
           round(w) / w on the output dtype's grid -- what the offset does to a row of tied
           maxima where P is rounded to bf16, without e4m3's 1/16 grid on a key that may hold
           most of the row (`output_dither`; docs/fp8.md).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stable_attn.numerics import Dtypes

MAX_ADJUST_MODES = ("off", "paper", "safe")
PAPER_TIE_TOLERANCE = 1e-3
SAFE_WEIGHT_MIN, SAFE_WEIGHT_MAX = 0.55, 0.95   # range of the largest P_bar under "safe"
# Log-sum-exp of a row with no visible key: exp(S - LSE) is then 0 for every score.
EMPTY_ROW_LSE = 1e30
# A masked score: finite, so that no step makes an infinity (jax.debug_infs checks every
# intermediate of the jnp implementations), yet below every visible score and below the initial
# running max by so much that exp(MASKED_SCORE - m) is 0 for any running max m (`init_stats`).
MASKED_SCORE = float(jnp.finfo(jnp.float32).min)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Weyl sequences in 24-bit fixed point: consecutive query positions spread evenly over [0, 1).
_ROW_STEP = (10368889, 12664881)    # round(0.6180339887 * 2**24), round(0.7548776662 * 2**24)
_HEAD_STEP = (5698259, 9256969)     # round(0.3396 * 2**24), round(0.5517 * 2**24), odd
_FIXED_MASK = (1 << 24) - 1

f32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# Rounding and matmuls
# ---------------------------------------------------------------------------------------------

def round_convert(x: jax.Array, dtype) -> jax.Array:
  """Rounds fp32 `x` to `dtype`'s precision and back; the compiled kernels' rounding."""
  if jnp.dtype(dtype) == jnp.float32:
    return x
  return x.astype(dtype).astype(f32)


def round_exact(x: jax.Array, dtype) -> jax.Array:
  """Like `round_convert` (the same value as a real cast, subnormals and overflow included), but
  XLA may never elide it (the jnp implementations and interpret mode: XLA:CPU's excess-precision
  simplification may drop an f32 -> bf16 -> f32 pair, and a bitcast round trip is folded away).

  reduce_precision is never removed, but with fewer exponent bits than fp32 (fp16) it flushes the
  dtype's subnormals to zero where a cast keeps them: a long fp16 row whose P_bar all lie below
  2^-14 summed to 0. Below the smallest normal, a cast rounds to the fixed grid of subnormals
  (spacing `smallest_subnormal`), to nearest, ties to even; scaling by a power of two is exact, so
  round(x / spacing) * spacing is that rounding.
  """
  if jnp.dtype(dtype) == jnp.float32:
    return x
  info = jnp.finfo(dtype)
  if info.nexp >= 8:   # fp32's exponent range (bf16): reduce_precision keeps the subnormals
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  return _round_narrow(x, jnp.dtype(dtype))


def _exponent_bits(info) -> int:
  """reduce_precision's exponent bits for a narrow type's normal grid: its own, or one more for a
  type without infinities (float8_e4m3fn: its top exponent holds finite values up to 448, where
  an IEEE 4-bit exponent stops at 240). Below the type's smallest normal the subnormal grid
  applies either way."""
  ieee_max = (2 - 2.0 ** -info.nmant) * 2.0 ** (2 ** (info.nexp - 1) - 1)
  return info.nexp + (float(info.max) > ieee_max)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _round_narrow(x, dtype):
  info = jnp.finfo(dtype)
  rounded = lax.reduce_precision(x, exponent_bits=_exponent_bits(info), mantissa_bits=info.nmant)
  tiny, spacing = float(info.tiny), float(info.smallest_subnormal)
  small = jnp.clip(x, -tiny, tiny)   # clipped so that no lane overflows (no inf under debug_infs)
  grid = lax.round(small * (1.0 / spacing), lax.RoundingMethod.TO_NEAREST_EVEN) * spacing
  return jnp.where(jnp.abs(x) < tiny, grid, rounded)


@_round_narrow.defjvp
def _round_narrow_jvp(dtype, primals, tangents):
  # The derivative of a cast, whose transpose casts the cotangent (subnormals kept); the
  # derivative of reduce_precision would flush subnormal cotangents, the grid's would be zero.
  # FP8 passes it straight through (docs/fp8.md): a cotangent cast to e4m3 loses all below 2^-9,
  # where P_bar's (scaled by 1 / (p_scale * l)) mostly are (`operand`).
  (x,), (t,) = primals, tangents
  if jnp.dtype(dtype).itemsize == 1:
    return _round_narrow(x, dtype), t
  return _round_narrow(x, dtype), t.astype(dtype).astype(t.dtype)


RoundFn = Callable[[jax.Array, object], jax.Array]


def rounding(interpret: bool) -> RoundFn:
  """The rounding a Pallas kernel uses: a real conversion when compiled, `round_exact` when its
  body runs as XLA:CPU code in interpret mode."""
  return round_exact if interpret else round_convert


def operand(x: jax.Array, dtype, round_fn: RoundFn = round_convert) -> jax.Array:
  """fp32 `x` cast to `dtype` for a matmul operand, rounded for certain (see `round_exact`)."""
  if round_fn is round_convert:
    return x.astype(dtype)   # one conversion, not a round trip and a second conversion
  if jnp.dtype(dtype).itemsize == 1:
    # FP8 values stay fp32 here: autodiff (the xla path) would cast the cotangent to e4m3 too,
    # flushing all below 2^-9 (dQ 15-60% wrong). Every FP8 product widens them first anyway.
    return round_fn(x, dtype)
  return round_fn(x, dtype).astype(dtype)


def _precision(dtype):
  # fp32 inputs get true fp32 products (no TF32): fp32 results must stay far under 1e-3 error.
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def matmul(a: jax.Array, b: jax.Array, *, transpose_a=False, transpose_b=False) -> jax.Array:
  """a @ b (optionally transposed operands) with fp32 accumulation."""
  contract_a = 0 if transpose_a else 1
  contract_b = 1 if transpose_b else 0
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         precision=_precision(a.dtype), preferred_element_type=f32)


def _rows(x: jax.Array, like: jax.Array, q_axis: int) -> jax.Array:
  """A per-query vector broadcast over a tile (explicitly: Mosaic GPU has no [n, 1] layouts)."""
  return lax.broadcast_in_dim(x, like.shape, (q_axis,))


# ---------------------------------------------------------------------------------------------
# Scores and visibility
# ---------------------------------------------------------------------------------------------

class Scores(NamedTuple):
  """A tile's masked logits, `values * factor` (fp32). factor is 1 except in base-2 kernels with a
  positive softmax scale and not both a bias and a soft cap: there the scale times log2(e) (with
  a bias: log2(e), the values being scale * qk + bias; with a soft cap: cap * log2(e), the values
  being the tanh) stays outside the tile, so the max is taken of raw values and
  exp2(values * factor - m) is one FMA per element. dtanh, with a soft cap, is
  d(capped)/d(logits) = 1 - tanh^2 for the backward (else None)."""
  values: jax.Array
  factor: float
  dtanh: Optional[jax.Array] = None

  def scaled(self) -> jax.Array:
    return self.values if _unit(self.factor) else self.values * self.factor

  def minus(self, rows: jax.Array) -> jax.Array:
    """The logits minus a per-query value already broadcast to the tile (fused when scaled)."""
    return self.values - rows if _unit(self.factor) else self.values * self.factor - rows


def _unit(factor) -> bool:
  """Whether a Scores factor is the constant 1 (a traced factor, an FP8 call's, never is)."""
  return isinstance(factor, (int, float, np.floating)) and factor == 1.0


def scores(qk, ok=None, *, scale: float, bias=None, dt: Dtypes, round_fn: RoundFn = round_convert,
           base2: bool = False, soft_cap: Optional[float] = None, descale=None) -> Scores:
  """Logits of a tile from its product qk = Q K^T (fp32, either orientation).

  scale * qk + bias, soft-capped to soft_cap * tanh(. / soft_cap) when soft_cap is given, rounded
  to the score dtype, in log2 units when base2, and MASKED_SCORE where `ok` (bool, same shape, or
  None = all visible) is False. bias, when given, is in the tile's orientation. Masked scores give
  P = 0 exactly in every later step, with no second select. With the scale kept outside the tile
  (factor != 1, compiled base-2 kernels only) masked scores are -inf: MASKED_SCORE * factor would
  rise above the initial max when factor < 1.
  descale: None, or an fp32 scalar (traced: an FP8 kernel's per-head q and k descale) that qk is
  multiplied by; folded into the scale, so it costs nothing per element. A power of two: exact.
  """
  qk_scale = scale if descale is None else scale * descale
  if base2 and jnp.dtype(dt.score) != jnp.float32:
    raise ValueError(f"base-2 scores need fp32 scores, not {jnp.dtype(dt.score).name}")
  if base2 and bias is None and soft_cap is None and scale > 0:
    s, factor, dtanh = qk, qk_scale * LOG2E, None
  elif base2 and soft_cap is None and scale > 0:
    # With a bias, log2(e) alone stays outside: one FMA per element here, one in exp2's.
    s, factor, dtanh = qk * qk_scale + bias.astype(f32), LOG2E, None
  elif base2 and bias is None and scale > 0:
    # cap * tanh(scale * qk / cap) in log2 units: tanh of the product, with cap * log2(e) kept
    # outside the tile as the factor (one multiply and the tanh per element, then one FMA).
    t = jnp.tanh(qk * (qk_scale / soft_cap))
    s, factor, dtanh = t, soft_cap * LOG2E, 1.0 - t * t
  else:
    s = qk * qk_scale if bias is None else qk * qk_scale + bias.astype(f32)
    dtanh = None
    if soft_cap is not None:
      t = jnp.tanh(s * (1.0 / soft_cap))
      s, dtanh = t * soft_cap, 1.0 - t * t
    s = round_fn(s, dt.score)
    s, factor = (s * LOG2E if base2 else s), 1.0
  if ok is not None:
    s = jnp.where(ok, s, MASKED_SCORE if _unit(factor) else -jnp.inf)
  return Scores(s, factor, dtanh)


def visible(q_pos, k_pos, q_len, kv_len, *, causal: bool, window, mask=None, q_seg=None,
            kv_seg=None, shift=0):
  """Which scores take part: bool [bq, bk] from int32 positions, either q_pos [bq] and k_pos [bk]
  or both already broadcast to the tile's shape (either orientation; Mosaic GPU makes them with
  a layout-aware iota). Segment ids q_seg / kv_seg (int32, shaped like the positions, or None)
  keep only pairs of the same segment.

  Semantics of jax.nn.dot_product_attention: causal keeps k <= q (top-left aligned when T != S),
  window (left, right) keeps q - left <= k <= q + right, lengths mask padding at the end.
  shift (the q_shift operand; int32 scalar): the queries stand at q + shift among the keys (a
  context-parallel shard's first global position). Measured in key coordinates, the query
  positions and q_len move together, so q < q_len still counts the call's own rows.
  """
  rows_cols = lambda a, b: (a[:, None], b[None, :]) if a.ndim == 1 else (a, b)
  q, k = rows_cols(q_pos, k_pos)
  if not (isinstance(shift, int) and shift == 0):
    q, q_len = q + shift, q_len + shift
  ok = (q < q_len) & (k < kv_len)
  if causal:
    ok = ok & (k <= q)
  if window is not None:
    left, right = window
    ok = ok & (k >= q - left) & (k <= q + right)
  if q_seg is not None:
    qs, ks = rows_cols(q_seg, kv_seg)
    ok = ok & (qs == ks)
  if mask is not None:
    ok = ok & mask
  return ok


# ---------------------------------------------------------------------------------------------
# The max adjustment
# ---------------------------------------------------------------------------------------------

def _weyl(q_pos, head, which: int):
  x = (q_pos * _ROW_STEP[which] + head * _HEAD_STEP[which]) & _FIXED_MASK
  return x.astype(f32) * (1.0 / (1 << 24))


def safe_offset(q_pos, head, p_dtype, *, base2: bool = False) -> jax.Array:
  """The per-row exponent offset c of max_adjust="safe": fp32, exp(-c) in [0.55, 0.95].

  q_pos: int32 query positions (any shape); head: int32 query head(s), broadcastable; p_dtype:
  the dtype P is rounded to. In log2 units when base2.
  """
  nmant = jnp.finfo(p_dtype).nmant
  cell = 2.0 ** -(nmant + 1)   # spacing of p_dtype in [0.5, 1)
  cells = jnp.floor(SAFE_WEIGHT_MIN / cell + _weyl(q_pos, head, 1) *
                    ((SAFE_WEIGHT_MAX - SAFE_WEIGHT_MIN) / cell))
  within = _weyl(q_pos, head, 0)
  if nmant <= 3:
    # FP8: w uniform within its cell makes the rounded weight low on average relative to w
    # (E[round(w) / w] = 1 - O(cell^2): 1/w is convex), which showed as -0.05 ulp of O in every
    # row; a density proportional to w makes E[round(w) / w] = 1 exactly. bf16's and fp16's
    # cells are 16 and 128 times finer, where that bias (~1e-4 ulp) is below what the probe
    # resolves, so their offsets stay as measured.
    within = jnp.sqrt(cells * cells + within * (2 * cells + 1)) - cells
  weight = (cells + within) * cell
  return -jnp.log2(weight) if base2 else -jnp.log(weight)


def _above_lowest(x, dtype):
  """x, raised to `dtype`'s lowest finite value when dtype is narrower than fp32 (the "paper"
  preset's scores): a masked score minus a max would round to -inf there. exp of either is 0."""
  if jnp.dtype(dtype) == jnp.float32:
    return x
  return jnp.maximum(x, float(jnp.finfo(dtype).min))


def paper_adjusted_max(s, block_max, beta: float, dt: Dtypes, round_fn: RoundFn = round_convert,
                       *, base2: bool = False, q_axis: int = 0):
  """The paper's per-block rule on masked scores s (an array) and their row max (per query).

  Masked scores are never within the tolerance of a visible block max. A block with no visible
  score counts all its entries as ties (the paper's code fills masked scores with a finite -max,
  so there they tie): the max becomes 0, as it always has here.
  """
  tolerance = PAPER_TIE_TOLERANCE * (LOG2E if base2 else 1.0)
  threshold = round_fn(_above_lowest(block_max - tolerance, dt.score), dt.score)
  close = s >= _rows(threshold, s, q_axis)
  ties = jnp.sum(jnp.where(close, 1.0, 0.0), axis=1 - q_axis) > 1.5
  if s.shape[1 - q_axis] > 1:
    ties = ties | (block_max <= MASKED_SCORE)
  # beta * block_max only where it is used (max > 0): a masked block's max would overflow.
  boosted = round_fn(beta * jnp.maximum(block_max, 0.0), dt.score)
  adjusted = jnp.where(ties & (block_max > 0), boosted, block_max)
  return jnp.where(ties & (adjusted < 0), 0.0, adjusted)


# ---------------------------------------------------------------------------------------------
# Forward: the online-softmax step, split around the PV product
# ---------------------------------------------------------------------------------------------

class RowStats(NamedTuple):
  """Running statistics of the query rows of one tile (fp32, holding values of their dtypes)."""
  m: jax.Array    # running (possibly adjusted) max, in the scores' units
  l: jax.Array    # running sum of P_bar


def initial_max(score_dtype) -> float:
  """The running max before any key: the score dtype's lowest finite value, for fp32 one step
  above MASKED_SCORE, so that exp(MASKED_SCORE - m) is 0 (m - MASKED_SCORE >= 2^104) while no
  visible score (>= MASKED_SCORE + 2^104, i.e. all but the lowest fp32 value) is below it."""
  if jnp.dtype(score_dtype) == jnp.float32:
    return float(np.nextafter(np.float32(MASKED_SCORE), np.float32(0)))
  return float(jnp.finfo(score_dtype).min)


def init_stats(rows: int, dt: Dtypes) -> RowStats:
  return RowStats(jnp.full((rows,), initial_max(dt.score), f32), jnp.zeros((rows,), f32))


def rescale(stats: RowStats, s: Scores, *, dt: Dtypes, max_adjust: str, beta: float,
            offset=None, round_fn: RoundFn = round_convert, base2: bool = False, q_axis: int = 0,
            split_top: bool = False):
  """Folds one key block's masked scores (from `scores`) into the row statistics.

  Returns (p, alpha, stats): P_bar * dt.p_scale in dt.p (the PV operand: `pv_product`; fp32
  holding dt.p's values and, at each row's top key, dt.p_top's, where that is set), the
  factor alpha (fp32, per query) by which the O accumulator must be rescaled, and the new
  statistics. offset: per query, from `safe_offset` in the same units, when max_adjust="safe".
  With fp32 scores the pre-cast scale is folded into the exponent (exp(s - (m - log p_scale)), one
  per-row subtraction instead of a multiply per element; within fp32 rounding of P_bar * p_scale).

  split_top (an FP8 P, for kernels whose 8-bit operands cannot hold a finer top key): p is
  (head, residual) instead, head P_bar * dt.p_scale cast to dt.p, residual None where dt.p_top
  is not wider than dt.p (`has_top_residual`), else what the top keys keep beyond head, in dt.p
  too and 0 elsewhere: head V + residual V, two FP8 products into one fp32 accumulator, is the
  fp32 p's P_bar V. The residual is one value per row (the top keys share their score), so
  it costs a compare and a select per element. Exact for a bf16 top key: bf16(x) - e4m3(x) is
  a whole number of x's bf16 spacings, at most half e4m3's spacing (8 of them) plus half of one,
  so at most 8: four significant bits, an e4m3 value wherever it is not below e4m3's subnormal
  spacing 2^-9 (x >= 2^-2, i.e. P_bar >= 2^-10 under a 2^8 pre-cast scale; below, within 2^-10
  of it: half that spacing).
  """
  exp = jnp.exp2 if base2 else jnp.exp
  k_axis = 1 - q_axis
  if dt.dither_out and offset is not None:   # the maximum's weight on P's grid: exact
    # (per row, each block: a kernel's softmax pays it per row, not per score)
    offset = p_grid_offset(offset, dt.p, round_fn=round_fn, base2=base2)
  singled = dt.sum_keeps_max or dt.p_top is not None   # the numerics single the top keys out
  top_score = None   # each row's largest score: raw, before the factor
  if max_adjust != "paper" or singled:
    top_score = jnp.max(s.values, axis=k_axis)
  if max_adjust == "paper":
    scaled = s.scaled()
    block_max = paper_adjusted_max(scaled, jnp.max(scaled, axis=k_axis), beta, dt, round_fn,
                                   base2=base2, q_axis=q_axis)
  else:
    block_max = top_score if _unit(s.factor) else top_score * s.factor   # factor > 0 commutes
  m_new = jnp.maximum(stats.m, block_max)
  tile_rows = lambda x: _rows(x, s.values, q_axis)
  p_top = None   # the top keys' P_bar * p_scale, per row, where the numerics single them out
  if jnp.dtype(dt.score) == jnp.float32:
    shift = m_new if offset is None else m_new + offset
    if dt.p_scale != 1:
      shift = shift - float(np.log2(dt.p_scale) if base2 else np.log(dt.p_scale))
    p = exp(s.minus(tile_rows(shift)))
    if dt.p_top is not None:
      p_top = exp((top_score if _unit(s.factor) else top_score * s.factor) - shift)
  else:
    shifted = round_fn(_above_lowest(s.minus(tile_rows(m_new)), dt.score), dt.score)
    p = exp(shifted if offset is None else shifted - tile_rows(offset))
    p = p if dt.p_scale == 1 else p * dt.p_scale
    if dt.p_top is not None:
      p_top = jnp.max(p, axis=k_axis)
  p_low = operand(p, dt.p, round_fn)
  if singled:
    top = s.values >= tile_rows(top_score)
  low32 = p_low.astype(f32) if dt.sum_of_rounded_p or dt.p_top is not None else None
  residual = None
  if dt.p_top is not None:   # the top key's P_bar on a finer grid than `p`: one value per row
    wide = operand(p_top, dt.p_top, round_fn).astype(f32)
    residual = jnp.where(top, tile_rows(wide - operand(p_top, dt.p, round_fn).astype(f32)), 0.0)
  alpha = exp(round_fn(_above_lowest(stats.m - m_new, dt.score), dt.score))
  summed = p
  if dt.sum_of_rounded_p:
    if dt.sum_keeps_max:   # the block's top key unrounded in l: safe's dither on the max stays out
      summed = jnp.where(top, p, low32)
    else:
      summed = low32 if residual is None else low32 + residual
  row_sum = jnp.sum(summed, axis=k_axis)
  if dt.p_scale != 1:
    row_sum = row_sum * (1.0 / dt.p_scale)
  l_new = round_fn(round_fn(round_fn(alpha, dt.sum) * stats.l, dt.sum) + round_fn(row_sum, dt.sum),
                   dt.sum)
  if split_top:
    p_out = (p_low, operand(residual, dt.p, round_fn) if has_top_residual(dt) else None)
  else:   # pv_product takes fp32 where the top key is finer
    p_out = p_low if residual is None else low32 + residual
  return p_out, alpha, RowStats(m_new, l_new)


def has_top_residual(dt: Dtypes) -> bool:
  """Whether an FP8 P's top keys keep their P_bar on a finer grid (dt.p_top wider than 8 bits):
  `rescale(split_top=True)`'s residual."""
  return dt.p_top is not None and jnp.dtype(dt.p_top).itemsize > 1


def pv_product(p, v, dt: Dtypes) -> jax.Array:
  """One key block's P_bar V, fp32 (what `accumulate` adds): p as `rescale` returns it, V cast to
  dt.p -- or kept in its own dtype where P_bar is FP8 (V's own quantization is not P's; the FP8
  values are exact in V's dtype) -- and the product divided by dt.p_scale (exact)."""
  if jnp.dtype(dt.p).itemsize == 1:
    # FP8 values, exact in V's dtype; with dt.p_top, fp32 also holding the top key's P_bar
    wide = dt.p_top is not None and jnp.dtype(dt.p_top).itemsize > jnp.dtype(v.dtype).itemsize
    pv = matmul(p, v.astype(f32)) if wide else matmul(p.astype(v.dtype), v)
  else:
    pv = matmul(p, v.astype(dt.p))
  return pv if dt.p_scale == 1 else pv * (1.0 / dt.p_scale)


def scale_acc(acc, alpha, *, dt: Dtypes, round_fn: RoundFn = round_convert, q_axis: int = 0):
  """The O accumulator rescaled by alpha, before this block's PV is added."""
  return round_fn(acc * _rows(round_fn(alpha, dt.acc), acc, q_axis), dt.acc)


def accumulates_in_place(dt: Dtypes) -> bool:
  """Whether an MMA may add PV straight into the rescaled accumulator (`scale_acc` then MMA):
  true when neither PV nor the accumulator is rounded below fp32."""
  return jnp.dtype(dt.pv) == jnp.float32 and jnp.dtype(dt.acc) == jnp.float32


def accumulate(acc, alpha, pv, *, dt: Dtypes, round_fn: RoundFn = round_convert, q_axis: int = 0):
  """O accumulator after one key block: acc * alpha + PV, with PV (fp32 product) rounded to dt.pv
  and the sum to dt.acc."""
  scaled = scale_acc(acc, alpha, dt=dt, round_fn=round_fn, q_axis=q_axis)
  return round_fn(scaled + round_fn(pv, dt.pv), dt.acc)


def finalize(acc, stats: RowStats, *, dt: Dtypes, offset=None, round_fn: RoundFn = round_convert,
             base2: bool = False, q_axis: int = 0, sink=None):
  """-> (O in the input dtype, residual O in dt.residual_o, LSE fp32 per query, natural units).

  Rows that saw no visible key (l == 0, acc == 0) give O = 0 and LSE = EMPTY_ROW_LSE, so the
  backward's P = exp(S - LSE) is 0 there and their gradients are zero, never NaN.

  sink: None, or the row's attention-sink logit (fp32, natural units, broadcastable to the rows;
  finite): a term exp(sink) in the denominator with no value. It joins here, after the keys, so
  the P_bar tiles (and the max adjustment's guarantees on them) are those without a sink: O is
  scaled once in fp32 by exp(LSE_keys - LSE), with LSE = logaddexp(LSE_keys, sink), which is
  exact for any sink (above or below the row max). A row without keys then has O = 0 and LSE =
  sink.
  """
  empty = stats.l == 0.0
  l_safe = jnp.where(empty, 1.0, stats.l)
  o_exact = acc / _rows(l_safe, acc, q_axis)
  if dt.dither_out and offset is not None:
    o_exact = o_exact * _rows(output_dither(offset, dt, round_fn=round_fn, base2=base2), acc,
                              q_axis)
    offset = p_grid_offset(offset, dt.p, round_fn=round_fn, base2=base2)   # `rescale`'s
  m = stats.m if offset is None else stats.m + offset
  lse = m * LN2 + jnp.log(l_safe) if base2 else m + jnp.log(l_safe)
  if sink is None:
    lse = jnp.where(empty, EMPTY_ROW_LSE, lse)
  else:
    lse, kept = join_sink(lse, empty, jnp.asarray(sink, f32))
    o_exact = o_exact * _rows(kept, acc, q_axis)
  o = round_fn(o_exact, dt.out).astype(dt.input)
  # The fp32 residual skips the output rounding: delta then sees O before it is rounded.
  residual = o_exact if jnp.dtype(dt.residual_o) == jnp.float32 else o
  return o, residual.astype(dt.residual_o), lse


def p_grid_offset(offset, p_dtype, *, round_fn: RoundFn = round_convert, base2: bool = False):
  """Numerics.dither="out": per query, the exponent offset "safe" then uses, -log(round(w)) with
  w = exp(-offset) rounded to P's dtype `p_dtype`: the row maximum's P_bar is that grid value, which the
  cast keeps exactly (e4m3's 9/16..15/16 for w in [0.55, 0.95]), while every other P_bar of the
  row sits at its own place on P's grid, row to row (without it, rows sharing their scores round
  alike: a drift of up to -0.07 ulp in the probe with FP8 q, k, v; docs/fp8.md)."""
  exp, log = (jnp.exp2, jnp.log2) if base2 else (jnp.exp, jnp.log)
  return -log(round_fn(exp(-offset), p_dtype))


def output_dither(offset, dt: Dtypes, *, round_fn: RoundFn = round_convert, base2: bool = False):
  """max_adjust="safe" with Numerics.dither="out": per query, the factor (fp32) that O is
  multiplied by before its rounding, round(w) / w with w = exp(-offset) (`safe_offset`, computed
  on the output dtype's grid) and round() the output dtype's. A row of tied maxima then gets the
  multiplicative error "max" gives it where P_bar is rounded to the output dtype -- up in some
  rows, down in others, so O's half-way cases round both ways -- while the maximum's own P_bar
  stays exact (`p_grid_offset`)."""
  w = (jnp.exp2 if base2 else jnp.exp)(-offset)
  return round_fn(w, dt.input) / w


def no_visible_key(lse):
  """A backend's LSE -> True where its row saw no visible key (and no sink): EMPTY_ROW_LSE, or
  -inf where the caller asked for the LSE (flash.public_lse)."""
  return (lse == EMPTY_ROW_LSE) | (lse == -jnp.inf)


def join_sink(lse, empty, sink):
  """(LSE, kept): a row's log-sum-exp over its keys (`lse`, fp32; `empty` where it saw none) with
  an attention sink's logit (fp32, finite) joined in, and the factor exp(LSE_keys - LSE) its O
  keeps. A row without keys has LSE = sink and keeps nothing of its (zero) O."""
  # Its keys' LSE gets the sink as a finite stand-in (-inf would be the value: no step may make
  # an infinity, see MASKED_SCORE), replaced in both results.
  lse_keys = jnp.where(empty, sink, lse)
  # logaddexp by hand: jnp.logaddexp is a custom_jvp, which Mosaic GPU kernels cannot lower.
  top = jnp.maximum(lse_keys, sink)
  lse = jnp.where(empty, sink, top + jnp.log(jnp.exp(lse_keys - top) + jnp.exp(sink - top)))
  kept = jnp.where(empty, 0.0, jnp.exp(lse_keys - lse))
  return lse, kept


def merge_blocks(outs, lses, *, sink=None):
  """Attention over the union of disjoint key blocks from each block's own result (a ring
  step's): outs O_i [B, T, N, H] (any float dtype), lses LSE_i fp32 [B, N, T] as the kernels
  return them (EMPTY_ROW_LSE where a row saw no key of the block). -> (O fp32, LSE fp32): LSE =
  log sum_i exp(LSE_i) and O = sum_i exp(LSE_i - LSE) O_i, in fp32. sink: None, or per-head
  logits [N] joined after the keys as in `finalize` (the blocks' own results without it). A row
  that saw no key of any block: O = 0 and LSE = EMPTY_ROW_LSE (or the sink)."""
  stack = jnp.stack(lses)                                    # [blocks, B, N, T]
  empty = stack == EMPTY_ROW_LSE
  none = jnp.all(empty, axis=0)
  top = jnp.max(jnp.where(empty, -EMPTY_ROW_LSE, stack), axis=0)
  top = jnp.where(none, 0.0, top)
  # Finite everywhere (an empty block's weight is made from `top` itself, then zeroed).
  weights = jnp.where(empty, 0.0, jnp.exp(jnp.where(empty, top, stack) - top))
  total = jnp.where(none, 1.0, jnp.sum(weights, axis=0))
  lse = jnp.where(none, EMPTY_ROW_LSE, top + jnp.log(total))
  to_rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]      # [B, N, T] -> [B, T, N, 1]
  o = sum(to_rows(w / total) * o_i.astype(f32) for w, o_i in zip(weights, outs))
  if sink is not None:
    lse, kept = join_sink(lse, none, jnp.asarray(sink, f32)[None, :, None])
    o = o * to_rows(kept)
  return o, lse


def sink_grad(sinks, lse, shifted_delta):
  """d(loss)/d(sinks) [N] fp32 from the sinks [N], the LSE with the sinks [B, N, T] and the rows'
  delta - dLSE [B, N, T]: the sink's probability is exp(sink - LSE) and its value is 0, so its
  logit's gradient is -P_sink * (delta - dLSE), summed over batch and rows."""
  # P_sink <= 1 since the LSE holds the sink; the clamp also keeps XLA 0.12's GPU reduction
  # fusion from returning NaN for a sink above 88 (seen on an H200: it evaluates this product
  # as inf * 0 there; 0.11 and the CPU do not).
  p_sink = jnp.exp(jnp.minimum(sinks.astype(f32)[None, :, None] - lse, 0.0))
  return -jnp.sum(p_sink * shifted_delta, axis=(0, 2))


# ---------------------------------------------------------------------------------------------
# Backward (flash backward: delta pre-pass, then dK/dV and dQ)
# ---------------------------------------------------------------------------------------------

def delta(do, o_residual) -> jax.Array:
  """delta = rowsum(dO * O): fp32 per row, from dO [..., H] and the saved O residual."""
  return jnp.sum(do.astype(f32) * o_residual.astype(f32), axis=-1)


class TileGrads(NamedTuple):
  p: jax.Array      # P in the input dtype: the operand of dV += P^T dO
  ds: jax.Array     # dS = P * (dP - delta) in fp32: the gradient of the logits (dbias)
  ds_op: jax.Array  # dS in the input dtype: the operand of dQ += dS K and dK += dS^T Q


def backward_p(s: Scores, lse, *, in_dtype, round_fn: RoundFn = round_convert, base2: bool = False,
               q_axis: int = 0):
  """P = exp(S - LSE) of one tile from masked scores (`scores`, the forward's units) and the saved
  LSE (per query, fp32, natural units) -> (dS's factor: P fp32, times the soft cap's dtanh
  (`Scores.dtanh`) when there is one; P in the input dtype: the dV operand). The factor is formed
  here so that a kernel keeps one fp32 tile, not P and dtanh, until dP arrives."""
  exp = jnp.exp2 if base2 else jnp.exp
  p = exp(s.minus(_rows(lse * LOG2E if base2 else lse, s.values, q_axis)))
  return (p if s.dtanh is None else p * s.dtanh), operand(p, in_dtype, round_fn)


def backward_ds(p_factor, dp, delta_rows, *, in_dtype, round_fn: RoundFn = round_convert,
                q_axis: int = 0):
  """dS = P * dtanh * (dP - delta) from `backward_p`'s factor (P * dtanh, or P without a soft cap),
  dP = dO V^T (fp32, same orientation) and delta (per query) -> (dS fp32: the gradient of
  scale * QK^T + bias, dS in the input dtype: the dQ/dK operand)."""
  ds = p_factor * (dp - _rows(delta_rows, dp, q_axis))
  return ds, operand(ds, in_dtype, round_fn)


def backward_tile(s: Scores, lse, dp, delta_rows, *, in_dtype, round_fn: RoundFn = round_convert,
                  base2: bool = False, q_axis: int = 0) -> TileGrads:
  """One tile of the flash backward: `backward_p` then `backward_ds` (kernels that issue the dV
  product between the two call them separately).

  dQ and dK are then scale * (dS K) and scale * (dS^T Q), accumulated in fp32.
  """
  p_factor, p_op = backward_p(s, lse, in_dtype=in_dtype, round_fn=round_fn, base2=base2,
                              q_axis=q_axis)
  ds, ds_op = backward_ds(p_factor, dp, delta_rows, in_dtype=in_dtype, round_fn=round_fn,
                          q_axis=q_axis)
  return TileGrads(p_op, ds, ds_op)


class Fp8RowScale(NamedTuple):
  running: jax.Array   # per row: the largest |value| over the blocks seen (fp32, 0 before any)
  scale: jax.Array     # per row: the power of two the row's values are multiplied by for e4m3
  ratio: jax.Array     # scale / the previous block's scale (<= 1): the accumulator's rescale


def fp8_row_scale(running, block, *, largest: float = 448.0, q_axis: int = 0) -> Fp8RowScale:
  """The FP8 backward's scale of an operand it makes as it goes (dS, issue 49; docs/fp8.md, "The
  backward in FP8"): per row of a tile `block` (fp32, rows on q_axis), the running largest |value|
  over the blocks seen (`running`, per row, 0 at first) and the largest power of two under which
  it stays at or below `largest` (e4m3's 448; for a running max of 0 or a subnormal one, 2^127:
  the row is all zeros or below every e4m3 value anyway). The products of the scaled block go into
  an fp32 accumulator that is first multiplied by `ratio` (exact: powers of two; at least 2^-126,
  past which the rows so far were zero or subnormal), and the result is divided by the last
  scale. From the bits of the running max, so that it is exact and needs no log2 or division: a
  max m = 1.f * 2^e takes 2^(E - e) when 1.f <= largest's own mantissa 1.F (largest = 1.F * 2^E),
  else 2^(E - 1 - e)."""
  new = jnp.maximum(running, jnp.max(jnp.abs(block), axis=1 - q_axis))
  e_max, f_max = divmod(int(np.float32(largest).view(np.int32)), 1 << 23)
  k_new, k_old = (_exponent_under(m, e_max, f_max) for m in (new, running))
  return Fp8RowScale(new, _power_of_two(k_new), _power_of_two(k_new - k_old))


def _exponent_under(m, e_max: int, f_max: int):
  """k, the largest with m * 2^k <= largest (`fp8_row_scale`), capped at 127."""
  bits = lax.bitcast_convert_type(m, jnp.int32)   # m >= 0: no sign bit
  exponent = lax.shift_right_logical(bits, jnp.int32(23))   # biased
  mantissa = lax.bitwise_and(bits, jnp.int32((1 << 23) - 1))
  k = jnp.where(mantissa <= f_max, e_max, e_max - 1) - exponent   # the biases cancel
  return jnp.minimum(k, 127)


def _power_of_two(k):
  """2^k in fp32 for int32 k, k clamped to fp32's normal exponents [-126, 127]."""
  k = jnp.clip(k, -126, 127)
  return lax.bitcast_convert_type(lax.shift_left(k + 127, jnp.int32(23)), f32)


# ---------------------------------------------------------------------------------------------
# Monitoring
# ---------------------------------------------------------------------------------------------

def tied_rows(s, ok, dtype) -> jax.Array:
  """bool [..., rows]: rows where two or more P_bar = exp(S - max) round to exactly 1 in `dtype`.

  s: scores [..., rows, cols] in natural units; ok: visibility of the same shape (or None).
  That is what the PV product sees under max_adjust="off" (in bf16 anything within ~0.002 of the
  max becomes 1.0), the trigger of the paper's biased rounding.
  """
  if ok is not None:
    s = jnp.where(ok, s, MASKED_SCORE)
  ones = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)).astype(dtype) == 1
  if ok is not None:   # a row with no visible key has max MASKED_SCORE, so P_bar = 1 everywhere
    ones = ones & ok
  return jnp.sum(ones.astype(jnp.int32), axis=-1) > 1
