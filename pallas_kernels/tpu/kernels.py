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
array (the scratch m and l, the query positions, the safe offset), exact because all 128 lanes hold
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
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stable_attn import blocks, tile
from stable_attn.flash import make_flash_attention, reduce_to_shape
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


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _sublane_multiple(*dtypes) -> int:
  """Rows of a native (sublane) tile: 8 for 32-bit, 16 for 16-bit data."""
  return max(SUBLANES * max(1, 4 // np.dtype(d).itemsize) for d in dtypes)


def _resolve(name: str, requested: Optional[int], length: int, multiple: int) -> int:
  size = DEFAULT_BLOCK if requested is None else requested
  if not isinstance(size, (int, np.integer)) or size < 1 or size % multiple:
    raise ValueError(f"{name} must be a positive multiple of {multiple} on TPU, got {requested!r}")
  return int(min(size, _round_up(length, multiple)))


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
  T, S = ops.q.shape[1], ops.k.shape[1]
  sub = _sublane_multiple(ops.q.dtype, *(() if ops.bias is None else (ops.bias.dtype,)))
  q_side = lambda name: _resolve(name, getattr(sizes, name), T, sub)
  k_side = lambda name: _resolve(name, getattr(sizes, name), S, LANES)
  return _Config(q_side("block_q"), k_side("block_k"), q_side("block_q_dkv"),
                 k_side("block_k_dkv"), q_side("block_q_dq"), k_side("block_k_dq"))


# ---------------------------------------------------------------------------------------------
# Layout helpers (outside the kernels)
# ---------------------------------------------------------------------------------------------

def _heads_major(x, padded_len: int, padded_dim: int):
  """[B, L, heads, H] -> [B, heads, Lp, Hp], zero padded."""
  x = jnp.swapaxes(x, 1, 2)
  return jnp.pad(x, ((0, 0), (0, 0), (0, padded_len - x.shape[2]),
                     (0, padded_dim - x.shape[3])))


def _from_heads_major(x, length: int, dim: int):
  return jnp.swapaxes(x[:, :, :length, :dim], 1, 2)


def _lane_broadcast(x):
  """[..., L] -> [..., L, 128] (row statistics as Mosaic keeps them)."""
  return jnp.broadcast_to(x[..., None], (*x.shape, LANES))


def _pad_pairwise(x, T: int, S: int, Tp: int, Sp: int, fill):
  """Pads the T / S dims of a broadcastable [b, n, t, s] bias or mask, keeping size-1 dims."""
  if x is None:
    return None
  pad_t = Tp - T if x.shape[2] != 1 else 0
  pad_s = Sp - S if x.shape[3] != 1 else 0
  return jnp.pad(x, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)), constant_values=fill)


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
    if s is not None:
      _check_tpu_block(s, a.shape, name)
  for s, a in zip(out_specs, out_shape):
    _check_tpu_block(s, a.shape, name)
  in_specs = [s for s in in_specs if s is not None]
  args = [a for a in args if a is not None]
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
  indexing, and the tile function's `x[:, None]` then moves them to sublanes (as splash's dQ
  kernel does with its log-sum-exp)."""
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


def _safe_offset(spec: AttentionSpec, dt, q_start, rows: int, head):
  """tile.safe_offset for rows q_start.., evaluated on a 2-D tile and reduced like the stats."""
  if spec.max_adjust != "safe":
    return None
  q_pos = q_start + lax.broadcasted_iota(jnp.int32, (rows, LANES), 0)
  return jnp.max(tile.safe_offset(q_pos, head, dt.p), axis=-1)


def _pairwise_tile(ref, rows: int, cols: int):
  """A bias/mask block, broadcast from its (1|rows, 1|cols) block to (rows, cols)."""
  if ref is None:
    return None
  return jnp.broadcast_to(ref[...], (rows, cols))


def _visible(spec: AttentionSpec, q_start, bq: int, k_start, bk: int, q_len, kv_len, mask_ref):
  return tile.visible(_row_positions(q_start, bq), _col_positions(k_start, bk), q_len, kv_len,
                      causal=spec.is_causal, window=spec.window,
                      mask=_pairwise_tile(mask_ref, bq, bk))


def _round_fn(spec: AttentionSpec):
  """The rounding of the tile functions. On a TPU a conversion is a conversion; interpreted on CPU,
  the kernel body is compiled by XLA, whose default excess-precision simplification may drop an
  f32 -> bf16 -> f32 pair, so interpret mode rounds with reduce_precision, which it never drops."""
  return tile.round_exact if spec.interpret else tile.round_convert


def _cast(spec: AttentionSpec, x, dtype):
  """x.astype(dtype) for a matmul operand, rounded for certain in interpret mode (see above)."""
  return _round_fn(spec)(x, dtype).astype(dtype)


def _unpack(refs, flags):
  """Splits the kernel's refs: flags is a list of (name, present)."""
  out, pos = {}, 0
  for name, present in flags:
    if present:
      out[name] = refs[pos]
      pos += 1
    else:
      out[name] = None
  assert pos == len(refs), (pos, len(refs))
  return out


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

def _forward_kernel(q_lens_ref, kv_lens_ref, *refs, spec: AttentionSpec, dt, bq: int, bk: int,
                    nk: int, has_bias: bool, has_mask: bool, separate_residual: bool):
  r = _unpack(refs, [("q", True), ("k", True), ("v", True), ("bias", has_bias),
                     ("mask", has_mask), ("o", True), ("res", separate_residual), ("lse", True),
                     ("m", True), ("l", True), ("acc", True)])
  b, n, i, j = (pl.program_id(a) for a in range(4))
  q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
  q_start = i * bq
  lo, hi = blocks.kv_block_range(q_start, bq, bk, nk, causal=spec.is_causal, window=spec.window,
                                 kv_len=kv_len)
  head_dim = r["acc"].shape[-1]

  @pl.when(j == 0)
  def _init():
    state = tile.init_state(bq, head_dim, dt)
    _store_rows(r["m"], state.m)
    _store_rows(r["l"], state.l)
    r["acc"][...] = state.acc

  @pl.when((j >= lo) & (j < hi) & (q_start < q_len))
  def _step():
    k_start = j * bk
    state = tile.SoftmaxState(_rows(r["m"]), _rows(r["l"]), r["acc"][...])
    s = tile.scores(r["q"][...], r["k"][...], spec.scale, _pairwise_tile(r["bias"], bq, bk), dt,
                    _round_fn(spec))
    ok = _visible(spec, q_start, bq, k_start, bk, q_len, kv_len, r["mask"])
    state = tile.online_softmax_step(state, s, ok, r["v"][...], dt=dt, max_adjust=spec.max_adjust,
                                     beta=spec.beta, offset=_safe_offset(spec, dt, q_start, bq, n),
                                     round_fn=_round_fn(spec))
    _store_rows(r["m"], state.m)
    _store_rows(r["l"], state.l)
    r["acc"][...] = state.acc

  @pl.when(j == nk - 1)
  def _finish():
    state = tile.SoftmaxState(_rows(r["m"]), _rows(r["l"]), r["acc"][...])
    o, residual, lse = tile.finalize(state, dt=dt, offset=_safe_offset(spec, dt, q_start, bq, n),
                                     round_fn=_round_fn(spec))
    r["o"][...] = o.astype(r["o"].dtype)
    if r["res"] is not None:
      r["res"][...] = residual.astype(r["res"].dtype)
    _store_rows(r["lse"], lse)


def _forward(spec: AttentionSpec, config: _Config, ops: Operands):
  dt = spec.numerics.dtypes(ops.q.dtype)
  B, T, N, H = ops.q.shape
  S, K = ops.k.shape[1], ops.k.shape[2]
  G = N // K
  bq, bk = config.bq, config.bk
  Tp, Sp, Hp = _round_up(T, bq), _round_up(S, bk), _round_up(H, LANES)
  nq, nk = Tp // bq, Sp // bk
  q = _heads_major(ops.q, Tp, Hp)
  k = _heads_major(ops.k, Sp, Hp)
  v = _heads_major(ops.v, Sp, Hp)
  bias = _pad_pairwise(ops.bias, T, S, Tp, Sp, 0)
  mask = _pad_pairwise(ops.mask, T, S, Tp, Sp, False)
  q_lens = jnp.minimum(ops.q_lens, T).astype(jnp.int32)
  kv_lens = jnp.minimum(ops.kv_lens, S).astype(jnp.int32)

  def kv_block(b, n, i, j, q_lens_ref, kv_lens_ref):
    lo, hi = blocks.kv_block_range(i * bq, bq, bk, nk, causal=spec.is_causal,
                                   window=spec.window, kv_len=kv_lens_ref[b])
    return _clamp(j, lo, hi, nk)

  q_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, Hp), lambda b, n, i, j, *_: (b, n, i, 0))
  kv_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, bk, Hp),
                         lambda b, n, i, j, *p: (b, n // G, kv_block(b, n, i, j, *p), 0))
  pair_index = lambda b, n, i, j, *p: (b, n, i, kv_block(b, n, i, j, *p))
  in_specs = [q_spec, kv_spec, kv_spec, _pairwise_spec(bias, bq, bk, pair_index),
              _pairwise_spec(mask, bq, bk, pair_index)]

  separate_residual = np.dtype(dt.residual_o) != np.dtype(ops.q.dtype)
  row_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, Hp), lambda b, n, i, j, *_: (b, n, i, 0))
  stat_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, LANES),
                           lambda b, n, i, j, *_: (b, n, i, 0))
  out_specs = [row_spec] + ([row_spec] if separate_residual else []) + [stat_spec]
  out_shape = [jax.ShapeDtypeStruct((B, N, Tp, Hp), ops.q.dtype)]
  if separate_residual:
    out_shape.append(jax.ShapeDtypeStruct((B, N, Tp, Hp), dt.residual_o))
  out_shape.append(jax.ShapeDtypeStruct((B, N, Tp, LANES), f32))

  kernel = functools.partial(_forward_kernel, spec=spec, dt=dt, bq=bq, bk=bk, nk=nk,
                             has_bias=bias is not None, has_mask=mask is not None,
                             separate_residual=separate_residual)
  outs = _pallas_call(
      kernel, spec, grid=(B, N, nq, nk), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((bq, LANES), f32), pltpu.VMEM((bq, LANES), f32),
                      pltpu.VMEM((bq, Hp), f32)],
      args=[q_lens, kv_lens, q, k, v, bias, mask],
      semantics=("parallel", "parallel", "parallel", "arbitrary"), name="stable_attn_tpu_fwd")
  o = _from_heads_major(outs[0], T, H)
  residual = _from_heads_major(outs[1], T, H) if separate_residual else o
  return o, residual, outs[-1][:, :, :T, 0]


# ---------------------------------------------------------------------------------------------
# Backward: dK/dV (innermost: the group's query heads x query blocks) and dQ (innermost: key blocks)
# ---------------------------------------------------------------------------------------------

def _tile_grads(r, spec: AttentionSpec, dt, q_start, bq: int, k_start, bk: int, q_len, kv_len):
  """Recomputes one tile's P and dS = P * (dP - delta): -> (q, k, dO, P, dS), fp32 P and dS."""
  q, k, v, do = r["q"][...], r["k"][...], r["v"][...], r["do"][...]
  s = tile.scores(q, k, spec.scale, _pairwise_tile(r["bias"], bq, bk), dt, _round_fn(spec))
  ok = _visible(spec, q_start, bq, k_start, bk, q_len, kv_len, r["mask"])
  p = tile.probabilities(s, _rows(r["lse"]), ok)
  ds = tile.score_grad(p, tile.matmul(do, v, transpose_b=True), _rows(r["delta"]))
  return q, k, do, p, ds


def _dkv_kernel(q_lens_ref, kv_lens_ref, *refs, spec: AttentionSpec, dt, bq: int, bk: int,
                nq: int, group: int, has_bias: bool, has_mask: bool):
  r = _unpack(refs, [("q", True), ("k", True), ("v", True), ("do", True), ("lse", True),
                     ("delta", True), ("bias", has_bias), ("mask", has_mask), ("dk_out", True),
                     ("dv_out", True), ("dk", True), ("dv", True)])
  b, kh, j, t = (pl.program_id(a) for a in range(4))
  i = t % nq
  q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
  q_start, k_start = i * bq, j * bk
  lo, hi = blocks.q_block_range(k_start, bk, bq, nq, causal=spec.is_causal, window=spec.window,
                                q_len=q_len)
  in_dtype = r["q"].dtype

  @pl.when(t == 0)
  def _init():
    r["dk"][...] = jnp.zeros(r["dk"].shape, f32)
    r["dv"][...] = jnp.zeros(r["dv"].shape, f32)

  @pl.when((i >= lo) & (i < hi) & (k_start < kv_len))
  def _step():
    q, k, do, p, ds = _tile_grads(r, spec, dt, q_start, bq, k_start, bk, q_len, kv_len)
    r["dv"][...] = r["dv"][...] + tile.matmul(_cast(spec, p, in_dtype), do, transpose_a=True)
    r["dk"][...] = r["dk"][...] + (tile.matmul(_cast(spec, ds, in_dtype), q, transpose_a=True)
                                   * spec.scale)

  @pl.when(t == group * nq - 1)
  def _finish():
    r["dk_out"][...] = r["dk"][...].astype(r["dk_out"].dtype)
    r["dv_out"][...] = r["dv"][...].astype(r["dv_out"].dtype)


def _dq_kernel(q_lens_ref, kv_lens_ref, *refs, spec: AttentionSpec, dt, bq: int, bk: int, nk: int,
               has_bias: bool, has_mask: bool):
  r = _unpack(refs, [("q", True), ("k", True), ("v", True), ("do", True), ("lse", True),
                     ("delta", True), ("bias", has_bias), ("mask", has_mask), ("dq_out", True),
                     ("ds_out", has_bias), ("dq", True)])
  b, n, i, j = (pl.program_id(a) for a in range(4))
  q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
  q_start, k_start = i * bq, j * bk
  lo, hi = blocks.kv_block_range(q_start, bq, bk, nk, causal=spec.is_causal, window=spec.window,
                                 kv_len=kv_len)
  run = (j >= lo) & (j < hi) & (q_start < q_len)
  in_dtype = r["q"].dtype

  @pl.when(j == 0)
  def _init():
    r["dq"][...] = jnp.zeros(r["dq"].shape, f32)

  @pl.when(run)
  def _step():
    q, k, do, p, ds = _tile_grads(r, spec, dt, q_start, bq, k_start, bk, q_len, kv_len)
    r["dq"][...] = r["dq"][...] + tile.matmul(_cast(spec, ds, in_dtype), k) * spec.scale
    if r["ds_out"] is not None:
      r["ds_out"][...] = ds

  if r["ds_out"] is not None:
    @pl.when(jnp.logical_not(run))
    def _skipped():
      r["ds_out"][...] = jnp.zeros(r["ds_out"].shape, f32)

  @pl.when(j == nk - 1)
  def _finish():
    r["dq_out"][...] = r["dq"][...].astype(r["dq_out"].dtype)


def _stats_spec(bq: int, q_rows_index):
  """BlockSpec of the backward's LSE / delta rows, lane-major or lane-broadcast (see layout)."""
  if bq % LANES == 0:
    def index(*args):
      b, n, i, _ = q_rows_index(*args)
      return b, n, 0, i
    return pl.BlockSpec((pl.squeezed, pl.squeezed, 1, bq), index)
  return pl.BlockSpec((pl.squeezed, pl.squeezed, bq, LANES), q_rows_index)


def _backward(spec: AttentionSpec, config: _Config, ops: Operands, o_residual, lse, do):
  dt = spec.numerics.dtypes(ops.q.dtype)
  B, T, N, H = ops.q.shape
  S, K = ops.k.shape[1], ops.k.shape[2]
  G = N // K
  Hp = _round_up(H, LANES)
  q_lens = jnp.minimum(ops.q_lens, T).astype(jnp.int32)
  kv_lens = jnp.minimum(ops.kv_lens, S).astype(jnp.int32)
  # The delta pre-pass is one fused elementwise + row-sum pass (XLA), with the shared tile.delta.
  delta = tile.delta(jnp.swapaxes(do, 1, 2), jnp.swapaxes(o_residual, 1, 2))      # [B, N, T]

  def layout(bq, bk):
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)

    def rows(x, fill):
      x = jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T)), constant_values=fill)
      # Lane-major [B, N, 1, Tp] (4 bytes a row) when a (1, bq) block is lane aligned, else
      # lane-broadcast [B, N, Tp, 128] (512 bytes a row, re-read for every key block).
      return x[:, :, None, :] if bq % LANES == 0 else _lane_broadcast(x)

    return dict(
        Tp=Tp, Sp=Sp, q=_heads_major(ops.q, Tp, Hp), k=_heads_major(ops.k, Sp, Hp),
        v=_heads_major(ops.v, Sp, Hp), do=_heads_major(do.astype(ops.q.dtype), Tp, Hp),
        lse=rows(lse, tile.EMPTY_ROW_LSE), delta=rows(delta, 0.0),
        bias=_pad_pairwise(ops.bias, T, S, Tp, Sp, 0),
        mask=_pad_pairwise(ops.mask, T, S, Tp, Sp, False))

  # dK, dV: grid (B, K, k blocks, G * q blocks).
  bq, bk = config.bq_dkv, config.bk_dkv
  x = layout(bq, bk)
  nq, nk = x["Tp"] // bq, x["Sp"] // bk

  def q_block(b, j, t, q_lens_ref):
    lo, hi = blocks.q_block_range(j * bk, bk, bq, nq, causal=spec.is_causal, window=spec.window,
                                  q_len=q_lens_ref[b])
    return _clamp(t % nq, lo, hi, nq)

  def q_rows_index(b, kh, j, t, q_lens_ref, kv_lens_ref):
    return (b, kh * G + t // nq, q_block(b, j, t, q_lens_ref), 0)

  def pair_index(b, kh, j, t, q_lens_ref, kv_lens_ref):
    return (b, kh * G + t // nq, q_block(b, j, t, q_lens_ref), j)

  q_rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, Hp), q_rows_index)
  stats = _stats_spec(bq, q_rows_index)
  kv_rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bk, Hp), lambda b, kh, j, t, *_: (b, kh, j, 0))
  kernel = functools.partial(_dkv_kernel, spec=spec, dt=dt, bq=bq, bk=bk, nq=nq, group=G,
                             has_bias=x["bias"] is not None, has_mask=x["mask"] is not None)
  dk, dv = _pallas_call(
      kernel, spec, grid=(B, K, nk, G * nq),
      in_specs=[q_rows, kv_rows, kv_rows, q_rows, stats, stats,
                _pairwise_spec(x["bias"], bq, bk, pair_index),
                _pairwise_spec(x["mask"], bq, bk, pair_index)],
      out_specs=[kv_rows, kv_rows],
      out_shape=[jax.ShapeDtypeStruct((B, K, x["Sp"], Hp), ops.k.dtype),
                 jax.ShapeDtypeStruct((B, K, x["Sp"], Hp), ops.v.dtype)],
      scratch_shapes=[pltpu.VMEM((bk, Hp), f32), pltpu.VMEM((bk, Hp), f32)],
      args=[q_lens, kv_lens, x["q"], x["k"], x["v"], x["do"], x["lse"], x["delta"], x["bias"],
            x["mask"]],
      semantics=("parallel", "parallel", "parallel", "arbitrary"), name="stable_attn_tpu_dkv")

  # dQ (and dS for dbias): grid (B, N, q blocks, k blocks).
  bq, bk = config.bq_dq, config.bk_dq
  x = layout(bq, bk)
  nq, nk = x["Tp"] // bq, x["Sp"] // bk

  def kv_block(b, n, i, j, q_lens_ref, kv_lens_ref):
    lo, hi = blocks.kv_block_range(i * bq, bq, bk, nk, causal=spec.is_causal,
                                   window=spec.window, kv_len=kv_lens_ref[b])
    return _clamp(j, lo, hi, nk)

  q_rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bq, Hp), lambda b, n, i, j, *_: (b, n, i, 0))
  stats = _stats_spec(bq, lambda b, n, i, j, *_: (b, n, i, 0))
  kv_rows = pl.BlockSpec((pl.squeezed, pl.squeezed, bk, Hp),
                         lambda b, n, i, j, *p: (b, n // G, kv_block(b, n, i, j, *p), 0))
  pair_index = lambda b, n, i, j, *p: (b, n, i, kv_block(b, n, i, j, *p))
  has_bias = x["bias"] is not None
  out_specs = [q_rows]
  out_shape = [jax.ShapeDtypeStruct((B, N, x["Tp"], Hp), ops.q.dtype)]
  if has_bias:
    out_specs.append(pl.BlockSpec((pl.squeezed, pl.squeezed, bq, bk),
                                  lambda b, n, i, j, *_: (b, n, i, j)))
    out_shape.append(jax.ShapeDtypeStruct((B, N, x["Tp"], x["Sp"]), f32))
  kernel = functools.partial(_dq_kernel, spec=spec, dt=dt, bq=bq, bk=bk, nk=nk,
                             has_bias=has_bias, has_mask=x["mask"] is not None)
  outs = _pallas_call(
      kernel, spec, grid=(B, N, nq, nk),
      in_specs=[q_rows, kv_rows, kv_rows, q_rows, stats, stats,
                _pairwise_spec(x["bias"], bq, bk, pair_index),
                _pairwise_spec(x["mask"], bq, bk, pair_index)],
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((bq, Hp), f32)],
      args=[q_lens, kv_lens, x["q"], x["k"], x["v"], x["do"], x["lse"], x["delta"], x["bias"],
            x["mask"]],
      semantics=("parallel", "parallel", "parallel", "arbitrary"), name="stable_attn_tpu_dq")

  dbias = None
  if has_bias:
    dbias = reduce_to_shape(outs[1][:, :, :T, :S], ops.bias.shape).astype(ops.bias.dtype)
  return (_from_heads_major(outs[0], T, H), _from_heads_major(dk, S, H),
          _from_heads_major(dv, S, H), dbias)


_flash = make_flash_attention(_forward, _backward)


def flash_attention(spec: AttentionSpec, ops: Operands,
                    block_sizes: Optional[BlockSizes] = None) -> jax.Array:
  """O [B, T, N, H] for canonical operands; differentiable in q, k, v and bias."""
  return _flash(spec, resolve_block_sizes(block_sizes, ops), ops)
