"""Flash attention forward and backward as Pallas kernels with the Triton lowering.

Layout: q/o/dO [B, Tp, N, Hp], k/v [B, Sp, K, Hp] stay in the caller's [B, T, heads, H] layout (no
transpose); Tp, Sp, Hp are the lengths padded to the block sizes and the head dim padded to a power
of two (only when needed; stable_attn.layout). GQA: the kv head of query head n is n // G
(G = N // K), chosen by the index maps, so K/V are never repeated. bias/mask keep their broadcast
shape [Bb, Nb, Tb, Sb] (each dim 1 or full); the mask travels as int8.

Operands travel by name: each pallas_call takes the padded `Operands` as one pytree with a pytree
of BlockSpecs built from the operand table (pallas_kernels.operand_specs) and one `dims` per grid,
so a kernel reads `refs.q_seg`, and an absent operand is a None ref.

Kernels (all math from stable_attn.tile, all block ranges from stable_attn.blocks):
  forward  grid (query blocks, B*N): online softmax over visible key blocks -> O, O residual, LSE.
  delta    grid (query blocks, B*N): delta = rowsum(dO * O_residual).
  dK/dV    grid (key blocks, B*K): loops over the G query heads of its kv head and, for each, over
           the query blocks that see the key block; no atomics.
  dQ       grid (query blocks, B*N): loops over visible key blocks; writes dS tiles when a bias
           needs its gradient.
The visited blocks are the causal / window / length ranges intersected with the packed-sequence
ranges (`blocks.segment_sections`, computed once per call for each kernel's block sizes). Blocks
visible in full (no causal/window edge, no padding, no mask, one document) run the same tile calls
with ok=None, which skips the masking arithmetic; the results are identical.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from stable_attn import blocks, tile
from stable_attn.flash import reduce_to_shape, shifted_delta
from stable_attn.layout import Geometry, Padded, pad_operands, pad_to, unpad
from stable_attn.numerics import Dtypes
from stable_attn.spec import (BACKWARD_AXES, LSE_AXES, OPERANDS, ROW_AXES, AttentionSpec,
                              BackwardInputs, Lengths, Operands)

from pallas_kernels.gpu import tuning
from pallas_kernels.operand_specs import block_spec, blocked, operand_specs, read, squeezed

f32 = jnp.float32
i32 = jnp.int32
PAIRWISE_AXES = OPERANDS["bias"].axes


# ---------------------------------------------------------------------------------------------
# The static description of one call
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Call:
  """Everything static about one call: shapes, padding, dtypes, which operands are present."""
  spec: AttentionSpec
  geo: Geometry
  pad: Padded
  dt: Dtypes
  has_mask: bool   # a mask operand may hide anything: no block runs unmasked

  @property
  def round_fn(self):
    return tile.rounding(self.spec.interpret)

  def scores(self, qk, ok, bias):
    return tile.scores(qk, ok, scale=self.spec.scale, bias=bias, dt=self.dt,
                       round_fn=self.round_fn, soft_cap=self.spec.logits_soft_cap)

  def visible(self, q_start, bq: int, k_start, bk: int, lens: Lengths, mask, q_seg, kv_seg):
    return tile.visible(q_start + lax.iota(i32, bq), k_start + lax.iota(i32, bk), lens.q,
                        lens.kv, causal=self.spec.is_causal, window=self.spec.window,
                        mask=None if mask is None else mask != 0, q_seg=q_seg, kv_seg=kv_seg,
                        shift=lens.shift)

  def kv_ranges(self, q_start, bq: int, bk: int, lens: Lengths, segments):
    """(lo, flo, fhi, hi) of the key blocks query rows [q_start, +bq) visit (blocks.kv_sections)."""
    return blocks.kv_sections(q_start, bq, bk, self.pad.S // bk, causal=self.spec.is_causal,
                              window=self.spec.window, q_len=lens.q, kv_len=lens.kv,
                              has_mask=self.has_mask, segments=segments, shift=lens.shift)

  def q_ranges(self, k_start, bk: int, bq: int, lens: Lengths, segments):
    """(lo, flo, fhi, hi) of the query blocks that see key columns [k_start, +bk)."""
    return blocks.q_sections(k_start, bk, bq, self.pad.T // bq, causal=self.spec.is_causal,
                             window=self.spec.window, q_len=lens.q, kv_len=lens.kv,
                             has_mask=self.has_mask, segments=segments, shift=lens.shift)


def _prepare(spec: AttentionSpec, config: tuning.Config, ops: Operands):
  """-> (call, padded operands) for one call; the mask as int8 (Triton loads no bools)."""
  geo = Geometry.of(ops)
  qb = max(config.fwd.block_q, config.dkv.block_q, config.dq.block_q)
  kb = max(config.fwd.block_k, config.dkv.block_k, config.dq.block_k)
  pad = geo.padded(qb, kb, tuning.padded_head_dim(geo.H))
  x = pad_operands(ops, pad)
  if x.mask is not None:
    x = x._replace(mask=x.mask.astype(jnp.int8))
  call = _Call(spec, geo, pad, spec.numerics.dtypes(ops.q.dtype), ops.mask is not None)
  return call, x


def _row_dims(geo: Geometry, bq: int, nq: int) -> dict:
  """Grid (query blocks, B*N), heaviest causal blocks first: one query block of one head."""
  N, G = geo.N, geo.G
  return dict(batch=squeezed(lambda i, bh: bh // N), heads=squeezed(lambda i, bh: bh % N),
              kv_heads=squeezed(lambda i, bh: bh % N // G),
              query=blocked(bq, lambda i, bh: nq - 1 - i))


def _key_dims(geo: Geometry, bk: int) -> dict:
  """Grid (key blocks, B*K): one key block of one kv head, with every query of its G heads."""
  K, G = geo.K, geo.G
  return dict(batch=squeezed(lambda j, bkh: bkh // K), heads=blocked(G, lambda j, bkh: bkh % K),
              kv_heads=squeezed(lambda j, bkh: bkh % K), key=blocked(bk, lambda j, bkh: j))


def _sections(x: Operands, bq: int, bk: int, per: str, dims: dict):
  """The packed-sequence block ranges for these block sizes, and their BlockSpec (one block's
  (lo, flo, fhi, hi) per program), or (None, None)."""
  if x.q_seg is None:
    return None, None
  ranges = blocks.segment_sections(x.q_seg, x.kv_seg, bq, bk, per=per)
  along = dims["query" if per == "query" else "key"].index
  batch = dims["batch"].index
  return ranges, pl.BlockSpec((None, None, 4), lambda *g: (batch(*g), along(*g), 0))


def _segment_ranges(ref):
  return None if ref is None else tuple(ref[i] for i in range(4))


def _params(kc: tuning.KernelConfig):
  return plgpu.CompilerParams(num_warps=kc.num_warps, num_stages=kc.num_stages)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

def _forward_kernel(refs: Operands, sections_ref, o_ref, res_ref, lse_ref, *, call: _Call,
                    kc: tuning.KernelConfig):
  spec, dt, round_fn = call.spec, call.dt, call.round_fn
  bq, bk = kc.block_q, kc.block_k
  q_start = (call.pad.T // bq - 1 - pl.program_id(0)) * bq
  bh = pl.program_id(1)
  b, n = bh // call.geo.N, bh % call.geo.N
  lens = Lengths.of(refs, b)
  q = refs.q[...]
  offset = None if refs.offset is None else refs.offset[...]
  q_seg = None if refs.q_seg is None else refs.q_seg[...]

  def body(j, carry, *, masked):
    acc, stats = carry
    cols = pl.ds(j * bk, bk)
    ok = None
    if masked:
      ok = call.visible(q_start, bq, j * bk, bk, lens,
                        None if refs.mask is None else read(refs.mask, slice(None), cols),
                        q_seg, None if refs.kv_seg is None else refs.kv_seg[cols])
    bias = None if refs.bias is None else read(refs.bias, slice(None), cols)
    s = call.scores(tile.matmul(q, refs.k[cols, :], transpose_b=True), ok, bias)
    p, alpha, stats = tile.rescale(stats, s, dt=dt, max_adjust=spec.max_adjust, beta=spec.beta,
                                   offset=offset, round_fn=round_fn)
    pv = tile.pv_product(p, refs.v[cols, :], dt)
    return tile.accumulate(acc, alpha, pv, dt=dt, round_fn=round_fn), stats

  ranges = call.kv_ranges(q_start, bq, bk, lens, _segment_ranges(sections_ref))
  init = (jnp.zeros((bq, call.pad.H), f32), tile.init_stats(bq, dt))
  acc, stats = blocks.split_loop(*ranges, body, init)
  sink = None if refs.sinks is None else refs.sinks[n].astype(f32)
  o, residual, lse = tile.finalize(acc, stats, dt=dt, offset=offset, round_fn=round_fn, sink=sink)
  o_ref[...] = o.astype(o_ref.dtype)
  if res_ref is not None:
    res_ref[...] = residual.astype(res_ref.dtype)
  lse_ref[...] = lse


def forward(spec: AttentionSpec, config: tuning.Config, ops: Operands):
  """-> (O [B,T,N,H], O residual [B,T,N,H] in dt.residual_o, LSE fp32 [B,N,T])."""
  call, x = _prepare(spec, config, ops)
  geo, pad, dt = call.geo, call.pad, call.dt
  kc = config.fwd
  nq = pad.T // kc.block_q
  dims = _row_dims(geo, kc.block_q, nq)
  sections, sections_spec = _sections(x, kc.block_q, kc.block_k, "query", dims)
  # The residual equals O unless it is kept in a wider dtype than the input.
  write_residual = dt.residual_o != dt.input
  rows = (geo.B, pad.T, geo.N, pad.H)
  row_spec = block_spec(ROW_AXES, rows, dims)
  lse_shape = (geo.B, geo.N, pad.T)
  o, residual, lse = pl.pallas_call(
      functools.partial(_forward_kernel, call=call, kc=kc), grid=(nq, geo.B * geo.N),
      in_specs=(operand_specs(x, dims), sections_spec),
      out_specs=(row_spec, row_spec if write_residual else None,
                 block_spec(LSE_AXES, lse_shape, dims)),
      out_shape=(jax.ShapeDtypeStruct(rows, ops.q.dtype),
                 jax.ShapeDtypeStruct(rows, dt.residual_o) if write_residual else None,
                 jax.ShapeDtypeStruct(lse_shape, f32)),
      compiler_params=_params(kc), interpret=spec.interpret, name="stable_attn_fwd",
  )(x, sections)
  o = unpad(o, ROW_AXES, geo)
  residual = o if residual is None else unpad(residual, ROW_AXES, geo)
  return o, residual, unpad(lse, LSE_AXES, geo)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

def _delta_kernel(do_ref, o_ref, delta_ref):
  delta_ref[...] = tile.delta(do_ref[...], o_ref[...])


class _Tile(NamedTuple):
  """Where one tile of the backward stands: its query block [q_start, q_start + bq) and key block
  [k_start, k_start + bk); pair_index is its index into a bias or mask block
  (pallas_kernels.operand_specs.read)."""
  q_start: object
  bq: int
  k_start: object
  bk: int
  pair_index: tuple


def _tile_grads(call: _Call, ops: Operands, grads: BackwardInputs, at: _Tile, lens: Lengths,
                masked: bool):
  """One tile's P and dS (tile.backward_tile). ops: the kernel's refs with the tile's own q, k, v,
  q_seg and kv_seg loaded in their place (bias and mask still refs, read here at at.pair_index);
  grads: the tile's rows of dO, LSE and delta."""
  ok = None
  if masked:
    mask = None if ops.mask is None else read(ops.mask, *at.pair_index)
    ok = call.visible(at.q_start, at.bq, at.k_start, at.bk, lens, mask, ops.q_seg, ops.kv_seg)
  bias = None if ops.bias is None else read(ops.bias, *at.pair_index)
  s = call.scores(tile.matmul(ops.q, ops.k, transpose_b=True), ok, bias)
  return tile.backward_tile(s, grads.lse, tile.matmul(grads.do, ops.v, transpose_b=True),
                            grads.delta, in_dtype=call.dt.input, round_fn=call.round_fn)


def _dkv_kernel(refs: Operands, grads: BackwardInputs, sections_ref, dk_ref, dv_ref, *,
                call: _Call, kc: tuning.KernelConfig):
  spec = call.spec
  bq, bk = kc.block_q, kc.block_k
  k_start = pl.program_id(0) * bk
  b = pl.program_id(1) // call.geo.K
  lens = Lengths.of(refs, b)
  k, v = refs.k[...], refs.v[...]
  kv_seg = None if refs.kv_seg is None else refs.kv_seg[...]
  ranges = call.q_ranges(k_start, bk, bq, lens, _segment_ranges(sections_ref))

  def head_body(g, carry):
    def body(i, carry, *, masked):
      dk, dv = carry
      q_start = i * bq
      rows = pl.ds(q_start, bq)
      q, do = refs.q[rows, g, :], grads.do[rows, g, :]
      t = _tile_grads(
          call, refs._replace(q=q, k=k, v=v, kv_seg=kv_seg,
                              q_seg=None if refs.q_seg is None else refs.q_seg[rows]),
          BackwardInputs(do, grads.lse[g, rows], grads.delta[g, rows]),
          _Tile(q_start, bq, k_start, bk, (g, rows, slice(None))), lens, masked)
      dv = dv + tile.matmul(t.p, do, transpose_a=True)
      dk = dk + tile.matmul(t.ds_op, q, transpose_a=True) * spec.scale
      return dk, dv

    return blocks.split_loop(*ranges, body, carry)

  zeros = jnp.zeros((bk, call.pad.H), f32)
  dk, dv = lax.fori_loop(0, call.geo.G, head_body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(refs: Operands, grads: BackwardInputs, sections_ref, dq_ref, ds_ref, *,
               call: _Call, kc: tuning.KernelConfig):
  spec = call.spec
  bq, bk = kc.block_q, kc.block_k
  q_start = (call.pad.T // bq - 1 - pl.program_id(0)) * bq
  b = pl.program_id(1) // call.geo.N
  lens = Lengths.of(refs, b)
  q, do, lse, delta = refs.q[...], grads.do[...], grads.lse[...], grads.delta[...]
  q_seg = None if refs.q_seg is None else refs.q_seg[...]
  ranges = call.kv_ranges(q_start, bq, bk, lens, _segment_ranges(sections_ref))

  def body(j, dq, *, masked):
    cols = pl.ds(j * bk, bk)
    k = refs.k[cols, :]
    t = _tile_grads(
        call, refs._replace(q=q, k=k, v=refs.v[cols, :], q_seg=q_seg,
                            kv_seg=None if refs.kv_seg is None else refs.kv_seg[cols]),
        BackwardInputs(do, lse, delta), _Tile(q_start, bq, j * bk, bk, (slice(None), cols)),
        lens, masked)
    if ds_ref is not None:
      ds_ref[:, cols] = t.ds
    return dq + tile.matmul(t.ds_op, k) * spec.scale

  if ds_ref is not None:   # key blocks this query block never visits have dS = 0
    def zero(j, carry):
      ds_ref[:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), f32)
      return carry
    lax.fori_loop(0, ranges[0], zero, 0)
    lax.fori_loop(ranges[3], call.pad.S // bk, zero, 0)
  dq = blocks.split_loop(*ranges, body, jnp.zeros((bq, call.pad.H), f32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def backward(spec: AttentionSpec, config: tuning.Config, ops: Operands, o_res, lse, do,
             dlse=None):
  """-> (dq, dk, dv, dbias or None)."""
  call, x = _prepare(spec, config, ops)
  geo, pad = call.geo, call.pad
  B, N, K = geo.B, geo.N, geo.K
  do_p = pad_to(do.astype(ops.q.dtype), ROW_AXES, pad)
  lse_p = pad_to(lse, LSE_AXES, pad)

  # delta pre-pass.
  rows = config.dq.block_q
  dims = _row_dims(geo, rows, pad.T // rows)
  delta = pl.pallas_call(
      _delta_kernel, grid=(pad.T // rows, B * N),
      in_specs=[block_spec(ROW_AXES, do_p.shape, dims)] * 2,
      out_specs=block_spec(LSE_AXES, lse_p.shape, dims),
      out_shape=jax.ShapeDtypeStruct(lse_p.shape, f32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=spec.interpret, name="stable_attn_delta",
  )(do_p, pad_to(o_res, ROW_AXES, pad))
  grads = BackwardInputs(do_p, lse_p, shifted_delta(delta, None if dlse is None else
                                                     pad_to(dlse, LSE_AXES, pad)))
  grad_specs = lambda dims: BackwardInputs(*(block_spec(axes, a.shape, dims)
                                              for axes, a in zip(BACKWARD_AXES, grads)))

  # dK, dV: one program per (key block, batch, kv head); loops over the G query heads.
  kc = config.dkv
  dims = _key_dims(geo, kc.block_k)
  sections, sections_spec = _sections(x, kc.block_q, kc.block_k, "key", dims)
  kv_spec = block_spec(OPERANDS["k"].axes, x.k.shape, dims)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, call=call, kc=kc), grid=(pad.S // kc.block_k, B * K),
      in_specs=(operand_specs(x, dims), grad_specs(dims), sections_spec),
      out_specs=(kv_spec, kv_spec),
      out_shape=(jax.ShapeDtypeStruct(x.k.shape, ops.k.dtype),
                 jax.ShapeDtypeStruct(x.v.shape, ops.v.dtype)),
      compiler_params=_params(kc), interpret=spec.interpret, name="stable_attn_dkv",
  )(x, grads, sections)

  # dQ (and dS for dbias): one program per (query block, batch, head).
  kc = config.dq
  nq = pad.T // kc.block_q
  dims = _row_dims(geo, kc.block_q, nq)
  sections, sections_spec = _sections(x, kc.block_q, kc.block_k, "query", dims)
  write_ds = ops.bias is not None
  ds_shape = (B, N, pad.T, pad.S)
  dq, ds = pl.pallas_call(
      functools.partial(_dq_kernel, call=call, kc=kc), grid=(nq, B * N),
      in_specs=(operand_specs(x, dims), grad_specs(dims), sections_spec),
      out_specs=(block_spec(ROW_AXES, x.q.shape, dims),
                 block_spec(PAIRWISE_AXES, ds_shape, dims) if write_ds else None),
      out_shape=(jax.ShapeDtypeStruct(x.q.shape, ops.q.dtype),
                 jax.ShapeDtypeStruct(ds_shape, f32) if write_ds else None),
      compiler_params=_params(kc), interpret=spec.interpret, name="stable_attn_dq",
  )(x, grads, sections)

  dbias = None
  if write_ds:
    dbias = reduce_to_shape(ds[:, :, :geo.T, :geo.S], ops.bias.shape).astype(ops.bias.dtype)
  kv_axes = OPERANDS["k"].axes
  return (unpad(dq, ROW_AXES, geo), unpad(dk, kv_axes, geo), unpad(dv, kv_axes, geo), dbias)
