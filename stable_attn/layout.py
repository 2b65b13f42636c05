"""How a call's arrays are padded for the backends: one host-side helper, shared by all of them.

`Geometry` holds the static sizes of a call; `pad_operands` pads every operand's "query", "key"
and "head_dim" dims to a backend's block multiples following its row of the operand table
(`stable_attn.spec.OPERANDS`: zeros, or the last value repeated for segment ids; broadcast dims of
size 1 stay 1, never materialised) and clamps the lengths to T and S, so that padding is never
visible. `pad_to` / `unpad` do the same for the backward's inputs and the outputs, named by their
logical axes. Backends choose their block multiples and any further memory layout (heads-major,
lane broadcasts); the padding is the same everywhere.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from stable_attn.spec import Operands, is_packed

# The axes padding changes, and the Padded field that holds each one's padded size.
_PADDED_AXES = {"query": "T", "key": "S", "head_dim": "H"}


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
    """The sizes of Operands, or of PackedOperands (self-attention: S = T, K = N)."""
    if is_packed(ops):
      B, T, _, N, H = ops.qkv.shape
      return cls(B, T, T, N, N, H)
    B, T, N, H = ops.q.shape
    S, K = ops.k.shape[1], ops.k.shape[2]
    return cls(B, T, S, N, K, H)

  @property
  def G(self) -> int:
    """Query heads per key/value head: query head n reads key/value head n // G."""
    return self.N // self.K

  def size(self, axis: str) -> int:
    return dict(batch=self.B, query=self.T, key=self.S, heads=self.N, kv_heads=self.K,
                head_dim=self.H, qkv=3)[axis]

  def padded(self, q_multiple: int, kv_multiple: int, head_dim: int | None = None) -> Padded:
    return Padded(round_up(self.T, q_multiple), round_up(self.S, kv_multiple),
                  self.H if head_dim is None else head_dim)


def pad_axis(x: jax.Array, axis: int, size: int, fill=0) -> jax.Array:
  """x with dim `axis` padded at the end to `size`: with `fill`, or the last value if "edge"."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  if isinstance(fill, str) and fill == "edge":
    return jnp.pad(x, widths, mode="edge")
  return jnp.pad(x, widths, constant_values=fill)


def pad_to(x: jax.Array, axes, padded: Padded, fill=0, *, broadcast: bool = False) -> jax.Array:
  """x, whose dims are the logical `axes`, with its query / key / head_dim dims padded. With
  `broadcast`, dims of size 1 are broadcast dims and stay 1."""
  for dim, axis in enumerate(axes):
    if axis in _PADDED_AXES and not (broadcast and x.shape[dim] == 1):
      x = pad_axis(x, dim, getattr(padded, _PADDED_AXES[axis]), fill)
  return x


def unpad(x: jax.Array, axes, geo: Geometry) -> jax.Array:
  """x, whose dims are the logical `axes`, sliced back to the call's sizes (a no-op when nothing
  was padded)."""
  index = tuple(slice(0, geo.size(a)) if a in _PADDED_AXES else slice(None) for a in axes)
  if all(x.shape[d] == geo.size(a) for d, a in enumerate(axes) if a in _PADDED_AXES):
    return x
  return x[index]


def pad_operands(ops: Operands, padded: Padded) -> Operands:
  """Every operand padded by its table row's rule; lengths clamped to T and S (lengths past the
  end mean the whole sequence, as in jax.nn, and never expose padding)."""
  geo = Geometry.of(ops)
  out = {}
  for row, x in type(ops).TABLE.present(ops):
    if row.counts is not None:
      out[row.name] = jnp.minimum(x, geo.size(row.counts)).astype(jnp.int32)
    else:
      out[row.name] = pad_to(x, row.axes, padded, "edge" if row.fill == "edge" else 0,
                             broadcast=row.broadcast)
  return type(ops).TABLE.make(**out)


def heads_major(x: jax.Array) -> jax.Array:
  """[B, L, heads, H] -> [B, heads, L, H] (the TPU kernels' and the reference's layout)."""
  return jnp.swapaxes(x, 1, 2)
