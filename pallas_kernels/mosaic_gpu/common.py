"""What the Hopper kernels share: the call's static description, padding, pipeline bookkeeping.

Pipelines. Each CTA has two compute warpgroups and one producer warpgroup. The producer streams
blocks through `stages` shared-memory slots with TMA: a "loaded" barrier per slot (the copy
engine arrives) and a "free" barrier per slot (both compute warpgroups arrive when they are done
with it). The two compute warpgroups own different rows, so under causal or window masking they
need different block ranges; the producer streams the union, and a warpgroup steps over a block
outside its own range by waiting for it and releasing it (a "skip" step). Every warpgroup thus
waits on every barrier phase once, in order, which is what Mosaic GPU's per-thread phase
tracking requires. Under a mask the union is compacted (`Schedule`): the CTA streams only the
blocks whose mask tile holds a True for one of its warpgroups, and both warpgroups walk the same
positions.

Without a producer (TuningConfig.producer False, the table's where ptxas ignores setmaxnreg) the
last compute warpgroup issues the same copies between its own steps (`inline_stream`, `issuer`),
and every thread keeps its share of the register file at entry.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax._src.lib.mlir.dialects import vector

from stable_attn import blocks, fp8, tile
from stable_attn import numerics as numerics_lib
from stable_attn.layout import Geometry, Padded
from stable_attn.numerics import Dtypes
from stable_attn.spec import OPERANDS, AttentionSpec, Lengths, is_packed

from pallas_kernels.mosaic_gpu import tuning

f32 = jnp.float32
i32 = jnp.int32

# Registers per thread (compute, producer) by compute warpgroups per CTA: 64K per SM in all.
REGISTERS = {2: (232, 40), 3: (160, 32)}
ROWS = plgpu.Layout.WGMMA.reduce(1)   # a per-row vector of a [rows, cols] WGMMA tile
COLS = plgpu.Layout.WGMMA.reduce(0)   # a per-column vector
# Shared-memory tiles that wgmma and TMA read: 8-row tiles 128 bytes wide, 128-byte swizzle.
SWIZZLE = 128


def mma_transforms(dtype, k_rows: int):
  """Tiling and swizzle of a kernel's wgmma operands in shared memory. One swizzle for all of
  them (A and B of a product share it), and a product whose reduction runs over k_rows streamed
  rows needs k_rows * itemsize >= the swizzle: 128 bytes, 64 for 32-row blocks (head dim 256)."""
  swizzle = min(SWIZZLE, k_rows * jnp.dtype(dtype).itemsize)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def tile_transforms(cols: int, dtype):
  """Tiling and swizzle of a [rows, cols] SMEM tile read into (or written from) the WGMMA layout:
  the widest swizzle the row holds (bias, mask and dS tiles: cols * itemsize may be 64 bytes)."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(SWIZZLE, cols * itemsize)
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


# JAX 0.11 takes `plgpu.load(ref, layout=...)` and deprecates the index argument that 0.10 needs;
# 0.12 removes it.
_LOAD_PARAMS = inspect.signature(plgpu.load).parameters
_LOAD_NEEDS_INDEX = ("idx" in _LOAD_PARAMS
                     and _LOAD_PARAMS["idx"].default is inspect.Parameter.empty)


def load_tile(ref, layout):
  """A whole SMEM ref (a vector, a tile) as an array in `layout`."""
  if _LOAD_NEEDS_INDEX:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def zeros(shape, layout):
  return plgpu.layout_cast(jnp.zeros(shape, f32), layout)


def init_stats(rows: int, dt: Dtypes) -> tile.RowStats:
  return tile.RowStats(*(plgpu.layout_cast(x, ROWS) for x in tile.init_stats(rows, dt)))


# An 8-bit P kept in registers for the P V wgmma (TuningConfig.fp8_p_registers). The f32
# accumulator's layout (WGMMA) and the 8-bit operand's (WGMMA_8BIT) hold the same 4 values of each
# row and 16-column group per thread -- lane t columns 2t, 2t+1, 8+2t, 9+2t in the accumulator,
# 4t .. 4t+3 in the operand -- as two vector<2> registers against one vector<4>. Relabelled as
# the operand (`as_8bit_operand`, no data moves), operand column n of each 16 holds key
# RELABELLED_KEYS[n], so V^T's keys are stored in that order (`relabelled_keys`).
RELABELLED_KEYS = tuple(k for t in range(4) for k in (2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t))


def relabelled_keys(a, axis: int = -1):
  """a with each group of 16 along `axis` (its length a multiple of 16) in RELABELLED_KEYS
  order: a reshape and a transpose (key 8h + 2t + l goes to 4t + 2h + l)."""
  axis = axis % a.ndim
  shape = a.shape[:axis] + (a.shape[axis] // 16, 2, 4, 2) + a.shape[axis + 1:]
  order = list(range(len(shape)))
  order[axis + 1], order[axis + 2] = axis + 2, axis + 1
  return jnp.transpose(a.reshape(shape), order).reshape(a.shape)


def as_8bit_operand(p):
  """An 8-bit [64, cols] array in the WGMMA layout (cols a multiple of 16) -> the same registers
  as a WGMMA_8BIT array, the wgmma A operand from registers; its columns in each 16 are then in
  RELABELLED_KEYS order."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=plgpu.ShapeDtypeStruct(
      p.shape, p.dtype, layout=plgpu.Layout.WGMMA_8BIT))
  def relabel(ctx, x):
    del ctx
    regs = x.registers   # [1, cols / 8, 1, 1, 2 row halves, 1, 1, 1, 1] of vector<2>
    out = np.empty(fa.WGMMA_LAYOUT_8BIT.registers_shape(p.shape), dtype=object)
    for group in range(out.shape[1]):   # each 16 columns: one vector<4>
      for half in range(out.shape[4]):
        pair = (regs[0, 2 * group + i, 0, 0, half, 0, 0, 0, 0] for i in (0, 1))
        out[0, group, 0, 0, half, 0, 0, 0, 0] = vector.shuffle(*pair, [0, 1, 2, 3])
    return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=None)
  return relabel(p)


def fp8_forward(spec: AttentionSpec, dtype) -> bool:
  """Whether the call's forward runs in FP8: numerics "fast" but for e4m3 q, k and v (qkv="e4m3")
  and P cast to e4m3 (p="e4m3", any p_scale) -- FlashAttention-3's FP8 arithmetic -- with or
  without the "fp8" preset's top key on a finer grid (p_top), row sum of the rounded P_bar
  (sum_of_rounded_p, sum_keeps_max) and "safe"'s dither on O (dither="out", "fp8_fast"). The
  backward then runs the bf16/fp16 kernels on the
  dequantized q, k and v (exact in the input dtype), or with TuningConfig.fp8_backward the FP8
  kernels of fp8_backward.py."""
  dt = spec.numerics.dtypes(dtype)
  fast = numerics_lib.FAST.dtypes(dtype)
  free = dict(p=dt.p, p_scale=dt.p_scale, p_top=dt.p_top, sum_of_rounded_p=dt.sum_of_rounded_p,
              sum_keeps_max=dt.sum_keeps_max, dither_out=dt.dither_out)
  return (spec.numerics.qkv == "e4m3" and jnp.dtype(dt.p) == jnp.dtype(fp8.E4M3)
          and dt == fast._replace(**free))


@dataclasses.dataclass(frozen=True)
class Call:
  """Everything static about one call."""
  spec: AttentionSpec
  geo: Geometry
  pad: Padded
  dt: Dtypes
  config: tuning.TuningConfig
  packed: bool = False   # segment ids: their block ranges bound the loops, edge blocks compare ids

  @property
  def safe(self) -> bool:
    return self.spec.max_adjust == "safe"

  @property
  def fp8(self) -> bool:
    """The forward runs in FP8 (`fp8_forward`): e4m3 Q, K and V^T, P cast to e4m3 for the PV
    product; the bf16 backward kernels take the dequantized q, k and v (the FP8 ones,
    TuningConfig.fp8_backward, their e4m3 payloads)."""
    return fp8_forward(self.spec, self.dt.input)

  def lengths(self, refs, b) -> Lengths:
    """The batch row's query and key lengths and q_shift: static T, S and 0 unless the call has
    them (a CTA then starts its TMA loads without waiting for scalar loads from global memory)."""
    lens = Lengths.of(refs, b)
    if self.spec.has_lengths:
      return lens
    return Lengths(self.geo.T, self.geo.S, lens.shift)

  def scores(self, qk, ok, bias=None, descale=None) -> tile.Scores:
    """A tile's masked, soft-capped scores in log2 units (either orientation; bias, the bias
    tile in the same orientation, or None; descale: the FP8 forward's q and k descale, or None)."""
    return tile.scores(qk, ok, scale=self.spec.scale, bias=bias, dt=self.dt, base2=True,
                       soft_cap=self.spec.logits_soft_cap, descale=descale)

  def iota_positions(self, shape, q_start, k_start, *, q_axis: int):
    """int32 query and key positions of a tile, in the WGMMA layout: a per-row and a per-column
    vector broadcast, so a thread holds 2 row and 32 column positions. (A 2-D iota of the tile
    let LLVM compute the rows per element and hoist them out of the key loop: ptxas spilled 180
    bytes in the H64 causal forward with "safe" and 300 in the H128 dK/dV kernel, against 0 and
    132 this way; same positions, outputs bitwise equal.)"""
    def along(axis, start):
      vector = plgpu.broadcasted_iota(i32, (shape[axis],), 0, layout=ROWS if axis == 0 else COLS)
      return lax.broadcast_in_dim(vector + start, shape, (axis,))
    return along(q_axis, q_start), along(1 - q_axis, k_start)

  def visible(self, shape, q_start, k_start, lens: Lengths, *, q_axis: int = 0, q_ids=None,
              kv_ids=None, mask=None):
    """The tile's visibility (WGMMA layout); q_ids / kv_ids: the rows' and columns' segment ids
    as per-row / per-column vectors (ROWS / COLS of the tile), or None; mask: the mask operand's
    tile (bool, same shape and orientation), or None."""
    # tile.visible's shift, folded into the rows' start (a scalar add, not one per element).
    q, k = self.iota_positions(shape, q_start + lens.shift, k_start, q_axis=q_axis)
    q_seg = kv_seg = None
    if q_ids is not None:
      q_seg = lax.broadcast_in_dim(q_ids, shape, (q_axis,))
      kv_seg = lax.broadcast_in_dim(kv_ids, shape, (1 - q_axis,))
    return tile.visible(q, k, lens.q + lens.shift, lens.kv, causal=self.spec.is_causal,
                        window=self.spec.window,
                        mask=mask, q_seg=q_seg, kv_seg=kv_seg)

  def kv_ranges(self, q_start, bq: int, bk: int, lens: Lengths, segments=None, mask=None):
    """(lo, flo, fhi, hi) of the key blocks query rows [q_start, +bq) visit (blocks.kv_sections);
    segments / mask: the block's packed-sequence / mask-operand range (`block_range`)."""
    ranges = blocks.kv_sections(q_start, bq, bk, self.pad.S // bk, causal=self.spec.is_causal,
                                window=self.spec.window, q_len=lens.q, kv_len=lens.kv,
                                has_mask=False, segments=segments, shift=lens.shift)
    return blocks.intersect(ranges, mask)

  def q_ranges(self, k_start, bk: int, bq: int, lens: Lengths, segments=None, mask=None):
    """(lo, flo, fhi, hi) of the query blocks that see key columns [k_start, +bk)."""
    ranges = blocks.q_sections(k_start, bk, bq, self.pad.T // bq, causal=self.spec.is_causal,
                               window=self.spec.window, q_len=lens.q, kv_len=lens.kv,
                               has_mask=False, segments=segments, shift=lens.shift)
    return blocks.intersect(ranges, mask)


class Ranges(NamedTuple):
  """A kernel's block ranges computed once per call (XLA), [..., blocks, 4] int32 (lo, flo, fhi,
  hi) in global memory, or None: `segments` [B, n, 4] from the segment ids, `mask` [Bm, Nm, n, 4]
  from the mask operand (Bm, Nm full or 1), `mask_blocks` [Bm, Nm, n, m] int32, 0 for the
  blocks whose mask tile is all False (blocks.mask_blocks), and `rank`, `order`: the blocks each
  CTA streams under the mask, compacted (blocks.mask_order over the CTA's two blocks)."""
  segments: Optional[jax.Array] = None
  mask: Optional[jax.Array] = None
  mask_blocks: Optional[jax.Array] = None
  rank: Optional[jax.Array] = None
  order: Optional[jax.Array] = None


def block_ranges(x, block_q: int, block_kv: int, per: str, groups: int = 1) -> Ranges:
  """The call's packed-sequence and mask block ranges for one kernel's block sizes (per="query":
  for each query block, per="key": for each key block; groups: query heads merged per mask row,
  the dK/dV kernel's G when the mask has a head dim)."""
  segments = mask = flags = rank = order = None
  if x.q_seg is not None:
    segments = blocks.segment_sections(x.q_seg, x.kv_seg, block_q, block_kv, per=per)
  if x.mask is not None:
    groups = groups if x.mask.shape[1] > 1 else 1
    mask = blocks.mask_sections(x.mask, block_q, block_kv, per=per, groups=groups)
    flags = blocks.mask_blocks(x.mask, block_q, block_kv, per=per)
    rank, order = blocks.mask_order(x.mask, block_q, block_kv, per=per, pair=2, groups=groups)
  return Ranges(segments, mask, flags, rank, order)


class Schedule(NamedTuple):
  """The blocks one CTA streams, in order: positions first .. stop-1, position p holding block
  block(p); rank(j) is block j's position (the first one after it if it is not streamed)."""
  first: jax.Array
  stop: jax.Array
  rank: Callable
  block: Callable


def schedule(ranges: Ranges, b, n, lo, hi, cta_start, cta_rows: int) -> Schedule:
  """The CTA's union [lo, hi) of both warpgroups' blocks, in order; under a mask only the blocks
  whose tile of the CTA's rows holds any True (Ranges.order, read at batch row b, head n and the
  CTA's block of `cta_rows` owned rows starting at `cta_start`)."""
  if ranges.order is None:
    return Schedule(lo, hi, lambda j: j, lambda p: p)
  index = (*pairwise_index(ranges.order, b, n), cta_start // cta_rows)
  last = ranges.order.shape[-1] - 1
  rank = lambda j: ranges.rank[(*index, j)]
  return Schedule(rank(lo), rank(hi), rank,
                  lambda p: ranges.order[(*index, jnp.minimum(p, last))])


def block_flags(flags_ref, b, n, block):
  """j -> the mask's flag of block (block, j) (`Ranges.mask_blocks`; j clamped into the table),
  or None without a mask."""
  if flags_ref is None:
    return None
  last = flags_ref.shape[-1] - 1
  return lambda j: flags_ref[(*pairwise_index(flags_ref, b, n), block, jnp.minimum(j, last))]


def block_range(ranges_ref, b, n, block):
  """Block `block`'s (lo, flo, fhi, hi) from a `Ranges` field ([B, n, 4], or [Bm, Nm, n, 4] read
  at batch row b and head n, either broadcast), or None when the field is None."""
  if ranges_ref is None:
    return None
  index = (b,) if ranges_ref.ndim == 3 else (pairwise_index(ranges_ref, b, n))
  return tuple(ranges_ref[(*index, block, c)] for c in range(4))


def has_idle_rows(call: Call, wgs: int, bq: int) -> bool:
  """Whether a CTA of wgs * bq query rows can start before row 0 (`cta_rows`): T is padded to
  2 * bq rows, so with 3 warpgroups the last CTA's first warpgroups may be idle."""
  return call.pad.T % (wgs * bq) != 0


def kv_ranges_of(call: Call, ranges: Ranges, b, n, q_start, bq: int, bk: int, lens: Lengths, *,
                 wgs: int = 2):
  """(lo, flo, fhi, hi) of the key blocks that one warpgroup's query rows [q_start, +bq) visit:
  the causal, window and length ranges with the packed-sequence and mask ranges (`ranges`, at
  batch row b and head n) intersected in. With 3 warpgroups per CTA, T is padded to 2 * bq rows
  only and the CTAs are aligned to its end (`cta_rows`): a warpgroup whose rows start before 0 is
  idle, an empty range."""
  idle_rows = has_idle_rows(call, wgs, bq)
  block = jnp.maximum(q_start // bq, 0) if idle_rows else q_start // bq
  sections = call.kv_ranges(q_start, bq, bk, lens,
                            block_range(ranges.segments, b, n, block),
                            block_range(ranges.mask, b, n, block))
  if idle_rows:
    sections = tuple(jnp.where(q_start >= 0, x, 0) for x in sections)
  return sections


def has_idle_keys(call: Call, wgs: int, bk: int) -> bool:
  """Whether a dK/dV CTA of wgs * bk key rows can reach past the padded S (S is padded to
  2 * bk rows; with 3 warpgroups the last CTA's last warpgroups may be idle)."""
  return call.pad.S % (wgs * bk) != 0


def q_ranges_of(call: Call, ranges: Ranges, b, n, k_start, bk: int, bq: int, lens: Lengths, *,
                wgs: int = 2):
  """(lo, flo, fhi, hi) of the query blocks that see one warpgroup's key rows [k_start, +bk),
  the packed-sequence and mask ranges intersected in (`ranges` per key block, at batch row b and
  kv head n); empty for an idle warpgroup (keys from the padded S on: `has_idle_keys`). The dK/dV
  kernel's CTAs start at 0, so its partial CTA holds the last keys: the lightest under a causal
  mask."""
  idle_keys = has_idle_keys(call, wgs, bk)
  last = call.pad.S // bk - 1
  block = jnp.minimum(k_start // bk, last) if idle_keys else k_start // bk
  sections = call.q_ranges(k_start, bk, bq, lens,
                           block_range(ranges.segments, b, n, block),
                           block_range(ranges.mask, b, n, block))
  if idle_keys:
    sections = tuple(jnp.where(k_start < call.pad.S, x, 0) for x in sections)
  return sections


def cta_rows(call: Call, wgs: int, bq: int, index):
  """(number of CTAs, the first row of CTA `index`) of a kernel whose CTAs own wgs * bq query
  rows, the heaviest causal rows first: the CTAs are aligned to the padded T's end, so when
  wgs * bq does not divide it (3 warpgroups), the last CTA's first warpgroups are idle (rows
  before 0) -- the lightest rows under a causal mask, not the heaviest."""
  rows = wgs * bq
  num = blocks.cdiv(call.pad.T, rows)
  return num, call.pad.T - (index + 1) * rows


class QueryCta(NamedTuple):
  """A CTA of `wgs` compute warpgroups owning block_q query rows each (the forward, dQ)."""
  start: jax.Array    # its first query row (below 0 where warpgroups idle: `cta_rows`)
  order: Schedule     # the key blocks its producer streams
  mine: Callable      # q_start -> a warpgroup's (lo, flo, fhi, hi), clamped into `order`'s union
  if_rows: Callable   # q_start -> a decorator running its function unless the warpgroup idles


def query_cta(call: Call, ranges: Ranges, b, n, lens: Lengths, *, wgs: int, bq: int,
              bk: int, index=None) -> QueryCta:
  """The rows, key-block ranges and streaming order of the query CTA `index` (default: its grid
  index "q_seq")."""
  index = lax.axis_index("q_seq") if index is None else index
  _, start = cta_rows(call, wgs, bq, index)   # heaviest causal rows first
  kv_ranges = lambda q_start: kv_ranges_of(call, ranges, b, n, q_start, bq, bk, lens, wgs=wgs)
  lo, hi = union_range(*(kv_ranges(start + i * bq) for i in range(wgs)))
  return QueryCta(
      start, schedule(ranges, b, n, lo, hi, start, wgs * bq),
      lambda q_start: clamp_ranges(kv_ranges(q_start), lo, hi),
      lambda q_start: if_rows(call, wgs, bq, q_start))


class KeyCta(NamedTuple):
  """A dK/dV CTA's key tile (`key_cta`): its first key row, the batch row's lengths, the
  query-block ranges of a warpgroup's keys as a function of their first key row, their union
  (lo, hi) and the CTA's streaming order."""
  start: object
  lens: Lengths
  q_ranges: Callable
  union: tuple
  order: "Schedule"

  def group_stream(self, kvh, groups: int):
    """(positions per query head, block(t)): the CTA streams the `groups` query heads of kv
    head kvh one after another, position t -> (query head, query block)."""
    order = self.order
    per_head = order.stop - order.first

    def block(t):
      # A tile with no query block to stream (per_head 0) still prefetches one position, never
      # loaded: no division by zero there (undefined in the kernel's LLVM IR).
      g = lax.div(t, jnp.maximum(per_head, 1))
      return kvh * groups + g, order.block(order.first + t - g * per_head)
    return per_head, block


def key_cta(call: Call, refs, ranges: "Ranges", b, kvh, index, *, wgs: int, bk: int,
            bq: int) -> KeyCta:
  """The key tile `index` of (batch row b, kv head kvh) whose wgs warpgroups own bk keys each
  (refs: the kernel's operands, whose lengths it reads)."""
  start = index * (wgs * bk)
  lens = call.lengths(refs, b)
  # The query blocks of one warpgroup's keys (its packed-sequence and mask ranges intersected
  # in; the mask's merged over the kv head's query heads).
  q_ranges = lambda k_start: q_ranges_of(call, ranges, b, kvh, k_start, bk, bq, lens, wgs=wgs)
  lo, hi = union_range(*(q_ranges(start + w * bk) for w in range(wgs)))
  return KeyCta(start, lens, q_ranges, (lo, hi),
                schedule(ranges, b, kvh, lo, hi, start, wgs * bk))


def if_rows(call: Call, wgs: int, bq: int, q_start):
  """A decorator running its function unless the warpgroup whose rows start at q_start idles
  (`cta_rows`)."""
  return _unless_idle(has_idle_rows(call, wgs, bq), q_start >= 0)


def if_keys(call: Call, wgs: int, bk: int, k_start):
  """The same for a dK/dV warpgroup whose key rows start at k_start (`has_idle_keys`)."""
  return _unless_idle(has_idle_keys(call, wgs, bk), k_start < call.pad.S)


def _unless_idle(may_idle: bool, owns):
  return pl.when(owns) if may_idle else (lambda f: f())


def pairwise_index(ref, b, n):
  """(batch, head) index into a [Bx, Nx, ...] operand whose leading dims are full or 1."""
  return (b if ref.shape[0] > 1 else 0, n if ref.shape[1] > 1 else 0)


def pairwise_tile(ref, b, n, rows, cols):
  """A [Bx, Nx, R, C] operand (bias, mask, their transposes) at batch row b, head n: the GMEM tile
  rows x cols (pl.ds slices) for a TMA copy."""
  return ref.at[(*pairwise_index(ref, b, n), rows, cols)]


def union_range(*ranges):
  """The blocks the producer streams for the compute warpgroups' (lo, flo, fhi, hi) ranges, given
  in the order of the rows they own.

  Ranges are monotone in the rows a warpgroup owns, so the union is [the first lo, the largest
  hi) -- except where a range is empty (it then adds nothing).
  """
  lo, hi = ranges[0][0], ranges[0][3]
  for later in ranges[1:]:
    lo1, hi1 = later[0], later[3]
    empty0, empty1 = hi <= lo, hi1 <= lo1
    lo = jnp.where(empty0, lo1, jnp.where(empty1, lo, jnp.minimum(lo, lo1)))
    hi = jnp.where(empty0, hi1, jnp.where(empty1, hi, jnp.maximum(hi, hi1)))
  return lo, jnp.maximum(hi, lo)


def clamp_ranges(ranges, lo, hi):
  """A warpgroup's (lo, flo, fhi, hi) clamped into the union [lo, hi), in order."""
  clamp = lambda x: jnp.minimum(jnp.maximum(x, lo), hi)
  a, b, c, d = (clamp(x) for x in ranges)
  b = jnp.maximum(b, a)
  c = jnp.maximum(c, b)
  d = jnp.maximum(d, c)
  return a, b, c, d


def sections(order: Schedule, my_ranges, step, carry, flags=None, before=None):
  """Runs step(p, j, carry, kind) over the CTA's streamed positions p (block j = order.block(p)):
  "skip" outside this warpgroup's range (my_ranges, clamped into the union), "masked" on its
  edge blocks and "full" on the blocks all its rows see whole.

  flags (`block_flags`, or None): under a mask, a "masked" block whose flag is 0 (its mask tile is
  all False for this warpgroup's rows, though not for the other's) runs as an "empty" step (a
  skip step that knows the block was in its range). Each step loads the next block's index and
  flag, so their latency hides behind a block. (An all-True tile could run unmasked as well: a
  third branch, measured on an H100 at B4 T4096 N16 H128, made a 25%-block-sparse mask 14%
  faster and a random 80% mask 29% slower, so masked blocks keep one kind.)
  before: None, or before(p), run at the start of every step (`issuer`'s refill)."""
  bounds = (order.first, *(order.rank(x) for x in my_ranges), order.stop)

  def named(p, j, carry, kind):
    if before is not None:
      before(p)
    with jax.named_scope(kind):   # a region of common.profiling's traces
      return step(p, j, carry, kind)

  if flags is None:
    body = lambda p, carry, kind: named(p, order.block(p), carry, kind)
  else:
    def body(p, state, kind):
      carry, j, flag = state
      upcoming = order.block(p + 1)
      upcoming_flag = flags(upcoming)
      if kind == "masked":
        carry = lax.cond(flag != 0, lambda c: named(p, j, c, "masked"),
                         lambda c: named(p, j, c, "empty"), carry)
      else:
        carry = named(p, j, carry, kind)
      return carry, upcoming, upcoming_flag

    first = order.block(order.first)
    carry = (carry, first, flags(first))
  for start, stop, kind in zip(bounds, bounds[1:], ("skip", "masked", "full", "masked", "skip")):
    carry = lax.fori_loop(start, stop, lambda p, x, kind=kind: body(p, x, kind), carry)
  return carry if flags is None else carry[0]


def lowered_once(*static_argnames):
  """A kernel call (`call` and the other static_argnames static, the rest pytrees of arrays)
  jitted, so that every place of one program that makes the same call (a model's layers) shares
  one traced jaxpr, which JAX then lowers once: one Mosaic GPU module that XLA compiles once.
  Lowered in place instead, each call is its own module -- JAX 0.11 gives every lowered module a
  unique name (its mosaic_gpu.dump_basename attribute, part of the kernel hash), and a backward
  also carries its caller's source location -- and a 12-layer GPT-2 step compiled 36 Mosaic GPU
  kernels instead of 3 (benchmarks/compile_time.py)."""
  return lambda fn: jax.jit(fn, static_argnames=static_argnames)


_PROFILE: dict = {}   # Mosaic GPU profiler parameters while `profiling` is active
# Whether this JAX's profiler bounds its traces: a loop longer than `ranges` then truncates its
# trace, never writes past it into shared memory.
PROFILE_BOUNDS_CHECKED = "profile_bounds_check" in inspect.signature(
    plgpu.CompilerParams).parameters


@contextlib.contextmanager
def profiling(directory: str, ranges: int = 256):
  """Every Hopper kernel compiled inside records its named regions (the `jax.named_scope`s of the
  kernel bodies: load_q, first_k, each step's kind and parts, epilogue), per warpgroup and CTA,
  in clock cycles, with Mosaic GPU's on-device profiler: one Chrome trace per kernel call in
  `directory`, named after the kernel (benchmarks/profile_mosaic.py reads them). ranges: the most
  regions one warpgroup records. JAX's caches are cleared on entry and exit (kernels are cached
  per call)."""
  params = dict(profile_space=ranges, profile_dir=directory)
  if PROFILE_BOUNDS_CHECKED:
    params["profile_bounds_check"] = True
  jax.clear_caches()
  _PROFILE.update(params)
  try:
    yield
  finally:
    _PROFILE.clear()
    jax.clear_caches()


def input_dtype(x) -> jnp.dtype:
  """The input dtype of padded Operands or PackedOperands."""
  return jnp.dtype((x.qkv if is_packed(x) else x.q).dtype)


def qkv_views(x):
  """The kernels read q, k and v as [B, T, N or K, H] refs. PackedOperands of refs become Operands
  whose q, k and v are views of slots 0, 1 and 2 of the one qkv ref [B, T, 3, N, H] (TMA copies
  the strided rows in place); anything else is returned as it is."""
  if not is_packed(x):
    return x
  fields = {name: getattr(x, name) for name in x._fields if name != "qkv"}
  return OPERANDS.make(**fields, **{name: x.qkv.at[:, :, i] for i, name in enumerate("qkv")})


def launch(kernel, scratch, *, name: str, out_type, grid, grid_names, in_place: bool = False,
           compute_wgs: int = 2, producer: bool = True, out_views=None):
  """A warp-specialised Mosaic GPU kernel named `name` (in profiles): `compute_wgs` compute
  warpgroups and a producer ("wg" 0 .. compute_wgs, the producer last) per CTA over `grid`; no
  producer where `producer` is False (TuningConfig.producer: a compute warpgroup streams).
  Returns run(*inputs): each input is a pytree of arrays (the padded `Operands`,
  `BackwardInputs`; None leaves for absent ones), and kernel(*inputs as the same pytrees of refs,
  *output refs, scratch) gets them by name, then `scratch` (a tuple of SMEM / barrier types)
  allocated collectively for the warpgroups.
  in_place: some inputs are refs the kernel writes (`in_place` below; pl.kernel takes them,
  plgpu.kernel's vmap wrapper does not -- the API folds vmap into the batch before any kernel
  runs). Packed operands reach the kernel as views (`qkv_views`); out_views: None, or a function
  of the output refs (a tuple) giving the refs the kernel writes (views of them)."""
  def run(*inputs):
    flat, tree = jax.tree.flatten(inputs)

    def entry(*refs):
      named = [qkv_views(x) for x in jax.tree.unflatten(tree, refs[:len(flat)])]
      outs = tuple(refs[len(flat):])
      if out_views is not None:
        outs = tuple(out_views(outs))
      pl.run_scoped(lambda *allocated: kernel(*named, *outs, allocated), *scratch,
                    collective_axes="wg")

    params = plgpu.CompilerParams(approx_math=True, **_PROFILE)
    if in_place:
      mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=compute_wgs + producer,
                        thread_name="wg", kernel_name=name)
      return pl.kernel(entry, out_type=out_type, mesh=mesh, compiler_params=params, name=name)(
          *flat)
    return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names,
                        num_threads=compute_wgs + producer, thread_name="wg",
                        compiler_params=params,
                        kernel_name=name)(*flat)

  return run


def in_place(run: Callable, initial, results=()):
  """run(refs) -> arrays, with `refs` a pytree of refs initialised to `initial` (None leaves stay
  None) that the kernels run launches write in place -> (the refs' final values, run's arrays,
  shaped and typed like `results`, ShapeDtypeStructs).

  The refs live inside a `pl.run_state`, not `jax.new_ref`: no ref effect leaves this function.
  A new_ref's effect reaches the caller's jaxpr, which custom_partitioning cannot lower (each
  device's program in stable_attn.partition: "Cannot lower jaxpr with effects"); run_state's
  discharge makes the kernels' outputs alias their inputs, as jit does for a new_ref. run's
  arrays leave through refs of their own: a whole-ref write is a rename once discharged (no
  copy), and their zero initial values are dead code."""
  def body(refs):
    state, outs = refs
    for ref, value in zip(outs, run(state)):
      ref[...] = value

  placeholders = tuple(jnp.zeros(r.shape, r.dtype) for r in results)
  return pl.run_state(body)((initial, placeholders))


def _filler(loads, stages: int):
  """fill(at, j, first_ones): loads block j, the at-th position streamed, into each of `loads`'
  rings' slots (`stream`); waits for that slot to be free unless first_ones(ring) says it is
  among the ring's first positions."""
  rings = [(free, load, *(ring or (stages, 0))) for free, load, *ring in loads]

  def fill(at, j, first_ones):
    for free, load, ring, offset in rings:
      slot = offset + (at % ring if isinstance(at, int) else slot_of(at, ring))
      first_one = first_ones(ring)
      wait = lambda free=free, slot=slot: plgpu.barrier_wait(free.at[slot])
      if first_one is False:
        wait()
      elif first_one is not True:   # traced
        pl.when(~first_one)(wait)
      load(j, slot)
  return fill


def _first_loads(fill, first, stop, stages: int, block):
  """Positions first .. first + stages - 1 (those before stop), each ring's first ones without
  waiting for a free slot."""
  for i in range(stages):
    pl.when(first + i < stop)(lambda i=i: fill(i, block(first + i), lambda ring: i < ring))


def stream(first, stop, stages: int, loads, block=lambda p: p, prefetch: bool = False, base=0):
  """The producer warpgroup's loop: positions first .. stop-1 go to slots (p - first) % stages.

  loads: (free barriers, load(block(p), slot)) entries, issued in order; the first `stages`
  positions load at once, a later one waits until both compute warpgroups freed its slot (per
  pair). An entry (free, load, ring, offset) keeps a ring of its own, `ring` slots from slot
  `offset` (a warpgroup's one bias buffer: 1, its index), whose first `ring` positions load at
  once. prefetch: block(p) reads memory (a mask's block order), so each refill reads the next
  position's before it waits for a slot, off the path from a freed slot to its next TMA copy.
  base: positions streamed before this call (a persistent CTA's earlier tiles, traced): position
  p goes to slot (base + p - first) % stages and waits for it unless it is among the first
  `stages` overall.
  """
  fill = _filler(loads, stages)

  if not isinstance(base, int) or base:
    assert not prefetch, "a persistent CTA streams no mask block order"

    def load_at(p):
      at = base + p - first
      fill(at, block(p), lambda ring: at < ring)
    pl.loop(first, stop)(load_at)
    return
  _first_loads(fill, first, stop, stages, block)

  def refill(p, at):
    upcoming = block(p + 1) if prefetch else None
    fill(p - first, at if prefetch else block(p), lambda ring: False)
    return upcoming

  if prefetch:
    lax.fori_loop(first + stages, stop, refill, block(first + stages))
  else:
    pl.loop(first + stages, stop)(lambda p: refill(p, None))


def inline_stream(first, stop, stages: int, loads, block=lambda p: p, lag: int = 1,
                  early: int = 0):
  """`stream` without a producer warpgroup (TuningConfig.producer False): one compute warpgroup,
  the issuer, issues the copies between its own steps -> (start(), refill(p), released(p) or
  None). start() loads positions first .. first + stages - 1 at once; refill(p), called by the
  issuer at the start of its step at position p, waits until every compute warpgroup freed
  position p - lag's slot and loads position p - lag + stages into it (TuningConfig.refill_lag,
  at most stages - 1). early: the first `early` of `loads` (the forward's K) refill at
  released(p) instead, called once the issuer freed position p's slot of them in its own step:
  position p + stages loads there as soon as every warpgroup freed it, as a producer would, not
  a step later with the rest (TuningConfig.refill_k_early).
  The issuer is the last warpgroup (the ping-pong's second, which runs behind the first).
  One tile per CTA (not persistent) and no rings (the API checks). A block order that reads
  memory (a mask's) is read at the refill, before its wait for the slot."""
  assert all(len(entry) == 2 for entry in loads), "rings need a producer"
  lag = min(lag, stages - 1)
  fill = _filler(loads, stages)
  fill_early, fill_late = _filler(loads[:early], stages), _filler(loads[early:], stages)
  start = lambda: _first_loads(fill, first, stop, stages, block)

  def refill(p):
    at = p - lag + stages

    @pl.when((p >= first + lag) & (at < stop))
    def _refill():
      with jax.named_scope("refill"):   # the wait for the slot and the copies (`profiling`)
        fill_late(at - first, block(at), lambda ring: False)

  def released(p):
    at = p + stages

    @pl.when(at < stop)
    def _refill():
      with jax.named_scope("refill_early"):
        fill_early(at - first, block(at), lambda ring: False)
  return start, refill, released if early else None


class Issuer(NamedTuple):
  """The issuer's hooks (`issuer`): before(p) for `sections`, released(p) for a kernel whose
  stream refills some loads early (`inline_stream`); None where they do nothing."""
  before: Optional[Callable]
  released: Optional[Callable]


def take_registers(call: Call, kernel: str, wgs: int, role: str) -> None:
  """A warpgroup's register share (setmaxnreg) in `kernel` ("fwd", "dq" or "dkv"): role "compute"
  takes REGISTERS[wgs][0] per thread, "producer" gives back down to REGISTERS[wgs][1]. Without a
  producer (TuningConfig.has_producer) nothing moves: every thread keeps 65536 / (128 * wgs), 255
  with two compute warpgroups, 168 with three."""
  if call.config.has_producer(kernel):
    producer = role == "producer"
    plgpu.set_max_registers(REGISTERS[wgs][producer],
                            action="decrease" if producer else "increase")


def issuer(call: Call, kernel: str, wg, wgs: int, streams: Callable) -> Issuer:
  """Without a producer in `kernel` ("fwd", "dq" or "dkv"): the last compute warpgroup runs
  start() of streams() -> (start, refill, released) (`inline_stream`) now -> its refill at each
  position, before(p) for `sections`, and its released(p). With a producer -> Issuer(None, None)
  (streams is not called)."""
  if call.config.has_producer(kernel):
    return Issuer(None, None)
  start, refill, released = streams()
  issues = wg == wgs - 1
  pl.when(issues)(start)
  by_issuer = lambda hook: hook and (lambda p: pl.when(issues)(lambda: hook(p)))
  return Issuer(by_issuer(refill), by_issuer(released))


def query_grid(call: Call, x, kernel: str, wgs: int, bq: int, persistent: bool):
  """(grid, grid names, persistent CTAs or 0) of a query kernel ("fwd" or "dq") whose CTAs own
  wgs * bq rows: the grid (B, N, row CTAs) (batch fastest where `batch_inner`; the row CTAs
  slowest where TuningConfig.heaviest_first names the kernel), or min(tiles, SMs) persistent
  CTAs (the H64 forward; a persistent dQ kernel measured slower, docs/hopper_kernel.md)."""
  return _grid(call.geo.B, call.geo.N, cta_rows(call, wgs, bq, 0)[0], "q_seq", persistent,
               batch_inner(call, x), kernel in call.config.heaviest_first)


def key_grid(call: Call, x, wgs: int, bk: int, persistent: bool):
  """The same for the dK/dV kernel, whose CTAs own wgs * bk key rows of a kv head: the grid (B, K,
  key CTAs), or persistent CTAs (TuningConfig.dkv_persistent)."""
  return _grid(call.geo.B, call.geo.K, key_ctas(call, wgs, bk), "kv_seq", persistent,
               batch_inner(call, x), "dkv" in call.config.heaviest_first)


def batch_inner(call: Call, x) -> bool:
  """Whether a grid runs the batch rows fastest: a bias or mask that every batch row shares
  ([1, Nx, T, S], B > 1) under TuningConfig.batch_inner. CUDA starts CTAs in grid order, last
  dimension fastest, so the CTAs that read one tile of it then run side by side and HBM serves the
  tile once, where the (B, N, rows) order reads it once per batch row, a wave or more apart."""
  shared = any(a is not None and a.shape[0] == 1 for a in (x.bias, x.mask))
  return call.config.batch_inner and shared and call.geo.B > 1


def key_ctas(call: Call, wgs: int, bk: int) -> int:
  """CTAs per (batch row, kv head) of the dK/dV kernel: S is padded to 2 * bk rows only, so with
  3 warpgroups the last CTA's last warpgroups may own no keys (`has_idle_keys`)."""
  return blocks.cdiv(call.pad.S, wgs * bk)


def _grid(B: int, heads: int, per_row: int, axis: str, persistent: bool, inner: bool = False,
          heaviest: bool = False):
  # The kernels name their program ids, so any order serves. CTA index 0 holds the heaviest
  # causal rows (keys): with it slowest (`heaviest`) every head's heaviest CTAs start first and
  # the lighter ones fill the SMs that free up (largest first), where (B, N, rows) starts the
  # last heads' heaviest CTAs in the last waves.
  if heaviest and not persistent:
    if inner:
      return (per_row, heads, B), (axis, "heads", "batch"), 0
    return (per_row, B, heads), (axis, "batch", "heads"), 0
  if inner and not persistent:
    return (heads, per_row, B), ("heads", axis, "batch"), 0
  if not persistent:
    return (B, heads, per_row), ("batch", "heads", axis), 0
  ctas = min(B * heads * per_row, sm_count())
  return (ctas,), ("cta",), ctas


class CtaTiles(NamedTuple):
  """The tiles (batch row, head, row or key CTA index) a CTA runs."""
  count: Any          # how many
  tile: Callable      # i -> (b, n, CTA index) of its i-th
  buffer: Callable    # i -> which of the two buffers of its resident tiles tile i uses (0: one)
  persistent: bool

  def run(self, body):
    """body(i, base) -> the next base, over the tiles; base: the positions the CTA's producer
    streamed for the tiles before (0 for the first)."""
    if self.persistent:
      lax.fori_loop(0, self.count, body, jnp.int32(0))
    else:
      body(0, 0)


def query_tiles(call: Call, x, wgs: int, bq: int, ctas: int) -> CtaTiles:
  """Inside a query kernel (x: its operand refs): its grid position's one tile, or (ctas > 0,
  `query_grid`) a persistent CTA's tiles in zigzag rounds (`persistent_tiles`), in the order of
  TuningConfig.persistent_order: "heaviest", tile t = (row CTA, batch row, head) with the row CTA
  slowest, every head's heaviest causal rows first; "grid", the grid's."""
  return _tiles(call, x, call.geo.N, cta_rows(call, wgs, bq, 0)[0], "q_seq", ctas)


def key_tiles(call: Call, x, wgs: int, bk: int, ctas: int) -> CtaTiles:
  """The same for the dK/dV kernel (`key_grid`): key CTA 0, the keys every causal query sees,
  is the heaviest, so the key CTA index ascends."""
  return _tiles(call, x, call.geo.K, key_ctas(call, wgs, bk), "kv_seq", ctas)


def _tiles(call: Call, x, heads: int, per_row: int, axis: str, ctas: int) -> CtaTiles:
  B = call.geo.B
  if not ctas:
    return CtaTiles(1, lambda i: (lax.axis_index("batch"), lax.axis_index("heads"),
                                  lax.axis_index(axis)), lambda i: 0, False)
  count, nth = persistent_tiles(lax.axis_index("cta"), ctas, B * heads * per_row)
  order, inner = call.config.persistent_order, batch_inner(call, x)
  return CtaTiles(count, lambda i: tile_coords(nth(i), (B, heads, per_row), order, inner),
                  lambda i: lax.rem(i, 2), True)


def tile_coords(t, dims: tuple[int, int, int], order: str, inner: bool = False):
  """(batch row, head, row or key CTA index) of persistent tile t (int32) of dims = (B, heads,
  CTAs per row) in TuningConfig.persistent_order `order`: "heaviest", the CTA index slowest;
  "grid", the order `_grid` launches its grid in: (B, heads, rows), or (heads, rows, B) when
  `inner` (`batch_inner`)."""
  B, heads, per_row = dims
  if order == "heaviest":
    r = lax.rem(t, B * heads)
    return lax.div(r, heads), lax.rem(r, heads), lax.div(t, B * heads)
  if inner:
    r = lax.div(t, B)
    return lax.rem(t, B), lax.div(r, per_row), lax.rem(r, per_row)
  r = lax.div(t, per_row)
  return lax.div(r, heads), lax.rem(r, heads), lax.rem(t, per_row)


def persistent_tiles(cta, ctas: int, total: int):
  """(count, nth): persistent CTA `cta` of `ctas` takes `count` of `total` tiles, its i-th being
  tile nth(i). Round r holds tiles [r * ctas, (r + 1) * ctas); the CTA takes position cta of the
  even rounds and ctas - 1 - cta of the odd ones, a zigzag that evens out the CTAs' work when the
  tiles come heaviest first (plain round-robin gives CTA 0 the heaviest tile of every round)."""
  position = lambda i: jnp.where(lax.rem(i, 2) == 0, cta, ctas - 1 - cta)
  rounds = total // ctas
  count = rounds + (position(jnp.int32(rounds)) < total % ctas).astype(jnp.int32)
  return count, lambda i: i * ctas + position(i)


def sm_count() -> int:
  """Streaming multiprocessors of the default device (a persistent kernel's CTAs); 132 (an H100
  SXM's and an H200's) where the device does not say, as when lowering on a CPU."""
  device = jax.devices()[0]
  return (getattr(device, "core_count", None) or 132) if device.platform == "gpu" else 132


def drain_stores():
  """A compute warpgroup's last act: wait until its TMA stores have *read* shared memory. Their
  writes to global memory complete on their own before the kernel does (as CUTLASS's and
  FlashAttention-3's epilogues end); waiting for them kept each CTA on its SM for a store's round
  trip, ahead of the next CTA's start."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@plgpu.inline_mgpu()
def _warpgroup_barrier(_):
  mgpu.utils.warpgroup_barrier()


def release(free, after_reads: bool = True):
  """Frees a slot whose tiles this warpgroup's threads have read (a bias, mask, segment-id or P
  tile). Pallas arrives on `free` from one thread, and nothing orders the other three warps'
  shared-memory reads before that arrival, so the producer's next TMA copy could overwrite a
  row a lagging warp has not read yet (it did, for the bias buffer: docs/hopper_kernel.md). A
  warpgroup barrier (bar.sync) first orders them, as every consumer thread's own arrival does
  in CUTLASS's pipelines and tokamax's named barriers; no proxy fence is needed for a TMA write
  after generic reads. after_reads=False: only the tensor cores read the slot, and the
  product's wait already ordered those reads."""
  if after_reads:
    _warpgroup_barrier()
  plgpu.barrier_arrive(free)


def slot_of(step, stages: int):
  return lax.rem(step, jnp.asarray(stages, step.dtype))


def block_ready(loaded, free, slot, kind: str) -> bool:
  """A streamed step's start: waits for the block in `slot`; on a "skip" or "empty" step
  (`sections`) frees the slot at once -> whether the step computes on the block."""
  with jax.named_scope("wait"):   # (named regions: what `profiling` records)
    plgpu.barrier_wait(loaded.at[slot])
  if kind in ("skip", "empty"):
    plgpu.barrier_arrive(free.at[slot])
    return False
  return True


def query_compute_start(call: Call, kernel: str, cta: "QueryCta", wg, wgs: int, bq: int,
                        stages: int, loads):
  """A query kernel's compute warpgroup's start (the dQ kernels'): its registers, the issuer's
  first loads where there is no producer -> (before for `sections`, its first row, its
  `if_rows`)."""
  take_registers(call, kernel, wgs, "compute")
  order = cta.order
  before = issuer(call, kernel, wg, wgs, lambda: inline_stream(
      order.first, order.stop, stages, loads(), order.block, call.config.refill_lag)).before
  q_start = cta.start + wg * bq
  return before, q_start, cta.if_rows(q_start)


def query_produce(call: Call, kernel: str, cta: "QueryCta", wgs: int, stages: int, loads,
                  ranges: Ranges) -> None:
  """A query kernel's producer warpgroup (the dQ kernels'): gives back its registers and streams
  the CTA's blocks (`stream`)."""
  take_registers(call, kernel, wgs, "producer")
  order = cta.order
  stream(order.first, order.stop, stages, loads(), order.block,
         prefetch=ranges.order is not None)


def pairwise_smem(x, stages: int, rows: int, cols: int):
  """SMEM slots for the bias and mask tiles that stream beside another operand: [stages, rows,
  cols] each in the operand's dtype (the mask as int8), or None where the operand is absent."""
  return tuple(None if a is None else
               plgpu.SMEM((stages, rows, cols), a.dtype, transforms=tile_transforms(cols, a.dtype))
               for a in (x.bias, x.mask))


def copy_beside(refs, b, n, rows, cols, barrier, buffers, slot, *, seg_rows=None, seg_ref=None):
  """TMA copies of what streams beside a block into its slot, on the block's barrier: segment ids
  (seg_ref at [b, seg_rows]; kv_seg when seg_ref is None) into buffers[0], the bias and mask tiles
  [rows, cols] of batch row b, head n into buffers[1] and buffers[2] (each None when absent, or
  when it streams apart)."""
  seg_smem, bias_smem, mask_smem = buffers
  if seg_smem is not None:
    ids = refs.kv_seg if seg_ref is None else seg_ref
    plgpu.copy_gmem_to_smem(ids.at[b, seg_rows], seg_smem.at[slot], barrier)
  for operand, smem in ((refs.bias, bias_smem), (refs.mask, mask_smem)):
    if smem is not None:
      plgpu.copy_gmem_to_smem(pairwise_tile(operand, b, n, rows, cols), smem.at[slot], barrier)


def read_beside(bias_smem, mask_smem, slot, rows, masked: bool):
  """A compute warpgroup's bias tile (its `rows` of the slot, or None) and, on a masked block, its
  mask tile as bool (else None), read into registers in the WGMMA layout."""
  bias = None if bias_smem is None else bias_smem.at[slot, rows][...]
  allowed = None
  if masked and mask_smem is not None:
    allowed = mask_smem.at[slot, rows][...] != 0
  return bias, allowed
