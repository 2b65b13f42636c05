"""References: exact textbook attention (ground truth) and the blockwise FA2 emulation.

`exact_attention` / `exact_attention_vjp` are NumPy, float64 by default (or float32): independent of
JAX and of the tile module, used as ground truth by tests and the bias probe. The backward there uses
dS = P * (dP - rowsum(dP * P) + dLSE), not delta from O; sinks are one more score column.

`blockwise_attention` is `implementation="reference"`: pure jnp, the same tile math and block order
as the kernels (online softmax over key blocks with causal/window skipping; backward as a delta
pre-pass, a dQ pass over key blocks and a dK/dV pass over query blocks), with every rounding point of
the chosen `Numerics` done exactly. It runs on any backend and is differentiable (custom VJP).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple, Optional

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from stable_attn import blocks, tile
from stable_attn.flash import make_flash_attention, reduce_to_shape, shifted_delta
from stable_attn.layout import Geometry, Padded, heads_major, pad_operands, pad_to, unpad
from stable_attn.numerics import Dtypes, Numerics
from stable_attn.spec import LSE_AXES, OPERANDS, ROW_AXES, AttentionSpec, Lengths, Operands

KV_AXES = OPERANDS["k"].axes

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64


# ---------------------------------------------------------------------------------------------
# Exact attention (NumPy)
# ---------------------------------------------------------------------------------------------

def _exact_visibility(B, N, T, S, mask, is_causal, q_lens, kv_lens, window, q_seg, kv_seg):
  qi = np.arange(T)[:, None]
  kj = np.arange(S)[None, :]
  ok = np.ones((B, N, T, S), bool)
  if mask is not None:
    ok &= np.broadcast_to(np.asarray(mask, bool), (B, N, T, S))
  if is_causal:
    ok &= (kj <= qi)[None, None]
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    ok &= ((kj >= qi - left) & (kj <= qi + right))[None, None]
  if q_lens is not None:
    ok &= (np.arange(T)[None, :] < np.asarray(q_lens)[:, None])[:, None, :, None]
  if kv_lens is not None:
    ok &= (np.arange(S)[None, :] < np.asarray(kv_lens)[:, None])[:, None, None, :]
  if q_seg is not None:
    q_seg = np.asarray(q_seg)
    kv_seg = q_seg if kv_seg is None else np.asarray(kv_seg)
    ok &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
  return ok


class _Exact(NamedTuple):
  q: np.ndarray        # [B, T, N, H]
  k: np.ndarray        # [B, S, N, H], kv heads repeated
  v: np.ndarray
  p: np.ndarray        # [B, N, T, S] softmax weights of the keys
  p_sink: np.ndarray   # [B, N, T] the sink's weight (0 without sinks)
  lse: np.ndarray      # [B, N, T] log of the denominator (-inf for a row with nothing in it)
  scale: float
  dtanh: object        # d(capped logits)/d(logits) [B, N, T, S], or None


def _exact_probs(q, k, v, bias, mask, scale, is_causal, q_lens, kv_lens, window, q_seg, kv_seg,
                 soft_cap, sinks, dtype) -> _Exact:
  """Softmax over the visible keys and, with sinks, one more column per row: the head's sink
  logit, always visible, with no value."""
  q, k, v = (np.asarray(x).astype(dtype) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  k = np.repeat(k, N // K, axis=2)
  v = np.repeat(v, N // K, axis=2)
  scale = 1.0 / np.sqrt(H) if scale is None else scale
  s = np.einsum("btnh,bsnh->bnts", q, k) * dtype(scale)
  if bias is not None:
    s = s + np.asarray(bias).astype(dtype)
  dtanh = None
  if soft_cap is not None:
    t = np.tanh(s / dtype(soft_cap))
    s, dtanh = t * dtype(soft_cap), 1 - t * t
  ok = _exact_visibility(B, N, T, S, mask, is_causal, q_lens, kv_lens, window, q_seg, kv_seg)
  s = np.where(ok, s, -np.inf)
  if sinks is not None:
    sink_col = np.broadcast_to(np.asarray(sinks).astype(dtype)[None, :, None, None], (B, N, T, 1))
    s, ok = np.concatenate([s, sink_col], -1), np.concatenate([ok, np.ones_like(ok[..., :1])], -1)
  row_max = np.max(s, axis=-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  e = np.where(ok, np.exp(s - row_max), 0.0)
  l = e.sum(-1, keepdims=True)
  p = e / np.where(l == 0, 1.0, l)
  with np.errstate(divide="ignore"):
    lse = (row_max + np.log(l))[..., 0]
  p_sink = p[..., S] if sinks is not None else np.zeros((B, N, T), dtype)
  return _Exact(q, k, v, p[..., :S], p_sink, lse, scale, dtanh)


def exact_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                    q_segment_ids=None, kv_segment_ids=None, logits_soft_cap=None, sinks=None,
                    dtype=np.float64) -> np.ndarray:
  """Textbook softmax attention in NumPy `dtype`; same arguments and layout as the public API.

  Returns O [B,T,N,H] in `dtype`; rows with no visible key are 0.
  """
  x = _exact_probs(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                   key_value_seq_lengths, local_window_size, q_segment_ids, kv_segment_ids,
                   logits_soft_cap, sinks, dtype)
  return np.einsum("bnts,bsnh->btnh", x.p, x.v)


class ExactVJP(NamedTuple):
  out: np.ndarray      # O [B, T, N, H]
  dq: np.ndarray
  dk: np.ndarray
  dv: np.ndarray
  dbias: object        # shaped like bias, or None
  lse: np.ndarray      # [B, N, T]
  dsinks: object       # [N], or None


def exact_attention_vjp(query, key, value, d_out, bias=None, mask=None, *, scale=None,
                        is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
                        logits_soft_cap=None, sinks=None, d_lse=None,
                        dtype=np.float64) -> ExactVJP:
  """Values and gradients, all NumPy `dtype`, for the cotangents d_out [B,T,N,H] and (optional)
  d_lse [B,N,T]. With sinks, the sink is one more score column (no value) and its gradient is
  that column's dS summed over batch and rows."""
  x = _exact_probs(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                   key_value_seq_lengths, local_window_size, q_segment_ids, kv_segment_ids,
                   logits_soft_cap, sinks, dtype)
  p, k, q, scale = x.p, x.k, x.q, x.scale
  do = np.asarray(d_out).astype(dtype)
  out = np.einsum("bnts,bsnh->btnh", p, x.v)
  dp = np.einsum("btnh,bsnh->bnts", do, x.v)
  # d(loss)/dS_j = P_j (dP_j - sum_i P_i dP_i) + P_j dLSE, over all columns (the sink's dP is 0)
  row = np.sum(dp * p, axis=-1, keepdims=True)
  if d_lse is not None:
    row = row - np.asarray(d_lse).astype(dtype)[..., None]
  ds = p * (dp - row)
  dsinks = None if sinks is None else np.sum(x.p_sink * -row[..., 0], axis=(0, 2))
  if x.dtanh is not None:
    ds = ds * x.dtanh   # through the soft cap: d(cap * tanh(x / cap)) / dx
  dq = np.einsum("bnts,bsnh->btnh", ds, k) * scale
  dk = np.einsum("bnts,btnh->bsnh", ds, q) * scale
  dv = np.einsum("bnts,btnh->bsnh", p, do)
  K = np.shape(key)[2]
  B, S, N, H = dk.shape
  dk = dk.reshape(B, S, K, N // K, H).sum(3)
  dv = dv.reshape(B, S, K, N // K, H).sum(3)
  dbias = None
  if bias is not None:
    bshape = np.shape(bias)
    axes = tuple(i for i in range(4) if bshape[i] == 1 and ds.shape[i] != 1)
    dbias = ds.sum(axis=axes, keepdims=True) if axes else ds
  return ExactVJP(out, dq, dk, dv, dbias, x.lse, dsinks)


# ---------------------------------------------------------------------------------------------
# Blockwise FA2 emulation (jnp)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes of the blockwise emulation."""
  block_q: int = 64
  block_k: int = 64

  def __post_init__(self):
    if self.block_q < 1 or self.block_k < 1:
      raise ValueError(f"block sizes must be positive, got block_q={self.block_q}, "
                       f"block_k={self.block_k}")


_ROUND = tile.round_exact   # jnp code: XLA must never elide a rounding point


def tile_dtypes(numerics: Numerics, input_dtype) -> Dtypes:
  """The rounding points of `numerics` for inputs of `input_dtype`, as the jnp implementations
  (and canonicalize's safe offsets) use them.

  float64 inputs (jax_enable_x64) compute as float32 inputs do -- every point float32 -- with the
  output (and the gradients) in float64. The tile math is float32 (stable_attn.tile: fp32
  products, statistics and accumulators), so an "input" point has no float64 to keep, and a
  float64 score dtype would start the running max at float64's minimum, which is -inf in float32
  (NaN for rows with no visible key). jax.nn, too, computes its softmax in float32 for float64
  inputs: both give float64 results with float32 accuracy (~1e-7 relative).
  """
  if np.dtype(input_dtype) == np.float64:
    return numerics.dtypes(np.float32)._replace(input=np.dtype(np.float64))
  return numerics.dtypes(input_dtype)


def segment_mask(ops: Operands):
  """The mask operand with segment ids folded in (bool, broadcastable to [B,N,T,S]), or None: the
  jnp implementations treat packed sequences as a mask."""
  if ops.q_seg is None:
    return ops.mask
  same = ops.q_seg[:, None, :, None] == ops.kv_seg[:, None, None, :]
  return same if ops.mask is None else ops.mask & same


class _Layout(NamedTuple):
  """Heads-major, padded arrays: q [B,N,Tp,H], k/v [B,N,Sp,H] (GQA repeated: a reference need not
  be frugal), bias/mask (segment ids folded in) broadcast to [B,N,Tp,Sp] or None; the padded
  operands (lengths clamped), and the segment block ranges (per query block, per key block)."""
  geo: Geometry
  pad: Padded
  x: Operands
  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: Optional[jax.Array]
  mask: Optional[jax.Array]
  kv_ranges: Optional[jax.Array]   # [B, nq, 4]
  q_ranges: Optional[jax.Array]    # [B, nk, 4]


def _layout(ops: Operands, blk: Blocks) -> _Layout:
  geo = Geometry.of(ops)
  pad = geo.padded(blk.block_q, blk.block_k)
  x = pad_operands(ops, pad)
  full = lambda a: None if a is None else jnp.broadcast_to(a, (geo.B, geo.N, pad.T, pad.S))
  repeat = lambda a: jnp.repeat(heads_major(a), geo.G, axis=1)
  kv_ranges = q_ranges = None
  if x.q_seg is not None:
    kv_ranges, q_ranges = (blocks.segment_sections(x.q_seg, x.kv_seg, blk.block_q, blk.block_k,
                                                   per=per) for per in ("query", "key"))
  return _Layout(geo, pad, x, heads_major(x.q), repeat(x.k), repeat(x.v), full(x.bias),
                 full(segment_mask(x)), kv_ranges, q_ranges)


def _slice(x, start, size, axis):
  return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis)


def _visited(lo, hi, ranges):
  return blocks.within_segments(lo, hi, None if ranges is None else tuple(ranges))


def _tile_scores(spec: AttentionSpec, dt, q_blk, k_blk, b_blk, m_blk, q_pos, k_pos, lens):
  ok = tile.visible(q_pos, k_pos, lens.q, lens.kv, causal=spec.is_causal, window=spec.window,
                    mask=m_blk, shift=lens.shift)
  return tile.scores(tile.matmul(q_blk, k_blk, transpose_b=True), ok, scale=spec.scale,
                     bias=b_blk, dt=dt, round_fn=_ROUND, soft_cap=spec.logits_soft_cap)


def _axis(x):
  return None if x is None else 0


def _forward(spec: AttentionSpec, blk: Blocks, ops: Operands):
  bq, bk = blk.block_q, blk.block_k
  dt = tile_dtypes(spec.numerics, ops.q.dtype)
  lay = _layout(ops, blk)
  geo, pad, x = lay.geo, lay.pad, lay.x
  num_kv = pad.S // bk

  def one_block(q_blk, k_all, v_all, bias_rows, mask_rows, lens, ranges, offset, sink, q_start):
    q_pos = q_start + jnp.arange(bq, dtype=jnp.int32)
    lo, hi = _visited(*blocks.kv_block_range(q_start + lens.shift, bq, bk, num_kv,
                                             causal=spec.is_causal, window=spec.window,
                                             kv_len=lens.kv), ranges)

    def body(j, carry):
      acc, stats = carry
      k_start = j * bk
      v_blk = lax.dynamic_slice_in_dim(v_all, k_start, bk)
      s = _tile_scores(spec, dt, q_blk, lax.dynamic_slice_in_dim(k_all, k_start, bk),
                       _slice(bias_rows, k_start, bk, 1), _slice(mask_rows, k_start, bk, 1),
                       q_pos, k_start + jnp.arange(bk, dtype=jnp.int32), lens)
      p, alpha, stats = tile.rescale(stats, s, dt=dt, max_adjust=spec.max_adjust,
                                     beta=spec.beta, offset=offset, round_fn=_ROUND)
      pv = tile.pv_product(p, v_blk, dt)
      return tile.accumulate(acc, alpha, pv, dt=dt, round_fn=_ROUND), stats

    init = (jnp.zeros((bq, geo.H), jnp.float32), tile.init_stats(bq, dt))
    acc, stats = lax.fori_loop(lo, hi, body, init)
    return tile.finalize(acc, stats, dt=dt, offset=offset, round_fn=_ROUND, sink=sink)

  nq = pad.T // bq
  rows = lambda a: None if a is None else a.reshape(geo.B, geo.N, nq, bq, pad.S)
  starts = jnp.arange(nq, dtype=jnp.int32) * bq
  offsets = None if x.offset is None else x.offset.reshape(geo.N, nq, bq)
  b_ax, m_ax, r_ax = _axis(lay.bias), _axis(lay.mask), _axis(lay.kv_ranges)
  o_ax, s_ax = _axis(offsets), _axis(x.sinks)
  fn = jax.vmap(one_block, (0, None, None, b_ax, m_ax, None, r_ax, o_ax, None, 0))  # q blocks
  fn = jax.vmap(fn, (0, 0, 0, b_ax, m_ax, None, None, o_ax, s_ax, None))          # heads
  fn = jax.vmap(fn, (0, 0, 0, b_ax, m_ax, 0, r_ax, None, None, None))             # batch
  o, o_res, lse = fn(lay.q.reshape(geo.B, geo.N, nq, bq, geo.H), lay.k, lay.v, rows(lay.bias),
                     rows(lay.mask), Lengths.of(x), lay.kv_ranges, offsets, x.sinks, starts)
  to_btnh = lambda a: unpad(jnp.swapaxes(a.reshape(geo.B, geo.N, pad.T, geo.H), 1, 2), ROW_AXES,
                            geo)
  return to_btnh(o), to_btnh(o_res), unpad(lse.reshape(geo.B, geo.N, pad.T), LSE_AXES, geo)


def _backward(spec: AttentionSpec, blk: Blocks, ops: Operands, o_res, lse, do, dlse=None):
  bq, bk = blk.block_q, blk.block_k
  dt = tile_dtypes(spec.numerics, ops.q.dtype)
  in_dtype = ops.q.dtype
  # Kept apart from the forward's: compiled together (jit of grad), jaxlib 0.10's CPU compiler
  # merged the forward's and the backward's repeated V wrongly where one key/value head serves
  # several query heads in a single block (B1 K1 T64: dQ and dK off by 160%; algsimp with
  # while-loop-invariant-code-motion; JAX 0.12 computes it right).
  ops = ops._replace(**dict(zip(("q", "k", "v"), lax.optimization_barrier((ops.q, ops.k, ops.v)))))
  lay = _layout(ops, blk)
  geo, pad, x = lay.geo, lay.pad, lay.x
  rows_p = lambda a: heads_major(pad_to(a, ROW_AXES, pad))
  do_h = rows_p(do)
  delta = tile.delta(do_h, rows_p(o_res))                                    # [B, N, Tp]
  delta = shifted_delta(delta, None if dlse is None else pad_to(dlse, LSE_AXES, pad))
  lse = pad_to(lse, LSE_AXES, pad)
  q, k, v, bias, mask = lay.q, lay.k, lay.v, lay.bias, lay.mask

  def tile_grads(q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, b_blk, m_blk, q_pos, k_pos,
                 lens):
    s = _tile_scores(spec, dt, q_blk, k_blk, b_blk, m_blk, q_pos, k_pos, lens)
    dp = tile.matmul(do_blk, v_blk, transpose_b=True)
    return tile.backward_tile(s, lse_blk, dp, delta_blk, in_dtype=in_dtype, round_fn=_ROUND)

  # dQ (and dS for dbias): each query block loops over its visible key blocks.
  def dq_block(q_blk, k_all, v_all, do_blk, lse_blk, delta_blk, bias_rows, mask_rows, lens,
               ranges, q_start):
    q_pos = q_start + jnp.arange(bq, dtype=jnp.int32)
    lo, hi = _visited(*blocks.kv_block_range(q_start + lens.shift, bq, bk, pad.S // bk,
                                             causal=spec.is_causal, window=spec.window,
                                             kv_len=lens.kv), ranges)

    def body(j, carry):
      dq, ds_rows = carry
      k_start = j * bk
      k_blk = lax.dynamic_slice_in_dim(k_all, k_start, bk)
      g = tile_grads(q_blk, k_blk, lax.dynamic_slice_in_dim(v_all, k_start, bk), do_blk,
                     lse_blk, delta_blk, _slice(bias_rows, k_start, bk, 1),
                     _slice(mask_rows, k_start, bk, 1), q_pos,
                     k_start + jnp.arange(bk, dtype=jnp.int32), lens)
      dq = dq + tile.matmul(g.ds_op, k_blk) * spec.scale
      if ds_rows is not None:
        ds_rows = lax.dynamic_update_slice_in_dim(ds_rows, g.ds, k_start, 1)
      return dq, ds_rows

    ds_rows = None if bias is None else jnp.zeros((bq, pad.S), jnp.float32)
    return lax.fori_loop(lo, hi, body, (jnp.zeros((bq, geo.H), jnp.float32), ds_rows))

  # dK, dV: each key block loops over the query blocks that see it.
  def dkv_block(k_blk, v_blk, q_all, do_all, lse_all, delta_all, bias_cols, mask_cols, lens,
                ranges, k_start):
    k_pos = k_start + jnp.arange(bk, dtype=jnp.int32)
    lo, hi = _visited(*blocks.q_block_range(k_start - lens.shift, bk, bq, pad.T // bq,
                                            causal=spec.is_causal, window=spec.window,
                                            q_len=lens.q), ranges)

    def body(i, carry):
      dk, dv = carry
      q_start = i * bq
      q_blk = lax.dynamic_slice_in_dim(q_all, q_start, bq)
      do_blk = lax.dynamic_slice_in_dim(do_all, q_start, bq)
      g = tile_grads(q_blk, k_blk, v_blk, do_blk, lax.dynamic_slice_in_dim(lse_all, q_start, bq),
                     lax.dynamic_slice_in_dim(delta_all, q_start, bq),
                     _slice(bias_cols, q_start, bq, 0), _slice(mask_cols, q_start, bq, 0),
                     q_start + jnp.arange(bq, dtype=jnp.int32), k_pos, lens)
      dv = dv + tile.matmul(g.p, do_blk, transpose_a=True)
      dk = dk + tile.matmul(g.ds_op, q_blk, transpose_a=True) * spec.scale
      return dk, dv

    zeros = jnp.zeros((bk, geo.H), jnp.float32)
    return lax.fori_loop(lo, hi, body, (zeros, zeros))

  nq, nk = pad.T // bq, pad.S // bk
  b_ax, m_ax = _axis(bias), _axis(mask)
  q_starts = jnp.arange(nq, dtype=jnp.int32) * bq
  k_starts = jnp.arange(nk, dtype=jnp.int32) * bk
  row_blocks = lambda a: None if a is None else a.reshape(geo.B, geo.N, nq, bq, *a.shape[3:])

  r_ax = _axis(lay.kv_ranges)
  fn = jax.vmap(dq_block, (0, None, None, 0, 0, 0, b_ax, m_ax, None, r_ax, 0))
  fn = jax.vmap(fn, (0, 0, 0, 0, 0, 0, b_ax, m_ax, None, None, None))
  fn = jax.vmap(fn, (0, 0, 0, 0, 0, 0, b_ax, m_ax, 0, r_ax, None))
  dq, ds = fn(row_blocks(q), k, v, row_blocks(do_h), row_blocks(lse), row_blocks(delta),
              row_blocks(bias), row_blocks(mask), Lengths.of(x), lay.kv_ranges, q_starts)

  col_blocks = lambda a: None if a is None else jnp.moveaxis(
      a.reshape(geo.B, geo.N, pad.T, nk, bk), 3, 2)                           # [B,N,nk,Tp,bk]
  r_ax = _axis(lay.q_ranges)
  fn = jax.vmap(dkv_block, (0, 0, None, None, None, None, b_ax, m_ax, None, r_ax, 0))
  fn = jax.vmap(fn, (0, 0, 0, 0, 0, 0, b_ax, m_ax, None, None, None))
  fn = jax.vmap(fn, (0, 0, 0, 0, 0, 0, b_ax, m_ax, 0, r_ax, None))
  kv_blocks = lambda a: a.reshape(geo.B, geo.N, nk, bk, geo.H)
  dk, dv = fn(kv_blocks(k), kv_blocks(v), q, do_h, lse, delta, col_blocks(bias),
              col_blocks(mask), Lengths.of(x), lay.q_ranges, k_starts)

  to_btnh = lambda a, length_axes: unpad(jnp.swapaxes(a, 1, 2), length_axes, geo)
  dq = to_btnh(dq.reshape(geo.B, geo.N, pad.T, geo.H), ROW_AXES).astype(in_dtype)

  def per_kv_head(a, like):
    a = a.reshape(geo.B, geo.K, geo.G, pad.S, geo.H).sum(2)
    return to_btnh(a, KV_AXES).astype(like.dtype)

  dbias = None
  if ops.bias is not None:
    ds_full = ds.reshape(geo.B, geo.N, pad.T, pad.S)[:, :, :geo.T, :geo.S]
    dbias = reduce_to_shape(ds_full, ops.bias.shape).astype(ops.bias.dtype)
  return dq, per_kv_head(dk, ops.k), per_kv_head(dv, ops.v), dbias


_blockwise = make_flash_attention(_forward, _backward)


def blockwise_attention(spec: AttentionSpec, ops: Operands, *, block_q: int = DEFAULT_BLOCK_Q,
                        block_k: int = DEFAULT_BLOCK_K) -> jax.Array:
  """The FA2 emulation on canonical operands (see `stable_attn.spec`); O [B,T,N,H]."""
  return _blockwise(spec, Blocks(int(block_q), int(block_k)), ops)[0]


# The backend protocol (stable_attn.backends): implementation="reference" runs anywhere, covers all.

def attention(spec: AttentionSpec, ops: Operands, config: Blocks | Mapping | None = None):
  """-> (O [B,T,N,H], LSE [B,N,T]). config: None (the default tiles), a Blocks, or a mapping of
  its fields (block_q, block_k); ValueError otherwise."""
  return _blockwise(spec, _blocks(config), ops)


def _blocks(config) -> Blocks:
  if config is None:
    return Blocks(DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K)
  if isinstance(config, Blocks):
    return config
  fields = {f.name for f in dataclasses.fields(Blocks)}
  if isinstance(config, Mapping) and set(config) <= fields:
    return dataclasses.replace(_blocks(None), **config)
  raise ValueError(f"config for implementation='reference' must be a stable_attn.reference.Blocks "
                   f"or a mapping of its fields {sorted(fields)}, got {config!r}")


def is_available() -> bool:
  return True


def covers(spec: AttentionSpec, ops: Operands):
  return None
