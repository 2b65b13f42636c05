"""Flash attention forward and backward as Pallas kernels with the Triton lowering.

Layout: q/o/dO [B, Tp, N, Hp], k/v [B, Sp, K, Hp] stay in the caller's [B, T, heads, H] layout (no
transpose); Tp, Sp, Hp are the lengths padded to the block sizes and the head dim padded to a power
of two (only when needed). GQA: the kv head of query head n is n // G (G = N // K), chosen by the
index maps, so K/V are never repeated. bias/mask keep their broadcast shape [Bb, Nb, Tb, Sb] (each
dim 1 or full) and are read tile by tile with per-dim indices; the mask travels as int8. Absent
optional operands are a None ref with a None BlockSpec.

Kernels (all math from stable_attn.tile, all block ranges from stable_attn.blocks):
  forward  grid (query blocks, B*N): online softmax over visible key blocks -> O, O residual, LSE.
  delta    grid (query blocks, B*N): delta = rowsum(dO * O_residual).
  dK/dV    grid (key blocks, B*K): loops over the G query heads of its kv head and, for each, over
           the query blocks that see the key block; no atomics.
  dQ       grid (query blocks, B*N): loops over visible key blocks; writes dS tiles when a bias
           needs its gradient.
Blocks that are visible in full (no causal/window edge, no padding, no mask) run the same tile
calls with ok=None, which skips the masking arithmetic; the results are identical.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from stable_attn import blocks, tile
from stable_attn.flash import reduce_to_shape, shifted_delta
from stable_attn.layout import Geometry, Padded, lengths, pad_axis, pad_pairwise, pad_seq_head, unpad
from stable_attn.numerics import Dtypes
from stable_attn.spec import AttentionSpec, Operands

from pallas_kernels.gpu import tuning

f32 = jnp.float32
i32 = jnp.int32


# ---------------------------------------------------------------------------------------------
# The static description of one call
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Pairwise:
  """Which dims of a bias or mask [Bb, Nb, Tb, Sb] are full (the others are 1, broadcast)."""
  full: tuple[bool, bool, bool, bool]

  def spec(self, shape) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda *_: (0, 0, 0, 0))

  def tile(self, ref, b, n, q_start, bq: int, k_start, bk: int):
    """The [bq, bk] tile for batch b and query head n (broadcastable)."""
    fb, fn, ft, fs = self.full
    x = ref[b if fb else 0, n if fn else 0, pl.ds(q_start, bq) if ft else 0,
            pl.ds(k_start, bk) if fs else 0]
    if ft and fs:
      return x
    if ft:
      return x[:, None]
    if fs:
      return x[None, :]
    return x  # a scalar broadcasts


@dataclasses.dataclass(frozen=True)
class _Call:
  """Everything static about one call: shapes, padding, dtypes, optional operands."""
  spec: AttentionSpec
  geo: Geometry
  pad: Padded
  dt: Dtypes
  bias: Optional[_Pairwise]
  mask: Optional[_Pairwise]
  segments: bool   # segment ids given: every block is masked, and blocks sharing none are skipped

  @property
  def round_fn(self):
    return tile.rounding(self.spec.interpret)

  @property
  def masks_every_block(self) -> bool:
    return self.mask is not None or self.segments

  def visible(self, mask_ref, b, n, q_start, bq: int, k_start, bk: int, q_len, kv_len,
              q_seg=None, kv_seg=None):
    m = None
    if mask_ref is not None:
      m = self.mask.tile(mask_ref, b, n, q_start, bq, k_start, bk) != 0
    return tile.visible(q_start + lax.iota(i32, bq), k_start + lax.iota(i32, bk), q_len, kv_len,
                        causal=self.spec.is_causal, window=self.spec.window, mask=m,
                        q_seg=q_seg, kv_seg=kv_seg)

  def scores(self, qk, ok, bias_ref, b, n, q_start, bq: int, k_start, bk: int):
    bias = None
    if bias_ref is not None:
      bias = self.bias.tile(bias_ref, b, n, q_start, bq, k_start, bk)
    return tile.scores(qk, ok, scale=self.spec.scale, bias=bias, dt=self.dt,
                       round_fn=self.round_fn, soft_cap=self.spec.logits_soft_cap)

  def key_block(self, q, k_ref, v_ref, bias_ref, mask_ref, rows: "_Rows", j, bk: int, masked,
                kv_seg=None):
    """Key block j for a program's query rows: (K tile, V tile, masked scores)."""
    k_start = j * bk
    k = k_ref[pl.ds(k_start, bk), :]
    v = v_ref[pl.ds(k_start, bk), :]
    b, n, q_start, bq, q_len, kv_len, q_seg = rows
    ok = None
    if masked:
      ok = self.visible(mask_ref, b, n, q_start, bq, k_start, bk, q_len, kv_len, q_seg, kv_seg)
    s = self.scores(tile.matmul(q, k, transpose_b=True), ok, bias_ref, b, n, q_start, bq, k_start,
                    bk)
    return k, v, s

  def kv_ranges(self, q_start, bq: int, bk: int, q_len, kv_len):
    """(lo, flo, fhi, hi) of the key blocks query rows [q_start, +bq) visit (blocks.kv_sections)."""
    return blocks.kv_sections(q_start, bq, bk, self.pad.S // bk, causal=self.spec.is_causal,
                              window=self.spec.window, q_len=q_len, kv_len=kv_len,
                              has_mask=self.masks_every_block)

  def q_ranges(self, k_start, bk: int, bq: int, q_len, kv_len):
    """(lo, flo, fhi, hi) of the query blocks that see key columns [k_start, +bk)."""
    return blocks.q_sections(k_start, bk, bq, self.pad.T // bq, causal=self.spec.is_causal,
                             window=self.spec.window, q_len=q_len, kv_len=kv_len,
                             has_mask=self.masks_every_block)


class _Rows(NamedTuple):
  """The query rows one program owns: batch, query head, first row, rows, the lengths and the rows'
  segment ids (or None)."""
  b: jax.Array
  n: jax.Array
  start: jax.Array
  size: int
  q_len: jax.Array
  kv_len: jax.Array
  seg: Optional[jax.Array]


def _skip_unless_shared(q_seg, kv_seg, compute, carry):
  """compute(carry) if the two blocks share a segment id (overlapping id ranges; packed ids are
  monotone, so that is exact for them and conservative otherwise), else carry unchanged."""
  if q_seg is None:
    return compute(carry)
  shared = (jnp.min(kv_seg) <= jnp.max(q_seg)) & (jnp.max(kv_seg) >= jnp.min(q_seg))
  return lax.cond(shared, compute, lambda c: c, carry)


def _segments(ref, start, size: int):
  """Segment ids [start, start + size) of the program's row, or None without segment ids."""
  return None if ref is None else ref[pl.ds(start, size)]


def _segment_spec(length: int, batch_of):
  """BlockSpec of a [B, length] segment-id array: the program's batch row, whole."""
  return pl.BlockSpec((None, length), lambda *grid: (batch_of(*grid), 0))


def _pairwise(x) -> Optional[_Pairwise]:
  return None if x is None else _Pairwise(tuple(d > 1 for d in x.shape))


def _prepare(spec: AttentionSpec, config: tuning.Config, ops: Operands):
  """-> (call, padded arrays dict) for one call."""
  geo = Geometry.of(ops)
  qb = max(config.fwd.block_q, config.dkv.block_q, config.dq.block_q)
  kb = max(config.fwd.block_k, config.dkv.block_k, config.dq.block_k)
  pad = geo.padded(qb, kb, tuning.padded_head_dim(geo.H))
  mask = None if ops.mask is None else ops.mask.astype(jnp.int8)
  call = _Call(spec, geo, pad, spec.numerics.dtypes(ops.q.dtype), _pairwise(ops.bias),
               _pairwise(mask), ops.q_seg is not None)
  q_lens, kv_lens = lengths(ops, geo)
  # Padding repeats the last id: padded rows and keys are masked by the lengths anyway, and a
  # block's id range stays as tight as its real ids.
  edge = lambda x, n: None if x is None else jnp.pad(x, ((0, 0), (0, n - x.shape[1])), mode="edge")
  arrays = dict(q=pad_seq_head(ops.q, pad.T, pad.H), k=pad_seq_head(ops.k, pad.S, pad.H),
                v=pad_seq_head(ops.v, pad.S, pad.H), q_lens=q_lens, kv_lens=kv_lens,
                bias=pad_pairwise(ops.bias, geo, pad), mask=pad_pairwise(mask, geo, pad),
                q_seg=edge(ops.q_seg, pad.T), kv_seg=edge(ops.kv_seg, pad.S))
  return call, arrays


def _optional_specs(call: _Call, arrays, batch_of):
  """BlockSpecs of bias, mask, q_seg and kv_seg (None for an absent operand); batch_of(*grid) is
  the program's batch row."""
  pairwise = [None if arrays[name] is None else getattr(call, name).spec(arrays[name].shape)
              for name in ("bias", "mask")]
  if not call.segments:
    return pairwise + [None, None]
  return pairwise + [_segment_spec(call.pad.T, batch_of), _segment_spec(call.pad.S, batch_of)]


def _optional_arrays(arrays):
  return [arrays[name] for name in ("bias", "mask", "q_seg", "kv_seg")]


def _lens_spec(B: int):
  return pl.BlockSpec((B,), lambda *_: (0,))


def _params(kc: tuning.KernelConfig):
  return plgpu.CompilerParams(num_warps=kc.num_warps, num_stages=kc.num_stages)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

def _forward_kernel(q_ref, k_ref, v_ref, qlen_ref, kvlen_ref, bias_ref, mask_ref, qseg_ref,
                    kvseg_ref, offset_ref, sink_ref, o_ref, res_ref, lse_ref, *, call: _Call,
                    kc: tuning.KernelConfig):
  spec, dt, round_fn = call.spec, call.dt, call.round_fn
  bq, bk = kc.block_q, kc.block_k
  qi = call.pad.T // bq - 1 - pl.program_id(0)      # heaviest causal blocks first
  bh = pl.program_id(1)
  b, n = bh // call.geo.N, bh % call.geo.N
  q_start = qi * bq
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  q = q_ref[...]
  offset = None if offset_ref is None else offset_ref[...]

  rows = _Rows(b, n, q_start, bq, q_len, kv_len, _segments(qseg_ref, q_start, bq))

  def body(j, carry, *, masked):
    kv_seg = _segments(kvseg_ref, j * bk, bk)

    def compute(carry):
      acc, stats = carry
      _, v, s = call.key_block(q, k_ref, v_ref, bias_ref, mask_ref, rows, j, bk, masked, kv_seg)
      p, alpha, stats = tile.rescale(stats, s, dt=dt, max_adjust=spec.max_adjust, beta=spec.beta,
                                     offset=offset, round_fn=round_fn)
      pv = tile.matmul(p, v.astype(dt.p))
      return tile.accumulate(acc, alpha, pv, dt=dt, round_fn=round_fn), stats

    return _skip_unless_shared(rows.seg, kv_seg, compute, carry)

  init = (jnp.zeros((bq, call.pad.H), f32), tile.init_stats(bq, dt))
  acc, stats = blocks.split_loop(*call.kv_ranges(q_start, bq, bk, q_len, kv_len), body, init)
  sink = None if sink_ref is None else sink_ref[n].astype(f32)
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
  bq = kc.block_q
  nq = pad.T // bq
  N, G = geo.N, geo.G
  # The residual equals O unless it is kept in a wider dtype than the input.
  write_residual = dt.residual_o != dt.input

  q_map = lambda i, bh: (bh // N, nq - 1 - i, bh % N, 0)
  kv_map = lambda i, bh: (bh // N, 0, (bh % N) // G, 0)
  rows = pl.BlockSpec((None, bq, None, pad.H), q_map)
  kv = pl.BlockSpec((None, pad.S, None, pad.H), kv_map)
  out_shape = [jax.ShapeDtypeStruct((geo.B, pad.T, N, pad.H), ops.q.dtype),
               jax.ShapeDtypeStruct((geo.B, pad.T, N, pad.H), dt.residual_o)
               if write_residual else None,
               jax.ShapeDtypeStruct((geo.B, N, pad.T), f32)]
  out_specs = [rows, rows if write_residual else None,
               pl.BlockSpec((None, None, bq), lambda i, bh: (bh // N, bh % N, nq - 1 - i))]
  offset = None if ops.offset is None else pad_axis(ops.offset, 1, pad.T)
  offset_spec = None
  if offset is not None:
    offset_spec = pl.BlockSpec((None, bq), lambda i, bh: (bh % N, nq - 1 - i))
  o, residual, lse = pl.pallas_call(
      functools.partial(_forward_kernel, call=call, kc=kc), grid=(nq, geo.B * N),
      in_specs=[rows, kv, kv, _lens_spec(geo.B), _lens_spec(geo.B),
                *_optional_specs(call, x, lambda i, bh: bh // N), offset_spec,
                None if ops.sinks is None else pl.BlockSpec((N,), lambda *_: (0,))],
      out_specs=out_specs, out_shape=out_shape, compiler_params=_params(kc),
      interpret=spec.interpret, name="stable_attn_fwd",
  )(x["q"], x["k"], x["v"], x["q_lens"], x["kv_lens"], *_optional_arrays(x), offset, ops.sinks)
  o = unpad(o, geo.T, geo.H)
  residual = o if residual is None else unpad(residual, geo.T, geo.H)
  return o, residual, lse[:, :, :geo.T]


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

def _delta_kernel(do_ref, o_ref, delta_ref):
  delta_ref[...] = tile.delta(do_ref[...], o_ref[...])


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qlen_ref, kvlen_ref, bias_ref,
                mask_ref, qseg_ref, kvseg_ref, dk_ref, dv_ref, *, call: _Call,
                kc: tuning.KernelConfig):
  spec = call.spec
  bq, bk = kc.block_q, kc.block_k
  kblk, bkh = pl.program_id(0), pl.program_id(1)
  b, kvh = bkh // call.geo.K, bkh % call.geo.K
  k_start = kblk * bk
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  k = k_ref[...]
  v = v_ref[...]
  kv_seg = _segments(kvseg_ref, k_start, bk)
  ranges = call.q_ranges(k_start, bk, bq, q_len, kv_len)

  def head_body(g, carry):
    n = kvh * call.geo.G + g

    def body(i, carry, *, masked):
      q_start = i * bq
      q_seg = _segments(qseg_ref, q_start, bq)

      def compute(carry):
        dk, dv = carry
        rows = pl.ds(q_start, bq)
        q = q_ref[rows, g, :]
        do = do_ref[rows, g, :]
        ok = None
        if masked:
          ok = call.visible(mask_ref, b, n, q_start, bq, k_start, bk, q_len, kv_len, q_seg, kv_seg)
        s = call.scores(tile.matmul(q, k, transpose_b=True), ok, bias_ref, b, n, q_start, bq,
                        k_start, bk)
        grads = tile.backward_tile(s, lse_ref[g, rows], tile.matmul(do, v, transpose_b=True),
                                   delta_ref[g, rows], in_dtype=call.dt.input,
                                   round_fn=call.round_fn)
        dv = dv + tile.matmul(grads.p, do, transpose_a=True)
        dk = dk + tile.matmul(grads.ds_op, q, transpose_a=True) * spec.scale
        return dk, dv

      return _skip_unless_shared(q_seg, kv_seg, compute, carry)

    return blocks.split_loop(*ranges, body, carry)

  zeros = jnp.zeros((bk, call.pad.H), f32)
  dk, dv = lax.fori_loop(0, call.geo.G, head_body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qlen_ref, kvlen_ref, bias_ref,
               mask_ref, qseg_ref, kvseg_ref, ds_in_ref, dq_ref, ds_ref, *, call: _Call,
               kc: tuning.KernelConfig):
  del ds_in_ref  # the zeros input aliased to ds_ref: blocks never visited keep dS = 0
  spec = call.spec
  bq, bk = kc.block_q, kc.block_k
  qi = call.pad.T // bq - 1 - pl.program_id(0)
  bh = pl.program_id(1)
  b, n = bh // call.geo.N, bh % call.geo.N
  q_start = qi * bq
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]

  rows = _Rows(b, n, q_start, bq, q_len, kv_len, _segments(qseg_ref, q_start, bq))

  def body(j, dq, *, masked):
    kv_seg = _segments(kvseg_ref, j * bk, bk)

    def compute(dq):
      k, v, s = call.key_block(q, k_ref, v_ref, bias_ref, mask_ref, rows, j, bk, masked, kv_seg)
      grads = tile.backward_tile(s, lse, tile.matmul(do, v, transpose_b=True), delta,
                                 in_dtype=call.dt.input, round_fn=call.round_fn)
      if ds_ref is not None:
        ds_ref[b, n, pl.ds(q_start, bq), pl.ds(j * bk, bk)] = grads.ds
      return dq + tile.matmul(grads.ds_op, k) * spec.scale

    return _skip_unless_shared(rows.seg, kv_seg, compute, dq)

  dq = blocks.split_loop(*call.kv_ranges(q_start, bq, bk, q_len, kv_len), body,
                         jnp.zeros((bq, call.pad.H), f32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def backward(spec: AttentionSpec, config: tuning.Config, ops: Operands, o_res, lse, do,
             dlse=None):
  """-> (dq, dk, dv, dbias or None)."""
  call, x = _prepare(spec, config, ops)
  geo, pad = call.geo, call.pad
  B, N, K, G = geo.B, geo.N, geo.K, geo.G
  do_p = pad_seq_head(do.astype(ops.q.dtype), pad.T, pad.H)
  lse_p = pad_axis(lse, 2, pad.T)
  # Lengths, bias, mask and segment ids: the inputs every backward kernel shares after its own.
  extras = [x["q_lens"], x["kv_lens"], *_optional_arrays(x)]
  extra_specs = lambda batch_of: [_lens_spec(B), _lens_spec(B),
                                  *_optional_specs(call, x, batch_of)]

  # delta pre-pass.
  rows = config.dq.block_q
  row_map = lambda i, bh: (bh // N, i, bh % N, 0)
  delta = pl.pallas_call(
      _delta_kernel, grid=(pad.T // rows, B * N),
      in_specs=[pl.BlockSpec((None, rows, None, pad.H), row_map)] * 2,
      out_specs=pl.BlockSpec((None, None, rows), lambda i, bh: (bh // N, bh % N, i)),
      out_shape=jax.ShapeDtypeStruct((B, N, pad.T), f32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=spec.interpret, name="stable_attn_delta",
  )(do_p, pad_seq_head(o_res, pad.T, pad.H))
  delta = shifted_delta(delta, None if dlse is None else pad_axis(dlse, 2, pad.T))

  # dK, dV: one program per (key block, batch, kv head); loops over the G query heads.
  kc = config.dkv
  bk = kc.block_k
  kv_blk = pl.BlockSpec((None, bk, None, pad.H), lambda j, bkh: (bkh // K, j, bkh % K, 0))
  heads_all = pl.BlockSpec((None, pad.T, G, pad.H), lambda j, bkh: (bkh // K, 0, bkh % K, 0))
  stats_all = pl.BlockSpec((None, G, pad.T), lambda j, bkh: (bkh // K, bkh % K, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, call=call, kc=kc), grid=(pad.S // bk, B * K),
      in_specs=[heads_all, kv_blk, kv_blk, heads_all, stats_all, stats_all,
                *extra_specs(lambda j, bkh: bkh // K)],
      out_specs=[kv_blk, kv_blk],
      out_shape=[jax.ShapeDtypeStruct(x["k"].shape, ops.k.dtype),
                 jax.ShapeDtypeStruct(x["v"].shape, ops.v.dtype)],
      compiler_params=_params(kc), interpret=spec.interpret, name="stable_attn_dkv",
  )(x["q"], x["k"], x["v"], do_p, lse_p, delta, *extras)

  # dQ (and dS for dbias): one program per (query block, batch, head).
  kc = config.dq
  bq = kc.block_q
  nq = pad.T // bq
  q_map = lambda i, bh: (bh // N, nq - 1 - i, bh % N, 0)
  kv_map = lambda i, bh: (bh // N, 0, (bh % N) // G, 0)
  stats_map = lambda i, bh: (bh // N, bh % N, nq - 1 - i)
  q_rows = pl.BlockSpec((None, bq, None, pad.H), q_map)
  kv_all = pl.BlockSpec((None, pad.S, None, pad.H), kv_map)
  stats = pl.BlockSpec((None, None, bq), stats_map)
  write_ds = ops.bias is not None
  ds_shape = (B, N, pad.T, pad.S)
  ds_spec = pl.BlockSpec(ds_shape, lambda *_: (0, 0, 0, 0)) if write_ds else None
  ds_zeros = jnp.zeros(ds_shape, f32) if write_ds else None
  args = [x["q"], x["k"], x["v"], do_p, lse_p, delta, *extras, ds_zeros]
  ds_input = sum(a is not None for a in args) - 1   # its index among the present inputs
  dq, ds = pl.pallas_call(
      functools.partial(_dq_kernel, call=call, kc=kc), grid=(nq, B * N),
      in_specs=[q_rows, kv_all, kv_all, q_rows, stats, stats,
                *extra_specs(lambda i, bh: bh // N), ds_spec],
      out_specs=[q_rows, ds_spec],
      out_shape=[jax.ShapeDtypeStruct(x["q"].shape, ops.q.dtype),
                 jax.ShapeDtypeStruct(ds_shape, f32) if write_ds else None],
      input_output_aliases={ds_input: 1} if write_ds else {},
      compiler_params=_params(kc), interpret=spec.interpret, name="stable_attn_dq",
  )(*args)

  dbias = None
  if write_ds:
    dbias = reduce_to_shape(ds[:, :, :geo.T, :geo.S], ops.bias.shape).astype(ops.bias.dtype)
  return (unpad(dq, geo.T, geo.H), unpad(dk, geo.S, geo.H), unpad(dv, geo.S, geo.H), dbias)
