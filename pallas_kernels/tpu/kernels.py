"""Mosaic TPU flash attention with the max adjustment: forward, dK/dV and dQ kernels.

The math is `stable_attn.tile` (the same calls as the blockwise reference), the visited blocks are
`stable_attn.blocks`; this module only moves tiles between HBM and VMEM.

Layout. Operands are transposed to heads-major and padded once, outside the kernels: q [B,N,Tp,Hp],
k/v [B,K,Sp,Hp] with Tp a multiple of block_q (>= 8 sublanes), Sp a multiple of block_k (>= 128
lanes) and the head dim padded to Hp, a multiple of 128 (zero columns change no score and give zero
output columns, sliced off). Bias and mask keep their broadcast dims: a size-1 batch or head dim is
an index map that returns 0, a size-1 query or key dim is a block of extent 1 (legal: it equals the
array dim) broadcast in the kernel. GQA is an index map (query head n reads key head n // G); K/V
are never repeated. Sequence lengths are scalar-prefetched into SMEM, so the index maps and the
kernels both see them.

Grid. Every kernel walks the blocks it reduces over as the innermost grid dimension ("arbitrary"),
with its accumulators in VMEM scratch, initialised on the first step and written out on the last:
  forward  (B, N, q blocks, k blocks)        m, l: (bq, 128) lane-broadcast; acc: (bq, Hp) fp32
  dK/dV    (B, K, k blocks, G * q blocks)    dk, dv: (bk, Hp) fp32; the innermost dim runs over
                                             the G query heads of the key head and their q blocks,
                                             so the GQA sum happens in VMEM, with no atomics
  dQ       (B, N, q blocks, k blocks)        dq: (bq, Hp) fp32; dS blocks for dbias when a bias is
                                             given (written for every block: zeros when skipped)
Blocks outside `blocks.kv_block_range` / `blocks.q_block_range` (causal, window, key length) and
query blocks past the query length are skipped with `pl.when`; their index maps are clamped into
the visited range, so the pipeline sees an unchanged block index and issues no DMA for them.

Row statistics. `stable_attn.tile` keeps them 1-D ([bq]). Mosaic keeps a (bq,) vector that comes out
of a lane reduction in a sublane-major layout, where `x[:, None]` is free; so the kernels produce
the 1-D values they hand to the tile functions by a lane reduction of a (bq, 128) lane-broadcast
array (the scratch m and l, the query positions, the safe offsets), exact because all 128 lanes hold
the same value, and store them back as `broadcast_to(x[:, None])`. The forward writes the LSE
that way too (as JAX's flash and splash kernels do). The backward reads LSE and delta lane-major,
(1, bq) blocks of [B, N, 1, Tp], when bq is a multiple of 128 (4 bytes a row instead of 512,
re-read for every key block; `ref[0][:, None]` as splash's dQ kernel does), lane-broadcast
otherwise (small blocks, for short sequences and tests).

Rounding in interpret mode. The kernel body then runs as XLA:CPU code, whose default
excess-precision simplification may drop an f32 -> bf16 -> f32 conversion pair; interpret mode
therefore rounds with `tile.round_exact` (reduce_precision, never dropped) where the compiled kernel
converts (`tile.round_convert`). Same values, by construction; see `_round_fn`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stable_attn import blocks, tile
from stable_attn.flash import make_flash_attention, reduce_to_shape, shifted_delta
from stable_attn.layout import (Geometry, Padded, from_heads_major, heads_major, lengths,
                                pad_pairwise, round_up)
from stable_attn.spec import AttentionSpec, Operands

LANES = 128
SUBLANES = 8
f32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the three kernels (None = default 128). Query-side sizes must be multiples of 8
  (16 for 16-bit inputs or bias), key-side sizes multiples of 128. Sizes larger than the padded
  sequence shrink to it."""
  block_q: Optional[int] = None
  block_k: Optional[int] = None
  block_q_dkv: Optional[int] = None
  block_k_dkv: Optional[int] = None
  block_q_dq: Optional[int] = None
  block_k_dq: Optional[int] = None


DEFAULT_BLOCK = 128


def _sublane_multiple(*dtypes) -> int:
  """Rows of a native (sublane) tile: 8 for 32-bit, 16 for 16-bit data."""
  return max(SUBLANES * max(1, 4 // np.dtype(d).itemsize) for d in dtypes)


def _resolve(name: str, requested: Optional[int], length: int, multiple: int) -> int:
  size = DEFAULT_BLOCK if requested is None else requested
  if not isinstance(size, (int, np.integer)) or size < 1 or size % multiple:
    raise ValueError(f"{name} must be a positive multiple of {multiple} on TPU, got {requested!r}")
  return int(min(size, round_up(length, multiple)))


@dataclasses.dataclass(frozen=True)
class _Config:
  """Concrete block sizes for one call (hashable: the custom VJP's static config)."""
  bq: int
  bk: int
  bq_dkv: int
  bk_dkv: int
  bq_dq: int
  bk_dq: int


def resolve_block_sizes(sizes: Optional[BlockSizes], ops: Operands) -> _Config:
  sizes = sizes or BlockSizes()
  if not isinstance(sizes, BlockSizes):
    raise ValueError(f"config for implementation='pallas_tpu' must be a "
                     f"pallas_kernels.tpu.BlockSizes, got {sizes!r}")
  T, S = ops.q.shape[1], ops.k.shape[1]
  sub = _sublane_multiple(ops.q.dtype, *(() if ops.bias is None else (ops.bias.dtype,)))
  q_side = lambda name: _resolve(name, getattr(sizes, name), T, sub)
  k_side = lambda name: _resolve(name, getattr(sizes, name), S, LANES)
  return _Config(q_side("block_q"), k_side("block_k"), q_side("block_q_dkv"),
                 k_side("block_k_dkv"), q_side("block_q_dq"), k_side("block_k_dq"))


# ---------------------------------------------------------------------------------------------
# Layout helpers (outside the kernels)
# ---------------------------------------------------------------------------------------------

def _lane_broadcast(x):
  """[..., L] -> [..., L, 128] (row statistics as Mosaic keeps them)."""
  return jnp.broadcast_to(x[..., None], (*x.shape, LANES))


def _pairwise_spec(x, bq: int, bk: int, index):
  """BlockSpec of a [b, n, t, s] bias/mask block; `index(*grid, *prefetch)` -> (b, n, i, j)."""
  if x is None:
    return None
  full = tuple(d != 1 for d in x.shape)
  block = (pl.squeezed, pl.squeezed, bq if full[2] else 1, bk if full[3] else 1)

  def index_map(*args):
    idx = index(*args)
    return tuple(v if f else 0 for v, f in zip(idx, full))

  return pl.BlockSpec(block, index_map)


def _check_tpu_block(spec: pl.BlockSpec, array_shape, name: str):
  """Mosaic's rule, checked here because interpret mode does not: the last two block dims are
  multiples of (8, 128) or equal to the array's."""
  dims = [1 if d is pl.squeezed or d is None else d for d in spec.block_shape]
  (b1, b0), (a1, a0) = dims[-2:], array_shape[-2:]
  if not ((b0 == a0 or b0 % LANES == 0) and (b1 == a1 or b1 % SUBLANES == 0)):
    raise AssertionError(f"TPU block {tuple(dims)} of {name} {tuple(array_shape)} breaks the "
                         f"(8, 128) rule")


def _interpret(spec: AttentionSpec):
  return pltpu.InterpretParams() if spec.interpret else False


def _pallas_call(kernel, spec: AttentionSpec, *, grid, in_specs, out_specs, out_shape,
                 scratch_shapes, args, semantics, name):
  for s, a in zip(in_specs, args[2:]):
    if s is not None and s.block_shape is not None:   # None: a whole array in SMEM
      _check_tpu_block(s, a.shape, name)
  for s, a in zip(out_specs, out_shape):
    if s is not None:
      _check_tpu_block(s, a.shape, name)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch_shapes),
      out_shape=out_shape,
      # The TPU interpreter ignores the grid dims that jax.vmap adds when it reads the dimension
      # semantics (and fails), so they are only declared for compilation; they change no result.
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=None if spec.interpret else semantics),
      interpret=_interpret(spec),
      name=name,
  )(*args)


def _clamp(idx, lo, hi, count: int):
  """The block index the pipeline fetches at a skipped step: the nearest visited one, so a run of
  skipped steps repeats one index and costs no DMA."""
  return jnp.minimum(jnp.maximum(jnp.minimum(idx, hi - 1), lo), count - 1)


# ---------------------------------------------------------------------------------------------
# In-kernel helpers: 1-D row statistics from lane-broadcast tiles (see the module docstring)
# ---------------------------------------------------------------------------------------------

def _rows(ref):
  """Row statistics -> (rows,). A (rows, 128) lane-broadcast ref gives them by an exact lane
  reduction; a lane-major (1, rows) ref (the backward's, when rows is a multiple of 128) by
  indexing, and the tile function's broadcast then moves them to sublanes (as splash's dQ kernel
  does with its log-sum-exp)."""
  if ref.shape[0] == 1:
    return ref[0]
  return jnp.max(ref[...], axis=-1)


def _store_rows(ref, x):
  ref[...] = jnp.broadcast_to(x[:, None], ref.shape).astype(ref.dtype)


def _row_positions(start, rows: int):
  """int32 (rows,): start + 0 .. rows-1, as a column (lane reduction of a 2-D iota)."""
  return jnp.max(start + lax.broadcasted_iota(jnp.int32, (rows, LANES), 0), axis=-1)


def _col_positions(start, cols: int):
  """int32 (cols,): start + 0 .. cols-1, as a row (sublane reduction of a 2-D iota)."""
  return jnp.max(start + lax.broadcasted_iota(jnp.int32, (SUBLANES, cols), 1), axis=0)


def _pairwise_tile(ref, rows: int, cols: int):
  """A bias/mask block, broadcast from its (1|rows, 1|cols) block to (rows, cols)."""
  if ref is None:
    return None
  return jnp.broadcast_to(ref[...], (rows, cols))


def _visible(spec: AttentionSpec, q_start, bq: int, k_start, bk: int, q_len, kv_len, masks):
  q_seg, kv_seg = _segments(masks)
  return tile.visible(_row_positions(q_start, bq), _col_positions(k_start, bk), q_len, kv_len,
                      causal=spec.is_causal, window=spec.window,
                      mask=_pairwise_tile(masks.mask, bq, bk), q_seg=q_seg, kv_seg=kv_seg)


class _Masks(NamedTuple):
  """The optional refs that decide visibility or add to the logits (each may be None): a bias and
  a mask block, the query block's segment ids (lane-broadcast, [bq, 128]) and the key block's
  (sublane-broadcast, [8, bk])."""
  bias: Optional[jax.Array]
  mask: Optional[jax.Array]
  q_seg: Optional[jax.Array]
  kv_seg: Optional[jax.Array]


def _segments(masks: _Masks):
  """(q ids [bq], kv ids [bk]) of the blocks, by exact reductions of their broadcast copies."""
  if masks.q_seg is None:
    return None, None
  return jnp.max(masks.q_seg[...], axis=-1), jnp.max(masks.kv_seg[...], axis=0)


def _shares_segment(masks: _Masks):
  """Whether the query and key blocks can share a segment (overlapping id ranges), or True."""
  if masks.q_seg is None:
    return True
  q_ids, kv_ids = masks.q_seg[...], masks.kv_seg[...]
  return (jnp.min(kv_ids) <= jnp.max(q_ids)) & (jnp.max(kv_ids) >= jnp.min(q_ids))


def _segment_specs(q_seg, kv_seg, bq: int, bk: int, q_index, kv_index):
  """BlockSpecs of the broadcast segment ids: q_index(*args) -> (b, q block),
  kv_index(*args) -> (b, kv block)."""
  if q_seg is None:
    return [None, None]
  q_spec = pl.BlockSpec((pl.squeezed, bq, LANES), lambda *a: (*q_index(*a), 0))
  kv_spec = pl.BlockSpec((pl.squeezed, SUBLANES, bk),
                         lambda *a: (kv_index(*a)[0], 0, kv_index(*a)[1]))
  return [q_spec, kv_spec]


def _broadcast_segments(ops: Operands, pad: Padded):
  """[B, Tp, 128] and [B, 8, Sp] copies of the ids (padding repeats the last id: lengths mask the
  padding anyway, and a block's id range stays tight), or (None, None)."""
  if ops.q_seg is None:
    return None, None
  edge = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1])), mode="edge")
  q_seg = edge(ops.q_seg, pad.T)
  kv_seg = edge(ops.kv_seg, pad.S)
  return (jnp.broadcast_to(q_seg[:, :, None], (*q_seg.shape, LANES)),
          jnp.broadcast_to(kv_seg[:, None, :], (kv_seg.shape[0], SUBLANES, kv_seg.shape[1])))


def _round_fn(spec: AttentionSpec):
  """Compiled, a conversion is a conversion; interpreted on CPU, the body is XLA code that may drop
  an f32 -> bf16 -> f32 pair, so interpret mode rounds with reduce_precision (tile.rounding)."""
  return tile.rounding(spec.interpret)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

def _forward_kernel(q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, bias_ref, mask_ref, qseg_ref,
                    kvseg_ref, offset_ref, sink_ref, o_ref, res_ref, lse_ref, m_ref, l_ref,
                    acc_ref, *, spec: AttentionSpec, dt, bq: int, bk: int, nk: int):
  b, n, i, j = (pl.program_id(a) for a in range(4))
  q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
  q_start = i * bq
  lo, hi = blocks.kv_block_range(q_start, bq, bk, nk, causal=spec.is_causal, window=spec.window,
                                 kv_len=kv_len)
  round_fn = _round_fn(spec)
  offset = None if offset_ref is None else _rows(offset_ref)   # lane-broadcast [bq, 128]
  masks = _Masks(bias_ref, mask_ref, qseg_ref, kvseg_ref)

  @pl.when(j == 0)
  def _init():
    stats = tile.init_stats(bq, dt)
    _store_rows(m_ref, stats.m)
    _store_rows(l_ref, stats.l)
    acc_ref[...] = jnp.zeros(acc_ref.shape, f32)

  @pl.when((j >= lo) & (j < hi) & (q_start < q_len) & _shares_segment(masks))
  def _step():
    ok = _visible(spec, q_start, bq, j * bk, bk, q_len, kv_len, masks)
    s = tile.scores(tile.matmul(q_ref[...], k_ref[...], transpose_b=True), ok, scale=spec.scale,
                    bias=_pairwise_tile(bias_ref, bq, bk), dt=dt, round_fn=round_fn,
                    soft_cap=spec.logits_soft_cap)
    p, alpha, stats = tile.rescale(tile.RowStats(_rows(m_ref), _rows(l_ref)), s, dt=dt,
                                   max_adjust=spec.max_adjust, beta=spec.beta, offset=offset,
                                   round_fn=round_fn)
    pv = tile.matmul(p, v_ref[...].astype(dt.p))
    acc_ref[...] = tile.accumulate(acc_ref[...], alpha, pv, dt=dt, round_fn=round_fn)
    _store_rows(m_ref, stats.m)
    _store_rows(l_ref, stats.l)

  @pl.when(j == nk - 1)
  def _finish():
    sink = None if sink_ref is None else sink_ref[n]   # a scalar from SMEM
    o, residual, lse = tile.finalize(acc_ref[...], tile.RowStats(_rows(m_ref), _rows(l_ref)),
                                     dt=dt, offset=offset, round_fn=round_fn, sink=sink)
    o_ref[...] = o.astype(o_ref.dtype)
    if res_ref is not None:
      res_ref[...] = residual.astype(res_ref.dtype)
    _store_rows(lse_ref, lse)


def _forward(spec: AttentionSpec, config: _Config, ops: Operands):
  dt = spec.numerics.dtypes(ops.q.dtype)
  geo = Geometry.of(ops)
  G = geo.G
  bq, bk = config.bq, config.bk
  pad = geo.padded(bq, bk, round_up(geo.H, LANES))
  nq, nk = pad.T // bq, pad.S // bk
  q, k, v = (heads_major(x, n, pad.H) for x, n in ((ops.q, pad.T), (ops.k, pad.S), (ops.v, pad.S)))
  bias = pad_pairwise(ops.bias, geo, pad, 0)
  mask = pad_pairwise(ops.mask, geo, pad, False)
  q_lens, kv_lens = lengths(ops, geo)

  def kv_block(b, n, i, j, q_lens_ref, kv_lens_ref):
    lo, hi = blocks.kv_block_range(i * bq, bq, bk, nk, causal=spec.is_causal,
                                   window=spec.window, kv_len=kv_lens_ref[b])
    return _clamp(j, lo, hi, nk)

  q_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, pad.H), lambda b, n, i, j, *_: (b, n, i, 0))
  kv_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, bk, pad.H),
                         lambda b, n, i, j, *p: (b, n // G, kv_block(b, n, i, j, *p), 0))
  pair_index = lambda b, n, i, j, *p: (b, n, i, kv_block(b, n, i, j, *p))
  q_seg, kv_seg = _broadcast_segments(ops, pad)
  offset = offset_spec = None
  if ops.offset is not None:
    offset = _lane_broadcast(jnp.pad(ops.offset, ((0, 0), (0, pad.T - geo.T))))   # [N, Tp, 128]
    offset_spec = pl.BlockSpec((pl.squeezed, bq, LANES), lambda b, n, i, j, *_: (n, i, 0))
  in_specs = [q_spec, kv_spec, kv_spec, _pairwise_spec(bias, bq, bk, pair_index),
              _pairwise_spec(mask, bq, bk, pair_index),
              *_segment_specs(q_seg, kv_seg, bq, bk, lambda b, n, i, j, *p: (b, i),
                              lambda b, n, i, j, *p: (b, kv_block(b, n, i, j, *p))),
              offset_spec, None if ops.sinks is None else pl.BlockSpec(memory_space=pltpu.SMEM)]
  sinks = None if ops.sinks is None else ops.sinks.astype(f32)

  separate_residual = np.dtype(dt.residual_o) != np.dtype(ops.q.dtype)
  rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, pad.H), lambda b, n, i, j, *_: (b, n, i, 0))
  stats = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, LANES), lambda b, n, i, j, *_: (b, n, i, 0))
  heads_rows = (geo.B, geo.N, pad.T, pad.H)
  out_shape = [jax.ShapeDtypeStruct(heads_rows, ops.q.dtype),
               jax.ShapeDtypeStruct(heads_rows, dt.residual_o) if separate_residual else None,
               jax.ShapeDtypeStruct((geo.B, geo.N, pad.T, LANES), f32)]
  kernel = functools.partial(_forward_kernel, spec=spec, dt=dt, bq=bq, bk=bk, nk=nk)
  o, residual, lse = _pallas_call(
      kernel, spec, grid=(geo.B, geo.N, nq, nk), in_specs=in_specs,
      out_specs=[rows, rows if separate_residual else None, stats], out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((bq, LANES), f32), pltpu.VMEM((bq, LANES), f32),
                      pltpu.VMEM((bq, pad.H), f32)],
      args=[q_lens, kv_lens, q, k, v, bias, mask, q_seg, kv_seg, offset, sinks],
      semantics=("parallel", "parallel", "parallel", "arbitrary"), name="stable_attn_tpu_fwd")
  o = from_heads_major(o, geo.T, geo.H)
  residual = o if residual is None else from_heads_major(residual, geo.T, geo.H)
  return o, residual, lse[:, :, :geo.T, 0]


# ---------------------------------------------------------------------------------------------
# Backward: dK/dV (innermost: the group's query heads x query blocks) and dQ (innermost: key blocks)
# ---------------------------------------------------------------------------------------------

def _tile_grads(spec: AttentionSpec, dt, refs, masks: _Masks, q_start, bq: int, k_start, bk: int,
                q_len, kv_len):
  """Recomputes one tile's P and dS from refs (q, k, v, dO, lse, delta) and the masks."""
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs
  round_fn = _round_fn(spec)
  ok = _visible(spec, q_start, bq, k_start, bk, q_len, kv_len, masks)
  s = tile.scores(tile.matmul(q_ref[...], k_ref[...], transpose_b=True), ok, scale=spec.scale,
                  bias=_pairwise_tile(masks.bias, bq, bk), dt=dt, round_fn=round_fn,
                  soft_cap=spec.logits_soft_cap)
  dp = tile.matmul(do_ref[...], v_ref[...], transpose_b=True)
  return tile.backward_tile(s, _rows(lse_ref), dp, _rows(delta_ref), in_dtype=dt.input,
                            round_fn=round_fn)


def _dkv_kernel(q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                bias_ref, mask_ref, qseg_ref, kvseg_ref, dk_out_ref, dv_out_ref, dk_ref, dv_ref, *,
                spec: AttentionSpec, dt, bq: int, bk: int, nq: int, group: int):
  b, kh, j, t = (pl.program_id(a) for a in range(4))
  i = t % nq
  q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
  q_start, k_start = i * bq, j * bk
  lo, hi = blocks.q_block_range(k_start, bk, bq, nq, causal=spec.is_causal, window=spec.window,
                                q_len=q_len)

  @pl.when(t == 0)
  def _init():
    dk_ref[...] = jnp.zeros(dk_ref.shape, f32)
    dv_ref[...] = jnp.zeros(dv_ref.shape, f32)

  masks = _Masks(bias_ref, mask_ref, qseg_ref, kvseg_ref)

  @pl.when((i >= lo) & (i < hi) & (k_start < kv_len) & _shares_segment(masks))
  def _step():
    refs = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref)
    grads = _tile_grads(spec, dt, refs, masks, q_start, bq, k_start, bk, q_len, kv_len)
    dv_ref[...] = dv_ref[...] + tile.matmul(grads.p, do_ref[...], transpose_a=True)
    dk_ref[...] = dk_ref[...] + (tile.matmul(grads.ds_op, q_ref[...], transpose_a=True)
                                 * spec.scale)

  @pl.when(t == group * nq - 1)
  def _finish():
    dk_out_ref[...] = dk_ref[...].astype(dk_out_ref.dtype)
    dv_out_ref[...] = dv_ref[...].astype(dv_out_ref.dtype)


def _dq_kernel(q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bias_ref,
               mask_ref, qseg_ref, kvseg_ref, dq_out_ref, ds_out_ref, dq_ref, *,
               spec: AttentionSpec, dt, bq: int,
               bk: int, nk: int):
  b, n, i, j = (pl.program_id(a) for a in range(4))
  q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
  q_start, k_start = i * bq, j * bk
  lo, hi = blocks.kv_block_range(q_start, bq, bk, nk, causal=spec.is_causal, window=spec.window,
                                 kv_len=kv_len)
  masks = _Masks(bias_ref, mask_ref, qseg_ref, kvseg_ref)
  run = (j >= lo) & (j < hi) & (q_start < q_len) & _shares_segment(masks)

  @pl.when(j == 0)
  def _init():
    dq_ref[...] = jnp.zeros(dq_ref.shape, f32)

  @pl.when(run)
  def _step():
    refs = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref)
    grads = _tile_grads(spec, dt, refs, masks, q_start, bq, k_start, bk, q_len, kv_len)
    dq_ref[...] = dq_ref[...] + tile.matmul(grads.ds_op, k_ref[...]) * spec.scale
    if ds_out_ref is not None:
      ds_out_ref[...] = grads.ds

  if ds_out_ref is not None:
    @pl.when(jnp.logical_not(run))
    def _skipped():
      ds_out_ref[...] = jnp.zeros(ds_out_ref.shape, f32)

  @pl.when(j == nk - 1)
  def _finish():
    dq_out_ref[...] = dq_ref[...].astype(dq_out_ref.dtype)


def _stats_spec(bq: int, q_rows_index):
  """BlockSpec of the backward's LSE / delta rows, lane-major or lane-broadcast (see layout)."""
  if bq % LANES == 0:
    def index(*args):
      b, n, i, _ = q_rows_index(*args)
      return b, n, 0, i
    return pl.BlockSpec((pl.squeezed, pl.squeezed, 1, bq), index)
  return pl.BlockSpec((pl.squeezed, pl.squeezed, bq, LANES), q_rows_index)


@dataclasses.dataclass(frozen=True)
class _BackwardLayout:
  """The padded, heads-major operands of one backward kernel (its own block sizes)."""
  pad: Padded
  q: jax.Array
  k: jax.Array
  v: jax.Array
  do: jax.Array
  lse: jax.Array
  delta: jax.Array
  bias: Optional[jax.Array]
  mask: Optional[jax.Array]
  q_seg: Optional[jax.Array]
  kv_seg: Optional[jax.Array]

  @classmethod
  def make(cls, ops: Operands, geo: Geometry, bq: int, bk: int, do, lse, delta):
    pad = geo.padded(bq, bk, round_up(geo.H, LANES))

    def rows(x, fill):
      x = jnp.pad(x, ((0, 0), (0, 0), (0, pad.T - geo.T)), constant_values=fill)
      # Lane-major [B, N, 1, Tp] (4 bytes a row) when a (1, bq) block is lane aligned, else
      # lane-broadcast [B, N, Tp, 128] (512 bytes a row, re-read for every key block).
      return x[:, :, None, :] if bq % LANES == 0 else _lane_broadcast(x)

    return cls(pad, heads_major(ops.q, pad.T, pad.H), heads_major(ops.k, pad.S, pad.H),
               heads_major(ops.v, pad.S, pad.H), heads_major(do.astype(ops.q.dtype), pad.T, pad.H),
               rows(lse, tile.EMPTY_ROW_LSE), rows(delta, 0.0),
               pad_pairwise(ops.bias, geo, pad, 0), pad_pairwise(ops.mask, geo, pad, False),
               *_broadcast_segments(ops, pad))

  def args(self, q_lens, kv_lens):
    return [q_lens, kv_lens, self.q, self.k, self.v, self.do, self.lse, self.delta, self.bias,
            self.mask, self.q_seg, self.kv_seg]


def _backward(spec: AttentionSpec, config: _Config, ops: Operands, o_residual, lse, do, dlse=None):
  dt = spec.numerics.dtypes(ops.q.dtype)
  geo = Geometry.of(ops)
  B, N, K, G = geo.B, geo.N, geo.K, geo.G
  q_lens, kv_lens = lengths(ops, geo)
  # The delta pre-pass is one fused elementwise + row-sum pass (XLA), with the shared tile.delta.
  delta = tile.delta(jnp.swapaxes(do, 1, 2), jnp.swapaxes(o_residual, 1, 2))      # [B, N, T]
  delta = shifted_delta(delta, dlse)

  # dK, dV: grid (B, K, k blocks, G * q blocks).
  bq, bk = config.bq_dkv, config.bk_dkv
  x = _BackwardLayout.make(ops, geo, bq, bk, do, lse, delta)
  nq, nk = x.pad.T // bq, x.pad.S // bk

  def q_block(b, j, t, q_lens_ref):
    lo, hi = blocks.q_block_range(j * bk, bk, bq, nq, causal=spec.is_causal, window=spec.window,
                                  q_len=q_lens_ref[b])
    return _clamp(t % nq, lo, hi, nq)

  def q_rows_index(b, kh, j, t, q_lens_ref, kv_lens_ref):
    return (b, kh * G + t // nq, q_block(b, j, t, q_lens_ref), 0)

  def pair_index(b, kh, j, t, q_lens_ref, kv_lens_ref):
    return (b, kh * G + t // nq, q_block(b, j, t, q_lens_ref), j)

  q_rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, x.pad.H), q_rows_index)
  stats = _stats_spec(bq, q_rows_index)
  kv_rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bk, x.pad.H),
                         lambda b, kh, j, t, *_: (b, kh, j, 0))
  kernel = functools.partial(_dkv_kernel, spec=spec, dt=dt, bq=bq, bk=bk, nq=nq, group=G)
  kv_shape = (B, K, x.pad.S, x.pad.H)
  dk, dv = _pallas_call(
      kernel, spec, grid=(B, K, nk, G * nq),
      in_specs=[q_rows, kv_rows, kv_rows, q_rows, stats, stats,
                _pairwise_spec(x.bias, bq, bk, pair_index),
                _pairwise_spec(x.mask, bq, bk, pair_index),
                *_segment_specs(x.q_seg, x.kv_seg, bq, bk,
                                lambda b, kh, j, t, ql, kl: (b, q_block(b, j, t, ql)),
                                lambda b, kh, j, t, *_: (b, j))],
      out_specs=[kv_rows, kv_rows],
      out_shape=[jax.ShapeDtypeStruct(kv_shape, ops.k.dtype),
                 jax.ShapeDtypeStruct(kv_shape, ops.v.dtype)],
      scratch_shapes=[pltpu.VMEM((bk, x.pad.H), f32), pltpu.VMEM((bk, x.pad.H), f32)],
      args=x.args(q_lens, kv_lens),
      semantics=("parallel", "parallel", "parallel", "arbitrary"), name="stable_attn_tpu_dkv")

  # dQ (and dS for dbias): grid (B, N, q blocks, k blocks).
  bq, bk = config.bq_dq, config.bk_dq
  x = _BackwardLayout.make(ops, geo, bq, bk, do, lse, delta)
  nq, nk = x.pad.T // bq, x.pad.S // bk

  def kv_block(b, n, i, j, q_lens_ref, kv_lens_ref):
    lo, hi = blocks.kv_block_range(i * bq, bq, bk, nk, causal=spec.is_causal,
                                   window=spec.window, kv_len=kv_lens_ref[b])
    return _clamp(j, lo, hi, nk)

  q_rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, x.pad.H),
                        lambda b, n, i, j, *_: (b, n, i, 0))
  stats = _stats_spec(bq, lambda b, n, i, j, *_: (b, n, i, 0))
  kv_rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bk, x.pad.H),
                         lambda b, n, i, j, *p: (b, n // G, kv_block(b, n, i, j, *p), 0))
  pair_index = lambda b, n, i, j, *p: (b, n, i, kv_block(b, n, i, j, *p))
  has_bias = x.bias is not None
  ds_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, bk), lambda b, n, i, j, *_: (b, n, i, j))
  kernel = functools.partial(_dq_kernel, spec=spec, dt=dt, bq=bq, bk=bk, nk=nk)
  dq, ds = _pallas_call(
      kernel, spec, grid=(B, N, nq, nk),
      in_specs=[q_rows, kv_rows, kv_rows, q_rows, stats, stats,
                _pairwise_spec(x.bias, bq, bk, pair_index),
                _pairwise_spec(x.mask, bq, bk, pair_index),
                *_segment_specs(x.q_seg, x.kv_seg, bq, bk, lambda b, n, i, j, *p: (b, i),
                                lambda b, n, i, j, *p: (b, kv_block(b, n, i, j, *p)))],
      out_specs=[q_rows, ds_spec if has_bias else None],
      out_shape=[jax.ShapeDtypeStruct((B, N, x.pad.T, x.pad.H), ops.q.dtype),
                 jax.ShapeDtypeStruct((B, N, x.pad.T, x.pad.S), f32) if has_bias else None],
      scratch_shapes=[pltpu.VMEM((bq, x.pad.H), f32)],
      args=x.args(q_lens, kv_lens),
      semantics=("parallel", "parallel", "parallel", "arbitrary"), name="stable_attn_tpu_dq")

  dbias = None
  if has_bias:
    dbias = reduce_to_shape(ds[:, :, :geo.T, :geo.S], ops.bias.shape).astype(ops.bias.dtype)
  return (from_heads_major(dq, geo.T, geo.H), from_heads_major(dk, geo.S, geo.H),
          from_heads_major(dv, geo.S, geo.H), dbias)


# Partitioned under jax.sharding when compiled. Not in interpret mode: the TPU interpreter runs the
# kernel body through ordered io_callbacks, which custom_partitioning cannot lower (a sharded
# interpret-mode call is gathered by XLA instead).
_flash = make_flash_attention(_forward, _backward, partition=lambda spec: not spec.interpret)


def flash_attention(spec: AttentionSpec, ops: Operands,
                    block_sizes: Optional[BlockSizes] = None) -> jax.Array:
  """(O [B, T, N, H], LSE [B, N, T]) for canonical operands; differentiable in q, k, v and bias."""
  return _flash(spec, resolve_block_sizes(block_sizes, ops), ops)
