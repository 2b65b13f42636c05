"""The static description of one attention call, shared by every implementation."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax

from stable_attn.numerics import Numerics


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Everything about a call that is not an array (hashable; a jit/custom_vjp static argument)."""
  scale: float
  is_causal: bool
  window: Optional[tuple[int, int]]  # (left, right) or None
  max_adjust: str                    # "off" | "paper" | "safe"
  beta: float
  numerics: Numerics
  interpret: bool = False
  # Whether sequence lengths were given: if not, ops.q_lens / kv_lens are T and S, and a kernel may
  # use those static values instead of reading the arrays.
  has_lengths: bool = False
  logits_soft_cap: Optional[float] = None   # logits -> cap * tanh(logits / cap)
  return_residuals: bool = False            # the caller also wants the (differentiable) LSE


class Operands(NamedTuple):
  """Canonical arrays: q [B,T,N,H], k/v [B,S,K,H], bias/mask 4-D broadcastable to [B,N,T,S] (size-1
  dims kept, never materialised) or None, q_lens/kv_lens int32 [B] (always present), q_seg int32
  [B,T] and kv_seg int32 [B,S] (both or neither: query t sees key s only if their ids match),
  offset fp32 [N,T] (max_adjust="safe" only), sinks float [N] or None."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: Optional[jax.Array]
  mask: Optional[jax.Array]
  q_lens: jax.Array
  kv_lens: jax.Array
  q_seg: Optional[jax.Array] = None
  kv_seg: Optional[jax.Array] = None
  # max_adjust="safe"'s per-row offsets, fp32 [N, T] in natural units (tile.safe_offset of each
  # query head and position), else None. An operand rather than recomputed in every kernel: one
  # definition, and a partitioned call gets each shard's global rows.
  offset: Optional[jax.Array] = None
  # Attention sinks: [N] logits, one per query head, that join every row's softmax denominator
  # without a value (gpt-oss / splash); differentiable. None without sinks.
  sinks: Optional[jax.Array] = None
