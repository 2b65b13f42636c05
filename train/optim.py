"""Optax AdamW with linear warm-up, cosine decay and global-norm clipping (nanoGPT's recipe)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from .config import TrainConfig


def lr_schedule(cfg: TrainConfig):
  """step -> learning rate: lr * (s+1)/(W+1) for s < W, then cosine to min_lr at decay_steps, then
  min_lr."""
  warmup, decay = cfg.warmup_steps, cfg.decay_steps

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = cfg.lr * (step + 1) / (warmup + 1)
    ratio = jnp.clip((step - warmup) / max(1, decay - warmup), 0.0, 1.0)
    cosine = cfg.min_lr + 0.5 * (1.0 + jnp.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)
    return jnp.where(step < warmup, warm, cosine)

  return schedule


def decay_mask(params):
  """Weight decay on matrices and embeddings only, never on biases or LayerNorm scales."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=1e-8,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
  return adamw
