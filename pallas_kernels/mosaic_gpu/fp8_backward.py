"""The FP8 backward (issue 49; docs/fp8.md, "The FP8 backward's kernel"): dQ, dK and dV of
attention of e4m3 q, k, v (the FP8 forward's operands) with e4m3 products only, in two kernels
with the bf16 backward's CTAs, block ranges and streams (backward.py).

dQ     per key block of a CTA's query rows:
         S = Q K^T and dP = dO V^T, e4m3 wgmma (K and V as stored: both reduce over the head dim);
         P = exp(S - LSE) fp32, dS = P (dP - delta) fp32, delta = rowsum(dO O) of the cast dO (on
           peaked rows dP - delta cancels, so delta must be made of the dO that dP is);
         dQ += dS K: dS times a power of two per row under its running largest |value|
           (tile.fp8_row_scale), cast to e4m3, its registers relabelled as the 8-bit A operand
           (common.as_8bit_operand), against K^T [H, block_kv] stored with its keys in the
           relabelled order (common.relabelled_keys); the fp32 accumulator is multiplied by the
           scale's ratio (exact) where the running max grows, each row divided by its last scale
           at the end.
dK/dV  per query block of every query head of a CTA's kv head, the tile transposed (S^T = K Q^T,
       dP^T = V dO^T): dV += P^T dO (P^T times 2^8 cast to e4m3, against dO^T; each block's
       product in a fresh accumulator: TuningConfig.fp8_dv_promote) and dK += dS^T Q
       (dS^T under its key rows' running scale, against Q^T), both from relabelled registers,
       Q^T and dO^T stored with their queries relabelled.
dO is e4m3 under one power of two per batch row and kv head; dP's descale d (dO's and V's) is
folded into delta and the end: dS * d = P (dP_e4m3 - delta * d), so no step multiplies a tile by
it. What the kernels compute is stable_attn.diagnostics.fp8_backward's variant "P, dO, dS e4m3,
delta of cast dO, dS scale online" (P without the preset's bf16 top key), up to fp32 sums.
No bias or mask operands (nor does the FP8 forward take them).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from stable_attn import fp8
from stable_attn import tile
from stable_attn.layout import pad_to, unpad
from stable_attn.spec import LSE_AXES, ROW_AXES, AttentionSpec, Operands

from pallas_kernels.mosaic_gpu import common
from pallas_kernels.mosaic_gpu.backward import _scores_then_p, _store, load_rows
from pallas_kernels.mosaic_gpu.common import COLS, ROWS, Call, f32

E4M3 = fp8.E4M3


class Fp8Grads(NamedTuple):
  """What the FP8 backward kernels read besides the operands (each padded like them). dO is
  quantized under one power of two per batch row and kv head (do_scale), so that a dK/dV CTA,
  which sums over the query heads of its kv head, sees one scale; d = do_scale * v_scale of the
  kv head."""
  do: jax.Array           # e4m3 [B, Tp, N, H]: dO times do_scale
  do_t: jax.Array         # e4m3 [B, N, H, Tp]: the same transposed, queries in relabelled order
  q_t: jax.Array          # e4m3 [B, N, H, Tp]: Q^T times q_scale, queries relabelled
  k_t: jax.Array          # e4m3 [B, K, H, Sp]: K^T times k_scale, keys relabelled
  lse: jax.Array          # fp32 [B, N, Tp], natural units (the forward's)
  delta: jax.Array        # fp32 [B, N, Tp]: (rowsum(cast dO * O) - dLSE) * d
  d_inv: jax.Array        # fp32 [B, N]: 1 / d, what dS computed from the e4m3 dO is times
  q_descale: jax.Array    # fp32 [N]: 1 / q_scale
  k_descale: jax.Array    # fp32 [N]: 1 / k_scale of the head's kv head
  dv_descale: jax.Array   # fp32 [B, K]: 1 / (P_SCALE * do_scale)


P_SCALE = 256.0   # P's pre-cast scale for dV += P^T dO (FlashAttention-3's 2^8, as the forward)


def _rows(v, cols: int):
  """A per-row vector (ROWS layout) broadcast to [rows, cols] (WGMMA layout)."""
  return lax.broadcast_in_dim(v, (v.shape[0], cols), (0,))


def _dq_kernel(refs: Operands, grads: Fp8Grads, ranges: common.Ranges, dq_ref, scratch, *,
               call: Call, wgs: int):
  (q_smem, do_smem, lse_smem, delta_smem, out_smem, k_smem, v_smem, kt_smem, qseg_smem,
   kseg_smem), (q_loaded, loaded), free = scratch
  tiles = call.config.dq
  bq, bk, stages, H = tiles.block_q, tiles.block_kv, tiles.stages, call.pad.H
  b, n, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  lens = call.lengths(refs, b)
  cta = common.query_cta(call, ranges, b, n, lens, wgs=wgs, bq=bq, bk=bk)
  order = cta.order
  kv_head = lax.div(n, jnp.asarray(call.geo.G, n.dtype))

  def loads():
    """The K, V and K^T blocks' copies (`common.stream`'s loads)."""
    def load(j, slot):
      keys = pl.ds(j * bk, bk)
      plgpu.copy_gmem_to_smem(refs.k.at[b, keys, kv_head], k_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(refs.v.at[b, keys, kv_head], v_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(grads.k_t.at[b, kv_head, :, keys], kt_smem.at[slot],
                              loaded.at[slot])
      common.copy_beside(refs, b, n, None, keys, loaded.at[slot], (kseg_smem, None, None), slot,
                         seg_rows=keys)
    return [(free, load)]

  @pl.when(wg < wgs)
  def _compute():
    before, q_start, if_rows = common.query_compute_start(call, "dq", cta, wg, wgs, bq, stages,
                                                          loads)
    rows = (b, pl.ds(q_start, bq), n)
    q, do = q_smem.at[wg], do_smem.at[wg]

    if_rows(lambda: load_rows(refs, grads, rows, (q, do), [
        (a.at[b, n, pl.ds(q_start, bq)], smem.at[wg])
        for a, smem in ((grads.lse, lse_smem), (grads.delta, delta_smem))],
        qseg_smem, q_loaded.at[wg], wg))
    lse = common.load_tile(lse_smem.at[wg], ROWS)
    delta = common.load_tile(delta_smem.at[wg], ROWS)
    qk_descale = refs.qk_descale[n]
    q_ids = lambda: common.load_tile(qseg_smem.at[wg], ROWS) if call.packed else None

    def step(p, j, carry, kind):
      dq, running, scale = carry
      slot = common.slot_of(p - order.first, stages)
      if not common.block_ready(loaded, free, slot, kind):
        return carry
      ok = None
      if kind == "masked":
        kv_ids = common.load_tile(kseg_smem.at[slot], COLS) if call.packed else None
        ok = call.visible((bq, bk), q_start, j * bk, lens, q_ids=q_ids(), kv_ids=kv_ids)

      def p_of_scores(qk):
        s = call.scores(qk, ok, None, descale=qk_descale)
        return tile.backward_p(s, lse, in_dtype=call.dt.input, base2=True)[0]

      with jax.named_scope("s_dp_p"):
        p, dp = _scores_then_p(
            lambda acc: plgpu.wgmma(acc, q, k_smem.at[slot].transpose((1, 0))),
            lambda acc: plgpu.wgmma(acc, do, v_smem.at[slot].transpose((1, 0))),
            (bq, bk), p_of_scores)
      with jax.named_scope("ds"):
        ds = tile.backward_ds(p, dp, delta, in_dtype=call.dt.input)[0]
        scaled = tile.fp8_row_scale(running, ds)
        ds_op = common.as_8bit_operand((ds * _rows(scaled.scale, bk)).astype(E4M3))
      dq = dq * _rows(scaled.ratio, H)

      def update(acc):
        plgpu.wgmma(acc, ds_op, kt_smem.at[slot].transpose((1, 0)))

      with jax.named_scope("dq"):
        dq = pl.run_state(update)(plgpu.ACC.init(dq))
        plgpu.barrier_arrive(free.at[slot])
      return dq, scaled.running, scaled.scale

    init = (common.zeros((bq, H), plgpu.Layout.WGMMA), common.zeros((bq,), ROWS),
            common.zeros((bq,), ROWS) + 1.0)
    dq, _, scale = common.sections(order, cta.mine(q_start), step, init, None, before)
    descale = grads.d_inv[b, n] * grads.k_descale[n] * call.spec.scale
    dq = dq * _rows(descale / scale, H)   # the scale is a power of two: exact
    if_rows(lambda: _store(out_smem.at[wg], dq.astype(out_smem.dtype), dq_ref.at[rows]))
    common.drain_stores()

  pl.when(wg == wgs)(lambda: common.query_produce(call, "dq", cta, wgs, stages, loads, ranges))


@common.lowered_once("call", "out_dtype")
def dq_call(call: Call, x: Operands, grads: Fp8Grads, ranges: common.Ranges, out_dtype):
  """Padded FP8 operands (x.q, x.k, x.v e4m3 [B, Tp|Sp, N|K, H] as stored, x.qk_descale [N]) ->
  dQ [B, Tp, N, H] in out_dtype."""
  tiles = call.config.dq
  bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
  B, N, H = call.geo.B, call.geo.N, call.pad.H
  wgs = call.config.dq_wgs
  rows_mma = common.mma_transforms(E4M3, H)   # Q, dO, K, V: 8-bit, K-major over the head dim
  keys_mma = common.mma_transforms(E4M3, bk)  # K^T: K-major over the keys
  smem = (plgpu.SMEM((wgs, bq, H), E4M3, transforms=rows_mma),
          plgpu.SMEM((wgs, bq, H), E4M3, transforms=rows_mma),
          plgpu.SMEM((wgs, bq), f32), plgpu.SMEM((wgs, bq), f32),
          plgpu.SMEM((wgs, bq, H), out_dtype, transforms=common.tile_transforms(H, out_dtype)),
          plgpu.SMEM((stages, bk, H), E4M3, transforms=rows_mma),
          plgpu.SMEM((stages, bk, H), E4M3, transforms=rows_mma),
          plgpu.SMEM((stages, H, bk), E4M3, transforms=keys_mma),
          plgpu.SMEM((wgs, bq), jnp.int32) if call.packed else None,
          plgpu.SMEM((stages, bk), jnp.int32) if call.packed else None)
  barriers = (plgpu.Barrier(num_arrivals=4 + call.packed, num_barriers=wgs),
              plgpu.Barrier(num_arrivals=3 + call.packed, num_barriers=stages))
  grid, grid_names, _ = common.query_grid(call, x, "dq", wgs, bq, False)
  return common.launch(
      functools.partial(_dq_kernel, call=call, wgs=wgs),
      (smem, barriers, plgpu.Barrier(num_arrivals=wgs, num_barriers=stages)),
      name="stable_attn_fp8_dq", out_type=jax.ShapeDtypeStruct((B, call.pad.T, N, H), out_dtype),
      compute_wgs=wgs, producer=call.config.has_producer("dq"), grid=grid,
      grid_names=grid_names,
  )(x, grads, ranges)


# ---------------------------------------------------------------------------------------------
# dK, dV
# ---------------------------------------------------------------------------------------------

def _dkv_kernel(refs: Operands, grads: Fp8Grads, ranges: common.Ranges, dk_ref, dv_ref, scratch,
                *, call: Call, wgs: int):
  """One CTA per (batch row, kv head, wgs * block_kv keys), each compute warpgroup a key tile of
  its own (K and V resident, e4m3), the producer streaming Q, dO, Q^T, dO^T, LSE and delta blocks
  of every query head of the group (backward._dkv_kernel's grid and streams). Per block, with the
  tile transposed (S^T = K Q^T, dP^T = V dO^T), dS^T first:
    dV += P^T dO: P^T times P_SCALE cast to e4m3, relabelled, against dO^T (queries relabelled),
      into a fresh accumulator added to dV in fp32 (TuningConfig.fp8_dv_promote) or into dV's;
    dK += dS^T Q: dS^T (over the group's query heads: times 1 / q_scale of the head where that
      differs within the group) under its key rows' running scale, cast, relabelled, against
      Q^T, the accumulator rescaled where the scale falls, as in the dQ kernel."""
  (k_smem, v_smem, out_smem, q_smem, do_smem, qt_smem, dot_smem, lse_smem, delta_smem, kseg_smem,
   qseg_smem), (kv_loaded, loaded), free = scratch
  tiles, G = call.config.dkv, call.geo.G
  bq, bk, stages, H = tiles.block_q, tiles.block_kv, tiles.stages, call.pad.H
  wg = lax.axis_index("wg")
  b, kvh, index = common.key_tiles(call, refs, wgs, bk, 0).tile(0)
  cta = common.key_cta(call, refs, ranges, b, kvh, index, wgs=wgs, bk=bk, bq=bq)
  cta_k, lens, (lo, hi), order = cta.start, cta.lens, cta.union, cta.order
  per_head, block = cta.group_stream(kvh, G)

  def load(at, slot):
    n, i = at
    queries = pl.ds(i * bq, bq)
    rows = (b, queries, n)
    for src, dst in ((refs.q, q_smem), (grads.do, do_smem)):
      plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], loaded.at[slot])
    for src, dst in ((grads.q_t, qt_smem), (grads.do_t, dot_smem)):
      plgpu.copy_gmem_to_smem(src.at[b, n, :, queries], dst.at[slot], loaded.at[slot])
    for src, dst in ((grads.lse, lse_smem), (grads.delta, delta_smem)):
      plgpu.copy_gmem_to_smem(src.at[b, n, queries], dst.at[slot], loaded.at[slot])
    common.copy_beside(refs, b, n, None, queries, loaded.at[slot], (qseg_smem, None, None), slot,
                       seg_rows=queries, seg_ref=refs.q_seg)
  loads = [(free, load)]

  @pl.when(wg < wgs)
  def _compute():
    common.take_registers(call, "dkv", wgs, "compute")
    refill = common.issuer(call, "dkv", wg, wgs, lambda: common.inline_stream(
        jnp.zeros((), jnp.int32), G * per_head, stages, loads, block,
        call.config.refill_lag)).before
    k_start = cta_k + wg * bk
    rows = (b, pl.ds(k_start, bk), kvh)
    if_keys = common.if_keys(call, wgs, bk, k_start)
    k, v = k_smem.at[wg], v_smem.at[wg]

    @if_keys
    def _load():
      plgpu.copy_gmem_to_smem(refs.k.at[rows], k, kv_loaded.at[wg])
      plgpu.copy_gmem_to_smem(refs.v.at[rows], v, kv_loaded.at[wg])
      if call.packed:
        plgpu.copy_gmem_to_smem(refs.kv_seg.at[b, pl.ds(k_start, bk)], kseg_smem.at[wg],
                                kv_loaded.at[wg])
      plgpu.barrier_wait(kv_loaded.at[wg])
    kv_ids = lambda: common.load_tile(kseg_smem.at[wg], ROWS) if call.packed else None
    mine = common.clamp_ranges(cta.q_ranges(k_start), lo, hi)
    soft_cap = call.spec.logits_soft_cap is not None

    def head(g, carry):
      n = kvh * G + g
      qk_descale = refs.qk_descale[n]
      q_descale = grads.q_descale[n] if G > 1 else None   # else applied once, at the end

      def step(p, i, carry, kind):
        dk, dv, running, scale = carry
        slot = common.slot_of(g * per_head + p - order.first, stages)
        if not common.block_ready(loaded, free, slot, kind):
          return carry
        ok = None
        if kind == "masked":
          q_ids = common.load_tile(qseg_smem.at[slot], COLS) if call.packed else None
          ok = call.visible((bk, bq), i * bq, k_start, lens, q_axis=1, q_ids=q_ids,
                            kv_ids=kv_ids())

        def p_of_scores(qk_t):
          s_t = call.scores(qk_t, ok, None, descale=qk_descale)
          return tile.backward_p(s_t, common.load_tile(lse_smem.at[slot], COLS),
                                 in_dtype=call.dt.input, base2=True, q_axis=1)

        with jax.named_scope("s_dp_p"):
          (p_t, p_op), dp_t = _scores_then_p(
              lambda acc: plgpu.wgmma(acc, k, q_smem.at[slot].transpose((1, 0))),
              lambda acc: plgpu.wgmma(acc, v, do_smem.at[slot].transpose((1, 0))),
              (bk, bq), p_of_scores)
        # P for dV: with a soft cap p_t is P times its dtanh, so P's input-dtype operand
        p = p_op.astype(f32) if soft_cap else p_t
        p8 = common.as_8bit_operand((p * P_SCALE).astype(E4M3))
        # dS before dV's product: P^T's and dP^T's fp32 tiles are dead by then, which leaves
        # room for the promoted product's fresh accumulator beside dK's and dV's
        with jax.named_scope("ds"):
          ds = tile.backward_ds(p_t, dp_t, common.load_tile(delta_smem.at[slot], COLS),
                                in_dtype=call.dt.input, q_axis=1)[0]
          if q_descale is not None:
            ds = ds * q_descale
          scaled = tile.fp8_row_scale(running, ds)
          ds8 = common.as_8bit_operand((ds * _rows(scaled.scale, bq)).astype(E4M3))

        def dv_product(acc):
          plgpu.wgmma(acc, p8, dot_smem.at[slot].transpose((1, 0)))

        def dv_alone(acc):
          dv_product(acc)
          return acc[...]
        with jax.named_scope("dv"):
          if call.config.fp8_dv_promote:   # this block's P^T dO alone, added to dV in fp32
            dv = dv + pl.run_scoped(dv_alone, plgpu.ACC((bk, H), f32))
          else:
            dv = pl.run_state(dv_product)(plgpu.ACC.init(dv))
        dk = dk * _rows(scaled.ratio, H)
        with jax.named_scope("dk"):
          dk = pl.run_state(lambda acc: plgpu.wgmma(acc, ds8, qt_smem.at[slot].transpose(
              (1, 0))))(plgpu.ACC.init(dk))
          plgpu.barrier_arrive(free.at[slot])
        return dk, dv, scaled.running, scaled.scale

      before = None if refill is None else (lambda p: refill(g * per_head + p - order.first))
      return common.sections(order, mine, step, carry, None, before)

    zeros = common.zeros((bk, H), plgpu.Layout.WGMMA)
    rows_of = common.zeros((bk,), ROWS)
    dk, dv, _, scale = lax.fori_loop(0, G, head, (zeros, zeros, rows_of, rows_of + 1.0))
    n0 = kvh * G
    descale = grads.d_inv[b, n0] * call.spec.scale
    if G == 1:
      descale = descale * grads.q_descale[n0]

    @if_keys
    def _store_grads():
      out = out_smem.at[wg]
      _store(out, (dk * _rows(descale / scale, H)).astype(out.dtype), dk_ref.at[rows])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      _store(out, (dv * grads.dv_descale[b, kvh]).astype(out.dtype), dv_ref.at[rows])
    common.drain_stores()

  @pl.when(wg == wgs)
  def _produce():
    common.take_registers(call, "dkv", wgs, "producer")
    common.stream(jnp.zeros((), jnp.int32), G * per_head, stages, loads, block,
                  prefetch=ranges.order is not None)


@common.lowered_once("call", "out_dtype")
def dkv_call(call: Call, x: Operands, grads: Fp8Grads, ranges: common.Ranges, out_dtype):
  """Padded FP8 operands (`dq_call`'s) -> (dK, dV) [B, Sp, K, H] in out_dtype."""
  tiles = call.config.dkv
  bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
  B, K, H, Sp = call.geo.B, call.geo.K, call.pad.H, call.pad.S
  wgs = call.config.dkv_wgs
  rows_mma = common.mma_transforms(E4M3, H)     # K, V, Q, dO: K-major over the head dim
  queries_mma = common.mma_transforms(E4M3, bq)  # Q^T, dO^T: K-major over the queries
  smem = (plgpu.SMEM((wgs, bk, H), E4M3, transforms=rows_mma),
          plgpu.SMEM((wgs, bk, H), E4M3, transforms=rows_mma),
          plgpu.SMEM((wgs, bk, H), out_dtype, transforms=common.tile_transforms(H, out_dtype)),
          plgpu.SMEM((stages, bq, H), E4M3, transforms=rows_mma),
          plgpu.SMEM((stages, bq, H), E4M3, transforms=rows_mma),
          plgpu.SMEM((stages, H, bq), E4M3, transforms=queries_mma),
          plgpu.SMEM((stages, H, bq), E4M3, transforms=queries_mma),
          plgpu.SMEM((stages, bq), f32), plgpu.SMEM((stages, bq), f32),
          plgpu.SMEM((wgs, bk), jnp.int32) if call.packed else None,
          plgpu.SMEM((stages, bq), jnp.int32) if call.packed else None)
  barriers = (plgpu.Barrier(num_arrivals=2 + call.packed, num_barriers=wgs),
              plgpu.Barrier(num_arrivals=6 + call.packed, num_barriers=stages))
  grid, grid_names, _ = common.key_grid(call, x, wgs, bk, False)
  kv_grad = jax.ShapeDtypeStruct((B, Sp, K, H), out_dtype)
  return common.launch(
      functools.partial(_dkv_kernel, call=call, wgs=wgs),
      (smem, barriers, plgpu.Barrier(num_arrivals=wgs, num_barriers=stages)),
      name="stable_attn_fp8_dkv", out_type=(kv_grad, kv_grad), compute_wgs=wgs,
      producer=call.config.has_producer("dkv"), grid=grid, grid_names=grid_names,
  )(x, grads, ranges)


# ---------------------------------------------------------------------------------------------
# The backward
# ---------------------------------------------------------------------------------------------

def _quantize_do(do, groups: int):
  """do [B, T, N, H] -> (its e4m3 payload under one power of two per batch row and kv head (the
  largest |value| of the head's group), the dequantized values fp32, the scales [B, K])."""
  B, T, N, H = do.shape
  amax = jnp.max(jnp.abs(do.astype(f32)).reshape(B, T, N // groups, groups, H), axis=(1, 3, 4))
  scale = fp8.scales_from_amax(amax)
  scaled = do.astype(f32) * jnp.repeat(scale, groups, axis=1)[:, None, :, None]
  # tile.round_exact for the dequantized copy: XLA drops an f32 -> e4m3 -> f32 pair.
  dequantized = tile.round_exact(scaled, E4M3) / jnp.repeat(scale, groups, axis=1)[:, None, :, None]
  return scaled.astype(E4M3), dequantized, scale


def backward_inputs(spec: AttentionSpec, config, ops: Operands, o, lse, do, dlse=None):
  """-> (Call, padded FP8 operands, Fp8Grads, dQ's block ranges, dK/dV's block ranges) for a call
  of the FP8 forward: ops as its backend gets them (q, k, v quantized, with their scales), its
  output O, LSE [B, N, T] fp32 (natural units), the cotangent dO [B, T, N, H] and dLSE (or
  None)."""
  from pallas_kernels import mosaic_gpu as mosaic
  call = mosaic._call(spec, config, ops)
  padded = mosaic._padded(ops, call)
  G = call.geo.G
  # Q and K e4m3 as the forward reads them; V as stored too (dP = dO V^T reduces over the head
  # dim); K^T, Q^T and dO^T for the products that reduce over keys or queries, relabelled.
  x = mosaic._fp8_operands(padded, ops, call.pad, G, v_transposed=False)
  # The relabelling as a pass of its own after XLA's tiled transpose (fused into it, XLA writes
  # both in one loop fusion: the FP8 forward's V^T measured that, mosaic_gpu._fp8_operands).
  transposed = lambda a: common.relabelled_keys(lax.optimization_barrier(
      jnp.transpose(a, (0, 2, 3, 1))))
  rows = lambda a: pad_to(a.astype(ops.q.dtype), ROW_AXES, call.pad)
  do8, do_c, do_scale = _quantize_do(rows(do), G)
  d = jnp.repeat(do_scale * ops.v_scale[None], G, axis=1)   # [B, N]: dO's and V's scales
  delta = jnp.swapaxes(tile.delta(do_c, rows(o)), 1, 2)
  if dlse is not None:
    delta = delta - pad_to(dlse, LSE_AXES, call.pad)
  grads = Fp8Grads(do8, transposed(do8), transposed(x.q), transposed(x.k),
                   pad_to(lse, LSE_AXES, call.pad, tile.EMPTY_ROW_LSE), delta * d[..., None],
                   1.0 / d, 1.0 / ops.q_scale, 1.0 / jnp.repeat(ops.k_scale, G),
                   1.0 / (P_SCALE * do_scale))
  x = x._replace(offset=None)
  ranges = (common.block_ranges(x, config.dq.block_q, config.dq.block_kv, "query"),
            common.block_ranges(x, config.dkv.block_q, config.dkv.block_kv, "key", G))
  return call, x, grads, *ranges


def fp8_backward(spec: AttentionSpec, config, ops: Operands, o, lse, do, dlse=None):
  """(dQ, dK, dV) in q's dtype, unpadded, of a call of the FP8 forward (`backward_inputs`'
  arguments), by the FP8 dQ and dK/dV kernels."""
  call, x, grads, dq_ranges, dkv_ranges = backward_inputs(spec, config, ops, o, lse, do, dlse)
  dtype = jnp.dtype(ops.q.dtype)
  dq = dq_call(call, x, grads, dq_ranges, dtype)
  dk, dv = dkv_call(call, x, grads, dkv_ranges, dtype)
  kv_axes = ("batch", "key", "kv_heads", "head_dim")
  return (unpad(dq, ROW_AXES, call.geo), unpad(dk, kv_axes, call.geo),
          unpad(dv, kv_axes, call.geo))
