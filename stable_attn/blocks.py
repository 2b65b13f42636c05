"""Which key blocks a query block needs, and which query blocks a key block needs.

Causal and local-window attention skip blocks that are entirely invisible; every implementation
(reference and kernels) uses these bounds, so they visit the same blocks in the same order.
Arguments may be Python ints or traced int32 scalars (Pallas program ids, loop indices).
"""
from __future__ import annotations

import jax.numpy as jnp


def cdiv(a, b):
  return (a + b - 1) // b


def kv_block_range(q_start, block_q: int, block_k: int, num_kv_blocks, *, causal: bool, window,
                   kv_len=None):
  """Half-open range [lo, hi) of key blocks visible to query rows [q_start, q_start + block_q)."""
  first_key = 0
  last_key = num_kv_blocks * block_k - 1
  q_last = q_start + block_q - 1
  if window is not None:
    left, right = window
    first_key = jnp.maximum(q_start - left, 0)
    last_key = jnp.minimum(last_key, q_last + right)
  if causal:
    last_key = jnp.minimum(last_key, q_last)
  if kv_len is not None:
    last_key = jnp.minimum(last_key, kv_len - 1)
  lo = first_key // block_k
  hi = jnp.maximum(lo, last_key // block_k + 1)
  return lo, jnp.where(last_key < first_key, lo, hi)


def q_block_range(k_start, block_k: int, block_q: int, num_q_blocks, *, causal: bool, window,
                  q_len=None):
  """Half-open range [lo, hi) of query blocks that see key columns [k_start, k_start + block_k)."""
  first_row = 0
  last_row = num_q_blocks * block_q - 1
  k_last = k_start + block_k - 1
  if causal:
    first_row = k_start
  if window is not None:
    left, right = window
    first_row = jnp.maximum(first_row, k_start - right)
    last_row = jnp.minimum(last_row, k_last + left)
  if q_len is not None:
    last_row = jnp.minimum(last_row, q_len - 1)
  first_row = jnp.maximum(first_row, 0)
  lo = first_row // block_q
  hi = jnp.maximum(lo, last_row // block_q + 1)
  return lo, jnp.where(last_row < first_row, lo, hi)
