"""Packed sequences as block ranges (stable_attn.blocks.segment_sections), against brute force."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from stable_attn import blocks


def _ids(rng, B, L, monotone: bool):
  if monotone:   # packing: documents of random lengths, ids never decrease
    return np.cumsum(rng.random((B, L)) < 3.0 / L * rng.integers(1, 4), axis=1).astype(np.int32)
  return rng.integers(0, 4, (B, L)).astype(np.int32)


def _blocks(ids, block):
  return ids.reshape(ids.shape[0], -1, block)


@pytest.mark.parametrize("monotone", [True, False])
@pytest.mark.parametrize("per", ["query", "key"])
def test_segment_sections_against_brute_force(monotone, per):
  rng = np.random.default_rng()
  for _ in range(20):
    bq, bk = (int(x) for x in rng.choice([4, 8, 16], 2))
    B, nq, nk = 2, int(rng.integers(1, 9)), int(rng.integers(1, 9))
    q_ids, kv_ids = _ids(rng, B, nq * bq, monotone), _ids(rng, B, nk * bk, monotone)
    got = np.asarray(blocks.segment_sections(q_ids, kv_ids, bq, bk, per=per))
    qb, kb = _blocks(q_ids, bq), _blocks(kv_ids, bk)
    # share[b, i, j]: query block i and key block j hold a common id (a visible pair may exist)
    share = np.array([[[bool(np.intersect1d(qb[b, i], kb[b, j]).size) for j in range(nk)]
                       for i in range(nq)] for b in range(B)])
    whole = np.array([[[len(set(qb[b, i]) | set(kb[b, j])) == 1 for j in range(nk)]
                       for i in range(nq)] for b in range(B)])
    if per == "key":
      share, whole = share.transpose(0, 2, 1), whole.transpose(0, 2, 1)
    for b in range(B):
      for r, (lo, flo, fhi, hi) in enumerate(got[b]):
        assert lo <= flo <= fhi <= hi <= share.shape[2]
        members = np.flatnonzero(share[b, r])
        assert all(lo <= m < hi for m in members), (per, b, r, got[b, r], members)
        if monotone and members.size:   # exact for packing: the range holds nothing else
          assert (lo, hi) == (members[0], members[-1] + 1), (got[b, r], members)
        assert all(whole[b, r, flo:fhi]), (got[b, r], whole[b, r])
        if monotone:   # and every one-document block is run unmasked
          assert fhi - flo == whole[b, r].sum(), (got[b, r], whole[b, r])


def test_intersection_with_causal_ranges_keeps_every_visible_block():
  """kv_sections with segments: every key block holding a visible (causal, same-document) pair is
  visited, and every block run unmasked has every pair visible."""
  rng = np.random.default_rng()
  bq = bk = 8
  T = 64
  for _ in range(10):
    ids = _ids(rng, 1, T, True)
    ranges = np.asarray(blocks.segment_sections(ids, ids, bq, bk, per="query"))[0]
    visible = (ids[0][:, None] == ids[0][None, :]) & (np.arange(T)[None] <= np.arange(T)[:, None])
    for i in range(T // bq):
      lo, flo, fhi, hi = (int(x) for x in blocks.kv_sections(
          i * bq, bq, bk, T // bk, causal=True, window=None, q_len=T, kv_len=T, has_mask=False,
          segments=tuple(ranges[i])))
      tiles = visible[i * bq:(i + 1) * bq].reshape(bq, T // bk, bk)
      for j in range(T // bk):
        if tiles[:, j].any():
          assert lo <= j < hi, (i, j, (lo, flo, fhi, hi))
        if flo <= j < fhi:
          assert tiles[:, j].all(), (i, j, (lo, flo, fhi, hi))


def test_block_ranges_stay_inside_their_tables():
  """kv_sections / q_sections: 0 <= lo <= flo <= fhi <= hi <= the block count, also for blocks
  that see nothing (keys past the last query row under a causal mask, a window's edge past the
  other side, lengths' shift), since kernels read per-block tables (mask_order's rank, of
  length n + 1) at lo and hi; and every visible (row, key) pair lies in [lo, hi)."""
  rng = np.random.default_rng()
  for _ in range(300):
    bq, bk = (int(x) for x in rng.choice([16, 32, 64], 2))
    nq, nk = (int(x) for x in rng.integers(1, 9, 2))
    q_len, kv_len = int(rng.integers(0, nq * bq + 1)), int(rng.integers(0, nk * bk + 1))
    shift = int(rng.integers(-nq * bq, nk * bk + 1)) if rng.integers(2) else 0
    causal = bool(rng.integers(2))
    window = None if rng.integers(2) else tuple(int(x) for x in rng.integers(0, 130, 2))
    rows, keys = np.arange(nq * bq)[:, None] + shift, np.arange(nk * bk)[None]
    seen = (rows - shift < q_len) & (keys < kv_len)
    seen &= (keys <= rows) if causal else True
    if window is not None:
      seen &= (keys >= rows - window[0]) & (keys <= rows + window[1])
    common = dict(causal=causal, window=window, q_len=q_len, kv_len=kv_len, has_mask=False)
    for per, n_own, n_other in (("query", nq, nk), ("key", nk, nq)):
      for i in range(n_own):
        if per == "query":
          got = blocks.kv_sections(i * bq, bq, bk, nk, **common, shift=shift)
          tile = seen[i * bq:(i + 1) * bq].reshape(bq, nk, bk).any(axis=(0, 2))
        else:
          got = blocks.q_sections(i * bk, bk, bq, nq, **common, shift=shift)
          tile = seen[:, i * bk:(i + 1) * bk].reshape(nq, bq, bk).any(axis=(1, 2))
        lo, flo, fhi, hi = (int(x) for x in got)
        assert 0 <= lo <= flo <= fhi <= hi <= n_other, (per, i, (lo, flo, fhi, hi))
        visible = np.flatnonzero(tile)
        assert all(lo <= j < hi for j in visible), (per, i, (lo, hi), visible)


@pytest.mark.parametrize("per", ["query", "key"])
@pytest.mark.parametrize("groups", [1, 2])
def test_mask_sections_match_brute_force(per, groups):
  """blocks.mask_sections: the hull of blocks with any True, and the all-True run inside it (kept
  only when contiguous), per query block or per key block, merged over head groups; and
  blocks.mask_blocks, the per-block flags."""
  rng = np.random.default_rng()
  bq, bk, nq, nk, heads = 8, 4, 5, 7, 4
  blocks_true = rng.random((2, heads, nq, nk)) < 0.5
  mask = np.repeat(np.repeat(blocks_true, bq, 2), bk, 3)
  mask &= rng.random(mask.shape) < 0.9   # some blocks partly True
  got = np.asarray(blocks.mask_sections(jnp.asarray(mask), bq, bk, per=per, groups=groups))
  per_block = mask.reshape(2, heads // groups, groups, nq, bq, nk, bk)
  share, whole = per_block.any(axis=(2, 4, 6)), per_block.all(axis=(2, 4, 6))
  if per == "key":
    share, whole = share.swapaxes(-1, -2), whole.swapaxes(-1, -2)
  if groups == 1:   # the per-block flags: 0 exactly for the all-False blocks
    flags = blocks.mask_blocks(jnp.asarray(mask), bq, bk, per=per)
    np.testing.assert_array_equal(np.asarray(flags), share.astype(np.int32))
  for pair in (1, nq if per == "query" else nk):   # the compacted order of the needed blocks
    rank, order = (np.asarray(a) for a in blocks.mask_order(jnp.asarray(mask), bq, bk, per=per,
                                                           pair=pair, groups=groups))
    needed = share.reshape(*share.shape[:-2], -1, pair, share.shape[-1]).any(axis=-2)
    for index in np.ndindex(needed.shape[:-1]):
      listed = np.flatnonzero(needed[index])
      np.testing.assert_array_equal(order[index][:listed.size], listed)
      np.testing.assert_array_equal(rank[index], np.concatenate([[0], np.cumsum(needed[index])]))
  for index in np.ndindex(share.shape[:-1]):
    visited = np.flatnonzero(share[index])
    lo, flo, fhi, hi = got[index]
    if visited.size == 0:
      assert lo == hi
      continue
    assert (lo, hi) == (visited[0], visited[-1] + 1)
    full = np.flatnonzero(whole[index])
    if full.size and full[-1] - full[0] + 1 == full.size:
      assert (flo, fhi) == (full[0], full[-1] + 1)
    else:
      assert flo == fhi
