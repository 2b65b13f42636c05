"""References: exact textbook attention (ground truth) and the blockwise FA2 emulation.

`exact_attention` / `exact_attention_vjp` are NumPy, float64 by default (or float32): independent of
JAX and of the tile module, used as ground truth by tests and the bias probe. The backward there uses
dS = P * (dP - rowsum(dP * P)), not delta from O.

`blockwise_attention` is `implementation="reference"`: pure jnp, the same tile math and block order
as the kernels (online softmax over key blocks with causal/window skipping; backward as a delta
pre-pass, a dQ pass over key blocks and a dK/dV pass over query blocks), with every rounding point of
the chosen `Numerics` done exactly. It runs on any backend and is differentiable (custom VJP).
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from stable_attn import blocks, tile
from stable_attn.flash import make_flash_attention, reduce_to_shape
from stable_attn.spec import AttentionSpec, Operands

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64


# ---------------------------------------------------------------------------------------------
# Exact attention (NumPy)
# ---------------------------------------------------------------------------------------------

def _exact_visibility(B, N, T, S, mask, is_causal, q_lens, kv_lens, window):
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
  return ok


def _exact_probs(q, k, v, bias, mask, scale, is_causal, q_lens, kv_lens, window, dtype):
  q, k, v = (np.asarray(x).astype(dtype) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  k = np.repeat(k, N // K, axis=2)
  v = np.repeat(v, N // K, axis=2)
  scale = 1.0 / np.sqrt(H) if scale is None else scale
  s = np.einsum("btnh,bsnh->bnts", q, k) * dtype(scale)
  if bias is not None:
    s = s + np.asarray(bias).astype(dtype)
  ok = _exact_visibility(B, N, T, S, mask, is_causal, q_lens, kv_lens, window)
  s = np.where(ok, s, -np.inf)
  row_max = np.max(s, axis=-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  e = np.where(ok, np.exp(s - row_max), 0.0)
  l = e.sum(-1, keepdims=True)
  p = e / np.where(l == 0, 1.0, l)
  return q, k, v, p, scale


def exact_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                    dtype=np.float64) -> np.ndarray:
  """Textbook softmax attention in NumPy `dtype`; same arguments and layout as the public API.

  Returns O [B,T,N,H] in `dtype`; rows with no visible key are 0.
  """
  _, _, v, p, _ = _exact_probs(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                               key_value_seq_lengths, local_window_size, dtype)
  return np.einsum("bnts,bsnh->btnh", p, v)


def exact_attention_vjp(query, key, value, d_out, bias=None, mask=None, *, scale=None,
                        is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None, dtype=np.float64):
  """-> (O, dQ, dK, dV, dBias or None), all NumPy `dtype`, for the cotangent d_out [B,T,N,H]."""
  q, k, v, p, scale = _exact_probs(query, key, value, bias, mask, scale, is_causal,
                                   query_seq_lengths, key_value_seq_lengths, local_window_size,
                                   dtype)
  do = np.asarray(d_out).astype(dtype)
  out = np.einsum("bnts,bsnh->btnh", p, v)
  dp = np.einsum("btnh,bsnh->bnts", do, v)
  ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
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
  return out, dq, dk, dv, dbias


# ---------------------------------------------------------------------------------------------
# Blockwise FA2 emulation (jnp)
# ---------------------------------------------------------------------------------------------

def _layout(spec: AttentionSpec, ops: Operands, block_q: int, block_k: int):
  """Heads-major, padded operands: q [B,N,Tp,H], k/v [B,N,Sp,H] (GQA repeated), full bias/mask."""
  B, T, N, H = ops.q.shape
  S, K = ops.k.shape[1], ops.k.shape[2]
  Tp, Sp = blocks.cdiv(T, block_q) * block_q, blocks.cdiv(S, block_k) * block_k

  def heads_major(x, length, padded):
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, padded - length), (0, 0)))

  q = heads_major(ops.q, T, Tp)
  k = jnp.repeat(heads_major(ops.k, S, Sp), N // K, axis=1)
  v = jnp.repeat(heads_major(ops.v, S, Sp), N // K, axis=1)

  def full(x, fill):
    if x is None:
      return None
    x = jnp.broadcast_to(x, (B, N, T, S))
    return jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T), (0, Sp - S)), constant_values=fill)

  return q, k, v, full(ops.bias, 0), full(ops.mask, False), Tp, Sp


def _forward(spec: AttentionSpec, config, ops: Operands):
  block_q, block_k = config
  dt = spec.numerics.dtypes(ops.q.dtype)
  q, k, v, bias, mask, Tp, Sp = _layout(spec, ops, block_q, block_k)
  B, N, _, H = q.shape
  num_kv = Sp // block_k

  def one_block(q_blk, k_all, v_all, bias_rows, mask_rows, q_len, kv_len, head, q_start):
    q_pos = q_start + jnp.arange(block_q, dtype=jnp.int32)
    offset = tile.safe_offset(q_pos, head, dt.p) if spec.max_adjust == "safe" else None
    lo, hi = blocks.kv_block_range(q_start, block_q, block_k, num_kv, causal=spec.is_causal,
                                   window=spec.window, kv_len=kv_len)

    def body(j, state):
      k_start = j * block_k
      k_blk = lax.dynamic_slice_in_dim(k_all, k_start, block_k)
      v_blk = lax.dynamic_slice_in_dim(v_all, k_start, block_k)
      b_blk = None if bias_rows is None else lax.dynamic_slice_in_dim(bias_rows, k_start, block_k, 1)
      m_blk = None if mask_rows is None else lax.dynamic_slice_in_dim(mask_rows, k_start, block_k, 1)
      s = tile.scores(q_blk, k_blk, spec.scale, b_blk, dt, tile.round_exact)
      ok = tile.visible(q_pos, k_start + jnp.arange(block_k, dtype=jnp.int32), q_len, kv_len,
                        causal=spec.is_causal, window=spec.window, mask=m_blk)
      return tile.online_softmax_step(state, s, ok, v_blk, dt=dt, max_adjust=spec.max_adjust,
                                      beta=spec.beta, offset=offset, round_fn=tile.round_exact)

    state = lax.fori_loop(lo, hi, body, tile.init_state(block_q, H, dt))
    return tile.finalize(state, dt=dt, offset=offset, round_fn=tile.round_exact)

  q_blocks = q.reshape(B, N, Tp // block_q, block_q, H)
  rows = lambda x: None if x is None else x.reshape(B, N, Tp // block_q, block_q, Sp)
  starts = jnp.arange(Tp // block_q, dtype=jnp.int32) * block_q
  heads = jnp.arange(N, dtype=jnp.int32)
  bias_axes = None if bias is None else 0
  mask_axes = None if mask is None else 0
  fn = jax.vmap(one_block, (0, None, None, bias_axes, mask_axes, None, None, None, 0))   # q blocks
  fn = jax.vmap(fn, (0, 0, 0, bias_axes, mask_axes, None, None, 0, None))                # heads
  fn = jax.vmap(fn, (0, 0, 0, bias_axes, mask_axes, 0, 0, None, None))                   # batch
  o, o_res, lse = fn(q_blocks, k, v, rows(bias), rows(mask), ops.q_lens, ops.kv_lens, heads,
                     starts)
  T = ops.q.shape[1]
  to_btnh = lambda x: jnp.swapaxes(x.reshape(B, N, Tp, H)[:, :, :T], 1, 2)
  return to_btnh(o), to_btnh(o_res), lse.reshape(B, N, Tp)[:, :, :T]


def _backward(spec: AttentionSpec, config, ops: Operands, o_res, lse, do):
  block_q, block_k = config
  dt = spec.numerics.dtypes(ops.q.dtype)
  B, T, N, H = ops.q.shape
  S, K = ops.k.shape[1], ops.k.shape[2]
  q, k, v, bias, mask, Tp, Sp = _layout(spec, ops, block_q, block_k)
  pad_rows = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))
  do_h = pad_rows(do)
  delta = tile.delta(do_h, pad_rows(o_res))                                  # [B, N, Tp]
  lse = jnp.pad(lse, ((0, 0), (0, 0), (0, Tp - T)))
  in_dtype = ops.q.dtype

  def tile_grads(q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk, b_blk, m_blk, q_pos, k_pos,
                 q_len, kv_len):
    s = tile.scores(q_blk, k_blk, spec.scale, b_blk, dt, tile.round_exact)
    ok = tile.visible(q_pos, k_pos, q_len, kv_len, causal=spec.is_causal, window=spec.window,
                      mask=m_blk)
    p = tile.probabilities(s, lse_blk, ok)
    dp = tile.matmul(do_blk, v_blk, transpose_b=True)
    return p, tile.score_grad(p, dp, delta_blk)

  def slice_opt(x, start, size, axis):
    return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis)

  # dQ (and dS for dbias): each query block loops over its visible key blocks.
  def dq_block(q_blk, k_all, v_all, do_blk, lse_blk, delta_blk, bias_rows, mask_rows, q_len,
               kv_len, q_start):
    q_pos = q_start + jnp.arange(block_q, dtype=jnp.int32)
    lo, hi = blocks.kv_block_range(q_start, block_q, block_k, Sp // block_k,
                                   causal=spec.is_causal, window=spec.window, kv_len=kv_len)

    def body(j, carry):
      dq, ds_rows = carry
      k_start = j * block_k
      k_blk = lax.dynamic_slice_in_dim(k_all, k_start, block_k)
      _, ds = tile_grads(q_blk, k_blk, lax.dynamic_slice_in_dim(v_all, k_start, block_k), do_blk,
                         lse_blk, delta_blk, slice_opt(bias_rows, k_start, block_k, 1),
                         slice_opt(mask_rows, k_start, block_k, 1), q_pos,
                         k_start + jnp.arange(block_k, dtype=jnp.int32), q_len, kv_len)
      dq = dq + tile.matmul(tile.round_exact(ds, in_dtype).astype(in_dtype), k_blk) * spec.scale
      if ds_rows is not None:
        ds_rows = lax.dynamic_update_slice_in_dim(ds_rows, ds, k_start, 1)
      return dq, ds_rows

    ds_rows = None if bias is None else jnp.zeros((block_q, Sp), jnp.float32)
    return lax.fori_loop(lo, hi, body, (jnp.zeros((block_q, H), jnp.float32), ds_rows))

  # dK, dV: each key block loops over the query blocks that see it.
  def dkv_block(k_blk, v_blk, q_all, do_all, lse_all, delta_all, bias_cols, mask_cols, q_len,
                kv_len, k_start):
    k_pos = k_start + jnp.arange(block_k, dtype=jnp.int32)
    lo, hi = blocks.q_block_range(k_start, block_k, block_q, Tp // block_q,
                                  causal=spec.is_causal, window=spec.window, q_len=q_len)

    def body(i, carry):
      dk, dv = carry
      q_start = i * block_q
      q_blk = lax.dynamic_slice_in_dim(q_all, q_start, block_q)
      do_blk = lax.dynamic_slice_in_dim(do_all, q_start, block_q)
      p, ds = tile_grads(q_blk, k_blk, v_blk, do_blk,
                         lax.dynamic_slice_in_dim(lse_all, q_start, block_q),
                         lax.dynamic_slice_in_dim(delta_all, q_start, block_q),
                         slice_opt(bias_cols, q_start, block_q, 0),
                         slice_opt(mask_cols, q_start, block_q, 0),
                         q_start + jnp.arange(block_q, dtype=jnp.int32), k_pos, q_len, kv_len)
      dv = dv + tile.matmul(tile.round_exact(p, in_dtype).astype(in_dtype), do_blk, transpose_a=True)
      dk = dk + tile.matmul(tile.round_exact(ds, in_dtype).astype(in_dtype), q_blk, transpose_a=True) * spec.scale
      return dk, dv

    zeros = jnp.zeros((block_k, H), jnp.float32)
    return lax.fori_loop(lo, hi, body, (zeros, zeros))

  nq, nk = Tp // block_q, Sp // block_k
  b_ax = None if bias is None else 0
  m_ax = None if mask is None else 0
  q_starts = jnp.arange(nq, dtype=jnp.int32) * block_q
  k_starts = jnp.arange(nk, dtype=jnp.int32) * block_k
  row_blocks = lambda x: None if x is None else x.reshape(B, N, nq, block_q, *x.shape[3:])

  fn = jax.vmap(dq_block, (0, None, None, 0, 0, 0, b_ax, m_ax, None, None, 0))
  fn = jax.vmap(fn, (0, 0, 0, 0, 0, 0, b_ax, m_ax, None, None, None))
  fn = jax.vmap(fn, (0, 0, 0, 0, 0, 0, b_ax, m_ax, 0, 0, None))
  dq, ds = fn(row_blocks(q), k, v, row_blocks(do_h), row_blocks(lse), row_blocks(delta),
              row_blocks(bias), row_blocks(mask), ops.q_lens, ops.kv_lens, q_starts)

  col_blocks = lambda x: None if x is None else jnp.moveaxis(
      x.reshape(B, N, Tp, nk, block_k), 3, 2)                                 # [B,N,nk,Tp,bk]
  fn = jax.vmap(dkv_block, (0, 0, None, None, None, None, b_ax, m_ax, None, None, 0))
  fn = jax.vmap(fn, (0, 0, 0, 0, 0, 0, b_ax, m_ax, None, None, None))
  fn = jax.vmap(fn, (0, 0, 0, 0, 0, 0, b_ax, m_ax, 0, 0, None))
  kv_blocks = lambda x: x.reshape(B, N, nk, block_k, H)
  dk, dv = fn(kv_blocks(k), kv_blocks(v), q, do_h, lse, delta, col_blocks(bias),
              col_blocks(mask), ops.q_lens, ops.kv_lens, k_starts)

  dq = jnp.swapaxes(dq.reshape(B, N, Tp, H)[:, :, :T], 1, 2).astype(ops.q.dtype)

  def per_kv_head(x, like):
    x = x.reshape(B, K, N // K, Sp, H).sum(2)[:, :, :S]
    return jnp.swapaxes(x, 1, 2).astype(like.dtype)

  dbias = None
  if ops.bias is not None:
    ds_full = ds.reshape(B, N, Tp, Sp)[:, :, :T, :S]
    dbias = reduce_to_shape(ds_full, ops.bias.shape).astype(ops.bias.dtype)
  return dq, per_kv_head(dk, ops.k), per_kv_head(dv, ops.v), dbias


_blockwise = make_flash_attention(_forward, _backward)


def blockwise_attention(spec: AttentionSpec, ops: Operands, *, block_q: int = DEFAULT_BLOCK_Q,
                        block_k: int = DEFAULT_BLOCK_K) -> jax.Array:
  """The FA2 emulation on canonical operands (see `stable_attn.spec`); O [B,T,N,H]."""
  if block_q < 1 or block_k < 1:
    raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
  return _blockwise(spec, (int(block_q), int(block_k)), ops)
