"""The whole fix in one place: the max adjustment and the online-softmax step, on tiles.

Every implementation (the blockwise reference, the XLA path, the Pallas GPU and TPU kernels) calls
these functions on [block_q, block_k] score tiles; they differ only in how tiles reach memory.
Everything is plain jnp that lowers in Pallas (Triton and Mosaic): fp32 arithmetic with explicit
rounding points taken from `numerics.Dtypes`, 1-D row statistics of shape [block_q].

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
           changes: softmax is shift invariant and the log-sum-exp is m + c + log l.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from stable_attn.numerics import Dtypes

MAX_ADJUST_MODES = ("off", "paper", "safe")
PAPER_TIE_TOLERANCE = 1e-3
SAFE_WEIGHT_MIN, SAFE_WEIGHT_MAX = 0.55, 0.95   # range of the largest P_bar under "safe"
# Log-sum-exp of a row with no visible key: exp(S - LSE) is then 0 for every score.
EMPTY_ROW_LSE = 1e30

# Weyl sequences in 24-bit fixed point: consecutive query positions spread evenly over [0, 1).
_ROW_STEP = (10368889, 12664881)    # round(0.6180339887 * 2**24), round(0.7548776662 * 2**24)
_HEAD_STEP = (5698259, 9256969)     # round(0.3396 * 2**24), round(0.5517 * 2**24), odd
_FIXED_MASK = (1 << 24) - 1

f32 = jnp.float32


def round_convert(x: jax.Array, dtype) -> jax.Array:
  """Rounds fp32 `x` to `dtype`'s precision and back; the kernels' rounding (a real conversion)."""
  if jnp.dtype(dtype) == jnp.float32:
    return x
  return x.astype(dtype).astype(f32)


def round_exact(x: jax.Array, dtype) -> jax.Array:
  """Like `round_convert`, but XLA may never elide it (used by the jnp implementations)."""
  info = jnp.finfo(dtype)
  if jnp.dtype(dtype) == jnp.float32:
    return x
  return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


RoundFn = Callable[[jax.Array, object], jax.Array]


def _precision(dtype):
  # fp32 inputs get true fp32 products (no TF32): fp32 results must stay far under 1e-3 error.
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def matmul(a: jax.Array, b: jax.Array, *, transpose_a=False, transpose_b=False) -> jax.Array:
  """a @ b (optionally transposed operands) with fp32 accumulation."""
  contract_a = 0 if transpose_a else 1
  contract_b = 1 if transpose_b else 0
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         precision=_precision(a.dtype), preferred_element_type=f32)


# ---------------------------------------------------------------------------------------------
# Scores and visibility
# ---------------------------------------------------------------------------------------------

def scores(q, k, scale: float, bias, dt: Dtypes, round_fn: RoundFn = round_convert):
  """S = scale * q k^T (+ bias), rounded to the score dtype; fp32 [bq, bk]."""
  s = matmul(q, k, transpose_b=True) * scale
  if bias is not None:
    s = s + bias.astype(f32)
  return round_fn(s, dt.score)


def visible(q_pos, k_pos, q_len, kv_len, *, causal: bool, window, mask=None):
  """Which scores take part: bool [bq, bk] from positions q_pos [bq], k_pos [bk] (int32).

  Semantics of jax.nn.dot_product_attention: causal keeps k <= q (top-left aligned when T != S),
  window (left, right) keeps q - left <= k <= q + right, lengths mask padding at the end.
  """
  q = q_pos[:, None]
  k = k_pos[None, :]
  ok = (q < q_len) & (k < kv_len)
  if causal:
    ok = ok & (k <= q)
  if window is not None:
    left, right = window
    ok = ok & (k >= q - left) & (k <= q + right)
  if mask is not None:
    ok = ok & mask
  return ok


def _weyl(q_pos, head, which: int):
  x = (q_pos * _ROW_STEP[which] + head * _HEAD_STEP[which]) & _FIXED_MASK
  return x.astype(f32) * (1.0 / (1 << 24))


def safe_offset(q_pos, head, p_dtype) -> jax.Array:
  """The per-row exponent offset c of max_adjust="safe": fp32 [bq], exp(-c) in [0.55, 0.95].

  q_pos: int32 [bq] query positions; head: int32 query head; p_dtype: the dtype P is rounded to.
  """
  cell = 2.0 ** -(jnp.finfo(p_dtype).nmant + 1)   # spacing of p_dtype in [0.5, 1)
  cells = jnp.floor(SAFE_WEIGHT_MIN / cell + _weyl(q_pos, head, 1) *
                    ((SAFE_WEIGHT_MAX - SAFE_WEIGHT_MIN) / cell))
  weight = (cells + _weyl(q_pos, head, 0)) * cell
  return -jnp.log(weight)


def paper_adjusted_max(s, block_max, beta: float, dt: Dtypes, round_fn: RoundFn = round_convert):
  """The paper's per-block rule on masked scores s [bq, bk] and their row max [bq]."""
  close = s >= round_fn(block_max - PAPER_TIE_TOLERANCE, dt.score)[:, None]
  ties = jnp.sum(close.astype(jnp.int32), axis=-1) > 1
  adjusted = jnp.where(ties & (block_max > 0), round_fn(beta * block_max, dt.score), block_max)
  return jnp.where(ties & (adjusted < 0), 0.0, adjusted)


# ---------------------------------------------------------------------------------------------
# Forward: the online-softmax step
# ---------------------------------------------------------------------------------------------

class SoftmaxState(NamedTuple):
  """Running statistics of one query block (all fp32, holding values of their rounding dtypes)."""
  m: jax.Array    # [bq] running (possibly adjusted) max
  l: jax.Array    # [bq] running sum of P_bar
  acc: jax.Array  # [bq, H] running P_bar V


def init_state(block_q: int, head_dim: int, dt: Dtypes) -> SoftmaxState:
  m = jnp.full((block_q,), jnp.finfo(dt.score).min, f32)
  return SoftmaxState(m, jnp.zeros((block_q,), f32), jnp.zeros((block_q, head_dim), f32))


def online_softmax_step(state: SoftmaxState, s, ok, v, *, dt: Dtypes, max_adjust: str,
                        beta: float, offset=None, round_fn: RoundFn = round_convert):
  """Folds one key block into the state.

  Args:
    s: fp32 [bq, bk] scores from `scores`; ok: bool [bq, bk] from `visible` or None (all visible).
    v: [bk, H] values in the input dtype. offset: [bq] from `safe_offset` when max_adjust="safe".
  """
  if ok is not None:
    s = jnp.where(ok, s, jnp.finfo(dt.score).min)  # finite fill, as the paper's code
  block_max = jnp.max(s, axis=-1)
  if max_adjust == "paper":
    block_max = paper_adjusted_max(s, block_max, beta, dt, round_fn)
  m_new = jnp.maximum(state.m, block_max)
  shifted = round_fn(s - m_new[:, None], dt.score)
  if offset is not None:
    shifted = shifted - offset[:, None]
  p = jnp.exp(shifted)
  if ok is not None:
    p = jnp.where(ok, p, 0.0)
  # Round through round_fn first: XLA may elide a bare f32->bf16->f32 pair around the dot.
  p_low = round_fn(p, dt.p).astype(dt.p)
  alpha = jnp.exp(round_fn(state.m - m_new, dt.score))
  row_sum = jnp.sum(p_low.astype(f32) if dt.sum_of_rounded_p else p, axis=-1)
  l_new = round_fn(round_fn(round_fn(alpha, dt.sum) * state.l, dt.sum) + round_fn(row_sum, dt.sum),
                   dt.sum)
  pv = round_fn(matmul(p_low, v.astype(dt.p)), dt.pv)
  acc_new = round_fn(round_fn(state.acc * round_fn(alpha, dt.acc)[:, None], dt.acc) + pv, dt.acc)
  return SoftmaxState(m_new, l_new, acc_new)


def finalize(state: SoftmaxState, *, dt: Dtypes, offset=None, round_fn: RoundFn = round_convert):
  """-> (O [bq, H] in the input dtype, residual O [bq, H] in dt.residual_o, LSE fp32 [bq]).

  Rows that saw no visible key (l == 0) give O = 0 and LSE = EMPTY_ROW_LSE, so the backward's
  P = exp(S - LSE) is 0 there and their gradients are zero, never NaN.
  """
  empty = state.l == 0.0
  l_safe = jnp.where(empty, 1.0, state.l)
  o_exact = jnp.where(empty[:, None], 0.0, state.acc / l_safe[:, None])
  o = round_fn(o_exact, dt.out).astype(dt.input)
  m = state.m if offset is None else state.m + offset
  lse = jnp.where(empty, EMPTY_ROW_LSE, m + jnp.log(l_safe))
  # The fp32 residual skips the output rounding: delta then sees O before it is rounded.
  residual = o_exact if dt.residual_o == jnp.float32 else o
  return o, residual.astype(dt.residual_o), lse


# ---------------------------------------------------------------------------------------------
# Backward tile math (flash backward: delta pre-pass, then dK/dV and dQ)
# ---------------------------------------------------------------------------------------------

def delta(do, o_residual) -> jax.Array:
  """delta = rowsum(dO * O): fp32 [bq] from dO [bq, H] and the saved O residual."""
  return jnp.sum(do.astype(f32) * o_residual.astype(f32), axis=-1)


def probabilities(s, lse, ok) -> jax.Array:
  """Normalised P = exp(S - LSE), fp32 [bq, bk], zero where not visible."""
  p = jnp.exp(s - lse[:, None])
  return p if ok is None else jnp.where(ok, p, 0.0)


def score_grad(p, dp, delta_rows) -> jax.Array:
  """dS = P * (dP - delta): fp32 [bq, bk] (the gradient w.r.t. the scaled, biased scores)."""
  return p * (dp - delta_rows[:, None])


# ---------------------------------------------------------------------------------------------
# Monitoring
# ---------------------------------------------------------------------------------------------

def tied_rows(s, ok, dtype) -> jax.Array:
  """bool [bq]: rows where two or more P_bar = exp(S - max) round to exactly 1 in `dtype`.

  That is what the PV product sees under max_adjust="off" (in bf16 anything within ~0.002 of the
  max becomes 1.0), the trigger of the paper's biased rounding.
  """
  if ok is not None:
    s = jnp.where(ok, s, -jnp.inf)
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)).astype(dtype)
  return jnp.sum((p == 1).astype(jnp.int32), axis=-1) > 1
