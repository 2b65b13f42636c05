"""implementation="xla": plain jnp softmax attention that materialises the [B,N,T,S] scores.

It is one online-softmax step over all keys (so numerics and max_adjust mean the same as elsewhere),
differentiated by ordinary JAX autodiff rather than the flash backward: tests use it as an
independent check of the custom VJP.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stable_attn import tile
from stable_attn.spec import AttentionSpec, Operands


def xla_attention(spec: AttentionSpec, ops: Operands) -> jax.Array:
  """O [B,T,N,H] in the input dtype."""
  B, T, N, H = ops.q.shape
  S, K = ops.k.shape[1], ops.k.shape[2]
  dt = spec.numerics.dtypes(ops.q.dtype)
  q = jnp.swapaxes(ops.q, 1, 2)                                   # [B, N, T, H]
  k = jnp.repeat(jnp.swapaxes(ops.k, 1, 2), N // K, axis=1)       # [B, N, S, H]
  v = jnp.repeat(jnp.swapaxes(ops.v, 1, 2), N // K, axis=1)
  bias = None if ops.bias is None else jnp.broadcast_to(ops.bias, (B, N, T, S))
  mask = None if ops.mask is None else jnp.broadcast_to(ops.mask, (B, N, T, S))
  q_pos = jnp.arange(T, dtype=jnp.int32)
  k_pos = jnp.arange(S, dtype=jnp.int32)

  def one_head(q_h, k_h, v_h, bias_h, mask_h, q_len, kv_len, head):
    s = tile.scores(q_h, k_h, spec.scale, bias_h, dt, tile.round_exact)
    ok = tile.visible(q_pos, k_pos, q_len, kv_len, causal=spec.is_causal, window=spec.window,
                      mask=mask_h)
    offset = tile.safe_offset(q_pos, head, dt.p) if spec.max_adjust == "safe" else None
    # The max only shifts the exponent: no gradient flows through it (softmax is shift invariant).
    state = tile.online_softmax_step(tile.init_state(T, H, dt), s, ok, v_h, dt=dt,
                                     max_adjust=spec.max_adjust, beta=spec.beta, offset=offset,
                                     round_fn=tile.round_exact)
    state = state._replace(m=jax.lax.stop_gradient(state.m))
    return tile.finalize(state, dt=dt, offset=offset, round_fn=tile.round_exact)[0]

  b_ax = None if bias is None else 0
  m_ax = None if mask is None else 0
  fn = jax.vmap(one_head, (0, 0, 0, b_ax, m_ax, None, None, 0))
  fn = jax.vmap(fn, (0, 0, 0, b_ax, m_ax, 0, 0, None))
  o = fn(q, k, v, bias, mask, ops.q_lens, ops.kv_lens, jnp.arange(N, dtype=jnp.int32))
  return jnp.swapaxes(o, 1, 2)
