"""Tiles and pipeline depths of the Hopper kernels: small frozen configs that validate themselves.

Every kernel runs CTAs of two compute warpgroups (each owning `block_q` query rows, or `block_kv`
key rows in the dK/dV kernel; three in the forward and the dQ kernel at head dims 64 and 128:
`fwd_wgs`, `dq_wgs`) and one producer warpgroup that streams the other operand through `stages`
shared-memory slots with TMA (none where ptxas ignores setmaxnreg, JAX 0.12: `producer`,
`_ENTRY_REGISTERS`).

    config = tuning.TuningConfig(fwd=tuning.Tiles(64, 128, 2), dkv=..., dq=...)
    stable_attn.dot_product_attention(..., implementation="pallas_mosaic_gpu", config=config)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

COMPUTE_WGS = 2        # compute warpgroups per CTA
WGMMA_M = 64           # rows of one warpgroup's wgmma
STREAMED_MIN = 32      # the fewest rows of a streamed block (a wgmma N and K of 32)
SMEM_BYTES = 227 * 1024
SMEM_RESERVE = 4 * 1024   # barriers and alignment, beyond the tiles counted in check_smem
HEAD_DIMS = (64, 128, 256)  # head dims the kernels cover (rows tiled 128 bytes wide)
PERSISTENT_ORDERS = ("heaviest", "grid")   # TuningConfig.persistent_order
FP8_PROMOTE_GROUPS = (0, 32, 64, 128)   # TuningConfig.fp8_pv_promote: keys per accumulator
KERNELS = ("fwd", "dq", "dkv")   # the kernels a TuningConfig tiles


def fits_smem(nbytes: int) -> bool:
  """Whether a CTA's tiles of `nbytes` fit Hopper's shared memory beside the reserve."""
  return nbytes + SMEM_RESERVE <= SMEM_BYTES


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One kernel's tiling: block_q query rows x block_kv key rows per step, `stages` slots."""
  block_q: int
  block_kv: int
  stages: int

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v < STREAMED_MIN or v % STREAMED_MIN or v > 256:
        raise ValueError(f"{name} must be a multiple of {STREAMED_MIN} up to 256 (64, 128, 192 or "
                         f"256 where a warpgroup owns the rows: the wgmma M), got {v!r}")
    if not isinstance(self.stages, (int, np.integer)) or not 2 <= self.stages <= 8:
      raise ValueError(f"stages must be between 2 and 8, got {self.stages!r}")

  def check_owned(self, name: str, kernel: str) -> None:
    """ValueError unless the rows a warpgroup owns (`name`) are a multiple of the wgmma M."""
    if getattr(self, name) % WGMMA_M:
      raise ValueError(f"{kernel}.{name} must be a multiple of {WGMMA_M} (each compute warpgroup "
                       f"owns that many rows: the wgmma M), got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Forward, dK/dV and dQ tilings.

  fwd: each compute warpgroup owns block_q query rows; K/V blocks of block_kv rows stream in.
  dkv: each compute warpgroup owns block_kv key rows; Q/dO blocks of block_q rows stream in.
  dq:  each compute warpgroup owns block_q query rows; K/V blocks of block_kv rows stream in.
  """
  fwd: Tiles
  dkv: Tiles
  dq: Tiles
  # FlashAttention-3's backward: the dK/dV kernel also adds each step's dS K into an fp32 dQ
  # (TMA reduce-add); no dQ kernel, 5 tile matmuls instead of 7, not bitwise deterministic.
  fused_dq: bool = False
  # dK and dV in two passes of the dK/dV kernel (one fp32 accumulator each): head dim 256, where
  # both take 256 registers per thread (a warpgroup has 232).
  dkv_passes: int = 1
  # Compute warpgroups of the forward: 2 that ping-pong, or 3 that run free (FlashAttention-3's
  # head-dim-64 shape, 3 * block_q query rows per CTA, 160 registers per thread; T is not padded
  # to 3 * block_q: the last CTA's first warpgroups idle). 3 takes a bias (its tiles cover all
  # the CTA's rows: `_BIAS_FWD`) but no mask operand (its compacted block order is per pair).
  fwd_wgs: int = COMPUTE_WGS
  # The same for the dQ kernel (its CTAs own dq_wgs * dq.block_q query rows): 2 or 3; 3 takes no
  # bias or mask operands.
  dq_wgs: int = COMPUTE_WGS
  # The same for the dK/dV kernel (its CTAs own dkv_wgs * dkv.block_kv key rows, S is padded to
  # 2 * block_kv: the last CTA's last warpgroups may idle): 2 or 3; 3 takes no bias or mask
  # operands and not the fused dQ.
  dkv_wgs: int = COMPUTE_WGS
  # dK and dV in one pass over one block_kv key tile per CTA, one gradient per warpgroup: the dV
  # warpgroup computes P^T and hands it (fp32, through shared memory) to the dK warpgroup, which
  # computes dP^T: four tile products a step, where two passes take five. The table's at head dim
  # 256, whose 64 x 256 fp32 dK and dV do not fit one warpgroup's registers together. Two
  # warpgroups, one pass, no fused dQ, not persistent, no bias or mask operands (the API checks).
  dkv_split: bool = False
  # A persistent forward: one CTA per SM taking the query tiles round-robin (heaviest rows
  # first), the next tile's Q loading during this one (two Q buffers, O staged apart); with two
  # warpgroups their ping-pong runs on across the tiles.
  fwd_persistent: bool = False
  # The dQ kernel computes delta = rowsum(dO * O) from its resident dO and an O tile it loads
  # beside it, uses it and writes it for the dK/dV kernel (which then runs second): no XLA pass
  # over dO and O before the kernels (the fused backward, which has no dQ kernel, keeps it).
  dq_delta: bool = False
  # A persistent dK/dV kernel: one CTA per SM taking the key tiles in zigzag rounds (heaviest
  # causal keys first), each compute warpgroup loading its next tile's K and V into a second
  # buffer while it works on this one; its dK and dV are staged in the buffer they came from.
  # Not with the fused dQ or two passes; takes no bias or mask operands (the API checks).
  dkv_persistent: bool = False
  # The persistent kernels' tile order: "heaviest", the row (key) CTA index slowest, so each
  # round's CTAs take every head's heaviest causal rows (keys) first, on as many heads as there are
  # SMs; "grid", the grid's own order (`batch_inner`'s included), so a round's CTAs share a few
  # heads' streamed K and V (Q and dO) in L2: where every tile costs the same (full). A grid's
  # CTAs start in its own order whatever this says.
  persistent_order: str = "heaviest"
  # The forward's bias tiles stream apart from K: one buffer per compute warpgroup on barriers of
  # its own, released (after a warpgroup barrier) once the warpgroup's QK^T product, during which
  # it read its tile, has landed, so the next block's loads while the step runs. One slot's shared
  # memory instead of one per stage: 128-key blocks fit beside it at head dim 128. No effect
  # without a bias (a mask stays with K).
  fwd_bias_apart: bool = False
  # With a bias or mask that every batch row shares ([1, Nx, T, S]), grids of (heads, rows, batch),
  # batch fastest: the CTAs that read one of its tiles run side by side and HBM serves it once
  # (common.batch_inner). False keeps (batch, heads, rows), as without one.
  batch_inner: bool = True
  # The kernels ("fwd", "dq", "dkv") whose grid (not persistent) launches the row (key) CTA index
  # slowest: every head's heaviest causal CTAs first, the lighter ones filling the SMs that free
  # up, where (B, heads, rows) leaves the last heads' heaviest CTAs to the last waves (a tail
  # as long as a head's heaviest CTA). Outputs bitwise the same.
  heaviest_first: tuple = ()
  # A producer warpgroup per CTA that streams the blocks with TMA and gives its registers to the
  # compute warpgroups (setmaxnreg: 232 a thread with two, 160 with three). False: no producer;
  # the last compute warpgroup issues the copies between its steps (common.inline_stream), and
  # every thread keeps its share at entry, 255 with two compute warpgroups and 168 with three:
  # the table's tiles where ptxas ignores setmaxnreg (`_ENTRY_REGISTERS`). Not persistent, no
  # fused dQ; takes no bias or mask operands (the API checks).
  producer: bool = True
  # Without a producer, the issuer's step at position p refills the slot of position
  # p - refill_lag (with position p - refill_lag + stages), once every warpgroup freed it: 1 loads
  # stages - 1 steps ahead but waits for the other warpgroups' previous step; stages - 1 loads one
  # step ahead and waits only for older steps. At most each kernel's stages - 1 (capped there).
  refill_lag: int = 1
  # Without a producer in the forward, the issuer refills each K slot in the step that frees it
  # (once its own Q K^T has landed and every warpgroup released the slot), as a producer would:
  # K then loads a step earlier than V, which refills at the next step's start (refill_lag).
  # No effect with a producer; outputs bitwise the same.
  refill_k_early: bool = False
  # The forward's producer where it differs from the backward kernels' (None: `producer`): JAX
  # 0.12's table at head dim 64 on full calls has none in the forward only
  # (`_ENTRY_REGISTERS_FULL`).
  fwd_producer: Optional[bool] = None
  # The FP8 forward keeps P in registers for its P V wgmma: the e4m3 P's registers relabelled as
  # the 8-bit operand (common.as_8bit_operand), V^T's keys stored in the matching order
  # (common.relabelled_keys); 1.10-1.21x the kernel that stores P to a shared-memory tile and
  # fences it every step (False; H200, docs/fp8.md). No effect outside the FP8 forward.
  fp8_p_registers: bool = True
  # The FP8 forward's P V product in groups of this many keys (32, 64 or 128: its key block),
  # each into a fresh (zeroed) wgmma accumulator added to O in fp32 registers ("promotion"); 0:
  # one accumulator along the row, as FlashAttention-3. Hopper's FP8 wgmma adds each 32-key
  # instruction's products to its accumulator in fixed point, truncated toward zero ~13 bits
  # below the largest of them and the accumulator, so along the row the small products lose
  # their low bits against O's growing sum: at the bias probe's near tail (keys 4-8 below the
  # max) O came out 2.9-4.4 bf16 ulps inward, 0.10-0.24 promoted per block ("fp8_fast" "safe"),
  # whose forward kernel ran 0.92-0.96x as fast (a second [block_q, head_dim] fp32 accumulator a
  # warpgroup). Groups under the block slice V^T's (and P's) tiles at that width; at head dim
  # 64 two accumulators take the groups in turn (the next issued before the last is read), where
  # the table takes 64. H200, JAX 0.11.2 (benchmarks/results/fp8_promotion_nvidia_h200.md). No
  # effect outside the FP8 forward.
  fp8_pv_promote: int = 128
  # The FP8 forward's backward in FP8 too (fp8_backward.py: e4m3 products in the dQ and dK/dV
  # kernels, dS under online row scales; docs/fp8.md), on the dq and dkv tiles and warpgroups
  # (one grid CTA per tile: the persistent, fused-dQ, split and two-pass fields are the bf16
  # kernels'). False: the bf16 kernels on the dequantized inputs. Only with the FP8 forward.
  fp8_backward: bool = False
  # The FP8 backward's dV += P^T dO with each query block's product in a fresh wgmma accumulator,
  # added to dV in fp32 (fp8_pv_promote's fix, in the dK/dV kernel); False: dV's accumulator
  # along the whole column, as the forward's along the row. Along the column dV came out 2.9
  # bf16 ulps (at its RMS) inward where dO's columns lean one way (mean 1; 5.5 on the keys with
  # the longest sums; relative error 3.1e-2), promoted +0.07 (2.6e-3), against the float64
  # emulation of the same arithmetic (B1 T2048 N2 causal, head dims 64 and 128); the dK/dV
  # kernel 0.975x as fast (H200, benchmarks/results/fp8_dv_promoted_nvidia_h200.md). dS's
  # products (dQ, dK), of both signs, showed no such bias.
  fp8_dv_promote: bool = True

  def __post_init__(self):
    self.fwd.check_owned("block_q", "fwd")
    self.dkv.check_owned("block_kv", "dkv")
    self.dq.check_owned("block_q", "dq")
    if self.fp8_pv_promote not in FP8_PROMOTE_GROUPS or isinstance(self.fp8_pv_promote, bool):
      raise ValueError(f"fp8_pv_promote must be one of {FP8_PROMOTE_GROUPS} (keys per fresh "
                       f"accumulator; 0: one along the row), got {self.fp8_pv_promote!r}")
    if not isinstance(self.fp8_dv_promote, bool):
      raise ValueError(f"fp8_dv_promote must be a bool, got {self.fp8_dv_promote!r}")
    if self.persistent_order not in PERSISTENT_ORDERS:
      raise ValueError(f"persistent_order must be one of {PERSISTENT_ORDERS}, got "
                       f"{self.persistent_order!r}")
    if self.dkv_passes not in (1, 2):
      raise ValueError(f"dkv_passes must be 1 or 2, got {self.dkv_passes!r}")
    for name in ("fwd_wgs", "dq_wgs", "dkv_wgs"):
      if getattr(self, name) not in (2, 3):
        raise ValueError(f"{name} must be 2 or 3, got {getattr(self, name)!r}")
    if self.fused_dq and self.dkv_passes != 1:
      raise ValueError("fused_dq adds dQ in the one dK/dV pass: it needs dkv_passes=1")
    if self.dkv_persistent and (self.fused_dq or self.dkv_passes != 1):
      raise ValueError("dkv_persistent runs one dK/dV pass without the fused dQ: it needs "
                       f"fused_dq=False and dkv_passes=1, got fused_dq={self.fused_dq}, "
                       f"dkv_passes={self.dkv_passes}")
    if self.dkv_split and (self.dkv_wgs != COMPUTE_WGS or self.dkv_passes != 1 or self.fused_dq
                           or self.dkv_persistent):
      raise ValueError(f"dkv_split gives each of {COMPUTE_WGS} dK/dV warpgroups one gradient in "
                       f"one pass: it needs dkv_wgs={COMPUTE_WGS}, dkv_passes=1, fused_dq=False "
                       f"and dkv_persistent=False, got dkv_wgs={self.dkv_wgs}, dkv_passes="
                       f"{self.dkv_passes}, fused_dq={self.fused_dq}, dkv_persistent="
                       f"{self.dkv_persistent}")
    if not self.has_producer("fwd") and self.fwd_persistent:
      raise ValueError("a forward without a producer (producer=False or fwd_producer=False) "
                       "streams one tile per CTA from a compute warpgroup: it needs "
                       "fwd_persistent=False")
    if not self.producer and (self.dkv_persistent or self.fused_dq):
      raise ValueError("producer=False streams one tile per CTA from a compute warpgroup: it "
                       "needs dkv_persistent=False and fused_dq=False, got dkv_persistent="
                       f"{self.dkv_persistent}, fused_dq={self.fused_dq}")
    if not isinstance(self.heaviest_first, tuple) or not set(self.heaviest_first) <= set(KERNELS):
      raise ValueError(f"heaviest_first must be a tuple of kernel names of {KERNELS}, got "
                       f"{self.heaviest_first!r}")
    if self.fwd_producer not in (None, True, False):
      raise ValueError(f"fwd_producer must be None, True or False, got {self.fwd_producer!r}")
    if not isinstance(self.refill_lag, (int, np.integer)) or self.refill_lag < 1:
      raise ValueError(f"refill_lag must be a positive int, got {self.refill_lag!r}")
    if self.fused_dq and self.dkv_wgs != COMPUTE_WGS:
      raise ValueError(f"fused_dq splits dQ between two dK/dV warpgroups: it needs dkv_wgs="
                       f"{COMPUTE_WGS}, got {self.dkv_wgs}")

  def has_producer(self, kernel: str) -> bool:
    """Whether `kernel` ("fwd", "dq" or "dkv") has a producer warpgroup."""
    if kernel == "fwd" and self.fwd_producer is not None:
      return self.fwd_producer
    return self.producer

  def replace(self, **changes) -> "TuningConfig":
    return dataclasses.replace(self, **changes)

  @property
  def dkv_key_wgs(self) -> int:
    """How many of the dK/dV kernel's warpgroups own key tiles of their own (a CTA owns that
    many times dkv.block_kv keys): one under `dkv_split`, else every one."""
    return 1 if self.dkv_split else self.dkv_wgs

  @property
  def q_multiple(self) -> int:
    """T is padded to a multiple of this (every kernel's rows per CTA or per step)."""
    return math.lcm(COMPUTE_WGS * self.fwd.block_q, self.dkv.block_q, COMPUTE_WGS * self.dq.block_q)

  @property
  def kv_multiple(self) -> int:
    return math.lcm(self.fwd.block_kv, COMPUTE_WGS * self.dkv.block_kv, self.dq.block_kv)

  def smem_needs(self, head_dim: int, itemsize: int, *, beside: int = 0, bias: int = 0,
                 ds_itemsize: int = 0, fp8: bool = False, fp8_residual: bool = False) -> dict:
    """Bytes of shared memory per CTA of each kernel ("fwd", "dkv", "dq"): what the kernels
    allocate, and the segment ids' bytes where a call has none (2.5 KB at most; a test holds it).

    beside: bytes per score of the tiles that stream beside a block (bias and mask: their
    itemsizes); bias: the bias's share of it (0 without one; `fwd_bias_apart`); ds_itemsize: the
    dQ kernel's dS staging tile (a bias's gradient), 0 without; fp8: the FP8 forward (e4m3 Q, K
    and V, O staged apart in the input's itemsize, and its e4m3 P tile per warpgroup unless P
    stays in registers, `fp8_p_registers`, with a second for the top keys' residual where
    fp8_residual: the "fp8" preset; with `fp8_backward`, the FP8 backward's kernels: e4m3 Q, K,
    V, dO and the transposes each product reads, their outputs staged apart)."""
    row = head_dim * itemsize
    qkv = head_dim if fp8 else row   # the forward's Q, K and V rows
    # Per query row: its tiles (Q; Q and dO), fp32 statistics and int32 segment id; per key row:
    # K and V and its segment id. Resident rows per warpgroup, streamed rows per stage; the bias
    # and mask tiles cover the CTA's resident rows and one streamed block per stage (the forward's
    # bias one block in all where it streams apart).
    fwd, dkv, dq = self.fwd, self.dkv, self.dq
    apart = bias if self.fwd_bias_apart else 0
    return {
        "fwd": (self.fwd_wgs * fwd.block_q * (qkv + 12)
                + fwd.stages * fwd.block_kv * (2 * qkv + 4)
                + (fwd.stages * (beside - apart) + apart) * self.fwd_wgs * fwd.block_q
                * fwd.block_kv
                # persistent: a second Q buffer (with offsets and segment ids); persistent or
                # FP8: O staged apart from Q; FP8: P's e4m3 tiles where they go through SMEM
                + self.fwd_wgs * fwd.block_q
                * (self.fwd_persistent * (qkv + 8) + (self.fwd_persistent or fp8) * row
                   + fp8 * (not self.fp8_p_registers) * (1 + fp8_residual) * fwd.block_kv)),
        "dkv": ((1 + self.dkv_persistent) * self.dkv_key_wgs * dkv.block_kv * (2 * row + 4)
                + dkv.stages * dkv.block_q * (2 * row + 12)
                + self.dkv_split * dkv.block_kv * dkv.block_q * 4   # the fp32 P^T handed over
                + dkv.stages * COMPUTE_WGS * dkv.block_kv * dkv.block_q * beside
                # fused dQ: each warpgroup's dS^T tile and fp32 dQ staging tile
                + self.fused_dq * COMPUTE_WGS * dkv.block_q * (dkv.block_kv * itemsize
                                                               + head_dim * 4)),
        "dq": (self.dq_wgs * dq.block_q * ((2 + self.dq_delta) * row + 12)
               + dq.stages * dq.block_kv * (2 * row + 4)
               + dq.stages * self.dq_wgs * dq.block_q * dq.block_kv * beside
               + self.dq_wgs * dq.block_q * dq.block_kv * ds_itemsize),
        # The FP8 backward (fp8_backward.py; no bias or mask): per resident key row K and V in
        # e4m3, its dK/dV staging and segment id; per streamed query row Q, dO, Q^T and dO^T in
        # e4m3, LSE, delta and its segment id. The dQ kernel: per resident query row Q and dO in
        # e4m3, its dQ staging, LSE, delta and segment id; per streamed key row K, V, K^T and its
        # segment id.
        **(dict(dkv=self.dkv_wgs * dkv.block_kv * (2 * head_dim + row + 4)
                + dkv.stages * dkv.block_q * (4 * head_dim + 12),
                dq=self.dq_wgs * dq.block_q * (2 * head_dim + row + 12)
                + dq.stages * dq.block_kv * (3 * head_dim + 4))
           if fp8 and self.fp8_backward else {}),
    }

  def smem_problem(self, head_dim: int, itemsize: int, **extras):
    """Why a kernel's shared memory would not fit (227 KB per CTA on Hopper), or None
    (`smem_needs`' arguments)."""
    for kernel, nbytes in self.smem_needs(head_dim, itemsize, **extras).items():
      if not fits_smem(nbytes):
        return (f"{kernel} tiling {getattr(self, kernel)} needs {nbytes} bytes of shared memory "
                f"at head dim {head_dim}; Hopper has {SMEM_BYTES}")
    return None

  def check_smem(self, head_dim: int, itemsize: int, **extras) -> None:
    """ValueError when a kernel's shared memory would not fit (`smem_problem`)."""
    problem = self.smem_problem(head_dim, itemsize, **extras)
    if problem is not None:
      raise ValueError(problem)


# TuningConfig's field names (a mapping `config` changes some of them: mosaic_gpu._checked_config).
FIELDS = frozenset(f.name for f in dataclasses.fields(TuningConfig))

_T = Tiles
TABLE = {
    # Chosen by benchmarks/mosaic_sweep.py on an H100 (docs/hopper_kernel.md); three forward
    # warpgroups by same-process A/Bs (bitwise equal to two): 1.01-1.13x the forward of two at
    # 64, 1.05-1.11x at 128 (once the mask's positions stopped spilling at 160 registers); three
    # in the dQ kernel: fwd+bwd 1.01-1.03x. A persistent forward at 64 (bitwise equal to the
    # grid's; H100, one process): 1.19x the grid's at B16 T1024 N12 causal, 1.06x at B8 T2048
    # N16 full, 1.17x at B4 T4096 N16 causal, 1.30x at B2 T1000 N12 causal, 0.99x at B4 T8192
    # N16 causal. At 128 its second Q buffer does not fit. Delta in the dQ kernel (dq_delta; A/B,
    # fwd+bwd): 1.02x at B16 T1024 N12 H64 causal and B2 T8192 N32 K8 H128, 0.995-1.005x at the
    # other targets; at 256 its O tile does not fit. A persistent dK/dV kernel at 64 (gradients
    # bitwise equal to the grid's; H200, one process, fwd+bwd time): 0.96-0.97x at B16 T1024 N12
    # causal, 0.89x at B2 T1000 N12 causal, 1.00x at B4 T4096 N16 causal, packed B1 T8192 N12
    # 0.95x (8 documents) and 0.88x (64); where every query sees every key 1.02-1.05x (_FULL).
    # The FP8 forward's P V promoted per 64 keys, two accumulators in turn (fp8_pv_promote): its
    # kernel 0.97-1.01x per block's (B4 T4096 N16 causal, four runs), O's bias at a near tail
    # ~3x smaller (H200, benchmarks/results/fp8_dv_promoted_nvidia_h200.md).
    64: TuningConfig(fwd=_T(64, 128, 2), dkv=_T(64, 64, 2), dq=_T(64, 64, 2), fwd_wgs=3,
                     dq_wgs=3, fwd_persistent=True, dq_delta=True, dkv_persistent=True,
                     fp8_pv_promote=64),
    # Two Q/dO stages in the dK/dV kernel at 128, not the H100 sweep's four: fwd+bwd time 0.96x
    # at B1 T16384 N16 causal, 0.96-0.98x packed (B1 T8192, 8 documents) and at B4 T1024 N16
    # causal, 0.98-1.00x at B4 T4096 N16 causal and GQA B2 T8192 N32 K8 (same-process A/Bs on an
    # H100 and an H200, gradients bitwise equal). A persistent dK/dV kernel there: 0.93x at T1024,
    # 0.98x with GQA, 1.00x at T4096, 1.03x at T16384, 1.15-1.20x packed: not taken.
    128: TuningConfig(fwd=_T(64, 128, 2), dkv=_T(64, 64, 2), dq=_T(64, 64, 2), fwd_wgs=3,
                      dq_wgs=3, dq_delta=True),
    # What fits 227 KB at 512-byte rows: 64-row K/V blocks in the forward, 32-row in the dQ
    # kernel; dK and dV in one pass over one 64-key tile per CTA, a warpgroup each (dkv_split:
    # their fp32 accumulators do not fit one warpgroup together), beside 64-row Q/dO blocks. H200,
    # one process, fwd+bwd against the two passes over 32-query blocks it replaces (gradients
    # bitwise equal under the same tiles): 1.20x at B2 T4096 N8 causal, 1.36x at B1 T8192 N8 K4
    # causal, 1.11x cuDNN at both in that run, 1.08x in benchmarks/attention.py's
    # (docs/hopper_kernel.md).
    256: TuningConfig(fwd=_T(64, 64, 2), dkv=_T(64, 64, 2), dq=_T(64, 32, 2), dkv_split=True),
}

# Where dkv_split cannot run at head dim 256 (bias or mask tiles beside the blocks): the dK/dV
# kernel it replaced, dK and dV in two passes over 32-query blocks.
_PASSES_256 = dict(dkv=_T(32, 64, 2), dkv_passes=2, dkv_split=False)


# With bias or mask tiles streaming beside K/V (or Q/dO), 64-key forward blocks and two stages
# leave them room at head dim 128.
_BESIDE = _T(64, 64, 2)
# Where even those do not fit (a bf16 bias at head dim 256, an fp32 bias at 128), 32-key blocks in
# the forward and the dQ kernel: a 64-byte swizzle, the 256 table's dQ tiling already.
_NARROW = _T(64, 32, 2)


# With a bias and no mask at head dim 64, where position or segment masks leave the query tiles
# unequal work (not `full`): the forward's three warpgroups, persistent, over 64-key blocks in three
# stages (beside the bias tiles of their 192 rows and two Q buffers, 128-key blocks do not fit).
# H200, one process, 5 interleaved reps, forward time against two warpgroups' (64, 128, 2):
# 1.15-1.19x at B16 T1024 N12 causal with ALiBi [1, N, T, T], 1.30-1.32x at B4 T4096 N16 with a
# 512-key window, 1.00-1.04x at B8 T2048 N16 causal with a [B, N, T, T] bias (three runs);
# (64, 64, 2) 1.13x at the first. Where every query sees every key, two run (`_BIAS_FULL_FWD`):
# the three ran 0.85-0.90x the grid of two there (B8 T2048 N16). At head dim 128 three ran
# 0.95-1.02x two (docs/hopper_kernel.md). Not where ptxas ignores setmaxnreg (JAX 0.12; not
# measured there). At head dim 128: `_BIAS_APART`.
_BIAS_FWD = {64: dict(fwd=_T(64, 64, 3), fwd_wgs=3, fwd_persistent=True)}

# With a bf16 or fp16 bias and no mask at head dim 128: two warpgroups over 128-key blocks, the
# bias streaming apart from K (`fwd_bias_apart`; beside K's slots only 64-key blocks fit). H200,
# one process, 5 interleaved reps (benchmarks/results/bias_apart_nvidia_h200.md), forward time
# against two warpgroups over (64, 64, 2) with the bias in K's slots: 1.17x at B4 T4096 N16 causal
# with ALiBi [1, N, T, T], 1.12x with GQA (B2 T8192 N32 K8 causal), 1.14x at B8 T2048 N16 full
# with a [B, N, T, T] bias (where the persistent (64, 64, 2) ran level with the grid). Apart over
# 64-key blocks: 0.87-0.95x the bias in K's slots (its fence then during QK^T). An fp32 bias does
# not fit beside 128-key blocks even apart.
_BIAS_APART = {128: dict(fwd=_T(64, 128, 2), fwd_bias_apart=True)}

# With a bias and no mask where every query sees every key: two warpgroups, persistent, taking the
# tiles in the grid's order (a round's CTAs share a few heads' K and V in L2; `persistent_order`).
# H200, one process, 5 interleaved reps, forward time against the grid of two (two runs): 1.09x
# and 1.11x at B8 T2048 N16 H64 with a [B, N, T, T] bias, 1.05x with ALiBi [1, N, T, T] (batch
# rows fastest), 1.04x at H128 with [B, N, T, T] over 64-key blocks (where `_BIAS_APART`'s 128-key
# blocks now run, which do not fit beside a second Q buffer); in the heaviest-first order
# 0.86-0.87x (H64 [B]). Under a causal mask the grid's order leaves the CTAs' work unequal (0.73x
# the heaviest-first order at B16 T1024 N12 H64 with ALiBi), so `_BIAS_FWD` keeps that.
_BIAS_FULL_FWD = {64: dict(fwd_persistent=True, persistent_order="grid")}


# FlashAttention-3's fused dQ (opt-in, TuningConfig.fused_dq): its dK/dV kernel also stages dS^T
# and an fp32 dQ tile, so it takes fewer Q/dO stages. Measured on an H100 against the table's
# two-kernel backward (docs/hopper_kernel.md): faster only at H64 without a causal mask.
_FUSED_DKV = {64: _T(64, 64, 3), 128: _T(64, 64, 2)}


def fused_dq_config(head_dim: int, itemsize: int = 2, **extras) -> TuningConfig:
  """`table_config` with the fused-dQ backward (not bitwise deterministic: dQ is summed by TMA
  reduce-adds in whatever order the CTAs run)."""
  if head_dim not in _FUSED_DKV:
    raise ValueError(f"the fused-dQ backward covers head dims {tuple(_FUSED_DKV)}, got {head_dim}")
  return table_config(head_dim, itemsize, **extras).replace(
      fused_dq=True, dkv=_FUSED_DKV[head_dim], dkv_wgs=COMPUTE_WGS, dkv_persistent=False)


# Where every query sees every key (no causal or window mask, no segment ids), the dK/dV key
# tiles all cost the same, so the hardware's CTA scheduling leaves no tail for a persistent dK/dV
# kernel to even out: it took 1.02-1.05x the grid's fwd+bwd time at B8 T2048 N16 and B16 T1024
# N16 H64 full, 1.02x with GQA (B8 T2048 N16 K4 full; H200, one process); in the grid's order
# 1.05x (three warpgroups) and 1.08x (two) at B8 T2048 N16 H64. The persistent forward takes its
# tiles in the grid's order there: forward 1.05-1.06x the heaviest-first order at B8 T2048 N16
# H64 (two runs), 1.00x at B16 T1024 N16 (H200, one process, outputs bitwise equal).
_FULL = {64: dict(dkv_persistent=False, persistent_order="grid")}

# Where, besides, each kv head has one query head: three dK/dV warpgroups at head dim 64, fwd+bwd
# 1.03-1.06x at B8 T2048 N16, B16 T1024 N12 and N16, B4 T4096 N16 H64 full; under a causal mask
# 0.98-1.01x, with GQA (B2 T8192 N32 K8 full) 0.96x (H100, one process, gradients bitwise equal;
# docs/hopper_kernel.md).
_DENSE = {64: dict(dkv_wgs=3)}

# With segment ids (packed sequences): two warpgroups in the dQ kernel, and at 128 in the forward.
# Their CTAs' 128 rows line up with documents of 128-row multiples, where three warpgroups' 192
# rows straddle two documents and stream the blocks of both. H200, one process, 3 reps, fwd+bwd
# time relative to three (docs/hopper_kernel.md): B1 T8192 N16 H128 causal 0.98x with 8 documents
# of 1024, 0.93x with 64 of 128, 1.00x with one of 8192; N12 H64, 8 of 1024 and 16 of 512: 0.96x
# and 0.87x with two dQ warpgroups, 0.97x and 0.88x with the forward's two as well (its persistent
# three stay).
_PACKED = {64: dict(dq_wgs=2), 128: dict(fwd_wgs=2, dq_wgs=2)}

# Where the dK/dV key tiles differ in work (causal or window masks) and are few, the last wave of
# a grid leaves SMs idle, and a persistent dK/dV kernel evens it out at head dim 128 too. H200,
# one process, 3 reps, fwd+bwd time against the grid, gradients bitwise equal (2026-11-26): 0.85x
# at B4 T1024 N32 K8 causal (256 key tiles of 128 keys), 0.94x at B8 T512 N16 (512), 0.97x at B4
# T2048 N16 and 0.99x at B8 T2048 N32 K8 (1,024); with more tiles 1.00x at B16 T1024 N16 (2,048)
# and B4 T4096 N16, 1.03x at B1 T16384 N16; packed rows 1.15-1.20x (docs/hopper_kernel.md), so
# not with segment ids.
FEW_KEY_TILES = 1024
_FEW = {128: dict(dkv_persistent=True)}

# Under a causal mask (no window, no segment ids) a CTA's work falls with its row (key) CTA index,
# and a grid launched (B, heads, rows) starts the last heads' heaviest CTAs in its last waves: the
# kernel ends on a tail as long as one of them. Launched heaviest first (`heaviest_first`), the
# lighter CTAs fill the SMs that free up. Same process, 3-5 alternating rounds, outputs bitwise
# equal, time of the default against each arm (identical arms spread 0.98-1.04x):
#   head dim 256, B2 T4096 N8 causal, every kernel: forward 1.19x, fwd+bwd 1.17x (JAX 0.11.2);
#     forward 1.18-1.24x, fwd+bwd 1.14x twice (0.12.0.1; with the forward's change alone 1.07x
#     and 1.04x, with the dQ kernel's too 1.12x);
#   head dim 128 causal, the forward: forward 1.00-1.10x at B4 T4096 N16 (median 1.03x of 9
#     arms with it), 1.00-1.05x at B2 T8192 N32 K8 and B1 T16384 N16; fwd+bwd 0.96-1.01x at B4
#     T4096 (median 0.99x of the 4 arms that change only the forward and the dQ kernel),
#     0.99-1.01x at the others. The dK/dV and dQ kernels at 128 stay in grid order: 0.975x and
#     0.979x with the dK/dV kernel heaviest first at B4 T4096 (its 132 CTAs then stream the Q and
#     dO of 64 heads, not 4: L2), 0.99-1.01x elsewhere; the dQ kernel's 0.99-1.02x (H200,
#     benchmarks/results/config_ab_nvidia_h200_j01{1,2}_heaviest*.md).
# Not where every query sees every key (equal tiles: the heaviest-first order only spreads a wave
# over more heads; at B8 T2048 N16 H64 full every kernel heaviest first ran 0.92x on 0.12). With a
# bias alone (`_CAUSAL_BIAS`), ALiBi [1, N, T, T] bf16, fwd+bwd against the grid order: at head
# dim 256 (B2 T4096 N8 causal, the two dK/dV passes) every kernel 1.103x and 1.098x (JAX 0.11.2),
# 1.166x (0.12.0.1), the forward alone 1.02-1.05x; at 128 (B4 T4096 N16) every kernel 0.94-0.95x,
# the forward alone 0.97-0.98x, its kernel 0.87-0.90x as fast (not profiled), so 128 keeps the
# grid order there (benchmarks/results/config_ab_nvidia_h200_j01{1,2}_heaviest_alibi*.md). Masks
# and windows: not measured.
_CAUSAL = {128: dict(heaviest_first=("fwd",)), 256: dict(heaviest_first=("fwd", "dq", "dkv"))}
_CAUSAL_BIAS = {256: dict(heaviest_first=("fwd", "dq", "dkv"))}


# The "fp8" preset's FP8 forward (a top-key residual tile and a second P V product a step:
# `tile.has_top_residual`) at head dim 128: two compute warpgroups. Three, at 160 registers a
# thread, spill 196 bytes there (ptxas; FlashAttention-3's arithmetic under the same tiles does
# not). H200, JAX 0.11.2, one process (benchmarks/results/fp8_preset_sweep_nvidia_h200.md), forward
# kernel time against the bf16 kernel's: 0.738x with two at B4 T4096 N16 causal (three: 0.623x),
# 0.834x at B1 T16384 N16 (0.666x); at head dim 64 two ran 0.91x three.
_TOP_RESIDUAL = {128: dict(fwd_wgs=2)}

# Where ptxas ignores setmaxnreg (JAX 0.12's Mosaic GPU compiles each kernel as a relocatable module
# through libnvJitLink: docs/ptxas_setmaxnreg.md), every thread keeps its share of the register file
# at entry, 65536 / threads: 128 with three compute warpgroups and the producer, 168 with two. The
# table's kernels then spill (1,456 bytes a thread in the head-dim-128 forward) and serialise their
# wgmma (C7512). Without the producer warpgroup (`producer=False`: the last compute warpgroup issues
# the copies) two compute warpgroups keep 255 and three 168, at least what setmaxnreg gives them on
# 0.11 (232, 160), so the table's own tiles fit: at head dim 128 with three Q/dO stages in the dK/dV
# kernel (its issuer, waiting at each step for the slot both warpgroups freed in the previous one,
# loads two steps ahead), at 256 as they are. H200, JAX 0.12.0.1, one process, fwd+bwd against
# cuDNN, before -> after (the tiles taken before: two compute warpgroups and dkv_split at 128, two
# dK/dV passes at 256, with a producer): B4 T4096 N16 H128 causal 0.84x -> 1.02x, B2 T8192 N32 K8
# 0.80x -> 0.92x, B1 T16384 N16 0.80x -> 0.97x, B2 T4096 N8 H256 0.39x -> 1.07x, B1 T8192 N8 K4 H256
# 0.35x -> 1.05x (JAX 0.11.2: 1.01x, 1.01x, 0.97x, 1.08x, 1.08x;
# benchmarks/results/producer_nvidia_h200.md). With two stages (one step ahead) fwd+bwd ran
# 0.91-0.95x cuDNN at those head-dim-128 shapes, with three and refill_lag 2 (one step ahead, no
# wait for the other warpgroup) 0.92-1.03x. Head dim 64 keeps its tiles (full calls aside:
# `_ENTRY_REGISTERS_FULL`): its persistent forward needs the producer (forward 1.28x cuDNN with it,
# 1.01x without at B16 T1024 N12 causal; fwd+bwd 1.24x and 1.10x in a second A/B, where the first
# had read 0.93x for the table's, against 1.28x in benchmarks/attention.py the same day). Calls
# with bias or mask tiles: `_ENTRY_REGISTERS_BESIDE`. At head dim 256 the forward's issuer refills
# K in the step that frees it (`refill_k_early`, a producer's timing): forward 1.03-1.045x, fwd+bwd
# 1.005-1.031x the default at B2 T4096 N8 causal in two A/Bs, bitwise equal; at head dims 64 and
# 128 (three free-running forward warpgroups, not a ping-pong pair) the forward ran 0.93-0.96x
# (H200, JAX 0.12.0.1, benchmarks/results/config_ab_nvidia_h200_j012_refill_k_early*.md).
_ENTRY_REGISTERS = {128: dict(producer=False, dkv=_T(64, 64, 3), fwd_persistent=False,
                              dkv_persistent=False),
                    256: dict(producer=False, refill_k_early=True)}
# The same toolchain, head dim 64, full calls: a forward without a producer (not persistent), the
# backward kernels with one (`fwd_producer`) and the causal table's dK/dV kernel (two warpgroups,
# persistent), not `_FULL`'s and `_DENSE`'s (three warpgroups beside a producer keep 128 registers
# a thread). B8 T2048 N16 H64 full, fwd+bwd against cuDNN: 0.967x and 0.957x in two runs, the
# table's 0.897x, no producer at all 0.909x, the forward's change alone (`_DENSE`'s three dK/dV
# warpgroups kept, this table's entry until 2026-12-01) 0.874x; at B16 T1024 N12 causal the
# table's stays (1.243x; the forward's producer alone 1.161x, the backward's 1.186x, neither
# 1.101x). H200, JAX 0.12.0.1, one process (benchmarks/results/producer_nvidia_h200.md, "Per
# kernel").
_ENTRY_REGISTERS_FULL = {64: dict(fwd_producer=False, fwd_persistent=False, dkv_wgs=COMPUTE_WGS,
                                   dkv_persistent=True, persistent_order="heaviest")}
# The same toolchain, calls with bias or mask tiles (two compute warpgroups in every kernel, none
# persistent) at head dims 128 and 256: the backward kernels without a producer, so each thread
# keeps 255 registers, not the 168 that two compute warpgroups beside a producer keep; the
# forward too with a mask, but with a bias alone at head dim 128 it keeps its producer
# (`_ENTRY_REGISTERS_BIAS_FWD`; at 256 not measured, where 168 registers beside the 64 x 256 fp32
# O spill), the bias in K's slots (`fwd_bias_apart` not measured there). Head dim 64 keeps the
# table's, as without bias or mask (its kernels fit 168 registers): with ALiBi at B16 T1024 N12
# causal the producer in all three kernels ran fastest (below). H200, JAX 0.12.0.1, one process
# each, ms (fwd+bwd unless forward) with a producer in all three kernels / in none / in the
# forward only:
#   B4 T4096 N16 H128 causal, ALiBi [1, N, T, T]   5.405 / 3.755 / 3.594 (cuDNN 5.05)
#     its forward                                  0.643 / 0.791 / 0.628 (tokamax 0.61-0.62)
#   B16 T1024 N12 H64 causal, ALiBi                0.627 / 0.641 / 0.644 (cuDNN 0.99-1.01)
#     its forward                                  0.127 / 0.135 / 0.133 (tokamax 0.124-0.133)
#   B4 T4096 N16 H128, mask all True               7.886 / 4.777 / 4.588 (cuDNN 6.35)
#     a random mask (80% True, [B, 1, T, T])       10.33 / 5.581 / 6.144 (cuDNN 6.42)
#     a block-sparse one (25% of blocks)           3.137 / 1.744 / 1.925 (cuDNN 6.34)
# (0.11.2 against cuDNN: 1.31x with ALiBi, 1.46x, 1.19x and 3.70x with the masks;
# benchmarks/results/features_nvidia_h200_j012_*.md.)
_ENTRY_REGISTERS_BESIDE = {h: dict(producer=False, fwd_bias_apart=False) for h in (128, 256)}
_ENTRY_REGISTERS_BIAS_FWD = {128: dict(fwd_producer=True)}
# The same toolchain, packed rows (segment ids) at head dim 128: the dK/dV kernel's issuer refills
# the slot of two steps back (`refill_lag=2`: one step ahead, no wait for the other warpgroup's
# previous step), where its key tiles' blocks are few and uneven. B1 T8192 N16 H128 causal, 8
# documents of 1024, fwd+bwd against the default (lag 1), gradients bitwise equal: 1.034x, 1.042x
# and 1.043x in three arms of two runs; where rows are not packed it was noise (0.983-1.027x at
# B4 T4096 N16, B2 T8192 N32 K8 and B1 T16384 N16, two arms each, around a 0.97-1.02x spread of
# identical arms). H200, JAX 0.12.0.1, one process (benchmarks/config_ab.py;
# benchmarks/results/config_ab_nvidia_h200_j012_{packed_h64full,lag2}.md).
_ENTRY_REGISTERS_PACKED = {128: dict(refill_lag=2)}
# The same toolchain, causal calls with few dK/dV key tiles (`_FEW`'s, whose persistent dK/dV
# kernel needs a producer): the dK/dV grid heaviest first too. B2 T8192 N32 K8 H128 causal (1,024
# key tiles), fwd+bwd against the default before: 1.031x and 1.033x (the forward's change alone
# 0.992x and 1.010x in the same runs), 1.036x and 1.071x with the dQ kernel's too (0.12.0.1; JAX
# 0.11.2 with 0.12's tiles, every kernel: 1.042x). H200, one process
# (benchmarks/results/config_ab_nvidia_h200_j012_heaviest*.md).
_ENTRY_REGISTERS_FEW = {128: dict(heaviest_first=("fwd", "dkv"))}


def dkv_key_tiles(head_dim: int, batch: int, kv_heads: int, kv_len: int) -> int:
  """How many key tiles (one dK/dV CTA's keys each) the table's dK/dV kernel has."""
  dkv = TABLE[head_dim]
  return batch * kv_heads * -(-kv_len // (dkv.dkv_key_wgs * dkv.dkv.block_kv))


def table_config(head_dim: int, itemsize: int = 2, *, full: bool = False, dense: bool = False,
                 packed: bool = False, causal: bool = False,
                 kv_shape: tuple[int, int, int] | None = None,
                 entry_registers: bool = False, bias_only: bool = False,
                 top_residual: bool = False, **extras) -> TuningConfig:
  """The table's config for a head dim (full: the call masks no (query, key) pair by position or
  segment: `_FULL`'s changes; dense: full, and each kv head has one query head: `_DENSE`'s too;
  packed: it has segment ids, `_PACKED`'s; causal: a causal mask without a window or segment ids,
  `_CAUSAL`'s; kv_shape (batch, kv heads, kv length) giving at most FEW_KEY_TILES dK/dV key tiles
  (`dkv_key_tiles`), neither full nor packed: `_FEW`'s); with
  `extras` (bias / mask tiles: see `smem_needs`), each kernel's first tiling of the table's,
  `_BESIDE` and `_NARROW` that fits shared memory beside them (ValueError when one kernel has
  none), the forward first trying `_BIAS_FWD`'s where they are a bias alone (bias_only), or
  `_BIAS_FULL_FWD`'s where that is also full, `_BIAS_APART`'s at head dim 128; top_residual (the
  "fp8" preset's FP8 forward, which takes no bias or mask): `_TOP_RESIDUAL`'s; entry_registers
  (a toolchain that ignores setmaxnreg: `registers_fixed_at_entry`), last, `_ENTRY_REGISTERS`'
  changes (and `_ENTRY_REGISTERS_FULL`'s where full, `_ENTRY_REGISTERS_PACKED`'s where packed,
  `_ENTRY_REGISTERS_FEW`'s where causal with few key tiles) where there are no bias or mask
  tiles, `_ENTRY_REGISTERS_BESIDE`'s where there are (and `_ENTRY_REGISTERS_BIAS_FWD`'s for a
  bias alone); a causal call with a bias alone: `_CAUSAL_BIAS`'s."""
  if head_dim not in TABLE:
    raise ValueError(f"pallas_mosaic_gpu covers head dims {HEAD_DIMS}, got {head_dim}")
  config = TABLE[head_dim]
  if not extras:
    few = (kv_shape is not None and not (full or dense or packed)
           and dkv_key_tiles(head_dim, *kv_shape) <= FEW_KEY_TILES)
    changes = {**(_FULL.get(head_dim, {}) if full or dense else {}),
               **(_DENSE.get(head_dim, {}) if dense else {}),
               **(_PACKED.get(head_dim, {}) if packed else {}),
               **(_FEW.get(head_dim, {}) if few else {}),
               **(_CAUSAL.get(head_dim, {}) if causal else {}),
               **(_TOP_RESIDUAL.get(head_dim, {}) if top_residual else {}),
               **(_ENTRY_REGISTERS.get(head_dim, {}) if entry_registers else {}),
               **(_ENTRY_REGISTERS_FULL.get(head_dim, {})
                  if entry_registers and (full or dense) else {}),
               **(_ENTRY_REGISTERS_PACKED.get(head_dim, {}) if entry_registers and packed
                  else {}),
               **(_ENTRY_REGISTERS_FEW.get(head_dim, {}) if entry_registers and causal and few
                  else {})}
    return config.replace(**changes)
  config = config.replace(fwd_wgs=COMPUTE_WGS, dq_wgs=COMPUTE_WGS,   # their tiles: per pair
                          dkv_wgs=COMPUTE_WGS, fwd_persistent=False, dkv_persistent=False,
                          **(_PASSES_256 if config.dkv_split else {}),
                          **(_ENTRY_REGISTERS_BESIDE.get(head_dim, {}) if entry_registers
                             else {}),
                          **(_ENTRY_REGISTERS_BIAS_FWD.get(head_dim, {})
                             if entry_registers and bias_only else {}),
                          **(_CAUSAL_BIAS.get(head_dim, {}) if causal and bias_only else {}))
  # Each kernel's shared memory is its own: each takes the first of its options that fits (the
  # dQ kernel keeps delta's O tile before it gives up 64-key blocks; without it, XLA's delta).
  alone = {**(_BIAS_FULL_FWD if full or dense else _BIAS_FWD), **_BIAS_APART}   # a bias alone
  bias_fwd = None if not bias_only or entry_registers else alone.get(head_dim)
  options = {"fwd": ([bias_fwd] if bias_fwd else [])
                    + [dict(fwd=t) for t in (config.fwd, _BESIDE, _NARROW)],
             "dkv": [dict(dkv=t) for t in (config.dkv, _BESIDE)],
             "dq": [dict(dq=t, dq_delta=d) for t in (config.dq, _NARROW)
                    for d in dict.fromkeys((config.dq_delta, False))]}
  chosen = {}
  for kernel, choices in options.items():
    fits = [c for c in choices
            if fits_smem(config.replace(**c).smem_needs(head_dim, itemsize, **extras)[kernel])]
    chosen.update(fits[0] if fits else choices[-1])
  config = config.replace(**chosen)
  config.check_smem(head_dim, itemsize, **extras)
  return config


def registers_fixed_at_entry(version: str) -> bool:
  """Whether JAX `version`'s Mosaic GPU compiles the kernels where ptxas ignores setmaxnreg: 0.12
  (0.12.0.1 measured on an H200: XLA's compilation provider takes libnvJitLink, which compiles
  each kernel relocatably, C7504; docs/ptxas_setmaxnreg.md). 0.10 and 0.11 compile whole-program."""
  return tuple(version.split(".")[:2]) == ("0", "12")
