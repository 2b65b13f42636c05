"""implementation="xla": plain jnp softmax attention that materialises the [B,N,T,S] scores.

It is one online-softmax step over all keys (so numerics and max_adjust mean the same as elsewhere),
differentiated by ordinary JAX autodiff rather than the flash backward: tests use it as an
independent check of the custom VJP.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stable_attn import tile
from stable_attn.flash import public_lse
from stable_attn.layout import Geometry
from stable_attn.reference import segment_mask, tile_dtypes
from stable_attn.spec import AttentionSpec, Lengths, Operands


def xla_attention(spec: AttentionSpec, ops: Operands):
  """-> (O [B,T,N,H] in the input dtype, LSE fp32 [B,N,T]; rows without keys: flash.public_lse)."""
  geo = Geometry.of(ops)
  B, T, S, N, H = geo.B, geo.T, geo.S, geo.N, geo.H
  dt = tile_dtypes(spec.numerics, ops.q.dtype)
  q = jnp.swapaxes(ops.q, 1, 2)                                   # [B, N, T, H]
  k = jnp.repeat(jnp.swapaxes(ops.k, 1, 2), geo.G, axis=1)        # [B, N, S, H]
  v = jnp.repeat(jnp.swapaxes(ops.v, 1, 2), geo.G, axis=1)
  bias = None if ops.bias is None else jnp.broadcast_to(ops.bias, (B, N, T, S))
  mask = segment_mask(ops)
  mask = None if mask is None else jnp.broadcast_to(mask, (B, N, T, S))
  q_pos = jnp.arange(T, dtype=jnp.int32)
  k_pos = jnp.arange(S, dtype=jnp.int32)
  round_fn = tile.round_exact

  def one_head(q_h, k_h, v_h, bias_h, mask_h, q_len, kv_len, shift, offset, sink):
    ok = tile.visible(q_pos, k_pos, q_len, kv_len, causal=spec.is_causal, window=spec.window,
                      mask=mask_h, shift=shift)
    s = tile.scores(tile.matmul(q_h, k_h, transpose_b=True), ok, scale=spec.scale, bias=bias_h,
                    dt=dt, round_fn=round_fn, soft_cap=spec.logits_soft_cap)
    p, alpha, stats = tile.rescale(tile.init_stats(T, dt), s, dt=dt, max_adjust=spec.max_adjust,
                                   beta=spec.beta, offset=offset, round_fn=round_fn)
    acc = tile.accumulate(jnp.zeros((T, H), jnp.float32), alpha, tile.pv_product(p, v_h, dt),
                          dt=dt, round_fn=round_fn)
    o, _, lse = tile.finalize(acc, stats, dt=dt, offset=offset, round_fn=round_fn, sink=sink)
    return o, lse

  b_ax = None if bias is None else 0
  m_ax = None if mask is None else 0
  o_ax = None if ops.offset is None else 0
  s_ax = None if ops.sinks is None else 0
  fn = jax.vmap(one_head, (0, 0, 0, b_ax, m_ax, None, None, None, o_ax, s_ax))
  fn = jax.vmap(fn, (0, 0, 0, b_ax, m_ax, 0, 0, 0, None, None))
  o, lse = fn(q, k, v, bias, mask, *Lengths.of(ops), ops.offset, ops.sinks)
  return jnp.swapaxes(o, 1, 2), public_lse(lse, spec)


# The backend protocol (stable_attn.backends): never picked by implementation=None.

def attention(spec: AttentionSpec, ops: Operands, config=None) -> jax.Array:
  if config is not None:
    raise ValueError("implementation='xla' takes no config")
  return xla_attention(spec, ops)


def is_available() -> bool:
  return True


def covers(spec: AttentionSpec, ops: Operands):
  return None
