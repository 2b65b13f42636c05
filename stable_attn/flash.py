"""The custom VJP every flash implementation shares: forward saves (O residual, LSE), backward is the
flash backward. Implementations supply the two passes; this module owns the differentiation rules.
"""
from __future__ import annotations

import functools
from typing import Callable, Hashable

import jax
import jax.numpy as jnp

from stable_attn.spec import AttentionSpec, Operands

# forward(spec, config, ops) -> (O [B,T,N,H], O residual [B,T,N,H], LSE fp32 [B,N,T])
Forward = Callable[[AttentionSpec, Hashable, Operands], tuple]
# backward(spec, config, ops, o_residual, lse, dO) -> (dq, dk, dv, dbias or None)
Backward = Callable[[AttentionSpec, Hashable, Operands, jax.Array, jax.Array, jax.Array], tuple]


def make_flash_attention(forward: Forward, backward: Backward):
  """Returns attention(spec, config, ops) -> O, differentiable in q, k, v and bias."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
  def attention(spec, config, ops):
    return forward(spec, config, ops)[0]

  def attention_fwd(spec, config, ops):
    o, o_residual, lse = forward(spec, config, ops)
    return o, (ops, o_residual, lse)

  def attention_bwd(spec, config, residuals, do):
    ops, o_residual, lse = residuals
    dq, dk, dv, dbias = backward(spec, config, ops, o_residual, lse, do)
    return (Operands(dq, dk, dv, dbias, None, None, None),)

  attention.defvjp(attention_fwd, attention_bwd)
  return attention


def reduce_to_shape(full: jax.Array, shape) -> jax.Array:
  """Sums a [B,N,T,S] gradient over the dims a broadcastable operand of `shape` had as size 1."""
  axes = tuple(i for i, (a, b) in enumerate(zip(full.shape, shape)) if b == 1 and a != 1)
  return jnp.sum(full, axis=axes, keepdims=True) if axes else full
