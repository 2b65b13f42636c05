"""The jitted computations: loss, one optimizer step with gradient accumulation, evaluation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def loss_fn(params, graphdef, x, y):
  """Mean next-token cross-entropy in float32. x, y: [B, T] int32."""
  logits = nnx.merge(graphdef, params)(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def make_train_step(graphdef, tx: optax.GradientTransformation):
  """(params, opt_state, x, y) -> (params, opt_state, metrics); x, y: [A, B, T] int32.

  The A micro-batches are scanned in order with float32 gradient sums, so the result is the gradient
  of the mean loss over the A*B sequences (what a single big batch would give) and deterministic.
  """
  grad_fn = jax.value_and_grad(loss_fn)

  def step(params, opt_state, x, y):
    if x.shape[0] == 1:
      loss, grads = grad_fn(params, graphdef, x[0], y[0])
    else:
      def micro(carry, xy):
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(params, graphdef, *xy)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

      zeros = jax.tree.map(jnp.zeros_like, params)
      (loss, grads), _ = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros), (x, y))
      loss, grads = loss / x.shape[0], jax.tree.map(lambda g: g / x.shape[0], grads)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

  return step


def make_eval_step(graphdef):
  """(params, x, y) -> mean loss; x, y: [B, T] int32."""

  def evaluate(params, x, y):
    return loss_fn(params, graphdef, x, y)

  return evaluate
