"""How a call's arrays are laid out for the backends: one description, shared.

`Geometry` holds the static sizes of a call (from canonical `spec.Operands`); the helpers pad
sequences and head dims, move heads in front of the sequence when a backend wants that, and pad
the query/key dims of a broadcastable bias or mask while keeping its size-1 dims (never
materialised). Backends choose their block multiples; the description is the same everywhere.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from stable_attn.spec import Operands


def cdiv(a, b):
  return (a + b - 1) // b


def round_up(n: int, multiple: int) -> int:
  return cdiv(n, multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Padded:
  """Padded sizes: T and S up to block multiples, the head dim up to what the backend needs."""
  T: int
  S: int
  H: int


@dataclasses.dataclass(frozen=True)
class Geometry:
  """B batch, T queries, S keys, N query heads, K key/value heads, H head dim (G = N // K)."""
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int

  @classmethod
  def of(cls, ops: Operands) -> "Geometry":
    B, T, N, H = ops.q.shape
    S, K = ops.k.shape[1], ops.k.shape[2]
    return cls(B, T, S, N, K, H)

  @property
  def G(self) -> int:
    """Query heads per key/value head: query head n reads key/value head n // G."""
    return self.N // self.K

  def padded(self, q_multiple: int, kv_multiple: int, head_dim: int | None = None) -> Padded:
    return Padded(round_up(self.T, q_multiple), round_up(self.S, kv_multiple),
                  self.H if head_dim is None else head_dim)


def lengths(ops: Operands, geo: Geometry):
  """(q_lens, kv_lens) int32 [B], clamped to T and S so that padding is never visible."""
  return (jnp.minimum(ops.q_lens, geo.T).astype(jnp.int32),
          jnp.minimum(ops.kv_lens, geo.S).astype(jnp.int32))


def pad_axis(x: jax.Array, axis: int, size: int, fill=0) -> jax.Array:
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=fill)


def pad_seq_head(x: jax.Array, length: int, head_dim: int) -> jax.Array:
  """[B, L, heads, H] -> [B, length, heads, head_dim], zero padded (the caller's layout)."""
  return pad_axis(pad_axis(x, 1, length), 3, head_dim)


def heads_major(x: jax.Array, length: int, head_dim: int) -> jax.Array:
  """[B, L, heads, H] -> [B, heads, length, head_dim], zero padded."""
  return pad_seq_head(x, length, head_dim).swapaxes(1, 2)


def from_heads_major(x: jax.Array, length: int, head_dim: int) -> jax.Array:
  """[B, heads, Lp, Hp] -> [B, length, heads, head_dim]."""
  return jnp.swapaxes(x[:, :, :length, :head_dim], 1, 2)


def unpad(x: jax.Array, length: int, head_dim: int) -> jax.Array:
  """[B, Lp, heads, Hp] -> [B, length, heads, head_dim] (a no-op when nothing was padded)."""
  if x.shape[1] == length and x.shape[3] == head_dim:
    return x
  return x[:, :length, :, :head_dim]


def pad_pairwise(x, geo: Geometry, padded: Padded, fill=0):
  """A bias or mask [Bb, Nb, Tb, Sb] (each dim 1 or full) with its full T / S dims padded."""
  if x is None:
    return None
  if x.shape[2] != 1:
    x = pad_axis(x, 2, padded.T, fill)
  if x.shape[3] != 1:
    x = pad_axis(x, 3, padded.S, fill)
  return x
