"""Which key blocks a query block needs, and which query blocks a key block needs.

Causal and local-window attention skip blocks that are entirely invisible; every implementation
(reference and kernels) uses these bounds, so they visit the same blocks in the same order. The
`full_*` sub-ranges are the blocks that every row sees whole: kernels run those without the
visibility mask (identical results, less arithmetic).

Packed sequences (segment ids) are ranges too: `segment_sections` computes, once per call, each
query block's range of key blocks that can share a document with it (and each key block's range
of query blocks), and inside it the blocks whose queries and keys all belong to one document.
`kv_sections` / `q_sections` intersect those with the causal / window / length ranges, so a
kernel loops over a packed row's own document only, and runs its inside unmasked. A boolean
mask operand becomes ranges the same way (`mask_sections`: blocks with any True, and the all-True
run inside them), and `mask_order` lists, for a kernel that streams blocks, only those the mask
leaves anything visible in, so a block-sparse mask costs about its visible blocks.
Arguments may be Python ints or traced int32 scalars (Pallas program ids, loop indices).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from stable_attn.layout import cdiv

__all__ = ["cdiv", "kv_block_range", "q_block_range", "full_kv_range", "full_q_range",
           "kv_sections", "q_sections", "segment_sections", "mask_sections", "mask_blocks",
           "mask_order", "intersect", "within_segments", "split_loop"]


def kv_block_range(q_start, block_q: int, block_k: int, num_kv_blocks, *, causal: bool, window,
                   kv_len=None):
  """Half-open range [lo, hi) of key blocks visible to query rows [q_start, q_start + block_q);
  0 <= lo <= hi <= num_kv_blocks, also where it is empty (kernels read per-block tables at lo)."""
  first_key = 0
  last_key = num_kv_blocks * block_k - 1
  q_last = q_start + block_q - 1
  if window is not None:
    left, right = window
    # Clamped to the keys' end: a window's left edge may pass it (T > S).
    first_key = jnp.minimum(jnp.maximum(q_start - left, 0), num_kv_blocks * block_k)
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
  """Half-open range [lo, hi) of query blocks that see key columns [k_start, k_start + block_k);
  0 <= lo <= hi <= num_q_blocks, also where it is empty (causal keys past the last query row:
  S > T)."""
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
  # Clamped to the rows' end: keys past the last row (causal, S > T) would put lo past the tables
  # that the dK/dV kernel reads at lo under a mask (`mask_order`'s rank: one int32 past its end,
  # whatever lies there then indexing the order).
  first_row = jnp.minimum(jnp.maximum(first_row, 0), num_q_blocks * block_q)
  lo = first_row // block_q
  hi = jnp.maximum(lo, last_row // block_q + 1)
  return lo, jnp.where(last_row < first_row, lo, hi)


def full_kv_range(q_start, block_q: int, block_k: int, lo, hi, *, causal: bool, window, q_len,
                  kv_len, has_mask: bool):
  """Sub-range [flo, fhi) of the key blocks [lo, hi) that every row of the query block sees whole.

  A mask operand may hide anything, so with one the sub-range is empty.
  """
  if has_mask:
    return lo, lo
  flo = lo
  fhi = kv_len // block_k                               # key blocks entirely before kv_len
  if causal:
    fhi = jnp.minimum(fhi, (q_start + 1) // block_k)    # (j + 1) * bk - 1 <= q_start
  if window is not None:
    left, right = window
    flo = jnp.maximum(flo, cdiv(q_start + block_q - 1 - left, block_k))
    fhi = jnp.minimum(fhi, (q_start + right + 1) // block_k)
  fhi = jnp.where(q_start + block_q <= q_len, fhi, flo)  # padded query rows need the mask
  return _clamp_subrange(lo, hi, flo, fhi)


def full_q_range(k_start, block_k: int, block_q: int, lo, hi, *, causal: bool, window, q_len,
                 kv_len, has_mask: bool):
  """Sub-range [flo, fhi) of the query blocks [lo, hi) whose rows all see the whole key block."""
  if has_mask:
    return lo, lo
  flo = lo
  fhi = q_len // block_q                                 # query blocks entirely before q_len
  k_last = k_start + block_k - 1
  if causal:
    flo = jnp.maximum(flo, cdiv(k_last, block_q))         # i * bq >= k_last
  if window is not None:
    left, right = window
    flo = jnp.maximum(flo, cdiv(k_last - right, block_q))
    fhi = jnp.minimum(fhi, (k_start + left + 1) // block_q)  # (i + 1) * bq - 1 <= k_start + left
  fhi = jnp.where(k_start + block_k <= kv_len, fhi, flo)    # padded keys need the mask
  return _clamp_subrange(lo, hi, flo, fhi)


def _clamp_subrange(lo, hi, flo, fhi):
  """Clamps [flo, fhi) into [lo, hi) (empty where they do not overlap)."""
  flo = jnp.minimum(jnp.maximum(flo, lo), hi)
  fhi = jnp.minimum(jnp.maximum(fhi, flo), hi)
  return flo, fhi


def kv_sections(q_start, block_q: int, block_k: int, num_kv_blocks, *, causal: bool, window,
                q_len, kv_len, has_mask: bool, segments=None, shift=0):
  """(lo, flo, fhi, hi): the key blocks [lo, hi) that query rows [q_start, +block_q) visit, and
  inside them [flo, fhi), the blocks all those rows see whole. `segments`: the query block's
  (lo, flo, fhi, hi) from `segment_sections` (per="query"), intersected in. shift: the rows stand
  at q + shift among the keys (tile.visible); the ranges are computed in key coordinates."""
  q_start, q_len = q_start + shift, q_len + shift
  lo, hi = kv_block_range(q_start, block_q, block_k, num_kv_blocks, causal=causal, window=window,
                          kv_len=kv_len)
  flo, fhi = full_kv_range(q_start, block_q, block_k, lo, hi, causal=causal, window=window,
                           q_len=q_len, kv_len=kv_len, has_mask=has_mask)
  return intersect((lo, flo, fhi, hi), segments)


def q_sections(k_start, block_k: int, block_q: int, num_q_blocks, *, causal: bool, window, q_len,
               kv_len, has_mask: bool, segments=None, shift=0):
  """(lo, flo, fhi, hi): the query blocks that see key columns [k_start, +block_k), and inside
  them the blocks whose rows all see the whole key block. `segments`: the key block's
  (lo, flo, fhi, hi) from `segment_sections` (per="key"), intersected in. shift: as in
  `kv_sections`; here the keys move the other way, into the rows' coordinates."""
  k_start, kv_len = k_start - shift, kv_len - shift
  lo, hi = q_block_range(k_start, block_k, block_q, num_q_blocks, causal=causal, window=window,
                         q_len=q_len)
  flo, fhi = full_q_range(k_start, block_k, block_q, lo, hi, causal=causal, window=window,
                          q_len=q_len, kv_len=kv_len, has_mask=has_mask)
  return intersect((lo, flo, fhi, hi), segments)


def intersect(sections, other: Optional[tuple] = None):
  """The blocks both (lo, flo, fhi, hi) visit, and inside them those both see whole."""
  if other is None:
    return tuple(sections)
  lo = jnp.maximum(sections[0], other[0])
  hi = jnp.maximum(lo, jnp.minimum(sections[3], other[3]))
  flo, fhi = _clamp_subrange(lo, hi, jnp.maximum(sections[1], other[1]),
                             jnp.minimum(sections[2], other[2]))
  return lo, flo, fhi, hi


def within_segments(lo, hi, segments: Optional[tuple] = None):
  """The blocks [lo, hi) that also lie in a block's packed-sequence range (lo, flo, fhi, hi from
  `segment_sections`), for loops that mask every block they visit."""
  if segments is None:
    return lo, hi
  lo, _, _, hi = intersect((lo, lo, lo, hi), segments)
  return lo, hi


def segment_sections(q_seg: jax.Array, kv_seg: jax.Array, block_q: int, block_k: int, *,
                     per: str) -> jax.Array:
  """Packed sequences as block ranges, computed once per call (plain XLA, outside the kernels).

  q_seg [B, Tp], kv_seg [B, Sp]: segment ids padded to multiples of block_q / block_k (padding
  repeats the last id). Returns int32 [B, n, 4]: for each query block (per="query", n = Tp //
  block_q) the (lo, flo, fhi, hi) of key blocks whose id range overlaps the query block's -- the
  only ones that can share a segment with it -- and inside them [flo, fhi), the blocks whose
  queries and keys all hold one and the same id; for each key block (per="key") the same over
  query blocks. For ids that never decrease along a row (packing) the overlapping blocks are
  contiguous and the range is exact; for other ids it is the hull (blocks inside it that share
  nothing run masked, still correct) and the one-document run is kept only if contiguous.
  """
  q_lo, q_hi = _block_ids(q_seg, block_q)                     # [B, nq]
  k_lo, k_hi = _block_ids(kv_seg, block_k)                    # [B, nk]
  share = (k_lo[:, None, :] <= q_hi[:, :, None]) & (k_hi[:, None, :] >= q_lo[:, :, None])
  whole = ((q_lo == q_hi)[:, :, None] & (k_lo == k_hi)[:, None, :]
           & (k_lo[:, None, :] == q_lo[:, :, None]))       # [B, nq, nk]
  return _ranges(share, whole, per)


def mask_sections(mask: jax.Array, block_q: int, block_k: int, *, per: str,
                  groups: int = 1) -> jax.Array:
  """A boolean mask as block ranges, computed once per call (plain XLA, outside the kernels).

  mask [Bm, Nm, Tp, Sp] (bool or int, nonzero = attend; Bm, Nm full or 1, Tp and Sp multiples of
  the blocks). Returns int32 [Bm, Nm // groups, n, 4]: for each query block (per="query") the
  (lo, flo, fhi, hi) of key blocks holding any True -- the hull; all-False blocks inside it are
  flagged by `mask_blocks` -- and inside it [flo, fhi), the contiguous run of blocks that are all
  True (they run without the mask); per="key" the same over query blocks for each key block.
  groups > 1 merges each run of `groups` heads (a dK/dV kernel loops over the query heads of one
  kv head): a block is visited if any of them needs it and runs unmasked only if all see it whole.
  """
  share, whole = _mask_tables(mask, block_q, block_k, groups)
  return _ranges(share, whole, per)


def mask_blocks(mask: jax.Array, block_q: int, block_k: int, *, per: str) -> jax.Array:
  """int32 [Bm, Nm, n, m]: 1 where block (i, j) of the mask holds any True, 0 where it is all
  False (a kernel runs such a block inside its range as a skip step); i over query blocks and j
  over key blocks for per="query", the other way round for per="key"."""
  share, _ = _mask_tables(mask, block_q, block_k, 1)
  return (jnp.swapaxes(share, -1, -2) if per == "key" else share).astype(jnp.int32)


def mask_order(mask: jax.Array, block_q: int, block_k: int, *, per: str, pair: int = 1,
               groups: int = 1) -> tuple[jax.Array, jax.Array]:
  """The blocks a kernel streams under a mask, compacted: computed once per call (plain XLA).

  A kernel program owns `pair` consecutive blocks (of queries per="query", of keys per="key") and
  streams the other axis's blocks; it needs block j only where one of its blocks' mask tiles
  holds a True (over runs of `groups` heads, as in mask_sections). Returns (rank, order), int32
  [Bm, Nm // groups, n // pair, m + 1] and [..., m]: rank[..., j] is the number of needed blocks
  before block j and order[..., p] the p-th needed one (entries past the count are unused), so a
  program that would stream blocks [lo, hi) streams order[rank[lo]:rank[hi]] instead.
  """
  share, _ = _mask_tables(mask, block_q, block_k, groups)
  if per == "key":
    share = jnp.swapaxes(share, -1, -2)
  *lead, n, m = share.shape
  share = jnp.any(share.reshape(*lead, n // pair, pair, m), axis=-2)
  counts = jnp.cumsum(share, axis=-1, dtype=jnp.int32)
  rank = jnp.concatenate([jnp.zeros_like(counts[..., :1]), counts], axis=-1)
  order = jnp.argsort(~share, axis=-1, stable=True).astype(jnp.int32)   # needed blocks first
  return rank, order


def _mask_tables(mask, block_q: int, block_k: int, groups: int):
  """(any, all) of every [block_q, block_k] block of a [Bm, Nm, Tp, Sp] mask, over runs of `groups`
  heads -> two bool [Bm, Nm // groups, Tp // block_q, Sp // block_k]."""
  Bm, Nm, Tp, Sp = mask.shape
  blocked = (mask != 0).reshape(Bm, Nm // groups, groups, Tp // block_q, block_q,
                                Sp // block_k, block_k)
  return jnp.any(blocked, axis=(2, 4, 6)), jnp.all(blocked, axis=(2, 4, 6))


def _ranges(share, whole, per: str):
  """(lo, flo, fhi, hi) per block from bool [..., nq, nk] block tables: `share`, the blocks to
  visit, `whole`, those that run unmasked -> int32 [..., n, 4] per query (or per key) block.
  One variadic reduction (first and last shared block, first and last whole block, how many are
  whole): a GPU runs it as one kernel, where separate reductions took one each (these run on
  every call with segment ids or a mask)."""
  if per == "key":
    share, whole = jnp.swapaxes(share, -1, -2), jnp.swapaxes(whole, -1, -2)
  elif per != "query":
    raise ValueError(f"per must be 'query' or 'key', got {per!r}")
  n = share.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  # Maxima as minima of negated indices, so that one reduction computation serves all four.
  lo, neg_hi, flo, neg_fhi, count = lax.reduce(
      (jnp.where(share, idx, n), jnp.where(share, -idx - 1, 0), jnp.where(whole, idx, n),
       jnp.where(whole, -idx - 1, 0), whole.astype(jnp.int32)),
      (jnp.int32(n), jnp.int32(0), jnp.int32(n), jnp.int32(0), jnp.int32(0)),
      lambda a, b: (*(jnp.minimum(x, y) for x, y in zip(a[:4], b[:4])), a[4] + b[4]),
      (share.ndim - 1,))
  hi, fhi = -neg_hi, -neg_fhi
  lo = jnp.minimum(lo, hi)                                    # nothing shared: [0, 0)
  contiguous = count == fhi - flo
  flo, fhi = _clamp_subrange(lo, hi, jnp.where(contiguous, flo, lo), jnp.where(contiguous, fhi, lo))
  return jnp.stack([lo, flo, fhi, hi], axis=-1).astype(jnp.int32)


def _block_ids(seg: jax.Array, block: int):
  """(smallest, largest) id of every block of a [B, L] id array -> two [B, L // block], in one
  variadic reduction."""
  blocked = seg.reshape(seg.shape[0], seg.shape[1] // block, block)
  info = jnp.iinfo(blocked.dtype)
  inits = (jnp.asarray(info.max, blocked.dtype), jnp.asarray(info.min, blocked.dtype))
  return lax.reduce((blocked, blocked), inits,
                    lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])), (2,))


def split_loop(lo, flo, fhi, hi, body, carry):
  """Runs body(j, carry, masked=...) over [lo, flo) masked, [flo, fhi) unmasked, [fhi, hi) masked."""
  carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
  return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)
