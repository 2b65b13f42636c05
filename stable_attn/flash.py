"""The custom VJP every flash implementation shares: forward saves (O residual, LSE), backward is the
flash backward. Implementations supply the two passes; this module owns the differentiation rules.

The residuals carry `jax.ad_checkpoint.checkpoint_name`s, "attn_out" (the O residual) and
"attn_lse", so that `jax.checkpoint` policies can keep them (and skip re-running the attention
forward in the backward) or drop them. Read them as the backward's inputs, not as O: under
context_strategy="alltoall" without sinks the O residual holds O's elements in the order its
device keeps them (stable_attn.partition._relabel). The sinks' gradient below reads it as O, so
with sinks it is O.
"""
from __future__ import annotations

import functools
from typing import Callable, Hashable, Union

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from stable_attn import tile
from stable_attn.partition import explicit_mesh, partitioned
from stable_attn.spec import AttentionSpec, Operands

# forward(spec, config, ops) -> (O [B,T,N,H], O residual [B,T,N,H], LSE fp32 [B,N,T])
Forward = Callable[[AttentionSpec, Hashable, Operands], tuple]
# backward(spec, config, ops, o_residual, lse, dO, dLSE or None) -> (dq, dk, dv, dbias or None),
# or (dqkv, dbias or None) for PackedOperands: the gradients of the operand table's `grad` rows, in
# table order.
Backward = Callable[..., tuple]
RESIDUAL_NAMES = ("attn_out", "attn_lse")


def public_lse(lse: jax.Array, spec: AttentionSpec) -> jax.Array:
  """The log-sum-exp as a backend returns it. For a caller who asked for it (return_residuals):
  -inf for rows with no visible key. Otherwise it stays internal and keeps the large finite
  sentinel tile.EMPTY_ROW_LSE there (which also makes the backward's exp(S - LSE) 0): no step may
  make an infinity the caller did not ask for (jax.debug_infs checks every one); jax.nn's
  return_residual is derived from it in `stable_attn.api.jax_nn_residual`."""
  if not spec.return_residuals:
    return lse
  return jnp.where(lse == tile.EMPTY_ROW_LSE, -jnp.inf, lse)


def make_flash_attention(forward: Forward, backward: Backward,
                         partition: Union[bool, Callable[[AttentionSpec], bool]] = False, *,
                         context_parallel: bool = False, fp32_residual: bool = False):
  """Returns attention(spec, config, ops) -> (O, LSE), differentiable in q, k, v and bias.

  With `partition` (True, or a predicate of the spec), both passes partition themselves under
  jax.sharding over batch and heads (`stable_attn.partition`): for kernels XLA cannot split (Pallas
  calls). Pure-jnp passes leave it off and let XLA partition them. With `context_parallel` (the
  passes take the q_shift operand) a sequence-sharded call runs context parallel; with
  `fp32_residual` the forward honours numerics whose residual_o is float32 (it returns O before
  its final rounding), which a ring step asks for so that the merge rounds O once.

  The LSE output ([B, N, T] fp32, natural log; rows without keys: see `public_lse`) is
  differentiable too when spec.return_residuals is set: its cotangent enters the backward as
  delta - dLSE (the log-sum-exp's gradient with respect to the scores is P).
  """

  if partition:
    when = partition if callable(partition) else (lambda spec: True)
    forward, backward = partitioned(forward, backward, when, sequence=context_parallel,
                                    fp32_steps=fp32_residual)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
  def attention(spec, config, ops):
    _check_offsets(spec, ops)
    o, _, lse = forward(spec, config, ops)
    return o, public_lse(lse, spec)

  def attention_fwd(spec, config, ops):
    _check_offsets(spec, ops)
    o, o_residual, lse = forward(spec, config, ops)
    residuals = (ops, checkpoint_name(o_residual, RESIDUAL_NAMES[0]),
                 checkpoint_name(lse, RESIDUAL_NAMES[1]))
    return (o, public_lse(lse, spec)), residuals

  def attention_bwd(spec, config, residuals, cotangents):
    ops, o_residual, lse = residuals
    do, dlse = cotangents
    dlse = jnp.where(lse == tile.EMPTY_ROW_LSE, 0.0, dlse) if spec.return_residuals else None
    grads = backward(spec, config, ops, o_residual, lse, do, dlse)
    dsinks = None
    if ops.sinks is not None:
      # The sinks have no value and one logit per head: their gradient needs only the rows' delta,
      # computed here once in jnp for every backend (and partitioned by XLA).
      delta = jnp.swapaxes(tile.delta(do, o_residual), 1, 2)           # [B, N, T]
      dsinks = tile.sink_grad(ops.sinks, lse, shifted_delta(delta, dlse)).astype(ops.sinks.dtype)
    grads = dict(zip(_grad_names(ops), grads), sinks=dsinks)
    return (type(ops).TABLE.make(**{name: _like(g, getattr(ops, name))
                                    for name, g in grads.items()}),)

  attention.defvjp(attention_fwd, attention_bwd)
  return attention


def _like(grad, operand):
  """grad with its operand's sharding type. On Explicit mesh axes a gradient computed from arrays
  split otherwise -- the sinks' [N] from head-split rows, while the caller replicated the sinks --
  has another type, which custom_vjp refuses; elsewhere (no Explicit axes) it is grad itself."""
  if grad is None or explicit_mesh([operand]) is None:
    return grad
  want = jax.typeof(operand).sharding.spec
  return grad if jax.typeof(grad).sharding.spec == want else jax.sharding.reshard(grad, want)


def _grad_names(ops):
  """The fields whose gradients the backward returns, in order (dq, dk, dv, dbias; or dqkv, dbias
  for PackedOperands)."""
  return [row.name for row in type(ops).TABLE.rows if row.grad]


def _check_offsets(spec: AttentionSpec, ops: Operands) -> None:
  if (spec.max_adjust == "safe") != (ops.offset is not None):
    raise ValueError("max_adjust='safe' needs its per-row offsets as ops.offset (and no other mode "
                     "takes them); build operands with stable_attn.api.canonicalize")


def shifted_delta(delta: jax.Array, dlse) -> jax.Array:
  """delta = rowsum(dO * O), less the LSE output's cotangent when it is differentiated."""
  return delta if dlse is None else delta - dlse.astype(delta.dtype)


def reduce_to_shape(full: jax.Array, shape) -> jax.Array:
  """Sums a [B,N,T,S] gradient over the dims a broadcastable operand of `shape` had as size 1."""
  axes = tuple(i for i, (a, b) in enumerate(zip(full.shape, shape)) if b == 1 and a != 1)
  return jnp.sum(full, axis=axes, keepdims=True) if axes else full
