"""Backward kernels: dK/dV and dQ in Pallas Mosaic GPU, and delta = rowsum(dO * O), computed by
the dQ kernel (TuningConfig.dq_delta: it then runs first and writes delta for the dK/dV kernel) or
by an XLA pass before both (head dim 256, a differentiated LSE). No atomics: the result is bitwise
deterministic -- unless TuningConfig.fused_dq (opt-in): then the dK/dV kernel
also reduce-adds dQ (FlashAttention-3's backward, below) and there is no dQ kernel.

dK/dV  one CTA per (batch, kv head, W * block_kv key rows; W = TuningConfig.dkv_wgs compute
       warpgroups: 2, or 3 at head dim 64). Each compute warpgroup keeps its K and
       V tiles and its dK, dV accumulators; the producer streams Q, dO, LSE and delta blocks of
       every query head of the kv head's group (GQA is summed here, in registers) over the query
       blocks that see the CTA's keys. The tile is computed transposed (S^T = K Q^T, FA3's
       SwapAB), so P^T and dS^T feed dV += P^T dO and dK += dS^T Q from registers.
       Persistent (TuningConfig.dkv_persistent, the table's at head dim 64 unless every query
       sees every key, and at 128 where such tiles are few, tuning._FEW): one CTA per SM takes
       the key tiles in zigzag rounds, key CTA 0 (the heaviest under a causal mask) first; each
       compute warpgroup loads its next tile's K and V into a second buffer during this one, and
       the producer's slots run on across tiles.
       Split (TuningConfig.dkv_split, the table's at head dim 256): one block_kv key tile per CTA,
       warpgroup 0 accumulating dV and warpgroup 1 dK over it; the first computes P^T and hands it
       (fp32) through shared memory on a ready / free barrier pair, the second computes dP^T, so
       each holds one fp32 accumulator and a step takes four tile products.
dQ     one CTA per (batch, query head, W * block_q query rows; W = TuningConfig.dq_wgs compute
       warpgroups, 3 at head dims 64 and 128 as in the forward, 2 with a bias's dS or a mask),
       like the forward: Q, dO, LSE and delta (or O, to compute it) resident, K and V streamed;
       dQ += dS K.
fused  the dK/dV kernel stores each step's dS^T in shared memory and adds dS K (fp32) into a zeroed
       dQ accumulator with a TMA reduce-add; at head dim 128 the two warpgroups share dS^T and each
       adds half of dQ's columns over the CTA's keys (FA3's split).
Bias and mask tiles stream with the blocks (transposed for dK/dV, one XLA transpose per call);
with a bias the dQ kernel also writes dS (the bias's gradient before any broadcast sum) through a
per-warpgroup staging tile, zeros for the blocks its rows never visit.
Both use stable_attn.tile's backward functions and the block ranges of stable_attn.blocks (causal,
window and other documents' blocks skipped, edge blocks masked; segment ids stream with the blocks
they belong to), with the pipelines of common.py (without a producer warpgroup,
TuningConfig.producer False, the last compute warpgroup issues the streamed copies).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from stable_attn import tile
from stable_attn.flash import shifted_delta
from stable_attn.spec import BackwardInputs, Operands, is_packed

from pallas_kernels.mosaic_gpu import common
from pallas_kernels.mosaic_gpu.common import COLS, ROWS, Call, f32


def _scores_then_p(qk_product, dp_product, shape, p_of_scores):
  """Issues the QK^T and dO V^T products into fresh fp32 accumulators of `shape`, computes P from
  the first while the second still runs, then waits for it -> (p_of_scores(qk), dP); dp_product
  None (a pass that needs no dP) -> (p_of_scores(qk), None)."""
  def body(acc_qk, acc_dp=None):
    qk_product(acc_qk)
    if acc_dp is not None:
      dp_product(acc_dp)
    p = p_of_scores(plgpu.wgmma_accumulator_load(acc_qk, wait_n=int(acc_dp is not None)))
    return p, None if acc_dp is None else plgpu.wgmma_accumulator_load(acc_dp, wait_n=0)
  accs = (plgpu.ACC(shape, f32),) * (1 if dp_product is None else 2)
  return pl.run_scoped(body, *accs)


def _product(issue, shape):
  """issue(acc) issues a product into a fresh fp32 accumulator of `shape` -> its value."""
  def body(acc):
    issue(acc)
    return plgpu.wgmma_accumulator_load(acc, wait_n=0)
  return pl.run_scoped(body, plgpu.ACC(shape, f32))


def _store(smem, value, gmem):
  smem[...] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, gmem)


# ---------------------------------------------------------------------------------------------
# dK, dV
# ---------------------------------------------------------------------------------------------

# What one pass of the dK/dV kernel accumulates (TuningConfig.dkv_passes: both, or one each).
_PASSES = {"dkv": ("dk", "dv"), "dk": ("dk",), "dv": ("dv",)}
_QKV_SLOT = {"dq": 0, "dk": 1, "dv": 2}   # where each gradient goes in a packed [B, T, 3, N, H]


def _dkv_kernel(refs: Operands, grads: BackwardInputs, ranges: common.Ranges, dq_acc, into,
                *rest, call: Call, part: str, ctas: int):
  """rest: the output refs of `part`'s gradients (_PASSES: dK and dV, or one of them), then the
  scratch; with packed operands `into` is the [B, Tp, 3, N, H] gradient (slot 0 holds dQ) whose
  slots 1 and 2 take dK and dV in place, and there are no output refs. refs.bias and refs.mask,
  when present, are transposed: [Bx, Nx, Sp, Tp]. dq_acc: None, or (config.fused_dq) the fp32
  [B, Tp, N, H] dQ accumulator (zeros on entry) that each step adds its dS K into with a TMA
  reduce-add: FlashAttention-3's backward, no dQ kernel. ctas: 0 for one CTA per key tile (grid
  (B, K, key CTAs)), else the number of persistent CTAs (`common.key_tiles`)."""
  *outs, scratch = rest
  names = _PASSES[part]
  if into is not None:
    outs = [into.at[:, :, _QKV_SLOT[name]] for name in names]
  (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kseg_smem, qseg_smem, bias_smem,
   mask_smem, ds_smem, dq_smem, p_smem), (kv_loaded, loaded, ds_ready, handoff), free = scratch
  spec, tiles, G, wgs = call.spec, call.config.dkv, call.geo.G, call.config.dkv_wgs
  split = _splits_dq(call)
  # TuningConfig.dkv_split: warpgroup 0 accumulates dV and hands each step's P^T to warpgroup 1,
  # which accumulates dK, over the CTA's one key tile (owners: the warpgroups with keys of their
  # own, each a key tile of bk rows).
  roles, owners = call.config.dkv_split, call.config.dkv_key_wgs
  p_ready, p_free = handoff or (None, None)
  bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
  wg = lax.axis_index("wg")
  key_tiles = common.key_tiles(call, refs, owners, bk, ctas)
  out_of = dict(zip(names, outs))

  def key_tile(i):
    """Tile i's (b, kv head, first key row, lengths, the query blocks of a warpgroup's keys as a
    function of its first key, their union, the tile's `common.KeyCta`)."""
    b, kvh, index = key_tiles.tile(i)
    cta = common.key_cta(call, refs, ranges, b, kvh, index, wgs=owners, bk=bk, bq=bq)
    return b, kvh, cta.start, cta.lens, cta.q_ranges, cta.union, cta

  def query_stream(b, kvh, cta_k, cta):
    """What streams through a key tile's CTA: (positions, block(t), loads) for common.stream,
    the query heads of the group one after another."""
    per_head, block = cta.group_stream(kvh, G)

    def load(at, slot):
      n, i = at
      q_start = i * bq
      rows = (b, pl.ds(q_start, bq), n)
      plgpu.copy_gmem_to_smem(refs.q.at[rows], q_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(grads.do.at[rows], do_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(grads.lse.at[b, n, pl.ds(q_start, bq)], lse_smem.at[slot],
                              loaded.at[slot])
      plgpu.copy_gmem_to_smem(grads.delta.at[b, n, pl.ds(q_start, bq)], delta_smem.at[slot],
                              loaded.at[slot])
      # The queries' segment ids and the CTA's transposed bias and mask tiles travel with Q.
      common.copy_beside(refs, b, n, pl.ds(cta_k, owners * bk), pl.ds(q_start, bq),
                         loaded.at[slot], (qseg_smem, bias_smem, mask_smem), slot,
                         seg_rows=pl.ds(q_start, bq), seg_ref=refs.q_seg)

    return G * per_head, block, [(free, load)]

  def accumulate(names, kw):
    """A compute warpgroup's work: the gradients `names` of its CTA's key tile kw (its own;
    under dkv_split the CTA's one, 0, shared)."""
    takes_p = roles and "dk" in names   # P^T comes from the dV warpgroup

    def load_kv(i, buf):
      """Tile i's K and V rows of key tile kw (and their segment ids) into K/V buffer buf."""
      b, kvh, index = key_tiles.tile(i)
      k_start = index * (owners * bk) + kw * bk
      rows = (b, pl.ds(k_start, bk), kvh)
      barrier = kv_loaded.at[buf * owners + kw]

      @common.if_keys(call, owners, bk, k_start)
      def _load():
        plgpu.copy_gmem_to_smem(refs.k.at[rows], k_smem.at[buf, kw], barrier)
        plgpu.copy_gmem_to_smem(refs.v.at[rows], v_smem.at[buf, kw], barrier)
        if call.packed:
          plgpu.copy_gmem_to_smem(refs.kv_seg.at[b, pl.ds(k_start, bk)], kseg_smem.at[buf, kw],
                                  barrier)

    def hand_p(p_t):
      """dkv_split, the dV warpgroup: this step's fp32 P^T to the dK warpgroup, once that has
      read the last one (it arrives once ahead, before its first step)."""
      plgpu.barrier_wait(p_free)
      p_smem[...] = p_t
      plgpu.barrier_arrive(p_ready)

    def take_p():
      """dkv_split, the dK warpgroup: this step's P^T from the dV warpgroup."""
      plgpu.barrier_wait(p_ready)
      p_t = common.load_tile(p_smem, plgpu.Layout.WGMMA)
      common.release(p_free)
      return p_t

    def run_tile(i, base):
      """Tile i, whose first streamed block is the CTA's base-th -> the next tile's base."""
      buf = key_tiles.buffer(i)
      if ctas:   # the next tile's K and V load into the other buffer once the previous tile's
        @pl.when(i + 1 < key_tiles.count)   # dK and dV stores have read it
        def _prefetch():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          load_kv(i + 1, 1 - buf)
      b, kvh, cta_k, lens, q_ranges, (lo, hi), cta = key_tile(i)
      order = cta.order
      per_head = order.stop - order.first

      def streams():   # without a producer (common.issuer)
        stop, block, loads = query_stream(b, kvh, cta_k, cta)
        return common.inline_stream(jnp.zeros((), jnp.int32), stop, stages, loads, block,
                                    call.config.refill_lag)
      refill = common.issuer(call, "dkv", wg, wgs, streams).before
      k_start = cta_k + kw * bk
      rows = (b, pl.ds(k_start, bk), kvh)
      # With 3 warpgroups the last CTA's last ones may own no keys: they load and store nothing
      # and step over every block.
      if_keys = common.if_keys(call, owners, bk, k_start)
      if_keys(lambda: plgpu.barrier_wait(kv_loaded.at[buf * owners + kw]))
      if split:   # each warpgroup's dQ columns take both warpgroups' keys
        plgpu.barrier_wait(kv_loaded.at[buf * wgs + 1 - wg])
      # Segment ids are read on the masked steps that need them, not held across the loop.
      kv_ids = lambda: common.load_tile(kseg_smem.at[buf, kw], ROWS) if call.packed else None
      mine = common.clamp_ranges(q_ranges(k_start), lo, hi)
      half = call.pad.H // 2

      @jax.named_scope("share_ds")
      def share_ds(ds_op, dbuf):
        """Splitting dQ's columns: this warpgroup's dS^T into its half of the shared buffer, then
        wait for the other's."""
        ds_smem.at[dbuf, wg][...] = ds_op
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_ready.at[dbuf])
        plgpu.barrier_wait(ds_ready.at[dbuf])

      @jax.named_scope("dq")
      def stage_dq(issue, cols: int):
        """issue(acc) issues a dS K product into a fresh [block_q, cols] fp32 accumulator; its
        result goes to this warpgroup's dq_smem tile (the read waits for every wgmma in flight,
        dK's and dV's too; the store waits for the last reduce to have read the tile)."""
        def product(acc):
          issue(acc)
          dq = acc[...]
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          dq_smem.at[wg][...] = dq
        pl.run_scoped(product, plgpu.ACC((bq, cols), f32))

      def dq_columns(dbuf):
        """dS K for this warpgroup's half of dQ's columns over both warpgroups' keys."""
        for w in range(2):
          def issue(acc, w=w):
            for j in range(2):
              plgpu.wgmma(acc, ds_smem.at[dbuf, j].transpose((1, 0)),
                          k_smem.at[buf, j, :, pl.ds(w * half, half)])
          pl.when(wg == w)(lambda issue=issue: stage_dq(issue, half))

      def reduce_dq(g, i):
        plgpu.commit_smem()
        cols = pl.ds(wg * half, half) if split else pl.ds(0, call.pad.H)
        plgpu.copy_smem_to_gmem(dq_smem.at[wg],
                                dq_acc.at[b, pl.ds(i * bq, bq), kvh * G + g, cols],
                                reduction_op="add")

      def head(g, carry):
        def step(p, i, carry, kind):
          t = g * per_head + p - order.first
          slot = common.slot_of(base + t, stages)
          dbuf = common.slot_of(t, 2)
          with jax.named_scope("wait"):   # (named regions: what common.profiling records)
            plgpu.barrier_wait(loaded.at[slot])
          if kind in ("skip", "empty"):
            if split:   # the other warpgroup may see this block: dQ's columns still take both
              share_ds(common.zeros((bk, bq), plgpu.Layout.WGMMA).astype(ds_smem.dtype), dbuf)
              dq_columns(dbuf)
            plgpu.barrier_arrive(free.at[slot])
            if split:
              reduce_dq(g, i)
            return carry
          q, do = q_smem.at[slot], do_smem.at[slot]
          bias_t, allowed_t = common.read_beside(bias_smem, mask_smem, slot,
                                                 pl.ds(kw * bk, bk), kind == "masked")
          ok = None
          if kind == "masked" and not takes_p:
            q_ids = common.load_tile(qseg_smem.at[slot], COLS) if call.packed else None
            ok = call.visible((bk, bq), i * bq, k_start, lens, q_axis=1, q_ids=q_ids,
                              kv_ids=kv_ids(), mask=allowed_t)

          def p_of_scores(qk_t):
            s_t = call.scores(qk_t, ok, bias_t)
            return tile.backward_p(s_t, common.load_tile(lse_smem.at[slot], COLS),
                                   in_dtype=call.dt.input, base2=True, q_axis=1)

          dp_product = lambda acc: plgpu.wgmma(acc, v_smem.at[buf, kw], do.transpose((1, 0)))
          with jax.named_scope("s_dp_p"):
            if takes_p:
              dp_t = _product(dp_product, (bk, bq))
              p_t, p_op = take_p(), None
            else:
              (p_t, p_op), dp_t = _scores_then_p(
                  lambda acc: plgpu.wgmma(acc, k_smem.at[buf, kw], q.transpose((1, 0))),
                  dp_product if "dk" in names else None,   # the dV pass needs no dP
                  (bk, bq), p_of_scores)
              if roles:
                hand_p(p_t)

          def update(accs):
            accs = dict(zip(names, accs))
            # Two kernels: dV's product runs while dS is computed. Fused: dS first (FA3's
            # order), so P's operand is not held beside the fp32 P and dP, which spilled
            # (measured in docs/hopper_kernel.md; the two kernels run faster with the overlap).
            ds_first = dq_acc is not None
            if "dv" in accs and not ds_first:
              plgpu.wgmma(accs["dv"], p_op, do)
            if "dk" not in accs:
              return
            dk_acc = accs["dk"]
            _, ds_op = tile.backward_ds(p_t, dp_t, common.load_tile(delta_smem.at[slot], COLS),
                                        in_dtype=call.dt.input, q_axis=1)
            if ds_first:
              plgpu.wgmma(accs["dv"], p_op, do)
            if dq_acc is None:
              plgpu.wgmma(dk_acc, ds_op, q)
              return
            if split:
              plgpu.wgmma(dk_acc, ds_op, q)
              share_ds(ds_op, dbuf)
              dq_columns(dbuf)
              return
            ds_smem.at[wg][...] = ds_op   # dS^T, the dQ product's operand (transposed)
            plgpu.commit_smem()
            plgpu.wgmma(dk_acc, ds_op, q)

            stage_dq(lambda acc: plgpu.wgmma(acc, ds_smem.at[wg].transpose((1, 0)),
                                             k_smem.at[buf, wg]),
                     call.pad.H)   # issued behind dK's: one wait for dV, dK and dQ

          with jax.named_scope("ds_dv_dk"):
            carry = pl.run_state(update)(tuple(plgpu.ACC.init(a) for a in carry))
            plgpu.barrier_arrive(free.at[slot])
          if dq_acc is not None:   # dQ[rows of block i, head g] += dS K
            with jax.named_scope("reduce_dq"):
              reduce_dq(g, i)
          return carry

        flags = common.block_flags(ranges.mask_blocks, b, kvh * G + g, k_start // bk)
        before = None if refill is None else (
            lambda p: refill(g * per_head + p - order.first))   # the stream's position
        return common.sections(order, mine, step, carry, flags, before)

      zeros = common.zeros((bk, call.pad.H), plgpu.Layout.WGMMA)
      grads_of = dict(zip(names, lax.fori_loop(0, G, head, (zeros,) * len(names))))

      @if_keys
      def _store_grads():
        # Staged in this tile's K and V buffers (the products that read them have landed); a
        # persistent CTA's next load into them waits for these stores to have read them. Under
        # dkv_split the dK warpgroup's last read of P^T follows its last product with V.
        if "dk" in grads_of:
          _store(k_smem.at[buf, kw], (grads_of["dk"] * spec.scale).astype(k_smem.dtype),
                 out_of["dk"].at[rows])
        if "dv" in grads_of:
          if roles:
            plgpu.barrier_wait(p_free)
          _store(v_smem.at[buf, kw], grads_of["dv"].astype(v_smem.dtype), out_of["dv"].at[rows])
      return base + G * per_head

    if takes_p:   # the P^T tile starts free; the dV warpgroup loads the shared K and V
      plgpu.barrier_arrive(p_free)
    else:
      load_kv(0, 0)
    key_tiles.run(run_tile)
    common.drain_stores()

  @pl.when(wg < wgs)
  def _compute():
    common.take_registers(call, "dkv", wgs, "compute")
    if roles:
      for w, name in enumerate(("dv", "dk")):
        pl.when(wg == w)(functools.partial(accumulate, (name,), 0))
    else:
      accumulate(names, wg)

  @pl.when(wg == wgs)
  def _produce():
    common.take_registers(call, "dkv", wgs, "producer")

    def stream_tile(i, base):
      b, kvh, cta_k, _, _, _, cta = key_tile(i)
      stop, block, loads = query_stream(b, kvh, cta_k, cta)
      common.stream(jnp.zeros((), jnp.int32), stop, stages, loads, block,
                    prefetch=ranges.order is not None, base=base)
      return base + stop

    key_tiles.run(stream_tile)


def _splits_dq(call: Call) -> bool:
  """FlashAttention-3's split of the fused dQ: each warpgroup computes half of dQ's columns over
  the CTA's 2 * block_kv keys (half the reduce-adds and half the dQ registers of a warpgroup
  computing all columns over its own keys; the halves are whole 128-byte swizzle tiles)."""
  return call.config.fused_dq and call.pad.H % 128 == 0


@common.lowered_once("call")
def _dkv_call(call: Call, x: Operands, grads: BackwardInputs, ranges: common.Ranges, into=None):
  """-> (dK, dV), or with config.fused_dq (dK, dV, dQ fp32 unscaled). into: None, or (packed
  operands, no fused dQ) the dQ kernel's [B, Tp, 3, N, H] output, slot 0 written: returns it with
  dK and dV written into slots 1 and 2 in place (no concatenation)."""
  tiles = call.config.dkv
  bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
  B, H, Sp, K = call.geo.B, call.pad.H, call.pad.S, call.geo.K
  dtype = common.input_dtype(x)
  mma = common.mma_transforms(dtype, bq)
  fused = call.config.fused_dq
  split = _splits_dq(call)
  wgs = call.config.dkv_wgs   # 2 with a bias or mask or the fused dQ (TuningConfig, the API)
  roles, owners = call.config.dkv_split, call.config.dkv_key_wgs
  # Persistent CTAs (TuningConfig.dkv_persistent): two K/V buffers, the next tile's loading.
  grid, grid_names, ctas = common.key_grid(call, x, owners, bk, call.config.dkv_persistent)
  kv_bufs = 2 if ctas else 1

  smem = (plgpu.SMEM((kv_bufs, owners, bk, H), dtype, transforms=mma),
          plgpu.SMEM((kv_bufs, owners, bk, H), dtype, transforms=mma),
          plgpu.SMEM((stages, bq, H), dtype, transforms=mma),
          plgpu.SMEM((stages, bq, H), dtype, transforms=mma),
          plgpu.SMEM((stages, bq), f32), plgpu.SMEM((stages, bq), f32),
          plgpu.SMEM((kv_bufs, wgs, bk), jnp.int32) if call.packed else None,
          plgpu.SMEM((stages, bq), jnp.int32) if call.packed else None,
          *common.pairwise_smem(x, stages, owners * bk, bq),
          plgpu.SMEM((2, 2, bk, bq) if split else (2, bk, bq), dtype, transforms=mma)
          if fused else None,
          plgpu.SMEM((2, bq, H // (1 + split)), f32,
                     transforms=common.tile_transforms(H // (1 + split), f32)) if fused else None,
          # dkv_split: the P^T the dV warpgroup hands the dK warpgroup
          plgpu.SMEM((bk, bq), f32, transforms=common.tile_transforms(bq, f32)) if roles else None)
  beside = call.packed + (x.bias is not None) + (x.mask is not None)
  barriers = (plgpu.Barrier(num_arrivals=2 + call.packed, num_barriers=kv_bufs * owners),
              plgpu.Barrier(num_arrivals=4 + beside, num_barriers=stages),
              plgpu.Barrier(num_arrivals=2, num_barriers=2) if split else None,
              (plgpu.Barrier(), plgpu.Barrier()) if roles else None)   # P^T ready, P^T free
  kv_grad = jax.ShapeDtypeStruct((B, Sp, K, H), dtype)

  def passes(dq_acc, into):
    """Launches the dK/dV pass(es) -> (dK, dV), or () where they write `into` (refs or None)."""
    grads_of = {}
    for part in ("dk", "dv") if call.config.dkv_passes == 2 else ("dkv",):
      names = _PASSES[part]
      out_type = () if into is not None else (kv_grad,) * len(names)
      grads_of.update(zip(names, common.launch(
          functools.partial(_dkv_kernel, call=call, part=part, ctas=ctas),
          (smem, barriers, plgpu.Barrier(num_arrivals=wgs, num_barriers=stages)),
          name=f"stable_attn_{part}", out_type=out_type, compute_wgs=wgs,
          producer=call.config.has_producer("dkv"),
          grid=grid, grid_names=grid_names,
          in_place=dq_acc is not None or into is not None,
      )(x, grads, ranges, dq_acc, into)))
    return tuple(grads_of[name] for name in ("dk", "dv") if name in grads_of)

  if not fused and into is None:
    return passes(None, None)
  # The fused dQ adds into a zeroed fp32 buffer; packed dK and dV go into the dQ kernel's output.
  dq_acc = jnp.zeros((B, call.pad.T, call.geo.N, H), f32) if fused else None
  (dq_acc, into), dkv = common.in_place(lambda refs: passes(*refs), (dq_acc, into),
                                        () if into is not None else (kv_grad, kv_grad))
  return into if into is not None else (*dkv, dq_acc)


# ---------------------------------------------------------------------------------------------
# dQ
# ---------------------------------------------------------------------------------------------

def load_rows(refs, grads, rows, tiles, copies, qseg_smem, barrier, wg):
  """A dQ warpgroup's resident rows (rows: (b, its row slice, n)) on `barrier`, then waits: Q
  and dO into `tiles`, each (GMEM view, SMEM ref) of `copies`, and the rows' segment ids into
  qseg_smem[wg] (None: no segment ids)."""
  b, queries, n = rows
  for src, dst in ((refs.q.at[rows], tiles[0]), (grads.do.at[rows], tiles[1]), *copies):
    plgpu.copy_gmem_to_smem(src, dst, barrier)
  if qseg_smem is not None:
    plgpu.copy_gmem_to_smem(refs.q_seg.at[b, queries], qseg_smem.at[wg], barrier)
  plgpu.barrier_wait(barrier)


def _dq_kernel(refs: Operands, grads: BackwardInputs, ranges: common.Ranges, o_ref, dq_ref, *rest,
               call: Call, wgs: int, has_ds: bool):
  """rest: dS [B, N, Tp, Sp] when has_ds (a bias's gradient: every block's dS, zeros where
  unvisited), delta [B, N, Tp] fp32 when o_ref is not None (grads.delta is None: this kernel
  computes it from O and dO), then the scratch."""
  *outs, scratch = rest
  ds_ref = outs.pop(0) if has_ds else None
  delta_ref = outs.pop(0) if o_ref is not None else None
  (q_smem, do_smem, lse_smem, delta_smem, o_smem, k_smem, v_smem, qseg_smem, kseg_smem, bias_smem,
   mask_smem, ds_smem), (q_loaded, loaded), free = scratch
  spec, tiles = call.spec, call.config.dq
  bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
  b, n, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  lens = call.lengths(refs, b)
  cta = common.query_cta(call, ranges, b, n, lens, wgs=wgs, bq=bq, bk=bk)
  cta_q, order = cta.start, cta.order

  def loads():
    """The K and V blocks' copies (`common.stream`'s loads)."""
    kv_head = lax.div(n, jnp.asarray(call.geo.G, n.dtype))

    def load(j, slot):
      keys = pl.ds(j * bk, bk)
      plgpu.copy_gmem_to_smem(refs.k.at[b, keys, kv_head], k_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(refs.v.at[b, keys, kv_head], v_smem.at[slot], loaded.at[slot])
      common.copy_beside(refs, b, n, pl.ds(cta_q, wgs * bq), keys, loaded.at[slot],
                         (kseg_smem, bias_smem, mask_smem), slot, seg_rows=keys)
    return [(free, load)]

  @pl.when(wg < wgs)
  def _compute():
    before, q_start, if_rows = common.query_compute_start(call, "dq", cta, wg, wgs, bq, stages,
                                                          loads)
    rows = (b, pl.ds(q_start, bq), n)
    q, do = q_smem.at[wg], do_smem.at[wg]

    vector = lambda a: a.at[b, n, pl.ds(q_start, bq)]
    if_rows(lambda: load_rows(refs, grads, rows, (q, do), [
        (vector(grads.lse), lse_smem.at[wg]),
        (vector(grads.delta), delta_smem.at[wg]) if o_ref is None else
        (o_ref.at[rows], o_smem.at[wg])], qseg_smem, q_loaded.at[wg], wg))
    lse = common.load_tile(lse_smem.at[wg], ROWS)
    if o_ref is None:
      delta = common.load_tile(delta_smem.at[wg], ROWS)
    else:   # delta = rowsum(dO * O) (tile.delta) in registers; written for the dK/dV kernel
      delta = tile.delta(common.load_tile(do, plgpu.Layout.WGMMA),
                         common.load_tile(o_smem.at[wg], plgpu.Layout.WGMMA))
      if_rows(lambda: _store(delta_smem.at[wg], delta,
                             delta_ref.at[b, n, pl.ds(q_start, bq)]))
    q_ids = lambda: common.load_tile(qseg_smem.at[wg], ROWS) if call.packed else None   # as dK/dV

    def step(p, j, dq, kind):
      slot = common.slot_of(p - order.first, stages)
      if not common.block_ready(loaded, free, slot, kind):
        return dq
      k = k_smem.at[slot]
      bias, allowed = common.read_beside(bias_smem, mask_smem, slot, pl.ds(wg * bq, bq),
                                         kind == "masked")
      ok = None
      if kind == "masked":
        kv_ids = common.load_tile(kseg_smem.at[slot], COLS) if call.packed else None
        ok = call.visible((bq, bk), q_start, j * bk, lens, q_ids=q_ids(), kv_ids=kv_ids,
                          mask=allowed)

      def p_of_scores(qk):
        s = call.scores(qk, ok, bias)
        return tile.backward_p(s, lse, in_dtype=call.dt.input, base2=True)[0]

      with jax.named_scope("s_dp_p"):
        p, dp = _scores_then_p(
            lambda acc: plgpu.wgmma(acc, q, k.transpose((1, 0))),
            lambda acc: plgpu.wgmma(acc, do, v_smem.at[slot].transpose((1, 0))),
            (bq, bk), p_of_scores)
      with jax.named_scope("ds"):
        ds, ds_op = tile.backward_ds(p, dp, delta, in_dtype=call.dt.input)
      if ds_ref is not None:
        store_ds(ds, j)

      def update(acc):
        plgpu.wgmma(acc, ds_op, k)

      with jax.named_scope("dq"):
        dq = pl.run_state(update)(plgpu.ACC.init(dq))
        plgpu.barrier_arrive(free.at[slot])
      return dq

    def store_ds(ds, j):
      """dS of block j -> dS[b, n, rows, keys] through this warpgroup's staging tile."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous block's store has read it
      _store(ds_smem.at[wg], ds.astype(ds_smem.dtype),
             ds_ref.at[b, n, pl.ds(q_start, bq), pl.ds(j * bk, bk)])

    mine = cta.mine(q_start)
    init = common.zeros((bq, call.pad.H), plgpu.Layout.WGMMA)
    flags = common.block_flags(ranges.mask_blocks, b, n, q_start // bq)
    dq = common.sections(order, mine, step, init, flags, before)
    if_rows(lambda: _store(q, (dq * spec.scale).astype(q_smem.dtype), dq_ref.at[rows]))
    if ds_ref is not None:   # the blocks this warpgroup's rows never computed: dS = 0
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      ds_smem.at[wg][...] = common.zeros((bq, bk), plgpu.Layout.WGMMA).astype(ds_smem.dtype)
      plgpu.commit_smem()

      def zero(j):
        plgpu.copy_smem_to_gmem(ds_smem.at[wg], ds_ref.at[b, n, pl.ds(q_start, bq),
                                                          pl.ds(j * bk, bk)])
      pl.loop(0, mine[0])(zero)
      pl.loop(mine[3], call.pad.S // bk)(zero)
      if flags is not None:   # inside the range: the blocks whose mask tile is all False
        pl.loop(mine[0], mine[3])(lambda j: pl.when(flags(j) == 0)(lambda: zero(j)))
    common.drain_stores()

  pl.when(wg == wgs)(lambda: common.query_produce(call, "dq", cta, wgs, stages, loads, ranges))


@common.lowered_once("call", "ds_dtype")
def _dq_call(call: Call, x: Operands, grads: BackwardInputs, o, ranges: common.Ranges, ds_dtype):
  """-> dQ, then dS when ds_dtype is not None, then delta [B, N, Tp] fp32 when o is not None (it
  is computed here: grads.delta is None)."""
  tiles = call.config.dq
  bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
  B, N, H = call.geo.B, call.geo.N, call.pad.H
  dtype = common.input_dtype(x)
  mma = common.mma_transforms(dtype, bk)
  wgs = call.config.dq_wgs   # 2 with a bias or mask (the API checks)

  smem = (plgpu.SMEM((wgs, bq, H), dtype, transforms=mma),
          plgpu.SMEM((wgs, bq, H), dtype, transforms=mma),
          plgpu.SMEM((wgs, bq), f32), plgpu.SMEM((wgs, bq), f32),
          None if o is None else plgpu.SMEM((wgs, bq, H), dtype, transforms=mma),
          plgpu.SMEM((stages, bk, H), dtype, transforms=mma),
          plgpu.SMEM((stages, bk, H), dtype, transforms=mma),
          plgpu.SMEM((wgs, bq), jnp.int32) if call.packed else None,
          plgpu.SMEM((stages, bk), jnp.int32) if call.packed else None,
          *common.pairwise_smem(x, stages, 2 * bq, bk),
          None if ds_dtype is None else plgpu.SMEM(
              (2, bq, bk), ds_dtype, transforms=common.tile_transforms(bk, ds_dtype)))
  beside = call.packed + (x.bias is not None) + (x.mask is not None)
  barriers = (plgpu.Barrier(num_arrivals=4 + call.packed, num_barriers=wgs),
              plgpu.Barrier(num_arrivals=2 + beside, num_barriers=stages))
  # With packed operands dQ goes to slot 0 of a packed gradient, which the dK/dV kernel fills.
  packed = is_packed(x)
  dq_shape = (B, call.pad.T) + ((3,) if packed else ()) + (N, H)
  out_type = [jax.ShapeDtypeStruct(dq_shape, dtype)]
  if ds_dtype is not None:
    out_type.append(jax.ShapeDtypeStruct((B, N, call.pad.T, call.pad.S), ds_dtype))
  if o is not None:
    out_type.append(jax.ShapeDtypeStruct((B, N, call.pad.T), f32))
  grid, grid_names, _ = common.query_grid(call, x, "dq", wgs, bq, False)
  outs = common.launch(
      functools.partial(_dq_kernel, call=call, wgs=wgs, has_ds=ds_dtype is not None),
      (smem, barriers, plgpu.Barrier(num_arrivals=wgs, num_barriers=stages)),
      name="stable_attn_dq", out_type=tuple(out_type), compute_wgs=wgs,
      producer=call.config.has_producer("dq"),
      grid=grid, grid_names=grid_names,
      out_views=(lambda outs: (outs[0].at[:, :, _QKV_SLOT["dq"]],) + outs[1:]) if packed else None,
  )(x, grads, ranges, o)
  return tuple(outs)


def backward_call(call: Call, x: Operands, o, lse, do, dlse=None, ds_dtype=None):
  """Padded operands (x.bias, x.mask: [Bx, Nx, Tp, Sp], the mask as int8) and O, dO [B, Tp, N, H],
  lse and dlse [B, N, Tp] natural units -> (dq, dk, dv, dS [B, N, Tp, Sp] in ds_dtype, or None
  when ds_dtype is None). For PackedOperands -> (dqkv [B, Tp, 3, N, H], dS or None): the dQ kernel
  runs first and the dK/dV kernel writes into its output."""
  config = call.config
  packed = is_packed(x)
  dtype = common.input_dtype(x)
  # The dK/dV kernel computes S^T: it reads the bias and mask transposed (one XLA transpose).
  transposed = x._replace(**{name: None if a is None else jnp.swapaxes(a, 2, 3)
                             for name, a in (("bias", x.bias), ("mask", x.mask))})
  dkv_ranges = common.block_ranges(x, config.dkv.block_q, config.dkv.block_kv, "key", call.geo.G)
  xla_delta = lambda: shifted_delta(jnp.swapaxes(tile.delta(do, o), 1, 2), dlse)   # [B, N, Tp]
  if config.fused_dq and ds_dtype is None:
    grads = BackwardInputs(do, lse, xla_delta())
    dk, dv, dq = _dkv_call(call, transposed, grads, dkv_ranges)
    dq = (dq * call.spec.scale).astype(dtype)
    if packed:   # the fused backward's dQ is an fp32 accumulator: one copy into the packed layout
      return jnp.stack([dq, dk, dv], axis=2), None
    return dq, dk, dv, None
  if config.fused_dq:   # a bias's gradient needs dS: the dQ kernel writes it
    call = dataclasses.replace(call, config=config.replace(fused_dq=False))
  dq_ranges = common.block_ranges(x, config.dq.block_q, config.dq.block_kv, "query")
  if config.dq_delta and dlse is None:   # the dQ kernel computes delta for the dK/dV kernel
    dq, *ds, delta = _dq_call(call, x, BackwardInputs(do, lse, None), o, dq_ranges, ds_dtype)
    grads = BackwardInputs(do, lse, delta)
  else:
    grads = BackwardInputs(do, lse, xla_delta())
    dq, *ds = _dq_call(call, x, grads, None, dq_ranges, ds_dtype)
  ds = ds[0] if ds else None
  if packed:   # dK and dV into slots 1 and 2 of the dQ kernel's packed output
    return _dkv_call(call, transposed, grads, dkv_ranges, dq), ds
  dk, dv = _dkv_call(call, transposed, grads, dkv_ranges)
  return dq, dk, dv, ds
