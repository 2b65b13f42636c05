"""Forward kernel: FlashAttention-3's structure in Pallas Mosaic GPU, with stable_attn's tile math.

One CTA per (batch, query head, W * block_q query rows), W compute warpgroups and a producer
(W = TuningConfig.fwd_wgs: 3 at head dims 64 and 128, else 2; 2 with a mask operand, with a
bias except at head dim 64 under a position mask, tuning._BIAS_FWD, and in the "fp8" preset's FP8
forward at head dim 128, tuning._TOP_RESIDUAL):
  compute       each owns block_q query rows (Q resident in shared memory) and runs the online
                softmax over the union of the warpgroups' key blocks; QK^T and PV are wgmma
                (PV with P from registers), scores in log2 units so P = exp2(s - m) is one FMA
                per element. Two warpgroups ping-pong on a schedule barrier: one's softmax runs
                while the other's matmuls occupy the tensor cores. Three run free (FA3's
                head-dim-64 shape, where one softmax takes twice the two products: three
                softmaxes in flight keep the SM's schedulers busier; faster at 128 too; a
                turn-taking ring like FA3's scheduler barrier measured slower). CTAs are
                aligned to T's end, so when 3 * block_q does not divide T the last CTA's first
                warpgroups idle.
  producer      streams K and V blocks through `stages` slots with TMA (common.py: pipelines);
                without one (TuningConfig.producer, fwd_producer False) the last compute
                warpgroup does.
Persistent (TuningConfig.fwd_persistent, the table's at head dim 64, and with a bias alone where
every query sees every key: tuning._BIAS_FULL_FWD): one CTA per SM takes the query tiles in zigzag
rounds (common.persistent_tiles), heaviest causal rows first, or in the grid's order where the
tiles cost the same (TuningConfig.persistent_order: its CTAs then share K and V in L2); each compute
warpgroup loads its next tile's Q into the second of two Q buffers while it works on this one,
and stages O apart from Q; the producer's slots run on across tiles. A CTA's start (Q's load,
its first K) and its epilogue no longer stand between two tiles on an SM.
Causal and window masks: blocks outside a warpgroup's range are skipped, blocks every row sees
whole run without the mask, edge blocks with it (stable_attn.blocks). Packed sequences: the
ranges are intersected with the rows' document ranges (blocks.segment_sections, once per call);
the keys' segment ids travel with K, and only edge blocks compare them with the rows' ids.
GQA: the kv head of query head n is n // G in the TMA index; K/V are never repeated. Lengths mask
padding at the end.
max_adjust "safe" reads its per-row offsets (the call's operand, stable_attn.tile.safe_offset per
head and position) and folds them into the row max; "paper" runs the paper's rule per block.
A logit soft cap is applied to the tile by tile.scores (tanh in fp32); attention sinks join each
row's denominator in tile.finalize, after the key blocks. Bias and mask operands (a mask with two
warpgroups only): the CTA's [W * block_q, block_kv] tiles of them travel with K (TMA, same
barrier) and each warpgroup reads its rows into registers while its QK^T product runs (the
read's latency hides behind the tensor cores), before the slot is freed; with a bias, log2(e)
stays outside the tile (tile.scores). A bias may stream apart from K instead
(TuningConfig.fwd_bias_apart, the table's at head dim 128: tuning._BIAS_APART): one [block_q,
block_kv] buffer per warpgroup, each its own ring of one slot in the producer's stream, released
once QK^T has landed; half the shared memory of a slot per stage, so 128-key blocks fit beside
it. The mask's block ranges (blocks.mask_sections) bound the loop like the segments', the
producer streams only the blocks whose tile holds a True for the CTA's rows (blocks.mask_order),
and only edge blocks read the mask tile. A slot whose tiles threads read is released after a
warpgroup barrier (common.release)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from stable_attn import tile
from stable_attn.spec import Operands

from pallas_kernels.mosaic_gpu import common
from pallas_kernels.mosaic_gpu.common import COLS, ROWS, Call, f32



def _kernel(refs: Operands, ranges: common.Ranges, o_ref, lse_ref, scratch, *, call: Call,
            ctas: int):
  """ctas: 0 for one CTA per query tile (grid (B, N, CTAs per row)), else the number of
  persistent CTAs (grid (ctas,)) that take the tiles in zigzag rounds (`common.query_tiles`)."""
  (q_smem, k_smem, v_smem, off_smem, lse_smem, qseg_smem, kseg_smem, bias_smem, mask_smem,
   o_smem, p_smem, r_smem), (loaded, free, schedule) = scratch[0], scratch[1:]
  q_loaded, k_loaded, v_loaded, bias_loaded = loaded
  k_free, v_free, bias_free = free
  apart = bias_loaded is not None   # the bias streams apart from K (TuningConfig.fwd_bias_apart)
  spec, dt, fwd, wgs, fp8 = call.spec, call.dt, call.config.fwd, call.config.fwd_wgs, call.fp8
  bq, bk, stages = fwd.block_q, fwd.block_kv, fwd.stages
  in_registers = call.config.fp8_p_registers   # the FP8 P's, for P V
  wg = lax.axis_index("wg")
  tiles = common.query_tiles(call, refs, wgs, bq, ctas)
  tile_of, buffer_of, count = tiles.tile, tiles.buffer, tiles.count

  def query_tile(i):
    """Tile i's (b, n, query CTA, its common.Lengths)."""
    b, n, index = tile_of(i)
    lens = call.lengths(refs, b)
    return b, n, common.query_cta(call, ranges, b, n, lens, wgs=wgs, bq=bq, bk=bk,
                                  index=index), lens

  def loads(b, n, cta):
    """The K and V blocks' copies (and the bias apart from K's, one ring per warpgroup) of
    CTA `cta` of tile (b, n): `common.stream`'s loads."""
    kv_head = lax.div(n, jnp.asarray(call.geo.G, n.dtype))

    def loader(ref, smem, barrier):
      def load(j, slot):
        keys = pl.ds(j * bk, bk)
        rows = ref.at[b, kv_head, :, keys] if fp8 and ref is refs.v else ref.at[b, keys, kv_head]
        plgpu.copy_gmem_to_smem(rows, smem.at[slot], barrier.at[slot])
        if ref is refs.k:   # the keys' segment ids and the CTA's bias and mask tiles: with K
          common.copy_beside(refs, b, n, pl.ds(cta.start, wgs * bq), keys, barrier.at[slot],
                             (kseg_smem, None if apart else bias_smem, mask_smem), slot,
                             seg_rows=keys)
      return load

    def bias_loader(w):
      """Warpgroup w's bias tile into its one buffer (a ring of 1 at slot w: common.stream)."""
      def load(j, slot):
        plgpu.copy_gmem_to_smem(
            common.pairwise_tile(refs.bias, b, n, pl.ds(cta.start + w * bq, bq),
                                 pl.ds(j * bk, bk)), bias_smem.at[slot], bias_loaded.at[slot])
      return load

    return [(k_free, loader(refs.k, k_smem, k_loaded)),
            (v_free, loader(refs.v, v_smem, v_loaded)),
            *((bias_free, bias_loader(w), 1, w) for w in range(wgs) if apart)]

  def rendezvous():   # the ping-pong of two warpgroups; three run free
    if wgs == 2:
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

  @pl.when(wg < wgs)
  def _compute():
    common.take_registers(call, "fwd", wgs, "compute")

    def load_q(i, buf):
      """Tile i's Q rows of this warpgroup (and their offsets and segment ids) into Q buffer buf."""
      b, n, index = tile_of(i)
      q_start = common.cta_rows(call, wgs, bq, index)[1] + wg * bq
      with jax.named_scope("load_q"):   # (the named regions are what common.profiling records)
        barrier = q_loaded.at[buf * wgs + wg]

        @common.if_rows(call, wgs, bq, q_start)
        def _load():
          plgpu.copy_gmem_to_smem(refs.q.at[b, pl.ds(q_start, bq), n], q_smem.at[buf, wg],
                                  barrier)
          if call.safe:
            plgpu.copy_gmem_to_smem(refs.offset.at[n, pl.ds(q_start, bq)],
                                    off_smem.at[buf, wg], barrier)
          if call.packed:
            plgpu.copy_gmem_to_smem(refs.q_seg.at[b, pl.ds(q_start, bq)],
                                    qseg_smem.at[buf, wg], barrier)

    def run_tile(i, base):
      """Tile i, whose first streamed block is the CTA's base-th -> the next tile's base."""
      buf = buffer_of(i)
      if ctas:
        pl.when(i + 1 < count)(lambda: load_q(i + 1, 1 - buf))
      b, n, cta, lens = query_tile(i)
      order = cta.order
      # Without a producer the last warpgroup streams K and V (first, before any rendezvous).
      before, k_released = common.issuer(call, "fwd", wg, wgs, lambda: common.inline_stream(
          order.first, order.stop, stages, loads(b, n, cta), order.block,
          call.config.refill_lag, early=int(call.config.refill_k_early)))
      k_released = k_released or (lambda p: None)
      q_start = cta.start + wg * bq
      if_rows = cta.if_rows(q_start)
      q = q_smem.at[buf, wg]
      if_rows(lambda: plgpu.barrier_wait(q_loaded.at[buf * wgs + wg]))
      offset = None   # natural units in memory (stable_attn's operand), log2 units here
      if call.safe:
        offset = common.load_tile(off_smem.at[buf, wg], ROWS) * tile.LOG2E
      # The rows' segment ids are read on the masked steps that need them, not held in registers
      # across the loop (held, the three-warpgroup forward spilled 220 bytes: ptxas, H128).
      q_ids = lambda: common.load_tile(qseg_smem.at[buf, wg], ROWS) if call.packed else None
      descale = refs.qk_descale[n] if fp8 else None   # FP8: Q K^T of e4m3 values, times 2^-e
      slot_of = lambda p: common.slot_of(base + p - order.first, stages)

      def wait_k(p):
        """Waits for the K of the block at position p; each step waits for the next one's while
        its PV product runs."""
        @pl.when(p < order.stop)
        def _wait():
          plgpu.barrier_wait(k_loaded.at[slot_of(p)])

      def step(p, j, carry, kind):
        acc, stats = carry
        slot = slot_of(p)
        if kind in ("skip", "empty"):
          plgpu.barrier_arrive(k_free.at[slot])
          k_released(p)
          if apart:   # its warpgroup's tile loads at every position: keep the ring's phases
            plgpu.barrier_wait(bias_loaded.at[wg])
            plgpu.barrier_arrive(bias_free.at[wg])
          rendezvous()
          plgpu.barrier_wait(v_loaded.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
          wait_k(p + 1)
          rendezvous()
          return carry

        def qk_product(acc_ref):
          plgpu.wgmma(acc_ref, q, k_smem.at[slot].transpose((1, 0)))
          # What travels with K is read into registers while the product runs.
          beside = read_beside(slot, kind)
          rendezvous()   # the other warpgroup's softmax runs while this product does
          return acc_ref[...], beside

        with jax.named_scope("qk"):
          qk, beside = pl.run_scoped(qk_product, plgpu.ACC((bq, bk), f32))
        with jax.named_scope("softmax"):
          acc, stats, probs = softmax(slot, j, qk, beside, acc, stats, kind)
        with jax.named_scope("wait_v"):
          if wgs == 2:
            plgpu.barrier_arrive(schedule)
          k_released(p)   # the issuer's K copy, while it waits for its turn anyway
          plgpu.barrier_wait(v_loaded.at[slot])
          if wgs == 2:
            plgpu.barrier_wait(schedule)

        def pv_product(acc_ref, keys=None):
          """P V of the block's keys (all, or the pl.ds `keys` of one promotion group) into
          acc_ref."""
          if fp8:   # V^T in SMEM viewed transposed: K-major, as 8-bit wgmma operands must be
            head, residual = probs if in_registers else (
                p_smem.at[wg], None if r_smem is None else r_smem.at[wg])
            v_t = v_smem.at[slot]
            if keys is not None:
              cut = lambda x: (None if x is None else x[:, keys.start:keys.start + keys.size]
                               if in_registers else x.at[:, keys])
              head, residual, v_t = cut(head), cut(residual), v_t.at[:, keys]
            v_t = v_t.transpose((1, 0))
            plgpu.wgmma(acc_ref, head, v_t)
            if residual is not None:   # the top keys' residual (tile.rescale's split_top)
              plgpu.wgmma(acc_ref, residual, v_t)
          else:
            plgpu.wgmma(acc_ref, probs, v_smem.at[slot])

        def alone(keys=None):
          """The P V of `keys` (None: the block's) in a fresh accumulator, waited for."""
          def product(acc_ref):
            pv_product(acc_ref, keys)
            if keys is None or keys.start == 0:   # the next K's wait while the product runs
              wait_k(p + 1)
            return acc_ref[...]
          return pl.run_scoped(product, plgpu.ACC((bq, call.pad.H), f32))

        def along(acc_ref):
          pv_product(acc_ref)
          wait_k(p + 1)

        def in_turns(*accs):
          """Groups under the block at head dim 64: two accumulators in turn, each group's
          product issued before the previous group's is read (and that accumulator zeroed for
          the next). At 128 their registers beside O's made the kernel 0.35-0.6x as fast as
          waiting for each group (H200, docs/fp8.md)."""
          total, pending = acc, 1 + tile.has_top_residual(dt)   # wgmma groups a product
          for i, start in enumerate(range(0, bk, group)):
            if i >= 2:
              accs[i % 2][...] = common.zeros((bq, call.pad.H), plgpu.Layout.WGMMA)
            pv_product(accs[i % 2], pl.ds(start, group))
            if i == 0:   # the next K's wait while the product runs
              wait_k(p + 1)
            else:   # the previous group's, this one's still in flight
              total = total + plgpu.wgmma_accumulator_load(accs[(i - 1) % 2], wait_n=pending)
          return total + plgpu.wgmma_accumulator_load(accs[(bk // group - 1) % 2], wait_n=0)

        with jax.named_scope("pv"):
          group = call.config.fp8_pv_promote if fp8 else 0
          if group == bk:   # the block's P V alone, added to O in fp32
            acc = acc + alone()
          elif group and call.pad.H <= 64:
            acc = pl.run_scoped(in_turns, *(plgpu.ACC((bq, call.pad.H), f32),) * 2)
          elif group:   # each group's P V alone, added to O in fp32, waited for in turn
            for start in range(0, bk, group):
              acc = acc + alone(pl.ds(start, group))
          else:
            acc = pl.run_state(along)(plgpu.ACC.init(acc))
          plgpu.barrier_arrive(v_free.at[slot])
        return acc, stats

      def read_beside(slot, kind):
        """The bias tile, the mask tile and the keys' segment ids of the block in `slot` (each
        None where absent or not needed: the mask and ids on masked steps only); a bias apart
        from K from its warpgroup's buffer."""
        bias, allowed = common.read_beside(None if apart else bias_smem, mask_smem, slot,
                                           pl.ds(wg * bq, bq), kind == "masked")
        if apart:
          plgpu.barrier_wait(bias_loaded.at[wg])
          bias = bias_smem.at[wg][...]   # freed once the product has landed (`softmax`)
        kv_ids = None
        if kind == "masked" and call.packed:
          kv_ids = common.load_tile(kseg_smem.at[slot], COLS)
        return bias, allowed, kv_ids

      def softmax(slot, j, qk, beside, acc, stats, kind):
        bias, allowed, kv_ids = beside   # read during QK^T, before the slot is freed
        # Threads read what travels with K and the bias buffer: a warpgroup barrier orders those
        # reads before the release (common.release). Released without one, the bias buffer's
        # next TMA copy overwrote rows not yet read (three warpgroups: wrong O in every run; H200,
        # JAX 0.11.2); with a proxy fence as well, the forward ran 0.97-0.99x as fast.
        with_k = (bias is not None and not apart) or allowed is not None or kv_ids is not None
        common.release(k_free.at[slot], after_reads=with_k)
        if apart:
          common.release(bias_free.at[wg], after_reads=not with_k)
        ok = None
        if kind == "masked":
          ok = call.visible((bq, bk), q_start, j * bk, lens, q_ids=q_ids(),
                            kv_ids=kv_ids, mask=allowed)
        s = call.scores(qk, ok, bias, descale)
        probs, alpha, stats = tile.rescale(stats, s, dt=dt, max_adjust=spec.max_adjust,
                                           beta=spec.beta, offset=offset, base2=True,
                                           split_top=fp8)
        acc = tile.scale_acc(acc, alpha, dt=dt)
        if fp8 and in_registers:   # V^T's keys are in the relabelled order
          probs = tuple(None if x is None else common.as_8bit_operand(x) for x in probs)
        elif fp8:   # P through SMEM, fenced for the wgmma that reads it
          head, residual = probs   # the top keys' residual: None, or a second P V product's
          p_smem.at[wg][...] = head
          if residual is not None:
            r_smem.at[wg][...] = residual
          plgpu.commit_smem()
          probs = None
        # Finish the softmax before handing the tensor cores over (as JAX's attention_mgpu does).
        return lax.optimization_barrier((acc, stats, probs))

      mine = cta.mine(q_start)
      with jax.named_scope("first_k"):
        pl.when(wg == 1)(rendezvous)   # offsets the two warpgroups by half a step: the ping-pong
        wait_k(order.first)
      init = (common.zeros((bq, call.pad.H), plgpu.Layout.WGMMA), common.init_stats(bq, dt))
      acc, stats = common.sections(order, mine, step, init,
                                   common.block_flags(ranges.mask_blocks, b, n, q_start // bq),
                                   before)
      with jax.named_scope("epilogue"):
        pl.when(wg == 0)(rendezvous)
        sink = None if refs.sinks is None else refs.sinks[n].astype(f32)
        if fp8:   # acc holds P_bar * p_scale times V's e4m3 values (V times 2^e)
          acc = acc * (refs.v_descale[n] * (1.0 / dt.p_scale))
        o, _, lse = tile.finalize(acc, stats, dt=dt, offset=offset, base2=True, sink=sink)

        @if_rows
        def _store():
          # A persistent CTA stages O apart from Q (whose buffer takes a later tile's rows) and
          # first waits for its previous tile's stores to have read the staging tiles; so does
          # the FP8 forward (Q's e4m3 buffer cannot hold O).
          staged = o_smem.at[wg] if ctas or fp8 else q
          if ctas:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          staged[...] = o
          lse_smem.at[wg][...] = lse
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(staged, o_ref.at[b, pl.ds(q_start, bq), n])
          plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, n, pl.ds(q_start, bq)])
      return base + (order.stop - order.first)

    load_q(0, 0)
    tiles.run(run_tile)
    common.drain_stores()

  @pl.when(wg == wgs)
  def _produce():
    common.take_registers(call, "fwd", wgs, "producer")

    def stream_tile(i, base):
      b, n, cta, _ = query_tile(i)
      order = cta.order
      common.stream(order.first, order.stop, stages, loads(b, n, cta), order.block,
                    prefetch=ranges.order is not None, base=base)
      return base + (order.stop - order.first)

    tiles.run(stream_tile)


@common.lowered_once("call")
def forward_call(call: Call, x: Operands, ranges: common.Ranges):
  """Padded Operands or PackedOperands (x.offset: [N, Tp] fp32 natural units, or None; x.bias,
  x.mask: [Bx, Nx, Tp, Sp], the mask as int8) and their block ranges (common.block_ranges per
  block_q rows) -> (O [B, Tp, N, H] in the input dtype, LSE fp32 [B, N, Tp]). With call.fp8:
  x.q, x.k e4m3, x.v e4m3 V^T [B, K, H, Sp] (keys in common.relabelled_keys order with
  config.fp8_p_registers), x.qk_descale and x.v_descale [N] fp32; P goes through a
  per-warpgroup e4m3 tile in shared memory (or stays in registers: config.fp8_p_registers), and
  where the top key is finer (tile.has_top_residual: the "fp8" preset) its residual too. P V runs
  in groups of config.fp8_pv_promote keys (the key block by default), each into a fresh
  accumulator added to O in fp32, or (0) into O's accumulator along the row."""
  tiles, wgs, fp8 = call.config.fwd, call.config.fwd_wgs, call.fp8
  bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
  B, N, H, Tp = call.geo.B, call.geo.N, call.pad.H, call.pad.T
  dtype, out_dtype = common.input_dtype(x), call.dt.input
  mma = common.mma_transforms(dtype, bk)
  # Q K^T reduces over the head dim: 8-bit rows of H bytes take a swizzle that wide (64 at H64).
  qk_mma = common.mma_transforms(dtype, H) if fp8 else mma
  p_tiles = fp8 and not call.config.fp8_p_registers   # P through shared memory
  # V^T's (and P's tiles') keys sliced into promotion groups narrower than the block: tiles (and
  # swizzle) that wide
  group = call.config.fp8_pv_promote
  key_mma = common.mma_transforms(dtype, group) if fp8 and 0 < group < bk else mma

  # Persistent CTAs (TuningConfig.fwd_persistent): as many as the device has SMs, each with two
  # Q buffers (the next tile's rows load during this one) and O staged apart from them.
  grid, names, ctas = common.query_grid(call, x, "fwd", wgs, bq, call.config.fwd_persistent)
  q_bufs = 2 if ctas else 1
  apart = call.config.fwd_bias_apart and x.bias is not None
  bias_smem, mask_smem = common.pairwise_smem(x, stages, wgs * bq, bk)
  if apart:   # one tile per warpgroup (common.stream's rings of 1)
    bias_smem = plgpu.SMEM((wgs, bq, bk), x.bias.dtype,
                           transforms=common.tile_transforms(bk, x.bias.dtype))
  smem = (plgpu.SMEM((q_bufs, wgs, bq, H), dtype, transforms=qk_mma),
          plgpu.SMEM((stages, bk, H), dtype, transforms=qk_mma),
          plgpu.SMEM((stages, H, bk) if fp8 else (stages, bk, H), dtype, transforms=key_mma),
          plgpu.SMEM((q_bufs, wgs, bq), f32) if call.safe else None,
          plgpu.SMEM((wgs, bq), f32),
          plgpu.SMEM((q_bufs, wgs, bq), jnp.int32) if call.packed else None,
          plgpu.SMEM((stages, bk), jnp.int32) if call.packed else None,
          bias_smem, mask_smem,
          plgpu.SMEM((wgs, bq, H), out_dtype, transforms=common.mma_transforms(out_dtype, bk))
          if ctas or fp8 else None,
          # P's e4m3 tile, and the "fp8" preset's top keys' residual (tile.rescale's split_top)
          *(plgpu.SMEM((wgs, bq, bk), dtype, transforms=key_mma) if needed else None
            for needed in (p_tiles, p_tiles and tile.has_top_residual(call.dt))))
  with_k = 1 + call.packed + (x.bias is not None and not apart) + (x.mask is not None)
  bias_ring = plgpu.Barrier(num_barriers=wgs) if apart else None   # one per warpgroup
  loaded = (plgpu.Barrier(num_arrivals=1 + call.safe + call.packed, num_barriers=q_bufs * wgs),
            plgpu.Barrier(num_arrivals=with_k, num_barriers=stages),
            plgpu.Barrier(num_barriers=stages), bias_ring)
  free = (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 2 + (bias_ring,)
  schedule = plgpu.Barrier(num_arrivals=2) if wgs == 2 else None   # the ping-pong's
  return common.launch(
      functools.partial(_kernel, call=call, ctas=ctas), (smem, loaded, free, schedule),
      name="stable_attn_forward", compute_wgs=wgs, producer=call.config.has_producer("fwd"),
      out_type=(jax.ShapeDtypeStruct((B, Tp, N, H), out_dtype),
                jax.ShapeDtypeStruct((B, N, Tp), f32)),
      grid=grid, grid_names=names,
  )(x, ranges)
