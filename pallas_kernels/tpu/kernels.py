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
Blocks outside `blocks.kv_block_range` / `blocks.q_block_range` (causal, window, key length),
intersected with the packed-sequence ranges of `blocks.segment_sections` (computed once per call
and scalar-prefetched with the lengths), and query blocks past the query length are skipped with
`pl.when`; their index maps are clamped into the visited range, so the pipeline sees an unchanged
block index and issues no DMA for them.

Operands travel by name: each pallas_call takes the padded, laid-out `Operands` as one pytree with
a pytree of BlockSpecs built from the operand table (pallas_kernels.operand_specs, with the
heads-major and lane-broadcast axes named here), so a kernel reads `refs.bias`; an absent operand
is a None ref.

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
from stable_attn.layout import Geometry, Padded, heads_major, pad_operands, pad_to, round_up, unpad
from stable_attn.spec import LSE_AXES, ROW_AXES, AttentionSpec, BackwardInputs, Operands

from pallas_kernels.operand_specs import block_spec, blocked, operand_specs, squeezed

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
# Layout (outside the kernels): heads-major q/k/v, lane-broadcast row values, scalar prefetch
# ---------------------------------------------------------------------------------------------

# The logical axes of the arrays this backend lays out differently from the operand table:
# heads-major q/k/v, and lane ("lanes", 128) or sublane ("sublanes", 8) broadcast copies of
# per-row and per-column values, which Mosaic reads as vectors in the layout the tiles want.
HEADS_MAJOR = ("batch", "heads", "query", "head_dim")
_AXES = dict(q=HEADS_MAJOR, k=("batch", "kv_heads", "key", "head_dim"),
             v=("batch", "kv_heads", "key", "head_dim"), q_seg=("batch", "query", "lanes"),
             kv_seg=("batch", "sublanes", "key"), offset=("heads", "query", "lanes"))
_LSE_LANES = ("batch", "heads", "query", "lanes")   # forward LSE out, small-block LSE / delta in
_LSE_ROW = ("batch", "heads", "one", "query")        # lane-major LSE / delta in (bq % 128 == 0)


class _Prefetch(NamedTuple):
  """Scalar-prefetched (SMEM) arrays, seen by index maps and kernels alike: the lengths [B] and
  the packed-sequence block ranges, flattened [B * blocks * 4], or None without segment ids."""
  q_lens: jax.Array
  kv_lens: jax.Array
  ranges: Optional[jax.Array]

  def segments(self, b, blk, count: int):
    """The (lo, flo, fhi, hi) of block `blk` of batch row b, or None."""
    if self.ranges is None:
      return None
    return tuple(self.ranges[(b * count + blk) * 4 + c] for c in range(4))


def _lane_broadcast(x):
  """[..., L] -> [..., L, 128] (row statistics as Mosaic keeps them)."""
  return jnp.broadcast_to(x[..., None], (*x.shape, LANES))


def _laid_out(ops: Operands, pad: Padded):
  """-> (prefetch without ranges, padded operands, operands in this backend's layout). Padding is
  the shared stable_attn.layout rule; then q/k/v go heads-major, segment ids and offsets are
  broadcast over lanes or sublanes and the lengths move to scalar prefetch."""
  x = pad_operands(ops, pad)
  segments = {}
  if x.q_seg is not None:
    B = x.q_seg.shape[0]
    segments = dict(q_seg=jnp.broadcast_to(x.q_seg[:, :, None], (B, pad.T, LANES)),
                    kv_seg=jnp.broadcast_to(x.kv_seg[:, None, :], (B, SUBLANES, pad.S)))
  laid = x._replace(
      q=heads_major(x.q), k=heads_major(x.k), v=heads_major(x.v), q_lens=None, kv_lens=None,
      offset=None if x.offset is None else _lane_broadcast(x.offset),
      sinks=None if x.sinks is None else x.sinks.astype(f32), **segments)
  return _Prefetch(x.q_lens, x.kv_lens, None), x, laid


def _with_ranges(pre: _Prefetch, x: Operands, bq: int, bk: int, per: str) -> _Prefetch:
  if x.q_seg is None:
    return pre
  return pre._replace(ranges=blocks.segment_sections(x.q_seg, x.kv_seg, bq, bk, per=per).ravel())


def _specs(laid: Operands, dims: dict) -> Operands:
  specs = operand_specs(laid, dims, axes=_AXES)
  if laid.sinks is not None:   # a scalar per program, read from SMEM
    specs = specs._replace(sinks=pl.BlockSpec(memory_space=pltpu.SMEM))
  return specs


def _check_tpu_block(spec: pl.BlockSpec, array_shape, name: str):
  """Mosaic's rule, checked here because interpret mode does not: the last two block dims are
  multiples of (8, 128) or equal to the array's."""
  dims = [1 if d is pl.squeezed or d is None else d for d in spec.block_shape]
  (b1, b0), (a1, a0) = dims[-2:], array_shape[-2:]
  if not ((b0 == a0 or b0 % LANES == 0) and (b1 == a1 or b1 % SUBLANES == 0)):
    raise AssertionError(f"TPU block {tuple(dims)} of {name} {tuple(array_shape)} breaks the "
                         f"(8, 128) rule")


def _pallas_call(kernel, spec: AttentionSpec, *, grid, in_specs, out_specs, out_shape,
                 scratch_shapes, args, semantics, name):
  """args: (prefetch, *pytrees), in_specs: the pytrees' BlockSpecs (same structure)."""
  in_leaves = jax.tree.leaves(args[1:])
  spec_leaves = jax.tree.leaves(in_specs)
  assert len(in_leaves) == len(spec_leaves), (name, len(in_leaves), len(spec_leaves))
  for s, a in zip(spec_leaves, in_leaves):
    if s.block_shape is not None:   # None: a whole array in SMEM
      _check_tpu_block(s, a.shape, name)
  for s, a in zip(out_specs, out_shape):
    if s is not None:
      _check_tpu_block(s, a.shape, name)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid,
                                             in_specs=tuple(in_specs), out_specs=out_specs,
                                             scratch_shapes=scratch_shapes),
      out_shape=out_shape,
      # The TPU interpreter ignores the grid dims that jax.vmap adds when it reads the dimension
      # semantics (and fails), so they are only declared for compilation; they change no result.
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=None if spec.interpret else semantics),
      interpret=pltpu.InterpretParams() if spec.interpret else False,
      name=name,
  )(*args)


def _clamp(idx, lo, hi, count: int):
  """The block index the pipeline fetches at a skipped step: the nearest visited one, so a run of
  skipped steps repeats one index and costs no DMA."""
  return jnp.minimum(jnp.maximum(jnp.minimum(idx, hi - 1), lo), count - 1)


def _kv_visits(spec: AttentionSpec, pre: _Prefetch, b, i, bq: int, bk: int, nq: int, nk: int):
  """[lo, hi): the key blocks query block i of batch row b visits."""
  lo, hi = blocks.kv_block_range(i * bq, bq, bk, nk, causal=spec.is_causal, window=spec.window,
                                 kv_len=pre.kv_lens[b])
  return blocks.within_segments(lo, hi, pre.segments(b, i, nq))


def _q_visits(spec: AttentionSpec, pre: _Prefetch, b, j, bk: int, bq: int, nq: int, nk: int):
  """[lo, hi): the query blocks that see key block j of batch row b."""
  lo, hi = blocks.q_block_range(j * bk, bk, bq, nq, causal=spec.is_causal, window=spec.window,
                                q_len=pre.q_lens[b])
  return blocks.within_segments(lo, hi, pre.segments(b, j, nk))


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


def _segments(refs: Operands):
  """(q ids [bq], kv ids [bk]) of the blocks, by exact reductions of their broadcast copies."""
  if refs.q_seg is None:
    return None, None
  return jnp.max(refs.q_seg[...], axis=-1), jnp.max(refs.kv_seg[...], axis=0)


def _scores(spec: AttentionSpec, dt, refs: Operands, q, k, q_start, bq: int, k_start, bk: int,
            q_len, kv_len):
  """One tile's masked scores from q [bq, Hp] and k [bk, Hp] and the refs' bias/mask/segments."""
  q_seg, kv_seg = _segments(refs)
  ok = tile.visible(_row_positions(q_start, bq), _col_positions(k_start, bk), q_len, kv_len,
                    causal=spec.is_causal, window=spec.window,
                    mask=_pairwise_tile(refs.mask, bq, bk), q_seg=q_seg, kv_seg=kv_seg)
  return tile.scores(tile.matmul(q, k, transpose_b=True), ok, scale=spec.scale,
                     bias=_pairwise_tile(refs.bias, bq, bk), dt=dt, round_fn=_round_fn(spec),
                     soft_cap=spec.logits_soft_cap)


def _round_fn(spec: AttentionSpec):
  """Compiled, a conversion is a conversion; interpreted on CPU, the body is XLA code that may drop
  an f32 -> bf16 -> f32 pair, so interpret mode rounds with reduce_precision (tile.rounding)."""
  return tile.rounding(spec.interpret)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

def _forward_kernel(pre: _Prefetch, refs: Operands, o_ref, res_ref, lse_ref, m_ref, l_ref,
                    acc_ref, *, spec: AttentionSpec, dt, bq: int, bk: int, nq: int, nk: int):
  b, n, i, j = (pl.program_id(a) for a in range(4))
  q_len, kv_len = pre.q_lens[b], pre.kv_lens[b]
  q_start = i * bq
  lo, hi = _kv_visits(spec, pre, b, i, bq, bk, nq, nk)
  round_fn = _round_fn(spec)
  offset = None if refs.offset is None else _rows(refs.offset)   # lane-broadcast [bq, 128]

  @pl.when(j == 0)
  def _init():
    stats = tile.init_stats(bq, dt)
    _store_rows(m_ref, stats.m)
    _store_rows(l_ref, stats.l)
    acc_ref[...] = jnp.zeros(acc_ref.shape, f32)

  @pl.when((j >= lo) & (j < hi) & (q_start < q_len))
  def _step():
    s = _scores(spec, dt, refs, refs.q[...], refs.k[...], q_start, bq, j * bk, bk, q_len, kv_len)
    p, alpha, stats = tile.rescale(tile.RowStats(_rows(m_ref), _rows(l_ref)), s, dt=dt,
                                   max_adjust=spec.max_adjust, beta=spec.beta, offset=offset,
                                   round_fn=round_fn)
    pv = tile.pv_product(p, refs.v[...], dt)
    acc_ref[...] = tile.accumulate(acc_ref[...], alpha, pv, dt=dt, round_fn=round_fn)
    _store_rows(m_ref, stats.m)
    _store_rows(l_ref, stats.l)

  @pl.when(j == nk - 1)
  def _finish():
    sink = None if refs.sinks is None else refs.sinks[n]   # a scalar from SMEM
    o, residual, lse = tile.finalize(acc_ref[...], tile.RowStats(_rows(m_ref), _rows(l_ref)),
                                     dt=dt, offset=offset, round_fn=round_fn, sink=sink)
    o_ref[...] = o.astype(o_ref.dtype)
    if res_ref is not None:
      res_ref[...] = residual.astype(res_ref.dtype)
    _store_rows(lse_ref, lse)


def _row_dims(G: int, bq: int, bk: int, kv_block) -> dict:
  """Grid (B, N, query blocks, key blocks): kv_block(b, n, i, j, pre) is the key block fetched."""
  return dict(batch=squeezed(lambda b, n, i, j, pre: b), heads=squeezed(lambda b, n, i, j, pre: n),
              kv_heads=squeezed(lambda b, n, i, j, pre: n // G),
              query=blocked(bq, lambda b, n, i, j, pre: i), key=blocked(bk, kv_block))


def _forward(spec: AttentionSpec, config: _Config, ops: Operands):
  dt = spec.numerics.dtypes(ops.q.dtype)
  geo = Geometry.of(ops)
  bq, bk = config.bq, config.bk
  pad = geo.padded(bq, bk, round_up(geo.H, LANES))
  nq, nk = pad.T // bq, pad.S // bk
  pre, x, laid = _laid_out(ops, pad)
  pre = _with_ranges(pre, x, bq, bk, "query")

  def kv_block(b, n, i, j, pre):
    return _clamp(j, *_kv_visits(spec, pre, b, i, bq, bk, nq, nk), nk)

  dims = _row_dims(geo.G, bq, bk, kv_block)
  separate_residual = np.dtype(dt.residual_o) != np.dtype(ops.q.dtype)
  heads_rows = (geo.B, geo.N, pad.T, pad.H)
  rows = block_spec(HEADS_MAJOR, heads_rows, dims)
  lse_shape = (geo.B, geo.N, pad.T, LANES)
  kernel = functools.partial(_forward_kernel, spec=spec, dt=dt, bq=bq, bk=bk, nq=nq, nk=nk)
  o, residual, lse = _pallas_call(
      kernel, spec, grid=(geo.B, geo.N, nq, nk), in_specs=[_specs(laid, dims)],
      out_specs=[rows, rows if separate_residual else None,
                 block_spec(_LSE_LANES, lse_shape, dims)],
      out_shape=[jax.ShapeDtypeStruct(heads_rows, ops.q.dtype),
                 jax.ShapeDtypeStruct(heads_rows, dt.residual_o) if separate_residual else None,
                 jax.ShapeDtypeStruct(lse_shape, f32)],
      scratch_shapes=[pltpu.VMEM((bq, LANES), f32), pltpu.VMEM((bq, LANES), f32),
                      pltpu.VMEM((bq, pad.H), f32)],
      args=[pre, laid],
      semantics=("parallel", "parallel", "parallel", "arbitrary"), name="stable_attn_tpu_fwd")
  to_rows = lambda a: unpad(jnp.swapaxes(a, 1, 2), ROW_AXES, geo)
  o = to_rows(o)
  residual = o if residual is None else to_rows(residual)
  return o, residual, unpad(lse[..., 0], LSE_AXES, geo)


# ---------------------------------------------------------------------------------------------
# Backward: dK/dV (innermost: the group's query heads x query blocks) and dQ (innermost: key blocks)
# ---------------------------------------------------------------------------------------------

def _tile_grads(spec: AttentionSpec, dt, refs: Operands, grads: BackwardInputs, q_start, bq: int,
                k_start, bk: int, q_len, kv_len):
  """Recomputes one tile's P and dS from the refs."""
  s = _scores(spec, dt, refs, refs.q[...], refs.k[...], q_start, bq, k_start, bk, q_len, kv_len)
  dp = tile.matmul(grads.do[...], refs.v[...], transpose_b=True)
  return tile.backward_tile(s, _rows(grads.lse), dp, _rows(grads.delta), in_dtype=dt.input,
                            round_fn=_round_fn(spec))


def _dkv_kernel(pre: _Prefetch, refs: Operands, grads: BackwardInputs, dk_out_ref, dv_out_ref,
                dk_ref, dv_ref, *, spec: AttentionSpec, dt, bq: int, bk: int, nq: int, nk: int,
                group: int):
  b, _, j, t = (pl.program_id(a) for a in range(4))
  i = t % nq
  q_len, kv_len = pre.q_lens[b], pre.kv_lens[b]
  q_start, k_start = i * bq, j * bk
  lo, hi = _q_visits(spec, pre, b, j, bk, bq, nq, nk)

  @pl.when(t == 0)
  def _init():
    dk_ref[...] = jnp.zeros(dk_ref.shape, f32)
    dv_ref[...] = jnp.zeros(dv_ref.shape, f32)

  @pl.when((i >= lo) & (i < hi) & (k_start < kv_len))
  def _step():
    g = _tile_grads(spec, dt, refs, grads, q_start, bq, k_start, bk, q_len, kv_len)
    dv_ref[...] = dv_ref[...] + tile.matmul(g.p, grads.do[...], transpose_a=True)
    dk_ref[...] = dk_ref[...] + (tile.matmul(g.ds_op, refs.q[...], transpose_a=True)
                                 * spec.scale)

  @pl.when(t == group * nq - 1)
  def _finish():
    dk_out_ref[...] = dk_ref[...].astype(dk_out_ref.dtype)
    dv_out_ref[...] = dv_ref[...].astype(dv_out_ref.dtype)


def _dq_kernel(pre: _Prefetch, refs: Operands, grads: BackwardInputs, dq_out_ref, ds_out_ref,
               dq_ref, *, spec: AttentionSpec, dt, bq: int, bk: int, nq: int, nk: int):
  b, _, i, j = (pl.program_id(a) for a in range(4))
  q_len, kv_len = pre.q_lens[b], pre.kv_lens[b]
  q_start, k_start = i * bq, j * bk
  lo, hi = _kv_visits(spec, pre, b, i, bq, bk, nq, nk)
  run = (j >= lo) & (j < hi) & (q_start < q_len)

  @pl.when(j == 0)
  def _init():
    dq_ref[...] = jnp.zeros(dq_ref.shape, f32)

  @pl.when(run)
  def _step():
    g = _tile_grads(spec, dt, refs, grads, q_start, bq, k_start, bk, q_len, kv_len)
    dq_ref[...] = dq_ref[...] + tile.matmul(g.ds_op, refs.k[...]) * spec.scale
    if ds_out_ref is not None:
      ds_out_ref[...] = g.ds

  if ds_out_ref is not None:
    @pl.when(jnp.logical_not(run))
    def _skipped():
      ds_out_ref[...] = jnp.zeros(ds_out_ref.shape, f32)

  @pl.when(j == nk - 1)
  def _finish():
    dq_out_ref[...] = dq_ref[...].astype(dq_out_ref.dtype)


def _backward_inputs(geo: Geometry, pad: Padded, bq: int, do, lse, delta):
  """dO heads-major; LSE and delta lane-major [B, N, 1, Tp] (4 bytes a row) when a (1, bq) block
  is lane aligned, else lane-broadcast [B, N, Tp, 128] (512 bytes a row, re-read for every key
  block) -> (BackwardInputs, their logical axes)."""
  rows = lambda x, fill: pad_to(x, LSE_AXES, pad, fill)
  if bq % LANES == 0:
    stats, stats_axes = (lambda x, fill: rows(x, fill)[:, :, None, :]), _LSE_ROW
  else:
    stats, stats_axes = (lambda x, fill: _lane_broadcast(rows(x, fill))), _LSE_LANES
  grads = BackwardInputs(heads_major(pad_to(do, ROW_AXES, pad)),
                         stats(lse, tile.EMPTY_ROW_LSE), stats(delta, 0.0))
  return grads, BackwardInputs(HEADS_MAJOR, stats_axes, stats_axes)


def _grad_specs(grads: BackwardInputs, axes: BackwardInputs, dims: dict) -> BackwardInputs:
  return BackwardInputs(*(block_spec(a, x.shape, dims) for a, x in zip(axes, grads)))


def _backward(spec: AttentionSpec, config: _Config, ops: Operands, o_residual, lse, do, dlse=None):
  dt = spec.numerics.dtypes(ops.q.dtype)
  geo = Geometry.of(ops)
  B, N, K, G = geo.B, geo.N, geo.K, geo.G
  # The delta pre-pass is one fused elementwise + row-sum pass (XLA), with the shared tile.delta.
  delta = tile.delta(jnp.swapaxes(do, 1, 2), jnp.swapaxes(o_residual, 1, 2))      # [B, N, T]
  delta = shifted_delta(delta, dlse)
  do = do.astype(ops.q.dtype)

  # dK, dV: grid (B, K, k blocks, G * q blocks).
  bq, bk = config.bq_dkv, config.bk_dkv
  pad = geo.padded(bq, bk, round_up(geo.H, LANES))
  nq, nk = pad.T // bq, pad.S // bk
  pre, x, laid = _laid_out(ops, pad)
  laid = laid._replace(offset=None, sinks=None)   # the backward needs neither
  pre = _with_ranges(pre, x, bq, bk, "key")
  grads, grad_axes = _backward_inputs(geo, pad, bq, do, lse, delta)

  def q_block(b, kh, j, t, pre):
    return _clamp(t % nq, *_q_visits(spec, pre, b, j, bk, bq, nq, nk), nq)

  dims = dict(batch=squeezed(lambda b, kh, j, t, pre: b),
              heads=squeezed(lambda b, kh, j, t, pre: kh * G + t // nq),
              kv_heads=squeezed(lambda b, kh, j, t, pre: kh),
              query=blocked(bq, q_block), key=blocked(bk, lambda b, kh, j, t, pre: j))
  kv_shape = (B, K, pad.S, pad.H)
  kv_rows = block_spec(_AXES["k"], kv_shape, dims)
  kernel = functools.partial(_dkv_kernel, spec=spec, dt=dt, bq=bq, bk=bk, nq=nq, nk=nk, group=G)
  dk, dv = _pallas_call(
      kernel, spec, grid=(B, K, nk, G * nq),
      in_specs=[_specs(laid, dims), _grad_specs(grads, grad_axes, dims)],
      out_specs=[kv_rows, kv_rows],
      out_shape=[jax.ShapeDtypeStruct(kv_shape, ops.k.dtype),
                 jax.ShapeDtypeStruct(kv_shape, ops.v.dtype)],
      scratch_shapes=[pltpu.VMEM((bk, pad.H), f32), pltpu.VMEM((bk, pad.H), f32)],
      args=[pre, laid, grads],
      semantics=("parallel", "parallel", "parallel", "arbitrary"), name="stable_attn_tpu_dkv")

  # dQ (and dS for dbias): grid (B, N, q blocks, k blocks).
  bq, bk = config.bq_dq, config.bk_dq
  pad = geo.padded(bq, bk, round_up(geo.H, LANES))
  nq, nk = pad.T // bq, pad.S // bk
  pre, x, laid = _laid_out(ops, pad)
  laid = laid._replace(offset=None, sinks=None)
  pre = _with_ranges(pre, x, bq, bk, "query")
  grads, grad_axes = _backward_inputs(geo, pad, bq, do, lse, delta)

  def kv_block(b, n, i, j, pre):
    return _clamp(j, *_kv_visits(spec, pre, b, i, bq, bk, nq, nk), nk)

  dims = _row_dims(G, bq, bk, kv_block)
  has_bias = laid.bias is not None
  ds_shape = (B, N, pad.T, pad.S)
  ds_dims = {**dims, "key": blocked(bk, lambda b, n, i, j, pre: j)}   # every block is written
  kernel = functools.partial(_dq_kernel, spec=spec, dt=dt, bq=bq, bk=bk, nq=nq, nk=nk)
  dq, ds = _pallas_call(
      kernel, spec, grid=(B, N, nq, nk),
      in_specs=[_specs(laid, dims), _grad_specs(grads, grad_axes, dims)],
      out_specs=[block_spec(HEADS_MAJOR, (B, N, pad.T, pad.H), dims),
                 block_spec(("batch", "heads", "query", "key"), ds_shape, ds_dims)
                 if has_bias else None],
      out_shape=[jax.ShapeDtypeStruct((B, N, pad.T, pad.H), ops.q.dtype),
                 jax.ShapeDtypeStruct(ds_shape, f32) if has_bias else None],
      scratch_shapes=[pltpu.VMEM((bq, pad.H), f32)],
      args=[pre, laid, grads],
      semantics=("parallel", "parallel", "parallel", "arbitrary"), name="stable_attn_tpu_dq")

  dbias = None
  if has_bias:
    dbias = reduce_to_shape(ds[:, :, :geo.T, :geo.S], ops.bias.shape).astype(ops.bias.dtype)
  to_caller = lambda a, axes: unpad(jnp.swapaxes(a, 1, 2), axes, geo)
  kv_axes = ("batch", "key", "kv_heads", "head_dim")
  return (to_caller(dq, ROW_AXES), to_caller(dk, kv_axes), to_caller(dv, kv_axes), dbias)


# Partitioned under jax.sharding when compiled. Not in interpret mode: the TPU interpreter runs the
# kernel body through ordered io_callbacks, which custom_partitioning cannot lower (a sharded
# interpret-mode call is gathered by XLA instead).
_flash = make_flash_attention(_forward, _backward, partition=lambda spec: not spec.interpret)


def flash_attention(spec: AttentionSpec, ops: Operands,
                    block_sizes: Optional[BlockSizes] = None) -> jax.Array:
  """(O [B, T, N, H], LSE [B, N, T]) for canonical operands; differentiable in q, k, v and bias."""
  return _flash(spec, resolve_block_sizes(block_sizes, ops), ops)
