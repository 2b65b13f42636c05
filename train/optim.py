"""Optax AdamW with linear warm-up, cosine decay and global-norm clipping (nanoGPT's recipe)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from .config import TrainConfig


def lr_schedule(cfg: TrainConfig):
  """step -> learning rate: lr * (s+1)/(W+1) for s < W, then cosine to min_lr at decay_steps, then
  min_lr.

  The warm-up is kept as configured in a run shorter than it (which then never leaves it), not
  scaled to --max-steps: the warm-up's steps do not depend on the run's length, so a short run
  trains the same first steps as a long one, bitwise (a timing or smoke run stands for the real
  one), and a run resumed with a larger --max-steps goes on in the same warm-up. Nothing changes
  silently either: describe_schedule says so in the log.
  """
  warmup, decay = cfg.warmup_steps, cfg.decay_steps

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = cfg.lr * (step + 1) / (warmup + 1)
    ratio = jnp.clip((step - warmup) / max(1, decay - warmup), 0.0, 1.0)
    cosine = cfg.min_lr + 0.5 * (1.0 + jnp.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)
    return jnp.where(step < warmup, warm, cosine)

  return schedule


def describe_schedule(cfg: TrainConfig) -> tuple[str, str | None]:
  """The learning-rate schedule in words for the log, and a warning where the run does not see what
  its numbers suggest, else None: a warm-up longer than the run (the lr stays below --lr), one as
  long (no cosine follows), a cosine that ends within the warm-up (--lr-decay-steps)."""
  lr, warmup, decay, steps = cfg.lr, cfg.warmup_steps, cfg.decay_steps, cfg.max_steps
  if warmup > steps:
    reach = lr * steps / (warmup + 1)  # lr_schedule at the run's last step, steps - 1
    return (f"lr {lr:g} (warm-up {warmup} steps, longer than this run's {steps}: the lr only "
            f"reaches {reach:.2g}; --warmup-steps sets it)",
            f"the warm-up ({warmup} steps) is longer than this run ({steps} steps): the lr rises "
            f"to {reach:.2g} at most, not to --lr {lr:g}, and no cosine follows; --warmup-steps "
            f"sets it")
  if 0 < warmup and steps <= warmup + 1:  # the last step is the warm-up's or the first at --lr
    return (f"lr {lr:g} (warm-up {warmup} steps, as long as this run: no cosine follows; "
            f"--warmup-steps sets it)",
            f"the warm-up ({warmup} steps) is as long as this run ({steps} steps): no cosine "
            f"follows; --warmup-steps sets it")
  # Only an explicit --lr-decay-steps gets here: the default, --max-steps, is past warmup + 1.
  if warmup + 1 < steps and decay <= warmup + 1:
    return (f"lr {lr:g} (warm-up {warmup}, then {cfg.min_lr:g} from step {warmup + 1}: "
            f"--lr-decay-steps {decay} ends the cosine within the warm-up)",
            f"--lr-decay-steps {decay} is not past the warm-up ({warmup} steps): the lr drops from "
            f"{lr:g} to --min-lr {cfg.min_lr:g} in one step, with no cosine")
  return f"lr {lr:g} (warm-up {warmup}, cosine to {cfg.min_lr:g} at {decay})", None


def decay_mask(params):
  """Weight decay on matrices and embeddings only, never on biases or LayerNorm scales."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=1e-8,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
  return adamw
