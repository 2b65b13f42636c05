"""The jitted computations: loss, one optimizer step with gradient accumulation, evaluation; and
`make_training`, the set-up that the training loop and benchmarks/train_speed.py share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from .attention import check_attention, jit_on_mesh
from .config import TrainConfig
from .model import GPT, abstract_model
from .optim import make_optimizer
from .sharding import batch_sharding, optimizer_shardings, param_shardings, replicated


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


def init_params(cfg: TrainConfig, shardings=None):
  """Float32 parameters (an nnx.State), created directly on their shardings by a jitted init."""
  def init():
    return nnx.split(GPT(cfg.model, rngs=nnx.Rngs(cfg.seed)), nnx.Param)[1]
  return jax.jit(init, out_shardings=shardings)()


@dataclass
class Training:
  """What training a config on a mesh needs: fresh arrays, their shardings and the jitted step."""

  graphdef: nnx.GraphDef  # the model's structure; nnx.merge(graphdef, params) is the model
  tx: optax.GradientTransformation
  params: Any  # nnx.State of float32 parameters, seeded by cfg.seed
  opt_state: Any
  param_shardings: Any  # pytrees of NamedSharding matching params / opt_state
  opt_shardings: Any
  batch_sharding: NamedSharding  # of train batches x, y: [grad_accum, batch_size, block_size]
  # (params, opt_state, x, y) -> (params, opt_state, {"loss", "grad_norm"}); donates params and
  # opt_state, so pass the returned ones on.
  train_step: Callable


def make_training(cfg: TrainConfig, mesh: Mesh) -> Training:
  """Initialises parameters and optimizer state on their shardings over `mesh` (data parallel, or
  FSDP with cfg.fsdp) and jits the train step with those shardings (its attention calls split
  over the batch by train.attention.on_mesh)."""
  check_attention(cfg)
  graphdef, abstract_params = nnx.split(abstract_model(cfg.model), nnx.Param)
  p_sh = param_shardings(abstract_params, mesh, cfg.fsdp)
  params = init_params(cfg, p_sh)
  tx = make_optimizer(cfg)
  o_sh = optimizer_shardings(tx, jax.eval_shape(tx.init, params), p_sh, mesh)
  opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
  b_sh = batch_sharding(mesh, 3, 1)
  step = jit_on_mesh(mesh, make_train_step(graphdef, tx), strategy=cfg.context_strategy,
                     in_shardings=(p_sh, o_sh, b_sh, b_sh),
                     out_shardings=(p_sh, o_sh, replicated(mesh)), donate_argnums=(0, 1))
  return Training(graphdef=graphdef, tx=tx, params=params, opt_state=opt_state,
                  param_shardings=p_sh, opt_shardings=o_sh, batch_sharding=b_sh, train_step=step)
