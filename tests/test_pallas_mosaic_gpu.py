"""implementation="pallas_mosaic_gpu" (Hopper): dispatch, pipeline bookkeeping and lowering on the CPU;
values, gradients, hazards and determinism compiled on a Hopper GPU (`-m gpu`).

JAX has no CPU interpret mode that runs wgmma, so on a CPU the kernels are lowered for CUDA
(`jit(...).trace(...).lower(lowering_platforms=("cuda",))`: the whole Pallas -> Mosaic GPU
lowering, short of ptxas) and their block bookkeeping is checked in plain Python.

    python -m pytest -m gpu tests/test_pallas_mosaic_gpu.py     # on the GPU machine
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn import blocks, tile
from stable_attn.api import Options, canonicalize
from stable_attn.layout import Padded
from stable_attn.diagnostics import REGIMES, measure, tie_inputs
from stable_attn.reference import exact_attention, exact_attention_vjp
from stable_attn.spec import Operands, pack
from tests import cases

IMPL = "pallas_mosaic_gpu"
bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32

mosaic = pytest.importorskip("pallas_kernels.mosaic_gpu")
from pallas_kernels.mosaic_gpu import common, tuning  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402

on_hopper = pytest.mark.skipif(not mosaic.is_available(), reason="needs a Hopper (sm_90) GPU")


FP8 = "fast+qkv=e4m3+p=e4m3+p_scale=256"   # the FP8 forward's numerics (FlashAttention-3's)


def _spec_ops(shape=(2, 128, 4, 64), kv_heads=2, dtype=bf16, **kwargs):
  B, T, N, H = shape
  q = jnp.zeros((B, T, N, H), dtype)
  kv = jnp.zeros((B, T, kv_heads, H), dtype)
  bias, mask = kwargs.pop("bias", None), kwargs.pop("mask", None)
  spec, ops, _ = canonicalize(q, kv, kv, bias, mask, Options(**kwargs))
  return spec, ops


# --- the dispatch table (CPU) -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, reason", [
    (dict(), None),
    (dict(is_causal=True, local_window_size=(16, 0), max_adjust="paper"), None),
    (dict(shape=(1, 64, 2, 128), kv_heads=1, dtype=f16, max_adjust="off"), None),
    (dict(dtype=f32), "float32"),
    (dict(shape=(1, 64, 2, 96), kv_heads=1), "head dim 96"),
    (dict(shape=(1, 64, 2, 256), kv_heads=1), None),
    (dict(shape=(1, 64, 2, 32), kv_heads=1), "head dim 32"),
    # At head dim 256 a bf16 bias streams beside 32-key forward blocks; with a mask as well, or
    # in fp32, the dQ kernel has no room.
    (dict(shape=(1, 64, 2, 256), kv_heads=1, bias=jnp.zeros((1, 1, 64, 64), bf16)), None),
    (dict(shape=(1, 64, 2, 256), kv_heads=1, bias=jnp.zeros((1, 1, 64, 64), bf16),
          mask=jnp.ones((1, 1, 64, 64), bool)), "shared memory"),
    (dict(shape=(1, 64, 2, 256), kv_heads=1, bias=jnp.zeros((1, 1, 64, 64), f32)),
     "shared memory"),
    (dict(bias=jnp.zeros((1, 1, 128, 128), f32)), None),
    (dict(mask=jnp.ones((1, 1, 128, 128), bool), is_causal=True), None),
    (dict(shape=(2, 128, 4, 128), bias=jnp.zeros((2, 4, 128, 128), bf16),
          mask=jnp.ones((2, 1, 1, 128), bool)), None),
    # fp32 bias tiles and the dS staging tile: 32-key blocks in the dQ kernel at head dim 128.
    (dict(shape=(2, 128, 4, 128), bias=jnp.zeros((1, 4, 128, 128), f32),
          mask=jnp.ones((2, 1, 1, 128), bool)), None),
    (dict(numerics="paper"), "numerics 'paper'"),
    (dict(numerics="fast+fp32o"), "numerics 'fast\\+fp32o'"),
    # FP8 q, k, v are quantized before the kernel, whose products of e4m3 values are exact; with
    # P cast to e4m3 too, the FP8 forward (head dim 64, 128; no bias or mask), the "fp8" preset's
    # top key in bf16 and rounded row sum too; fp16's top key has no e4m3 residual.
    (dict(numerics="fast+qkv=e4m3"), None),
    (dict(shape=(2, 128, 4, 128), numerics=FP8), None),
    (dict(shape=(2, 128, 4, 128), numerics="fast+qkv=e4m3+p=e4m3"), None),
    (dict(numerics=FP8), None),
    (dict(shape=(2, 128, 4, 256), numerics=FP8), "head dim 256: the FP8 forward"),
    (dict(shape=(2, 128, 4, 128), numerics=FP8, mask=jnp.ones((1, 1, 128, 128), bool)),
     "no bias or mask"),
    (dict(shape=(2, 128, 4, 128), numerics="fast+p=e4m3+p_scale=256"),
     "numerics 'fast\\+p=e4m3"),
    (dict(numerics="fp8"), None),
    (dict(shape=(2, 128, 4, 128), numerics="fp8+sum_keeps_max=false"), None),
    (dict(numerics="fp8", dtype=f16), "top key's P_bar in bfloat16 only"),
    (dict(numerics="fp8+p_top=float32"), "not float32"),
    (dict(numerics="fp8+p_top=p+sum_of_rounded_p=false+sum_keeps_max=false"), None),
    (dict(numerics="fp8+sum=input"), "numerics 'fp8\\+sum=input'"),
    (dict(interpret=True), "interpret"),
    (dict(q_segment_ids=jnp.zeros((2, 128), jnp.int32), is_causal=True), None),
    (dict(logits_soft_cap=30.0, is_causal=True), None),
    (dict(sinks=jnp.zeros(4, f32), logits_soft_cap=5.0), None),
])
def test_covers(kwargs, reason):
  spec, ops = _spec_ops(**kwargs)
  got = mosaic.covers(spec, ops)
  if reason is None:
    assert got is None
  else:
    assert got is not None and re.search(reason, got), got


def test_dispatch_off_hopper():
  if mosaic.is_available():
    pytest.skip("checks the dispatch where no Hopper GPU is present")
  q = jnp.ones((1, 64, 2, 64), bf16)
  choice = stable_attn.choose_implementation(q, q, q, is_causal=True)
  assert "pallas_mosaic_gpu" in choice.passed_over
  assert choice.name in ("pallas_gpu", "reference")
  with pytest.raises(ValueError, match="pallas_mosaic_gpu"):
    stable_attn.dot_product_attention(q, q, q, implementation=IMPL)
  with pytest.raises(ValueError, match="does not cover.*interpret"):
    stable_attn.dot_product_attention(q, q, q, implementation=IMPL, interpret=True)


def test_tuning_config_validates():
  T = tuning.Tiles
  with pytest.raises(ValueError, match="block_q"):
    T(16, 64, 2)
  with pytest.raises(ValueError, match="block_kv"):
    T(64, 80, 2)
  with pytest.raises(ValueError, match="fwd.block_q must be a multiple of 64"):
    tuning.table_config(64).replace(fwd=T(32, 64, 2))
  with pytest.raises(ValueError, match="dkv.block_kv must be a multiple of 64"):
    tuning.table_config(64).replace(dkv=T(64, 96, 2))
  with pytest.raises(ValueError, match="dkv_passes"):
    tuning.table_config(256).replace(fused_dq=True)
  with pytest.raises(ValueError, match="stages"):
    T(64, 64, 1)
  with pytest.raises(ValueError, match="shared memory"):
    tuning.table_config(128).replace(fwd=T(64, 256, 3)).check_smem(128, 2)
  with pytest.raises(ValueError, match="head dims"):
    tuning.table_config(96)
  with pytest.raises(ValueError, match="fwd_wgs must be 2 or 3"):
    tuning.table_config(64).replace(fwd_wgs=4)
  with pytest.raises(ValueError, match="dq_wgs must be 2 or 3"):
    tuning.table_config(64).replace(dq_wgs=1)
  with pytest.raises(ValueError, match="dkv_wgs must be 2 or 3"):
    tuning.table_config(64).replace(dkv_wgs=4)
  with pytest.raises(ValueError, match="fused_dq splits dQ between two"):
    tuning.fused_dq_config(64).replace(dkv_wgs=3)
  # three dK/dV warpgroups where every query sees every key at head dim 64, not under a bias or
  # mask, not in the fused backward
  assert tuning.table_config(64, dense=True).dkv_wgs == 3
  assert tuning.table_config(64).dkv_wgs == tuning.table_config(128, dense=True).dkv_wgs == 2
  assert tuning.table_config(64, dense=True, beside=1).dkv_wgs == 2
  assert tuning.table_config(64, full=True).dkv_wgs == 2   # GQA: every query sees every key
  assert tuning.fused_dq_config(64).dkv_wgs == 2
  with pytest.raises(ValueError, match="dq tiling"):   # three dQ warpgroups do not fit at 256
    tuning.table_config(256).replace(dq_wgs=3).check_smem(256, 2)
  # three forward and dQ warpgroups at head dims 64 and 128, two (per pair: the tiles) with a
  # bias or mask
  for h, wgs in ((64, 3), (128, 3), (256, 2)):
    assert tuning.table_config(h).fwd_wgs == tuning.table_config(h).dq_wgs == wgs
    assert tuning.table_config(h, beside=1).fwd_wgs == tuning.table_config(h, beside=1).dq_wgs == 2
  # a bf16 bias alone at head dim 64 under a position mask: the persistent three-warpgroup
  # forward over 64-key blocks; the grid of two on a toolchain that ignores setmaxnreg, and
  # beside an fp32 bias (whose tiles do not fit)
  bf16_bias = dict(beside=2, bias=2, ds_itemsize=2)
  config = tuning.table_config(64, **bf16_bias, bias_only=True)
  assert (config.fwd, config.fwd_wgs, config.fwd_persistent) == (T(64, 64, 3), 3, True)
  assert (config.dq_wgs, config.dkv_wgs, config.dkv_persistent) == (2, 2, False)
  assert config.persistent_order == "heaviest" and not config.fwd_bias_apart
  for kwargs in (dict(entry_registers=True), dict(beside=4, bias=4, ds_itemsize=4),
                 dict(full=True, beside=4, bias=4, ds_itemsize=4)):
    other = tuning.table_config(64, **{**bf16_bias, **kwargs}, bias_only=True)
    assert (other.fwd_wgs, other.fwd_persistent) == (2, False), kwargs
  # ... and where every query sees every key, two persistent warpgroups taking the tiles in the
  # grid's order, not beside a mask
  config = tuning.table_config(64, **bf16_bias, bias_only=True, full=True)
  assert (config.fwd, config.fwd_wgs, config.fwd_persistent, config.persistent_order) == (
      T(64, 128, 2), 2, True, "grid")
  assert not tuning.table_config(64, beside=3, bias=2, ds_itemsize=2, full=True).fwd_persistent
  # at head dim 128, a bf16 bias alone: the grid of two over 128-key blocks, the bias streaming
  # apart from K (one slot in all: beside K's two, those blocks do not fit); 64-key blocks with
  # the bias in K's slots beside a mask, with an fp32 bias, and where ptxas ignores setmaxnreg
  for full in (False, True):
    config = tuning.table_config(128, **bf16_bias, bias_only=True, full=full)
    assert (config.fwd, config.fwd_wgs, config.fwd_persistent, config.fwd_bias_apart) == (
        T(64, 128, 2), 2, False, True)
    with_k = config.replace(fwd_bias_apart=False)
    slot = 2 * 64 * 128 * 2   # a bias slot: both warpgroups' rows x 128 keys in bf16
    assert (with_k.smem_needs(128, 2, **bf16_bias)["fwd"]
            - config.smem_needs(128, 2, **bf16_bias)["fwd"]) == slot
    assert with_k.smem_problem(128, 2, **bf16_bias) is not None
  for kwargs in (dict(beside=4, bias=4, ds_itemsize=4, bias_only=True),
                 dict(beside=3, bias=2, ds_itemsize=2),
                 dict(**bf16_bias, bias_only=True, entry_registers=True)):
    config = tuning.table_config(128, **kwargs)
    assert (config.fwd.block_kv, config.fwd_bias_apart) == (64, False), kwargs
  # without bias or mask, the persistent forward at 64 takes the grid's order where every query
  # sees every key, the heaviest rows first otherwise
  assert tuning.table_config(64, full=True).persistent_order == "grid"
  assert tuning.table_config(64, dense=True).persistent_order == "grid"
  assert tuning.table_config(64).persistent_order == "heaviest"
  with pytest.raises(ValueError, match="persistent_order must be one of"):
    tuning.table_config(64).replace(persistent_order="rows")
  # the FP8 forward's P V promotion: keys per fresh accumulator, the 128-key block by default,
  # 64 keys (two accumulators in turn) in the table at head dim 64; the backward's dV per block
  assert tuning.table_config(128).fp8_pv_promote == 128
  assert tuning.table_config(64).fp8_pv_promote == 64
  for bad in (True, 1, 48, 256):
    with pytest.raises(ValueError, match="fp8_pv_promote must be one of"):
      tuning.table_config(128).replace(fp8_pv_promote=bad)
  assert tuning.table_config(64).fp8_dv_promote is True
  with pytest.raises(ValueError, match="fp8_dv_promote must be a bool"):
    tuning.table_config(64).replace(fp8_dv_promote=1)
  q = jnp.ones((1, 64, 2, 64), bf16)
  for name, refused in (("fwd_wgs", "mask"), ("dq_wgs", "bias or mask"),
                        ("dkv_wgs", "bias or mask")):
    config = tuning.table_config(64, beside=1).replace(**{name: 3})
    with pytest.raises(ValueError, match=f"{name}=3 takes no {refused}"):
      stable_attn.dot_product_attention(q, q, q, mask=jnp.ones((64, 64), bool),
                                        implementation=IMPL, config=config)
  # the forward's three warpgroups take a bias (its tiles cover all their rows); off Hopper the
  # call then fails only for want of the GPU
  config = tuning.table_config(64, beside=2).replace(fwd_wgs=3)
  call = lambda: stable_attn.dot_product_attention(q, q, q, bias=jnp.ones((64, 64), bf16),
                                                   implementation=IMPL, config=config)
  if mosaic.is_available():
    call()
  else:
    with pytest.raises(ValueError, match="needs a Hopper"):
      call()
  for h in tuning.HEAD_DIMS:
    tuning.table_config(h).check_smem(h, 2)
  # the persistent forward: two Q buffers (room for them at head dim 64 only), two or three
  # warpgroups
  assert tuning.table_config(64).fwd_persistent
  assert not tuning.table_config(64, beside=1).fwd_persistent
  tuning.table_config(64).replace(fwd_wgs=2).check_smem(64, 2)
  with pytest.raises(ValueError, match="fwd tiling"):
    tuning.table_config(128).replace(fwd_persistent=True).check_smem(128, 2)
  # the persistent dK/dV kernel: one pass, no fused dQ, two K/V buffers (at head dim 128 not
  # beside four Q/dO stages)
  with pytest.raises(ValueError, match="dkv_persistent runs one dK/dV pass"):
    tuning.fused_dq_config(64).replace(dkv_persistent=True)
  with pytest.raises(ValueError, match="dkv_persistent runs one dK/dV pass"):
    tuning.table_config(256).replace(dkv_split=False, dkv_passes=2, dkv_persistent=True)
  with pytest.raises(ValueError, match="dkv_split gives each of 2 dK/dV warpgroups one gradient"):
    tuning.table_config(256).replace(dkv_persistent=True)
  with pytest.raises(ValueError, match="dkv tiling"):
    tuning.table_config(128).replace(dkv_persistent=True, dkv=T(64, 64, 4)).check_smem(128, 2)
  tuning.table_config(128).replace(dkv_persistent=True).check_smem(128, 2)
  config = tuning.table_config(64)
  assert config.dkv_persistent and not tuning.fused_dq_config(64).dkv_persistent
  with pytest.raises(ValueError, match="dkv_persistent=True takes no bias or mask"):
    stable_attn.dot_product_attention(q, q, q, mask=jnp.ones((64, 64), bool),
                                      implementation=IMPL, config=config.replace(
                                          fwd_wgs=2, dq_wgs=2, fwd_persistent=False))
  # nor the persistent forward a mask (a bias it takes: `_BIAS_FWD`)
  with pytest.raises(ValueError, match="fwd_persistent=True takes no mask"):
    stable_attn.dot_product_attention(q, q, q, mask=jnp.ones((64, 64), bool),
                                      implementation=IMPL, config=config.replace(
                                          fwd_wgs=2, dq_wgs=2, dkv_persistent=False))


def test_deterministic_refuses_the_fused_backward():
  """deterministic=True with a config whose backward reduce-adds dQ (fused_dq) is refused, naming
  both; the default table's backward (two kernels, no reduce-adds) is what deterministic=False
  runs too: the table picks no fused backward (measured slower, docs/hopper_kernel.md)."""
  q = jnp.ones((1, 128, 2, 64), bf16)
  with pytest.raises(ValueError, match="fused_dq.*deterministic=True"):
    stable_attn.dot_product_attention(q, q, q, implementation=IMPL, deterministic=True,
                                      config=tuning.fused_dq_config(64))
  for kwargs in (dict(), dict(is_causal=True), dict(shape=(1, 128, 4, 128)),
                 dict(q_segment_ids=jnp.zeros((2, 128), jnp.int32))):
    for deterministic in (False, True):
      spec, ops = _spec_ops(deterministic=deterministic, **kwargs)
      assert not mosaic.default_config(spec, ops).fused_dq


# --- pipeline bookkeeping (CPU) ------------------------------------------------------------------

def _range_case(rng, q_multiple: int, k_multiple: int):
  """A random call for the block-range tests: T and S (multiples of 64) padded up to multiples of
  q_multiple and k_multiple, lengths, causal or not, a window or none, and in half the draws a
  shift of the rows among the keys in [-S, S) (a context-parallel device's: later under the
  allgather strategy, earlier too under the ring). -> (Tp, Sp, q_len, kv_len, shift, causal,
  window, Call)."""
  T, S = (int(x) * 64 for x in rng.integers(1, 12, 2))
  Tp, Sp = blocks.cdiv(T, q_multiple) * q_multiple, blocks.cdiv(S, k_multiple) * k_multiple
  q_len, kv_len = int(rng.integers(0, T + 1)), int(rng.integers(0, S + 1))
  shift = int(rng.integers(-S, S)) if rng.integers(2) else 0
  causal = bool(rng.integers(2))
  window = None if rng.integers(2) else tuple(int(x) for x in rng.integers(0, 300, 2))
  # The window as drawn: canonicalize would clamp it to the placeholder call's T = S = 128.
  spec = dataclasses.replace(_spec_ops(is_causal=causal)[0], window=window)
  return Tp, Sp, q_len, kv_len, shift, causal, window, common.Call(spec, None, Padded(Tp, Sp, 64),
                                                                   None, None)


@pytest.mark.parametrize("wgs", [2, 3])
def test_union_ranges_and_sections(wgs):
  """For random shapes and masks: each warpgroup computes exactly its own visible blocks (masked
  where needed), skips the rest of the union, and the union holds every warpgroup's blocks. With
  3 warpgroups T is padded to 2 * block_q only, and the last CTA's rows before 0 are idle. Half
  the draws shift the rows among the keys (q_shift: a context-parallel device's)."""
  rng = np.random.default_rng(wgs)
  for _ in range(200):
    bq, bk = 64, int(rng.choice([64, 128]))
    Tp, Sp, q_len, kv_len, shift, causal, window, call = _range_case(rng, 2 * bq, bk)
    lens = common.Lengths(q_len, kv_len, shift)
    for cta in (common.cta_rows(call, wgs, bq, i)[1] for i in range(blocks.cdiv(Tp, wgs * bq))):
      ranges = [common.kv_ranges_of(call, common.Ranges(), 0, 0, cta + w * bq, bq, bk, lens,
                                    wgs=wgs) for w in range(wgs)]
      lo, hi = (int(x) for x in common.union_range(*ranges))
      for w in range(wgs):
        a, b, c, d = (int(x) for x in common.clamp_ranges(ranges[w], lo, hi))
        assert lo <= a <= b <= c <= d <= hi
        kinds = {j: "skip" for j in range(lo, hi)}
        kinds.update({j: "masked" for j in list(range(a, b)) + list(range(c, d))})
        kinds.update({j: "full" for j in range(b, c)})
        if cta + w * bq < 0:   # an idle warpgroup
          assert set(kinds.values()) <= {"skip"}, (cta, w)
          continue
        vis = np.asarray(tile.visible(cta + w * bq + np.arange(bq), np.arange(Sp), q_len, kv_len,
                                      causal=causal, window=window, shift=shift))
        for j in range(Sp // bk):
          block = vis[:, j * bk:(j + 1) * bk]
          if block.any():
            assert kinds.get(j) in ("masked", "full"), (cta, w, j, kinds.get(j))
          if kinds.get(j) == "full":
            assert block.all(), (cta, w, j)


@pytest.mark.parametrize("wgs", [2, 3])
def test_key_ranges_of_dkv_ctas(wgs):
  """The dK/dV kernel's CTAs of wgs * block_kv keys from key 0 on (S padded to 2 * block_kv):
  each warpgroup's query-block range holds every query block that sees one of its keys, its
  "full" blocks see them all, and the warpgroups past the padded S are empty."""
  rng = np.random.default_rng(10 + wgs)
  for _ in range(200):
    bq, bk = 64, 64
    Tp, Sp, q_len, kv_len, shift, causal, window, call = _range_case(rng, bq, 2 * bk)
    lens = common.Lengths(q_len, kv_len, shift)
    vis = np.asarray(tile.visible(np.arange(Tp), np.arange(Sp), q_len, kv_len, causal=causal,
                                  window=window, shift=shift))
    for cta in range(blocks.cdiv(Sp, wgs * bk)):
      for w in range(wgs):
        k_start = cta * wgs * bk + w * bk
        a, b, c, d = (int(x) for x in common.q_ranges_of(call, common.Ranges(), 0, 0, k_start, bk,
                                                         bq, lens, wgs=wgs))
        if k_start >= Sp:
          assert a == b == c == d == 0, (cta, w)
          continue
        assert a <= b <= c <= d
        for i in range(Tp // bq):
          block = vis[i * bq:(i + 1) * bq, k_start:k_start + bk]
          if block.any():
            assert a <= i < d, (cta, w, i)
          if b <= i < c:
            assert block.all(), (cta, w, i)


def _record_sections(order, mine, flags=None):
  """[(position, block, kind)] as common.sections runs them."""
  visited = []

  def step(p, j, carry, kind):
    jax.debug.callback(lambda p, j, kind=kind: visited.append((int(p), int(j), kind)), p, j)
    return carry

  jax.block_until_ready(common.sections(order, mine, step, jnp.zeros(()), flags))
  return visited


@pytest.mark.parametrize("total,ctas", [(2752, 132), (1152, 132), (264, 132), (265, 132),
                                         (131, 131), (7, 3)])
def test_persistent_tiles_cover_each_tile_once(total, ctas):
  """The persistent forward's CTAs take every tile once, in zigzag rounds that even out their
  work when the tiles come heaviest first (cost total - t for tile t)."""
  taken, work = [], []
  for cta in range(ctas):
    count, nth = common.persistent_tiles(jnp.int32(cta), ctas, total)
    mine = [int(nth(jnp.int32(i))) for i in range(int(count))]
    assert mine == sorted(mine)   # heaviest first within a CTA too
    taken += mine
    work.append(sum(total - t for t in mine))
  assert sorted(taken) == list(range(total))
  assert max(work) - min(work) <= total   # within one tile's cost; round-robin: rounds x ctas


@pytest.mark.parametrize("order, inner", [("heaviest", False), ("grid", False), ("grid", True)])
def test_tile_coords_take_each_tile_once(order, inner):
  """A persistent kernel's tile t names each (batch row, head, CTA index) once; in the grid's
  order, in the order a grid launches its CTAs (last grid dimension fastest): (B, heads, rows),
  or (heads, rows, B) with the batch rows fastest."""
  B, heads, per_row = 3, 5, 4
  coords = [tuple(int(c) for c in common.tile_coords(jnp.int32(t), (B, heads, per_row), order,
                                                       inner))
            for t in range(B * heads * per_row)]
  assert sorted(coords) == list(itertools.product(range(B), range(heads), range(per_row)))
  if order == "heaviest":   # the CTA index slowest: every head's first rows come first
    assert [c[2] for c in coords] == sorted(c[2] for c in coords)
  elif inner:
    assert coords == [(b, n, r) for n, r, b in itertools.product(range(heads), range(per_row),
                                                                   range(B))]
  else:
    assert coords == list(itertools.product(range(B), range(heads), range(per_row)))
  if order == "grid":   # the order common._grid launches its grid in, last dimension fastest
    dims, names, _ = common._grid(B, heads, per_row, "q_seq", False, inner)
    launched = [dict(zip(names, index)) for index in itertools.product(*map(range, dims))]
    assert coords == [(c["batch"], c["heads"], c["q_seq"]) for c in launched]


def test_sections_run_in_order():
  order = common.Schedule(2, 9, lambda j: j, lambda p: p)
  assert [(j, kind) for p, j, kind in _record_sections(order, (3, 4, 6, 7))] == [
      (2, "skip"), (3, "masked"), (4, "full"), (5, "full"), (6, "masked"), (7, "skip"),
      (8, "skip")]


@pytest.mark.parametrize("per", ["query", "key"])
def test_mask_schedule_streams_only_needed_blocks(per):
  """Under a block-sparse mask a CTA streams, in order, exactly the blocks of its union range whose
  tile (both warpgroups' rows, the heads of a group) holds a True; each warpgroup runs the edge
  blocks of its range whose own tile is all False as "empty" steps, the others as before."""
  rng = np.random.default_rng(1)
  bq, bk, groups = 64, 128, 2
  n_own, n_other = (8, 6) if per == "query" else (6, 8)   # blocks of the owned / streamed axis
  T, S = (n_own * bq, n_other * bk) if per == "query" else (n_other * bk, n_own * bq)
  block = (bq, bk) if per == "query" else (bk, bq)
  keep = rng.random((1, 4, T // block[0], S // block[1])) < 0.4
  mask = jnp.asarray(np.repeat(np.repeat(keep, block[0], 2), block[1], 3))
  x = Operands(*(None,) * len(Operands._fields))._replace(mask=mask)
  ranges = common.block_ranges(x, *block, per, groups=groups)
  tiles = np.asarray(mask).reshape(1, 4, T // block[0], block[0], S // block[1], block[1])
  tile_any = tiles.any(axis=(3, 5))
  if per == "key":
    tile_any = tile_any.swapaxes(-1, -2)
  lo, hi = 1, n_other - 1   # a union range that cuts some blocks off
  seen = set()
  for head in range(4 // groups):
    for cta in range(n_own // 2):
      order = common.schedule(ranges, 0, head, lo, hi, cta * 2 * block[0], 2 * block[0])
      needed = tile_any[0, head * groups:(head + 1) * groups, 2 * cta:2 * cta + 2].any(axis=(0, 1))
      streamed = [int(order.block(p)) for p in range(int(order.first), int(order.stop))]
      assert streamed == [j for j in range(lo, hi) if needed[j]]
      for w, n in itertools.product((0, 1), range(head * groups, (head + 1) * groups)):
        own = 2 * cta + w
        mine = (lo + w, lo + w, lo + w + 1, hi)   # block lo + w full, the rest of it edge blocks
        got = _record_sections(order, mine, common.block_flags(ranges.mask_blocks, 0, n, own))
        assert [j for _, j, _ in got] == streamed
        for _, j, kind in got:
          if j < mine[0]:
            want = "skip"
          elif j == lo + w:
            want = "full"
          else:
            want = "masked" if tile_any[0, n, own, j] else "empty"
          assert kind == want, (head, cta, w, n, j)
          seen.add(kind)
  assert seen == {"skip", "full", "masked", "empty"}   # every kind was tested


# --- lowering for CUDA on the CPU --------------------------------------------------------------

LOWER_CASES = [
    dict(shape=(2, 256, 4, 64), kv_heads=2, is_causal=True, max_adjust="safe"),
    dict(shape=(1, 300, 2, 128), kv_heads=1, max_adjust="off"),
    dict(shape=(2, 200, 2, 128), kv_heads=2, dtype=f16, is_causal=True,
         local_window_size=(100, 0), max_adjust="paper"),
    dict(shape=(2, 200, 4, 256), kv_heads=2, is_causal=True, max_adjust="safe"),
]


@pytest.mark.parametrize("kwargs", LOWER_CASES, ids=lambda k: f"H{k['shape'][-1]}")
def test_lowers_for_cuda(kwargs):
  """Forward and backward lower to three Mosaic GPU kernels (fwd, dK/dV, dQ), also at head dim
  256, whose dK and dV take a warpgroup each of one pass (dkv_split); four where they take a pass
  each."""
  spec, ops = _spec_ops(**kwargs)
  assert mosaic.covers(spec, ops) is None
  config = tuning.table_config(ops.q.shape[-1])
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2 + config.dkv_passes
  passes = ("dkv",) if config.dkv_passes == 1 else ("dk", "dv")
  for name in ("forward", "dq", *passes):   # named, for profiles (common.profiling, nsys)
    assert f"stable_attn_{name}" in text


@pytest.mark.parametrize("H, bias_dtype, mask, kernel", [(256, bf16, False, "fwd"),
                                                          (128, f32, True, "dq")])
def test_narrow_tiles_take_what_fits_nowhere_else(H, bias_dtype, mask, kernel):
  """A bias (and mask) whose tiles fit no 64-key block (a bf16 bias at head dim 256: the
  forward; an fp32 bias and a mask at 128: the dQ kernel, beside dbias's fp32 staging) take
  32-key blocks in that kernel alone, and the call lowers for CUDA."""
  T = 200
  spec, ops = _spec_ops(shape=(2, T, 4, H), kv_heads=2, is_causal=True,
                        bias=jnp.zeros((1, 4, T, T), bias_dtype),
                        mask=jnp.ones((2, 1, T, T), bool) if mask else None)
  assert mosaic.covers(spec, ops) is None
  config = mosaic.default_config(spec, ops)
  wide = tuning.TABLE[H].replace(**{kernel: tuning.Tiles(64, 64, 2)})
  assert getattr(config, kernel) == tuning.Tiles(64, 32, 2)
  assert wide.smem_needs(H, 2, **mosaic._extras(ops))[kernel] + tuning.SMEM_RESERVE > \
      tuning.SMEM_BYTES
  assert config.smem_problem(H, 2, **mosaic._extras(ops)) is None
  assert tuning.table_config(H, 2, beside=1).fwd.block_kv == 64 * (1 + (H < 256))
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2 + config.dkv_passes


@pytest.mark.parametrize("max_adjust", ["off", "paper", "safe"])
def test_base2_tiles_with_a_bias_match_float64(max_adjust):
  """The Hopper kernels' tile math in log2 units with a bias (the tile holds scale * qk + bias,
  log2(e) stays outside it as the Scores factor): two key blocks through rescale, accumulate and
  finalize, then backward_p, against float64 softmax; masked entries and -inf bias entries give
  P = 0."""
  from stable_attn import numerics
  rng = np.random.default_rng()
  bq, bk, H, scale = 16, 32, 64, 0.125
  q, k, v = (rng.standard_normal(shape) for shape in ((bq, H), (2 * bk, H), (2 * bk, H)))
  q, k, v = (np.asarray(jnp.asarray(a, bf16), np.float64) for a in (q, k, v))
  bias = np.asarray(jnp.asarray(3 * rng.standard_normal((bq, 2 * bk)), bf16), np.float64)
  bias[:, 5] = -np.inf
  ok = np.arange(2 * bk)[None, :] <= np.arange(bq)[:, None] + bk   # a causal edge in block 2
  dt = numerics.FAST.dtypes(bf16)
  qk = jnp.asarray(q @ k.T, f32)
  offset = None
  if max_adjust == "safe":
    offset = tile.safe_offset(jnp.arange(bq), jnp.int32(0), bf16, base2=True)
  stats, acc, tiles = tile.init_stats(bq, dt), jnp.zeros((bq, H), f32), []
  for j in range(2):
    cols = slice(j * bk, (j + 1) * bk)
    s = tile.scores(qk[:, cols], jnp.asarray(ok[:, cols]), scale=scale, dt=dt, base2=True,
                    bias=jnp.asarray(bias[:, cols], bf16))
    assert s.factor == tile.LOG2E
    p, alpha, stats = tile.rescale(stats, s, dt=dt, max_adjust=max_adjust, beta=8.0,
                                   offset=offset, base2=True)
    acc = tile.accumulate(acc, alpha, tile.pv_product(p, jnp.asarray(v[cols], bf16), dt), dt=dt)
    tiles.append(s)
  o, _, lse = tile.finalize(acc, stats, dt=dt, offset=offset, base2=True)
  logits = np.where(ok, scale * (q @ k.T) + bias, -np.inf)
  want_lse = np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1)) + logits.max(1)
  want_p = np.exp(logits - want_lse[:, None])
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(np.asarray(o, np.float64), want_p @ v, atol=2e-2)
  p = np.concatenate([np.asarray(tile.backward_p(s, lse, in_dtype=bf16, base2=True)[0])
                      for s in tiles], axis=1)
  np.testing.assert_allclose(p, want_p, rtol=1e-5, atol=1e-7)
  assert np.all(p[~ok] == 0) and np.all(p[:, 5] == 0)


@pytest.mark.parametrize("H, wgs, persistent, apart", [
    (64, 3, False, False), (64, 3, True, False), (128, 3, False, False), (64, 2, True, False),
    (64, 3, True, True), (128, 2, False, True)])
def test_bias_forward_lowers_with_three_warpgroups(H, wgs, persistent, apart):
  """A bias (no mask) beside the forward's three warpgroups, persistent at head dim 64 (or two
  persistent ones): the tiles fit, the bias slots span all the warpgroups' rows, and the call
  lowers for CUDA; so does a bias streaming apart from K (a tile per warpgroup, 128-key blocks
  at 128)."""
  T = 200   # padded to 256, not a multiple of 192: the last CTA's first warpgroup idles
  spec, ops = _spec_ops(shape=(2, T, 4, H), kv_heads=2, is_causal=True,
                        bias=jnp.zeros((1, 4, T, T), bf16))
  config = mosaic.default_config(spec, ops).replace(
      fwd_wgs=wgs, fwd_persistent=persistent, fwd_bias_apart=apart,
      fwd=tuning.Tiles(64, 64 * (1 + (apart and H == 128)), 2))
  assert config.smem_problem(H, 2, **mosaic._extras(ops)) is None
  assert common.has_idle_rows(mosaic._call(spec, config, ops), wgs, 64) == (wgs == 3)
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2 + config.dkv_passes


@pytest.mark.parametrize("bias, mask, B, inner", [
    ((1, 4), None, 2, True),          # a bias every batch row shares
    (None, (1, 1), 3, True),          # a mask every batch row and head shares
    ((2, 4), (1, 1), 2, True),        # a per-row bias beside a shared mask: the mask's tiles
    ((2, 4), (2, 1), 2, False),       # nothing shared
    ((1, 4), None, 1, False),         # one batch row: nothing to share
])
def test_grids_run_the_batch_fastest_where_it_shares_a_tile(bias, mask, B, inner):
  """With a bias or mask of leading dim 1 and B > 1, every kernel's grid is (heads, rows, batch)
  (CUDA starts CTAs last dimension fastest), else (batch, heads, rows), as with
  batch_inner=False; the reordered kernels lower for CUDA."""
  T, N, H = 200, 4, 128
  spec, ops = _spec_ops(shape=(B, T, N, H), kv_heads=2, is_causal=True,
                        bias=None if bias is None else jnp.zeros((*bias, T, T), bf16),
                        mask=None if mask is None else jnp.ones((*mask, T, T), bool))
  config = mosaic.default_config(spec, ops)
  for c, batch_fastest in ((config, inner), (config.replace(batch_inner=False), False)):
    call = mosaic._call(spec, c, ops)
    for grid, names, _ in (common.query_grid(call, ops, "fwd", 2, 64, False),
                           common.key_grid(call, ops, 2, 64, False)):
      assert names[-1 if batch_fastest else 0] == "batch", names
      assert grid[names.index("batch")] == B and grid[names.index("heads")] in (N, 2)
  if inner:
    text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2 + config.dkv_passes


@pytest.mark.parametrize("inner", [False, True])
def test_heaviest_first_grids_start_every_heads_heaviest_ctas_first(inner):
  """TuningConfig.heaviest_first: the named kernels' grids launch the row (key) CTA index
  slowest, so the first B * heads CTAs CUDA starts (last grid dimension fastest) are every
  head's CTA 0, the heaviest causal rows (keys); the batch rows stay fastest where a shared bias
  asks for it; the other kernels' grids and the persistent ones do not change; the kernels lower
  for CUDA with it."""
  B, T, N, K, H = 2, 512, 4, 2, 128
  bias = jnp.zeros((1, N, T, T), bf16) if inner else None
  spec, ops = _spec_ops(shape=(B, T, N, H), kv_heads=K, is_causal=True, bias=bias)
  config = mosaic.default_config(spec, ops).replace(fwd_persistent=False, dkv_persistent=False,
                                                     heaviest_first=())
  grids = lambda c: {kernel: grid(mosaic._call(spec, c, ops), *args)[:2] for kernel, (grid, *args)
                     in {"fwd": (common.query_grid, ops, "fwd", 2, 64, False),
                         "dq": (common.query_grid, ops, "dq", 2, 64, False),
                         "dkv": (common.key_grid, ops, 2, 64, False)}.items()}
  plain = grids(config)
  for chosen in (("dkv",), ("fwd", "dq", "dkv")):
    changed = grids(config.replace(heaviest_first=chosen))
    for kernel, (dims, names) in changed.items():
      if kernel not in chosen:
        assert (dims, names) == plain[kernel]
        continue
      axis = "kv_seq" if kernel == "dkv" else "q_seq"
      assert names[0] == axis and sorted(dims) == sorted(plain[kernel][0]), (kernel, names)
      assert names[-1] == ("batch" if inner else "heads"), names
      launched = [dict(zip(names, i)) for i in itertools.product(*map(range, dims))]
      heads = dims[names.index("heads")]
      assert [c[axis] for c in launched[:B * heads]] == [0] * (B * heads)
      assert sorted((c["batch"], c["heads"], c[axis]) for c in launched) == list(
          itertools.product(range(B), range(heads), range(dims[0])))
  persistent = config.replace(dkv_persistent=True, heaviest_first=("dkv",))
  assert common.key_grid(mosaic._call(spec, persistent, ops), ops, 2, 64, True)[1] == ("cta",)
  changed = config.replace(heaviest_first=("fwd", "dq", "dkv"))
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, changed, o), ops)
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3
  for bad in (("bwd",), ["dkv"], "dkv"):
    with pytest.raises(ValueError, match="heaviest_first must be a tuple"):
      config.replace(heaviest_first=bad)


QKV_LOWER_CASES = [
    dict(shape=(2, 256, 4, 64), kv_heads=4, is_causal=True, max_adjust="safe"),
    dict(shape=(1, 300, 2, 128), kv_heads=2, max_adjust="off", query_seq_lengths=[200]),
    dict(shape=(2, 200, 2, 256), kv_heads=2, is_causal=True, max_adjust="paper"),
]


@pytest.mark.parametrize("dq_delta", [True, False])
@pytest.mark.parametrize("kwargs", QKV_LOWER_CASES, ids=lambda k: f"H{k['shape'][-1]}")
def test_qkvpacked_lowers_in_place(kwargs, dq_delta):
  """PackedOperands: the kernels take qkv [B, T, 3, N, H] itself (one operand, no split), the dQ
  kernel returns the packed gradient and the dK/dV kernel writes into it in place (its output
  aliases that operand): no concatenation anywhere in the program, with delta computed in the dQ
  kernel or in XLA."""
  spec, ops = _spec_ops(**kwargs)
  B, T, N, H = ops.q.shape
  qkv = jnp.zeros((B, T, 3, N, H), ops.q.dtype)
  config = tuning.table_config(H).replace(dq_delta=dq_delta and tuning.table_config(H).dq_delta)
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), pack(qkv, ops))
  kernels = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
  assert len(kernels) == 2 + config.dkv_passes
  # Each kernel's (operand types) -> (result types), from the end of its line.
  types = [line[line.rindex(": ("):].rsplit("->", 1) for line in kernels]
  packed = f"tensor<{B}x{config.q_multiple * -(-T // config.q_multiple)}x3x{N}x{H}x"
  assert all(packed in ins for ins, _ in types)          # every kernel reads qkv
  assert packed in types[1][1]                            # the dQ kernel returns the packed dqkv
  for line, (_, outs) in zip(kernels[2:], types[2:]):     # dK/dV write into it in place
    assert "output_operand_aliases" in line and packed in outs
  assert "concatenate" not in text


@pytest.mark.parametrize("H", [64, 128])
def test_dq_kernel_computes_delta_before_dkv(H):
  """The table's config (dq_delta): the dQ kernel computes delta = rowsum(dO * O) from O and
  returns it (its last result, [B, N, Tp] fp32) for the dK/dV kernel, so no XLA reduction over dO
  and O comes before the kernels; with dq_delta=False XLA computes delta and the dQ kernel returns
  dQ alone. The dQ kernel runs first either way (a packed backward writes dK and dV into its
  output)."""
  spec, ops = _spec_ops(shape=(2, 200, 4, H), kv_heads=2, is_causal=True)
  config = tuning.table_config(H)
  assert config.dq_delta and config.smem_problem(H, 2) is None
  for dq_delta in (True, False):
    text = cases.lower_vjp_for_cuda(
        lambda o: mosaic._flash(spec, config.replace(dq_delta=dq_delta), o), ops)
    dq, dkv = text.index("stable_attn_dq"), text.index("stable_attn_dkv")
    assert dq < dkv
    line = next(x for x in text.splitlines() if "custom_call @mosaic_gpu" in x
                and "stable_attn_dq" in x)
    results = line.rsplit("->", 1)[1]
    assert ("tensor<2x4x256xf32>" in results) == dq_delta, results
  assert not tuning.table_config(256).dq_delta   # its O tile would not fit beside the dQ tiles
  # A bias and a mask at 128 with dbias's staging: no room for O either, delta stays in XLA.
  extras = dict(beside=3, ds_itemsize=2)
  assert tuning.TABLE[128].replace(dq_wgs=2).smem_problem(128, 2, **extras) is not None
  assert not tuning.table_config(128, 2, **extras).dq_delta
  assert tuning.table_config(128, 2, beside=2).dq_delta
  assert tuning.table_config(256).replace(dq_delta=True).smem_problem(256, 2) is not None


def test_layers_share_one_kernel_each():
  """The same call at two places of one program (a model's layers, each differentiated) lowers
  to one Mosaic GPU module per kernel, not one per place: forward, dK/dV and dQ, three in all.
  JAX 0.11 names each lowered module uniquely, so a kernel lowered twice compiles twice."""
  spec, ops = _spec_ops(shape=(1, 256, 2, 64), is_causal=True)
  config = tuning.table_config(64)
  layer = lambda o: mosaic._flash(spec, config, o)[0]

  def two_layers(q):
    with jax.named_scope("layer0"):
      x = layer(ops._replace(q=q))
    with jax.named_scope("layer1"):   # a second call site: its own source location
      return jnp.sum(layer(ops._replace(q=x)).astype(jnp.float32))

  try:
    text = jax.jit(jax.grad(two_layers)).trace(ops.q).lower(
        lowering_platforms=("cuda",)).as_text()
  except NotImplementedError as e:
    pytest.skip(f"no CUDA lowering here: {e}")
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3


def test_dense_calls_take_three_dkv_warpgroups():
  """A call where every query sees every key takes three dK/dV warpgroups at head dim 64 (S = 200:
  the last CTA's last two idle); causal, windowed, packed, head-dim-128 and GQA calls take two.
  Asked for, three lower with segment ids too."""
  for kwargs, wgs in ((dict(), 3), (dict(is_causal=True), 2), (dict(local_window_size=(8, 8)), 2),
                      (dict(shape=(2, 200, 4, 128)), 2), (dict(kv_heads=2), 2)):
    kwargs = dict(dict(shape=(2, 200, 4, 64), kv_heads=4), **kwargs)
    spec, ops = _spec_ops(**kwargs)
    assert mosaic.default_config(spec, ops).dkv_wgs == wgs, kwargs
  spec, ops = _spec_ops(shape=(2, 200, 4, 64), kv_heads=4)
  packed = ops._replace(q_seg=jnp.zeros((2, 200), jnp.int32), kv_seg=jnp.zeros((2, 200), jnp.int32))
  assert mosaic.default_config(spec, packed).dkv_wgs == 2
  config = tuning.table_config(64).replace(dkv_wgs=3)
  for o in (ops, packed):
    text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), o)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3


def test_persistent_dkv_where_key_tiles_differ(monkeypatch):
  """The dK/dV kernel runs persistent CTAs at head dim 64 where its key tiles differ in work
  (causal, windowed, packed) and lowers so, and at head dim 128 where they differ and are few
  (tuning.FEW_KEY_TILES) without segment ids; a grid where every query sees every key (equal
  tiles, with or without GQA), for many tiles at 128, and with a bias or mask. (The table where
  setmaxnreg holds, whatever this JAX: JAX 0.12's tiles have their own test.)"""
  monkeypatch.setattr(tuning, "registers_fixed_at_entry", lambda version: False)
  many = 1 + tuning.FEW_KEY_TILES // (1024 // 128)   # rows of 1024 keys: 8 tiles each
  assert tuning.dkv_key_tiles(128, many, 1, 1024) > tuning.FEW_KEY_TILES
  assert tuning.dkv_key_tiles(128, many - 1, 1, 1024) == tuning.FEW_KEY_TILES
  cases_ = ((dict(is_causal=True), True), (dict(local_window_size=(8, 8)), True),
            (dict(kv_heads=2, is_causal=True), True), (dict(kv_heads=2), False), (dict(), False),
            (dict(shape=(2, 200, 4, 128)), False),
            (dict(shape=(2, 200, 4, 128), is_causal=True), True),
            (dict(shape=(2, 200, 4, 128), kv_heads=2, local_window_size=(8, 8)), True),
            (dict(shape=(many - 1, 1024, 1, 128), kv_heads=1, is_causal=True), True),
            (dict(shape=(many, 1024, 1, 128), kv_heads=1, is_causal=True), False),
            (dict(shape=(2, 200, 4, 256), is_causal=True), False),
            (dict(is_causal=True, mask=jnp.ones((1, 1, 200, 200), bool)), False))
  for kwargs, persistent in cases_:
    kwargs = dict(dict(shape=(2, 200, 4, 64), kv_heads=4), **kwargs)
    spec, ops = _spec_ops(**kwargs)
    assert mosaic.default_config(spec, ops).dkv_persistent == persistent, kwargs
  spec, ops = _spec_ops(shape=(2, 256, 4, 128), kv_heads=4, is_causal=True)
  packed = ops._replace(q_seg=jnp.zeros((2, 256), jnp.int32), kv_seg=jnp.zeros((2, 256), jnp.int32))
  assert not mosaic.default_config(spec, packed).dkv_persistent   # 1.15-1.20x packed at 128
  spec, ops = _spec_ops(shape=(2, 256, 4, 64), kv_heads=4, is_causal=True)
  packed = ops._replace(q_seg=jnp.zeros((2, 256), jnp.int32), kv_seg=jnp.zeros((2, 256), jnp.int32))
  assert mosaic.default_config(spec, packed).dkv_persistent
  for o in (ops, packed):   # three dK/dV warpgroups (idle keys: S = 256) lower persistent too
    for wgs in (2, 3):
      config = mosaic.default_config(spec, o).replace(dkv_wgs=wgs)
      text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), o)
      assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3


def test_packed_calls_take_two_query_warpgroups(monkeypatch):
  """With segment ids the dQ kernel takes two warpgroups (128-row CTAs line up with documents), and
  at head dim 128 the forward too, three without; at 64 the persistent three-warpgroup forward
  stays. (At 128 the few key tiles of this call also make the unpacked dK/dV kernel persistent,
  tuning._FEW, which packed rows are not.) The table where setmaxnreg holds, whatever this JAX."""
  monkeypatch.setattr(tuning, "registers_fixed_at_entry", lambda version: False)
  for H, packed_wgs in ((128, (2, 2)), (64, (3, 2))):
    spec, ops = _spec_ops(shape=(2, 256, 4, H), kv_heads=2, is_causal=True)
    packed = ops._replace(q_seg=jnp.zeros((2, 256), jnp.int32),
                          kv_seg=jnp.zeros((2, 256), jnp.int32))
    plain, config = mosaic.default_config(spec, ops), mosaic.default_config(spec, packed)
    assert (plain.fwd_wgs, plain.dq_wgs) == (3, 3)
    assert (config.fwd_wgs, config.dq_wgs) == packed_wgs, H
    assert plain.dkv_persistent and config.dkv_persistent == (H == 64)
    assert config.replace(fwd_wgs=plain.fwd_wgs, dq_wgs=plain.dq_wgs, dkv_persistent=True,
                          heaviest_first=plain.heaviest_first) == plain   # _CAUSAL's, unpacked
    config.check_smem(H, 2)


@pytest.mark.parametrize("entry_registers", [False, True])
def test_causal_calls_launch_their_grids_heaviest_first(entry_registers, monkeypatch):
  """tuning._CAUSAL: under a causal mask with nothing else bounding a CTA's work, the forward's
  grid at head dim 128 and every grid at 256 launch heaviest first; with a window, segment ids,
  without a mask, with bias or mask tiles, or at head dim 64, none; where ptxas ignores setmaxnreg
  and the dK/dV key tiles are few (no persistent dK/dV kernel there), its grid too.
  tuning._CAUSAL_BIAS: a causal call with a bias alone, every grid at head dim 256 (not at 128,
  not with a mask beside the bias or with a window)."""
  monkeypatch.setattr(tuning, "registers_fixed_at_entry", lambda version: entry_registers)
  ids = jnp.zeros((2, 512), jnp.int32)
  order = lambda H, K=4, **kw: mosaic.default_config(
      *_spec_ops(shape=(2, 512, 8, H), kv_heads=K, **kw)).heaviest_first
  few = ("fwd", "dkv") if entry_registers else ("fwd",)   # 2 x K x 512 / 128 key tiles: few
  assert order(128, is_causal=True) == few and order(128, K=1, is_causal=True) == few
  assert order(256, is_causal=True) == ("fwd", "dq", "dkv")
  assert tuning.table_config(128, causal=True, kv_shape=(64, 8, 4096),
                             entry_registers=entry_registers).heaviest_first == ("fwd",)
  assert order(64, is_causal=True) == ()
  bias = jnp.zeros((1, 8, 512, 512), bf16)
  mask = jnp.ones((2, 1, 512, 512), bool)
  assert order(256, is_causal=True, bias=bias) == ("fwd", "dq", "dkv")
  assert order(128, is_causal=True, bias=bias) == ()
  for kw in (dict(), dict(is_causal=True, local_window_size=(64, 0)),
             dict(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids),
             dict(bias=bias), dict(is_causal=True, local_window_size=(64, 0), bias=bias),
             dict(is_causal=True, mask=mask)):
    assert order(128, **kw) == () and order(256, **kw) == (), kw
  assert order(128, is_causal=True, bias=bias, mask=mask) == ()   # 256: does not fit beside both


class _Bounded:
  """A kernel's GMEM table as its scalar loads read it: IndexError for an index outside it (on
  the GPU, a read of whatever lies there, or an illegal address)."""

  def __init__(self, name, a):
    self.name, self.a = name, np.asarray(a)
    self.shape, self.ndim = self.a.shape, self.a.ndim

  def __getitem__(self, index):
    index = tuple(int(i) for i in (index if isinstance(index, tuple) else (index,)))
    if len(index) != self.ndim or not all(0 <= i < d for i, d in zip(index, self.shape)):
      raise IndexError(f"{self.name}{index} outside {self.shape}")
    return self.a[index]


# Calls whose blocks see nothing at some CTAs' edges: keys past the last query row (causal, S >
# T, lengths), a window's left edge past the keys (T > S), under a block-sparse mask or with
# segment ids.
MASK_EDGES = {
    "causal_s_gt_t_lens": dict(B=2, T=384, S=448, N=4, K=2, H=128, is_causal=True,
                               q_lens=(384, 300), kv_lens=(448, 250), mask=(2, 1, 384, 448),
                               sparse_blocks=(64, 0.5), whole_blocks=True),
    "window_t_gt_s": dict(B=1, T=640, S=192, N=2, K=1, H=64, window=(64, 0),
                          mask=(1, 2, 640, 192), sparse_blocks=(64, 0.3), whole_blocks=True),
    # Segment ids' tables, with three warpgroups where T leaves the last CTA's first ones idle.
    "packed_idle_rows": dict(B=2, T=320, S=448, N=4, K=2, H=64, is_causal=True, segments=True,
                             q_lens=(320, 150), kv_lens=(448, 200)),
}


@pytest.mark.parametrize("entry_registers", [False, True])
@pytest.mark.parametrize("name", list(MASK_EDGES))
def test_mask_tables_are_read_inside_their_bounds(name, entry_registers, monkeypatch):
  """Under a mask or segment ids every CTA of the three kernels reads the block tables (Ranges:
  the compacted order's rank and order, the blocks' flags and ranges) at indices inside them: the
  union's and each warpgroup's bounds, the first block and the prefetched one, for every batch
  row, head and CTA of the table's config. (`blocks.q_block_range` once put the dK/dV kernel's
  empty key tiles past the last query block, so rank was read one past its end, and what lay
  there indexed the order.)"""
  monkeypatch.setattr(tuning, "registers_fixed_at_entry", lambda version: entry_registers)
  (q, k, v, bias, mask), kwargs, _ = cases.make_inputs(dict(MASK_EDGES[name]), bf16, 5)
  spec, ops, _ = canonicalize(q, k, v, bias, mask, Options(**kwargs))
  config = mosaic.default_config(spec, ops)
  call = mosaic._call(spec, config, ops)
  x = mosaic._padded(ops, call)
  refs = x._replace(q_lens=_Bounded("q_lens", x.q_lens), kv_lens=_Bounded("kv_lens", x.kv_lens))
  bounded = lambda r, kernel: common.Ranges(*(None if a is None else _Bounded(f"{kernel}.{f}", a)
                                              for f, a in zip(r._fields, r)))
  geo = call.geo

  def reads(order, bounds, stages):
    first, stop = int(order.first), int(order.stop)
    assert 0 <= first <= stop
    for lo, flo, fhi, hi in bounds:
      assert first <= int(order.rank(lo)) <= int(order.rank(flo)) <= int(order.rank(fhi)) \
          <= int(order.rank(hi)) <= stop
    order.block(first), order.block(first + stages)   # read before the loop, and prefetched

  for kernel in ("fwd", "dq"):
    tiles, wgs = getattr(config, kernel), getattr(config, f"{kernel}_wgs")
    ranges = bounded(common.block_ranges(x, tiles.block_q, tiles.block_kv, "query"), kernel)
    for b, n, index in itertools.product(range(geo.B), range(geo.N),
                                         range(common.cta_rows(call, wgs, tiles.block_q, 0)[0])):
      cta = common.query_cta(call, ranges, b, n, call.lengths(refs, b), wgs=wgs,
                             bq=tiles.block_q, bk=tiles.block_kv, index=index)
      reads(cta.order, [cta.mine(cta.start + w * tiles.block_q) for w in range(wgs)],
            tiles.stages)
  tiles, wgs = config.dkv, config.dkv_key_wgs
  ranges = bounded(common.block_ranges(x, tiles.block_q, tiles.block_kv, "key", geo.G), "dkv")
  for b, kvh, index in itertools.product(range(geo.B), range(geo.K),
                                         range(common.key_ctas(call, wgs, tiles.block_kv))):
    cta = common.key_cta(call, refs, ranges, b, kvh, index, wgs=wgs, bk=tiles.block_kv,
                         bq=tiles.block_q)
    reads(cta.order, [common.clamp_ranges(cta.q_ranges(cta.start + w * tiles.block_kv),
                                          *cta.union) for w in range(wgs)], tiles.stages)


@pytest.mark.parametrize("H", [64, 128])
def test_fused_dq_lowers_for_cuda(H):
  """With TuningConfig.fused_dq the backward is one kernel: forward and dK/dV(+dQ), two in all;
  a bias (whose gradient needs dS from the dQ kernel) keeps three."""
  spec, ops = _spec_ops(shape=(2, 256, 4, H), kv_heads=2, is_causal=True, logits_soft_cap=20.0)
  config = tuning.fused_dq_config(H)
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
  spec, ops = _spec_ops(shape=(2, 256, 4, H), kv_heads=2,
                        bias=jnp.zeros((1, 4, 256, 256), bf16))
  config = tuning.fused_dq_config(H, 2, **mosaic._extras(ops))
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3


# --- compiled on a Hopper GPU ----------------------------------------------------------------------

GPU_CASES = {
    "gpt2": dict(B=2, T=512, S=512, N=4, K=4, H=64, is_causal=True),
    "gqa_h128_lens": dict(B=2, T=300, S=333, N=8, K=2, H=128, is_causal=True,
                          q_lens=(300, 217), kv_lens=(333, 190)),
    "cross_window": dict(B=1, T=257, S=513, N=4, K=1, H=64, window=(64, 32)),
    "T_gt_S": dict(B=1, T=320, S=130, N=2, K=2, H=128, is_causal=True),
    "empty_rows": dict(B=2, T=160, S=130, N=2, K=1, H=64, q_lens=(160, 90), kv_lens=(0, 130)),
    # Every query sees every key, no GQA: three dK/dV warpgroups, the last CTA's last two idle.
    "full_h64_lens": dict(B=2, T=330, S=200, N=2, K=2, H=64, kv_lens=(200, 90)),
    # The soft cap (tanh on the tile, its derivative in both backward kernels) and sinks.
    "softcap_sinks_gqa_h128": dict(B=2, T=300, S=333, N=8, K=2, H=128, is_causal=True,
                                   q_lens=(300, 217), kv_lens=(333, 190), soft_cap=20.0,
                                   sinks=True),
    "softcap_window_h64": dict(B=1, T=257, S=513, N=4, K=1, H=64, window=(64, 32), soft_cap=2.5),
    "sinks_empty_rows": dict(B=2, T=160, S=130, N=2, K=1, H=64, q_lens=(160, 90),
                             kv_lens=(0, 130), sinks=True),
    # Packed sequences: the segment block ranges bound the loops, edge blocks compare ids.
    "packed_causal_gqa": dict(B=2, T=768, S=768, N=4, K=2, H=64, is_causal=True, segments=True,
                              docs=6),
    "packed_cross_window_h128": dict(B=2, T=300, S=333, N=4, K=2, H=128, segments=True, docs=3,
                                     window=(100, 20), q_lens=(300, 217), kv_lens=(333, 190)),
    # Bias (with dbias) and mask tiles streamed beside K/V and Q/dO; a per-head bias summed over
    # the batch, a full one, an fp32 key-padding bias [B, 1, 1, S] summed over rows; masks
    # whose all-False blocks the block ranges skip, rows with no visible key.
    "bias_mask_causal_gqa": dict(B=2, T=300, S=333, N=4, K=2, H=64, is_causal=True,
                                 bias=(1, 4, 300, 333), mask=(2, 1, 300, 333),
                                 q_lens=(300, 217), kv_lens=(333, 190)),
    "bias_full_h128": dict(B=2, T=256, S=200, N=4, K=1, H=128, bias=(2, 4, 256, 200),
                           soft_cap=10.0, sinks=True),
    # A bias alone under a causal mask at head dim 64: the persistent three-warpgroup forward.
    "alibi_causal_h64": dict(B=2, T=200, S=233, N=4, K=2, H=64, is_causal=True,
                             bias=(1, 4, 200, 233), q_lens=(200, 117), kv_lens=(233, 190)),
    # ... and at head dim 128: the bias streams apart from K, beside 128-key blocks (GQA, lengths).
    "alibi_causal_gqa_h128": dict(B=2, T=300, S=333, N=4, K=2, H=128, is_causal=True,
                                  bias=(1, 4, 300, 333), q_lens=(300, 217), kv_lens=(333, 190)),
    "key_bias_fp32_window": dict(B=2, T=257, S=513, N=2, K=2, H=64, bias=(2, 1, 1, 513),
                                 bias_dtype=jnp.float32, window=(64, 32)),
    "block_sparse_mask_h128": dict(B=1, T=512, S=640, N=4, K=2, H=128, mask=(1, 4, 512, 640),
                                   sparse_blocks=(64, 0.4), masked_rows=(3, 200, 511)),
    "mask_packed": dict(B=2, T=384, S=384, N=2, K=2, H=64, is_causal=True, segments=True,
                        mask=(2, 2, 384, 384), sparse_blocks=(128, 0.6)),
    # Block-sparse masks of whole blocks: the producer streams only the CTA's non-empty blocks,
    # all-True blocks that causal / lengths / window leave whole run unmasked, and with a bias
    # the blocks nobody computed get dS = 0.
    "block_mask_causal_lens": dict(B=2, T=384, S=448, N=4, K=2, H=128, is_causal=True,
                                   q_lens=(384, 300), kv_lens=(448, 250), mask=(2, 1, 384, 448),
                                   sparse_blocks=(64, 0.5), whole_blocks=True),
    "bias_block_mask_window": dict(B=1, T=320, S=512, N=2, K=1, H=64, window=(200, 100),
                                   bias=(1, 2, 320, 512), mask=(1, 2, 320, 512),
                                   sparse_blocks=(128, 0.5), whole_blocks=True),
    # Tiles that fit only beside 32-key blocks: a bf16 bias at head dim 256 (the forward's), an
    # fp32 bias and a mask at 128 (the dQ kernel's).
    "bias_h256_gqa_lens": dict(B=2, T=300, S=333, N=4, K=2, H=256, is_causal=True,
                               bias=(1, 4, 300, 333), q_lens=(300, 217), kv_lens=(333, 190)),
    "bias_fp32_mask_h128": dict(B=2, T=256, S=200, N=4, K=2, H=128, bias=(2, 4, 256, 200),
                                bias_dtype=jnp.float32, mask=(2, 1, 256, 200),
                                sparse_blocks=(64, 0.5)),
    # A mask at head dim 256 fits beside the table's tiles (a bias with it does not).
    "block_mask_h256_window": dict(B=1, T=320, S=384, N=2, K=1, H=256, window=(200, 100),
                                   mask=(1, 2, 320, 384), sparse_blocks=(64, 0.5)),
    # Head dim 256 (32-row streamed blocks in the backward, dK and dV in a pass each).
    "h256_gqa_lens": dict(B=2, T=300, S=333, N=4, K=2, H=256, is_causal=True,
                          q_lens=(300, 217), kv_lens=(333, 190)),
    "h256_packed_softcap_sinks": dict(B=1, T=384, S=384, N=2, K=1, H=256, segments=True, docs=3,
                                      window=(100, 20), soft_cap=20.0, sinks=True),
}
GPU_CHECKS = ([(name, bf16, mode) for name in GPU_CASES for mode in ("off", "paper", "safe")]
              + [(name, f16, "safe") for name in GPU_CASES])


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("name,dtype,max_adjust", GPU_CHECKS,
                         ids=[f"{n}-{jnp.dtype(d).name}-{m}" for n, d, m in GPU_CHECKS])
def test_gpu_matches_exact(name, dtype, max_adjust):
  cases.check_case(IMPL, dict(name=name, **GPU_CASES[name]), dtype, max_adjust, "fast", seed=5)


@pytest.mark.gpu
@on_hopper
def test_gpu_fp8_inputs_are_the_call_on_their_quantized_values():
  """numerics "fast+qkv=e4m3" (stable_attn.fp8) compiled: the "fast" call on the quantized q, k,
  v, values and gradients bitwise (the same kernels on the same bf16-held e4m3 values)."""
  from stable_attn import fp8
  rng = np.random.default_rng()
  q, k, v, d_out = (jnp.asarray(rng.standard_normal((2, 256, 4, 128)) * 3, bf16)
                    for _ in range(4))
  call = lambda nx: jax.jit(lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, is_causal=True, implementation=IMPL, numerics=nx))
  o, pullback = jax.vjp(call("fast+qkv=e4m3"), q, k, v)
  o_want, pullback_want = jax.vjp(call("fast"), *(fp8.quantize(x) for x in (q, k, v)))
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_want, np.float32))
  for g, want in zip(pullback(d_out), pullback_want(d_out)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@on_hopper
def test_gpu_fp8_forward_takes_the_callers_scales():
  """The FP8 forward compiled with fp8_scales (delayed scaling), some 4x too large: bitwise the
  call on the saturated values (whose own measured scales are the given ones, so they quantize to
  themselves), and finite: the kernel's e4m3 payloads are made under the given scales."""
  from stable_attn import fp8
  rng = np.random.default_rng()
  q, k, v = (jnp.asarray(rng.standard_normal((2, 256, n, 128)) * 3, bf16) for n in (4, 2, 2))
  late = tuple(fp8.head_scales(x) * jnp.asarray(rng.choice([1.0, 4.0], x.shape[2]), f32)
               for x in (q, k, v))
  call = jax.jit(lambda q, k, v, s: stable_attn.dot_product_attention(
      q, k, v, is_causal=True, implementation=IMPL, numerics=FP8, fp8_scales=s))
  saturated = [fp8.quantize_under(x, s) for x, s in zip((q, k, v), late)]
  got = np.asarray(call(q, k, v, late), np.float32)
  np.testing.assert_array_equal(got, np.asarray(call(*saturated, None), np.float32))
  assert np.all(np.isfinite(got))


_FP8_IDS = np.repeat(np.arange(3), 128)[None].repeat(2, 0)
FP8_CASES = {   # B2 T384 N4 K2, head dim 64 and 128
    "gqa_lens": dict(is_causal=True, query_seq_lengths=np.array([384, 300]),
                     key_value_seq_lengths=np.array([384, 250])),
    "packed_sinks_window": dict(is_causal=True, q_segment_ids=_FP8_IDS, kv_segment_ids=_FP8_IDS,
                                sinks=np.array([0.0, 1.0, -1.0, 2.0]), local_window_size=(200, 0)),
    "soft_cap": dict(logits_soft_cap=20.0),
}


def _fp8_kwargs(case):
  """FP8_CASES[case] as call arguments (its arrays as jax arrays)."""
  return {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
          for k, v in FP8_CASES[case].items()}


def _fp8_errors(implementation, numerics, case, max_adjust, inputs):
  """Relative errors of O, dQ, dK, dV against float64 attention of the e4m3-quantized q, k, v
  (what is left is P's rounding and the products' accumulation), and O."""
  from stable_attn import fp8
  kwargs = _fp8_kwargs(case)
  q, k, v, d_out = inputs
  f = lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, implementation=implementation, numerics=numerics, max_adjust=max_adjust, **kwargs)
  o, pullback = jax.vjp(jax.jit(f), q, k, v)
  exact = exact_attention_vjp(*(fp8.quantize(x) for x in (q, k, v)), d_out, **kwargs)
  got = (o,) + tuple(pullback(d_out))
  return [cases.relative_error(x, want) for x, want in
          zip(got, (exact.out, exact.dq, exact.dk, exact.dv))], np.asarray(o, np.float32)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("numerics", [FP8, "fp8", "fp8_fast"])
@pytest.mark.parametrize("max_adjust", ["off", "paper", "safe"])
@pytest.mark.parametrize("case", list(FP8_CASES))
@pytest.mark.parametrize("head_dim", mosaic.FP8_HEAD_DIMS)
def test_gpu_fp8_forward_is_as_accurate_as_the_reference(head_dim, case, max_adjust, numerics):
  """The compiled FP8 forward (with its bf16 backward) against float64 attention of the quantized
  inputs: O, dQ, dK and dV within 1.25x (+ 2e-3) the error of implementation="reference" in the
  same numerics -- their P round on different key blocks, so they differ by P's rounding, not
  bitwise -- and O visibly not the bf16-P kernel's (P is cast to e4m3: ~2% apart). Both
  FlashAttention-3's arithmetic and the "fp8" preset (each block's top key in bf16: a second
  e4m3 product of its residual, tile.rescale's split_top; the row sum of the rounded P_bar)."""
  rng = np.random.default_rng()
  shapes = [(2, 384, n, head_dim) for n in (4, 2, 2, 4)]
  inputs = [jnp.asarray(rng.standard_normal(s), bf16) for s in shapes]
  got, o = _fp8_errors(IMPL, numerics, case, max_adjust, inputs)
  want, _ = _fp8_errors("reference", numerics, case, max_adjust, inputs)
  assert all(g <= 1.25 * w + 2e-3 for g, w in zip(got, want)), (got, want)
  _, o_bf16_p = _fp8_errors(IMPL, "fast+qkv=e4m3", case, max_adjust, inputs)
  assert cases.relative_error(o, o_bf16_p.astype(np.float64)) > 5e-3


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("head_dim", mosaic.FP8_HEAD_DIMS)
def test_gpu_fp8_fast_dithers_o_and_nothing_else(head_dim):
  """The compiled FP8 forward under "fp8_fast" (Numerics.dither="out") is its "safe" with
  dither="max" on weights first rounded to e4m3's grid (offsets moved as
  diagnostics.accuracy.on_grid_offsets does): the same LSE in all but a few rows (below) and
  there O times round(w) / w per row within one bf16 rounding, and not that O
  (tests.cases.assert_o_dithered). Causal GQA with sinks."""
  from stable_attn import backends
  from stable_attn.diagnostics.accuracy import on_grid_offsets
  rng = np.random.default_rng()
  B, T, N, K = 2, 384, 4, 2
  q = jnp.asarray(rng.standard_normal((B, T, N, head_dim)), bf16)
  k, v = (jnp.asarray(rng.standard_normal((B, T, K, head_dim)), bf16) for _ in range(2))
  sinks = jnp.asarray(rng.standard_normal(N), f32)
  offsets = stable_attn.api.safe_offsets(N, T, bf16)   # dither="out" designs w on bf16's grid

  def run(numerics, moved=None):
    spec, ops, _ = canonicalize(q, k, v, None, None, Options(
        is_causal=True, sinks=sinks, implementation=IMPL, numerics=numerics))
    ops = ops if moved is None else ops._replace(offset=moved)
    return jax.jit(lambda ops: backends.run(IMPL, spec, ops))(ops)

  nx = "fast+qkv=e4m3+p=e4m3+p_scale=256+sum_of_rounded_p=true"
  o_out, lse_out = run("fp8_fast")
  with warnings.catch_warnings():   # "safe" rounding its weight to e4m3: what is asked here
    warnings.simplefilter("ignore", RuntimeWarning)
    o_grid, lse_grid = run(nx, on_grid_offsets(offsets, jnp.float8_e4m3fn))
  # The kernel rounds each row's offset to e4m3's grid with its own exp2 and log2, which agree
  # with XLA's on_grid_offsets to fp32's rounding, not bitwise: where another key's P_bar sits at
  # one of e4m3's half-way points it can round the other way (the likely cause of 2 rows of
  # 3,072 off by up to 4e-4 on an H200). Another offset would change the e4m3 rounding of the
  # P_bar, and so the rounded row sum's LSE, in most rows.
  lse_out, lse_grid = np.asarray(lse_out), np.asarray(lse_grid)   # [B, N, T]
  same = np.isclose(lse_out, lse_grid, rtol=2e-6, atol=2e-6)
  assert np.mean(same) > 0.99 and np.abs(lse_out - lse_grid).max() < 1e-2, (
      np.mean(same), np.abs(lse_out - lse_grid).max())
  cases.assert_o_dithered(o_out, o_grid, offsets, rows=same.transpose(0, 2, 1))


def _fp8_grads(case, inputs, fp8_backward: bool, numerics=FP8, is_causal=True):
  """(dQ, dK, dV of the Hopper kernel's FP8 call, compiled, with or without
  TuningConfig.fp8_backward), (float64 dQ, dK, dV of the quantized inputs), the call's quantized
  q, k, v) for FP8_CASES[case] (None: is_causal only)."""
  kwargs = _fp8_kwargs(case) if case else dict(is_causal=is_causal)
  q, k, v, d_out = inputs
  spec, ops, _ = canonicalize(q, k, v, None, None, Options(
      implementation=IMPL, numerics=numerics, max_adjust="off", **kwargs))
  config = mosaic.default_config(spec, ops).replace(fp8_backward=fp8_backward)
  (_, lse), pullback = jax.vjp(jax.jit(lambda ops: mosaic.attention(spec, ops, config)), ops)
  got = pullback((d_out, jnp.zeros_like(lse)))[0]
  exact = exact_attention_vjp(ops.q, ops.k, ops.v, d_out, **kwargs)
  return (got.q, got.k, got.v), (exact.dq, exact.dk, exact.dv), (ops.q, ops.k, ops.v)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("head_dim", mosaic.FP8_HEAD_DIMS)
def test_gpu_fp8_backward_computes_its_emulation(head_dim, is_causal):
  """The FP8 backward compiled (TuningConfig.fp8_backward: e4m3 products in the dQ and dK/dV
  kernels, dS under online row scales) against stable_attn.diagnostics.fp8_backward's float64
  emulation of the same arithmetic: dQ, dK and dV each within 0.7 of the emulation's own
  error from it, and as far from float64 as it is (the causal mask as a -inf bias there; B2 T384
  N4, random normal inputs). Full calls have one query head per kv head: the table's dense
  tiling (three dK/dV warpgroups at head dim 64)."""
  from stable_attn.diagnostics import fp8_backward as emulation
  rng = np.random.default_rng()
  inputs = [jnp.asarray(rng.standard_normal((2, 384, 4, head_dim)), bf16) for _ in range(4)]
  got, exact, (q, k, v) = _fp8_grads(None, inputs, True, is_causal=is_causal)
  visible = np.tril(np.ones((384, 384), bool)) if is_causal else np.ones((384, 384), bool)
  mask_bias = np.where(visible, 0.0, -np.inf)[None, None]
  as64 = lambda a: np.asarray(jnp.asarray(a, f32), np.float64)
  emulated = emulation.gradients(*map(as64, (q, k, v)), mask_bias, as64(inputs[3]),
                                 emulation.KERNELS)
  for name, g, want in zip(emulation.TENSORS, got, exact):
    floor = cases.relative_error(emulated[name], want)
    assert 5e-3 < floor < 0.08, (name, floor)   # e4m3's P, dO and dS: ~3% (docs/fp8.md)
    # The same arithmetic up to fp32 summation order and where a row's dS scale moves: dQ and dK
    # 0.27-0.33 (full) and 0.42-0.55 (causal) of the floor from it, dV 0.07-0.13 (H200, 16
    # draws); an independent rounding would be ~1.4x the floor away, the bf16 backward ~1x.
    assert cases.relative_error(g, emulated[name]) < 0.7 * floor, (name, floor)
    assert cases.relative_error(g, want) < 1.1 * floor + 1e-3, (name, floor)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("head_dim", mosaic.FP8_HEAD_DIMS)
def test_gpu_fp8_backward_keeps_dv_unbiased_where_do_leans_one_way(head_dim):
  """TuningConfig.fp8_dv_promote: the FP8 backward's dV += P^T dO with each query block's
  product in a fresh accumulator. B1 T2048 N2 causal, random normal inputs, dO's mean 1 (each of
  dV's sums one sign, so the low bits Hopper's FP8 accumulation truncates all err one way): dV's
  mean outward error against the float64 emulation of the kernels' arithmetic, in bf16 ulps at
  dV's RMS, within 0.4 promoted and under a third of the accumulator's along the column (-2.9 at
  head dim 64 on an H200; the test needs it under -1, so that it can tell the two apart)."""
  from stable_attn.diagnostics import fp8_backward as emulation
  from stable_attn.diagnostics.probe import ulp
  rng, T = np.random.default_rng(), 2048
  q, k, v = (jnp.asarray(rng.standard_normal((1, T, 2, head_dim)), bf16) for _ in range(3))
  d_out = jnp.asarray(rng.standard_normal((1, T, 2, head_dim)) + 1.0, bf16)
  spec, ops, _ = canonicalize(q, k, v, None, None, Options(
      is_causal=True, implementation=IMPL, numerics=FP8, max_adjust="off"))
  as64 = lambda a: np.asarray(jnp.asarray(a, f32), np.float64)
  causal = np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf)[None, None]
  want = emulation.gradients(*map(as64, (ops.q, ops.k, ops.v)), causal, as64(d_out),
                             emulation.KERNELS)["dV"]
  unit = ulp(np.sqrt(np.mean(want ** 2)), bf16)

  def outward(promote):
    config = mosaic.default_config(spec, ops).replace(fp8_backward=True, fp8_dv_promote=promote)
    (_, lse), pullback = jax.vjp(jax.jit(lambda o: mosaic.attention(spec, o, config)), ops)
    dv = as64(pullback((d_out, jnp.zeros_like(lse)))[0].v)
    assert np.isfinite(dv).all()
    return float(np.mean((dv - want) * np.sign(want)) / unit)
  promoted, along = outward(True), outward(False)
  assert along < -1.0 and abs(promoted) < 0.4 and abs(promoted) < abs(along) / 3, (
      promoted, along)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("case", list(FP8_CASES))
@pytest.mark.parametrize("head_dim", mosaic.FP8_HEAD_DIMS)
def test_gpu_fp8_backward_serves_the_fp8_forwards_features(head_dim, case):
  """The FP8 backward compiled with GQA and lengths, packed documents with sinks and a window, a
  soft cap: dQ, dK and dV within 8% of float64 (e4m3's P, dO and dS cost ~3%), finite, and
  visibly the FP8 arithmetic (over 3x the error of the bf16 backward on the same call)."""
  rng = np.random.default_rng()
  shapes = [(2, 384, n, head_dim) for n in (4, 2, 2, 4)]
  inputs = [jnp.asarray(rng.standard_normal(s), bf16) for s in shapes]
  got, exact, _ = _fp8_grads(case, inputs, True)
  bf16_grads, _, _ = _fp8_grads(case, inputs, False)
  for name, g, b, want in zip("qkv", got, bf16_grads, exact):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    err, bf16_err = cases.relative_error(g, want), cases.relative_error(b, want)
    assert 3 * bf16_err < err < 0.08, (name, err, bf16_err)


@pytest.mark.gpu
@on_hopper
def test_gpu_trainer_takes_the_fp8_backward():
  """train's --fp8-backward (ModelConfig.fp8_backward) reaches the kernels: a 2-layer GPT's
  parameter gradient (numerics "fp8", "safe", head dim 64) through the FP8 backward is finite,
  differs from the bf16 backward's, and stays within e4m3's few percent of it."""
  from flax import nnx
  from train.config import get_config
  from train.model import abstract_model
  from train.step import init_params, loss_fn
  rng = np.random.default_rng()
  x, y = (jnp.asarray(rng.integers(0, 50257, (4, 256)), jnp.int32) for _ in range(2))
  grads = []
  for fp8_backward in (False, True):
    cfg = get_config("tiny").replace(model=dict(
        n_layer=2, n_head=2, n_embd=128, block_size=256, attention=IMPL, numerics="fp8",
        max_adjust="safe", fp8_backward=fp8_backward), seed=0)
    graphdef = nnx.split(abstract_model(cfg.model), nnx.Param)[0]
    g = jax.jit(jax.grad(loss_fn), static_argnums=1)(init_params(cfg), graphdef, x, y)
    grads.append(np.concatenate([np.ravel(a) for a in jax.tree.leaves(g)]).astype(np.float64))
  assert np.all(np.isfinite(grads[1]))
  difference = np.linalg.norm(grads[1] - grads[0]) / np.linalg.norm(grads[0])
  assert 1e-4 < difference < 0.1, difference


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("head_dim", mosaic.FP8_HEAD_DIMS)
def test_gpu_fp8_preset_keeps_safe_about_as_accurate_as_off(head_dim):
  """Near-one-hot rows (causal self-attention q = k = v = x ~ N(0, 1), dO = x: each row's own
  key takes ~90% of it) through the compiled FP8 forward: with every P_bar in e4m3, "safe"'s
  weight of the row's maximum rounds on a 1/16 grid and dQ's largest error is 20-40x "off"'s
  (the reference: docs/fp8.md); with the "fp8" preset's top key in bf16, 2-3x, as the
  reference's. dQ against float64 attention of the quantized inputs."""
  from stable_attn import fp8
  x = jnp.asarray(np.random.default_rng().standard_normal((2, 256, 4, head_dim)), bf16)
  xq = fp8.quantize(x)
  exact = exact_attention_vjp(xq, xq, xq, x, is_causal=True).dq

  def dq_error(implementation, numerics, max_adjust):
    f = lambda q, k, v: stable_attn.dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation, numerics=numerics,
        max_adjust=max_adjust)
    dq = jax.vjp(jax.jit(f), x, x, x)[1](x)[0]
    return float(np.max(np.abs(np.asarray(dq, np.float64) - exact)))

  off, safe = dq_error(IMPL, "fp8", "off"), dq_error(IMPL, "fp8", "safe")
  with warnings.catch_warnings():   # what this test shows is what that warning says
    warnings.simplefilter("ignore", RuntimeWarning)
    top_e4m3 = dq_error(IMPL, FP8, "safe")
  assert safe < 5 * off and top_e4m3 > 10 * off, (off, safe, top_e4m3)
  assert safe <= 1.5 * dq_error("reference", "fp8", "safe") + 1e-2, safe
  # "fp8_fast": the maximum's weight exact in e4m3, the dither on O on bf16's grid
  dithered = dq_error(IMPL, "fp8_fast", "safe")
  assert dithered < 5 * off and dithered <= 1.5 * dq_error("reference", "fp8_fast", "safe") + 1e-2


@pytest.mark.parametrize("version,fixed", [("0.12.0.1", True), ("0.12.0", True),
                                           ("0.11.2", False), ("0.10.2", False),
                                           ("0.13.0.dev20261101", False)])
def test_entry_registers_tiles_where_setmaxnreg_is_ignored(version, fixed):
  """On JAX 0.12 (ptxas drops setmaxnreg: every thread keeps 65536 / threads registers) the head
  dim 128 and 256 tables run without a producer warpgroup: the compute warpgroups alone, 255
  registers a thread with two and 168 with three, at least what setmaxnreg gives them on 0.11
  (232, 160), so their own tiles fit; at 128 with three Q/dO stages in the dK/dV kernel, and
  nothing persistent (packed rows: the dK/dV issuer two steps back), at 256 the forward's K
  refilled early (`refill_k_early`); with bias or mask tiles
  the table's tiles without a producer (but in the forward with a bias alone at head dim 128),
  the bias in K's slots. Head dim 64 keeps the
  table's but for full calls without bias or mask, whose forward (not persistent) has no
  producer and whose dK/dV kernel is the causal table's. Every config it gives fits shared memory and validates."""
  assert tuning.registers_fixed_at_entry(version) is fixed
  for h in tuning.HEAD_DIMS:
    for kw in (dict(), dict(full=True), dict(dense=True), dict(packed=True),
               dict(kv_shape=(1, 2, 1024)), dict(beside=1), dict(beside=2, ds_itemsize=2)):
      plain = tuning.table_config(h, **kw)
      config = tuning.table_config(h, entry_registers=fixed, **kw)
      config.check_smem(h, 2, **{k: v for k, v in kw.items() if k in ("beside", "ds_itemsize")})
      if fixed and h == 64 and (kw.get("full") or kw.get("dense")):
        # the forward without a producer, the table's causal dK/dV kernel (two warpgroups and
        # a producer, persistent), not _FULL's and _DENSE's three (128 registers beside one)
        assert config == plain.replace(fwd_producer=False, fwd_persistent=False,
                                       dkv_wgs=tuning.COMPUTE_WGS, dkv_persistent=True,
                                       persistent_order="heaviest"), kw
        assert config == tuning.TABLE[h].replace(fwd_producer=False, fwd_persistent=False), kw
        assert not config.has_producer("fwd") and config.has_producer("dkv")
        continue
      if fixed and "beside" in kw and h > 64:
        assert config == plain.replace(producer=False, fwd_bias_apart=False), (h, kw)
        alone = tuning.table_config(h, entry_registers=True, bias_only=True, **kw)
        assert not alone.producer and alone.has_producer("fwd") == (h == 128), (h, kw)
        assert not alone.fwd_bias_apart
        continue
      if not fixed or h == 64:
        assert config == plain, (h, kw)
        continue
      assert not config.producer and plain.producer
      assert not (config.fwd_persistent or config.dkv_persistent or config.fused_dq)
      for wgs in (config.fwd_wgs, config.dq_wgs, config.dkv_wgs):   # registers at entry
        assert min(255, 65536 // (128 * wgs)) >= common.REGISTERS[wgs][0]
      dkv = tuning.Tiles(64, 64, 3) if h == 128 else plain.dkv
      flat = dict(fwd_persistent=False, dkv_persistent=False)
      lag = 2 if h == 128 and kw.get("packed") else 1   # packed rows refill two steps back
      assert config == plain.replace(producer=False, dkv=dkv, refill_lag=lag,
                                     refill_k_early=h == 256, **flat), (h, kw)


@pytest.mark.parametrize("version,warns", [("0.12.0.1", True), ("0.12.0", True),
                                           ("0.11.2", False), ("0.10.2", False),
                                           ("0.13.0.dev20261101", False)])
def test_slow_toolchain_warns_once_on_jax_0_12(monkeypatch, version, warns):
  """JAX 0.12 (its Mosaic GPU's ptxas drops setmaxnreg: the table's tiles ran 2.4-3x slower at
  head dim 128, measured on 0.12.0.1; the kernels without a producer still run some calls
  slower) gets one RuntimeWarning per process saying what to do; other versions none."""
  import warnings
  monkeypatch.setattr(mosaic, "_warned", False)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert mosaic.warn_if_slow_toolchain(version) is warns
    assert mosaic.warn_if_slow_toolchain(version) is False       # once per process
  assert len(seen) == warns, [str(w.message) for w in seen]
  if warns:
    assert seen[0].category is RuntimeWarning
    assert f"JAX {version}" in str(seen[0].message) and "jax<0.12" in str(seen[0].message)


@pytest.mark.gpu
@on_hopper
def test_gpu_first_call_warns_only_on_jax_0_12(monkeypatch):
  """A compiled call on this machine's JAX: the slow-toolchain warning where it is 0.12 (and the
  call still right), nothing where it is not."""
  import warnings
  monkeypatch.setattr(mosaic, "_warned", False)
  jax.clear_caches()   # the warning comes with tracing: no earlier trace of this call may serve it
  q = jnp.asarray(np.random.default_rng().standard_normal((1, 128, 2, 128)), bf16)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    o = stable_attn.dot_product_attention(q, q, q, is_causal=True, implementation=IMPL)
  slow = [w for w in seen if "setmaxnreg" in str(w.message)]
  assert len(slow) == (jax.__version__.startswith("0.12.")), [str(w.message) for w in seen]
  want = jax.nn.dot_product_attention(q, q, q, is_causal=True)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want, np.float32), atol=2e-2,
                             rtol=2e-2)


WGS_CASES = [name for name, case in GPU_CASES.items()
             if "bias" not in case and "mask" not in case and case["H"] < 256]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("max_adjust", ["off", "paper", "safe"])
@pytest.mark.parametrize("name", WGS_CASES)
def test_gpu_three_warpgroups_match_two(name, max_adjust):
  """The forward and the dQ kernel with three compute warpgroups (the table's at head dims 64 and
  128; the last CTA's first warpgroups idle where 192 rows do not divide T), and the dK/dV kernel
  at head dim 64 (the table's where every query sees every key; the last CTA's last warpgroups
  idle), compute every row as two do: the same blocks in the same order, so O, the LSE and the
  gradients are bitwise equal."""
  (q, k, v, _, _), kwargs, do = cases.make_inputs(dict(GPU_CASES[name]), bf16, 3)

  def run(wgs):   # three dK/dV warpgroups at head dim 64 (at 128 their tiles do not fit)
    config = tuning.table_config(q.shape[-1]).replace(
        fwd_wgs=wgs, dq_wgs=wgs, dkv_wgs=wgs if q.shape[-1] == 64 else 2, fwd_persistent=False)
    attend = lambda q, k, v: stable_attn.dot_product_attention(
        q, k, v, implementation=IMPL, max_adjust=max_adjust, config=config,
        return_residuals=True, **kwargs)
    (out, residuals), vjp = jax.vjp(attend, q, k, v)
    grads = vjp((do, jax.tree.map(jnp.zeros_like, residuals)))
    return jax.device_get((out, residuals, grads))

  for a, b in zip(jax.tree.leaves(run(2)), jax.tree.leaves(run(3))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _outputs_and_grads(args, kwargs, do, max_adjust, config, implementation=IMPL):
  """(O, the residuals, the gradients in q, k, v and the bias) of one call with `config`: args
  (q, k, v, bias, mask), the bias differentiated with q, k and v."""
  q, k, v, bias, mask = args
  attend = lambda q, k, v, bias: stable_attn.dot_product_attention(
      q, k, v, bias, mask, implementation=implementation, max_adjust=max_adjust, config=config,
      return_residuals=True, **kwargs)
  (out, residuals), vjp = jax.vjp(attend, q, k, v, bias)
  grads = vjp((do, jax.tree.map(jnp.zeros_like, residuals)))
  return jax.device_get((out, residuals, grads))


def _assert_bitwise_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))



# dkv_split serves calls without bias or mask tiles, at head dims 128 and 256.
SPLIT_CASES = [name for name, case in GPU_CASES.items()
               if "bias" not in case and "mask" not in case and case["H"] >= 128]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("max_adjust", ["off", "safe"])
@pytest.mark.parametrize("name", SPLIT_CASES)
def test_gpu_dkv_split_matches_the_passes(name, max_adjust):
  """TuningConfig.dkv_split (one warpgroup accumulates dV and hands P^T to the other, which
  accumulates dK, over one key tile) computes the products the dK/dV kernel computes without it,
  over the same blocks in the same order, P^T handed over in fp32: outputs and gradients bitwise
  equal to one pass (head dim 128) or to two passes (256, where one does not fit), same tiles."""
  (q, k, v, _, _), kwargs, do = cases.make_inputs(dict(GPU_CASES[name]), bf16, 3)
  H = q.shape[-1]
  tiles = tuning.Tiles(64, 64, 2) if H == 128 else tuning.Tiles(32, 64, 2)
  passes = tuning.table_config(H).replace(dkv=tiles, dkv_passes=1 if H == 128 else 2,
                                          dkv_persistent=False, dkv_split=False)
  split = passes.replace(dkv_passes=1, dkv_split=True)
  args = (q, k, v, None, None)
  _assert_bitwise_equal(_outputs_and_grads(args, kwargs, do, max_adjust, passes),
                        _outputs_and_grads(args, kwargs, do, max_adjust, split))

# TuningConfig.producer=False serves calls without bias or mask tiles; at head dim 128 also under
# the tiles taken where registers are fixed at entry (two warpgroups, dkv_split).
PRODUCER_CASES = [(name, entry) for name, case in GPU_CASES.items()
                  if "bias" not in case and "mask" not in case
                  for entry in ((False, True) if case["H"] == 128 else (False,))]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("max_adjust", ["off", "safe"])
@pytest.mark.parametrize("name, entry", PRODUCER_CASES)
def test_gpu_without_a_producer_matches_the_producer(name, entry, max_adjust):
  """Without a producer warpgroup (the last compute warpgroup issues the TMA copies between its
  steps, no setmaxnreg; with `refill_k_early`, the forward's K in the step that freed its slot)
  the kernels compute the same products over the same blocks: outputs, residuals and gradients
  bitwise equal to the producer's under the same tiles."""
  (q, k, v, _, _), kwargs, do = cases.make_inputs(dict(GPU_CASES[name]), bf16, 5)
  config = tuning.table_config(q.shape[-1], entry_registers=entry).replace(
      fwd_persistent=False, dkv_persistent=False)
  args = (q, k, v, None, None)
  expected = _outputs_and_grads(args, kwargs, do, max_adjust, config)
  for early in (False, True):
    _assert_bitwise_equal(expected, _outputs_and_grads(
        args, kwargs, do, max_adjust, config.replace(producer=False, refill_k_early=early)))


def _as_on_jax_0_12(monkeypatch):
  """Default configs as JAX 0.12 takes them (ptxas ignoring setmaxnreg), without its warning."""
  monkeypatch.setattr(tuning, "registers_fixed_at_entry", lambda version: True)
  monkeypatch.setattr(mosaic, "_warned", True)


# Calls with bias or mask tiles, under the tiles taken where registers are fixed at entry.
BESIDE_CASES = [name for name, case in GPU_CASES.items() if "bias" in case or "mask" in case]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("name", BESIDE_CASES)
def test_gpu_bias_and_mask_without_a_producer_match_the_producer(name, monkeypatch):
  """Calls with bias or mask tiles under JAX 0.12's tiles, without a producer in the backward
  kernels (the last compute warpgroup streams the tiles beside Q or K and follows a mask's block
  order; tuning._ENTRY_REGISTERS_BESIDE at head dims 128 and 256), with and without the
  forward's (and without it, K refilled early: `refill_k_early`): outputs, residuals and
  gradients (the bias's too) bitwise equal to the same tiles with a producer in every kernel (the
  table's at head dim 64)."""
  (q, k, v, bias, mask), kwargs, do = cases.make_inputs(dict(GPU_CASES[name]), bf16, 5)
  spec, ops, _ = canonicalize(q, k, v, bias, mask, Options(implementation=IMPL, **kwargs))
  _as_on_jax_0_12(monkeypatch)
  config = mosaic.default_config(spec, ops)
  H = q.shape[-1]
  assert config.producer == (H == 64)
  if H > 64:   # a bias alone at head dim 128: the forward's producer
    assert config.has_producer("fwd") == (mask is None and H == 128)
  args = (q, k, v, bias, mask)
  everywhere = config.replace(producer=True, fwd_producer=None)
  expected = _outputs_and_grads(args, kwargs, do, "safe", everywhere)
  for fwd_producer, early in ((False, False), (False, True), (True, False)):
    _assert_bitwise_equal(expected, _outputs_and_grads(args, kwargs, do, "safe", everywhere.replace(
        producer=False, fwd_producer=fwd_producer, refill_k_early=early)))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("producers", [(False, True), (True, False)])
@pytest.mark.parametrize("name", [name for name, _ in PRODUCER_CASES
                                  if GPU_CASES[name]["H"] == 64])
def test_gpu_a_producer_in_one_kernel_matches_the_producer(name, producers):
  """TuningConfig.fwd_producer: a producer in the forward only (its persistent form) or in the
  backward kernels only (JAX 0.12's table at head dim 64 on full calls) gives the outputs,
  residuals and gradients of a producer in all three, bitwise."""
  (q, k, v, _, _), kwargs, do = cases.make_inputs(dict(GPU_CASES[name]), bf16, 5)
  spec, ops = _spec_ops(shape=q.shape, kv_heads=k.shape[2],
                        is_causal=GPU_CASES[name].get("is_causal", False))
  producer, fwd_producer = producers
  config = mosaic.default_config(spec, ops)
  config = config.replace(dkv_persistent=False, fwd_persistent=config.fwd_persistent and
                          fwd_producer)
  mixed = config.replace(producer=producer, fwd_producer=fwd_producer)
  args = (q, k, v, None, None)
  _assert_bitwise_equal(_outputs_and_grads(args, kwargs, do, "safe", config),
                        _outputs_and_grads(args, kwargs, do, "safe", mixed))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("case", list(FP8_CASES))
def test_gpu_fp8_forward_without_a_producer_matches_the_producer(case):
  kwargs = _fp8_kwargs(case)
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.standard_normal(s), bf16)
             for s in ((2, 384, 4, 128), (2, 384, 2, 128), (2, 384, 2, 128)))
  config = tuning.table_config(128).replace(fwd_persistent=False, dkv_persistent=False)
  if tuning.registers_fixed_at_entry(jax.__version__):
    # JAX 0.12: a producer leaves three compute warpgroups 128 registers a thread, too few for P
    # kept in registers beside the packed rows' and sinks' (ptxas C7600, fatal); P through shared
    # memory fits (the table has no producer there).
    config = config.replace(fp8_p_registers=False)
  run = lambda config: jax.device_get(stable_attn.dot_product_attention(
      q, k, v, implementation=IMPL, numerics=FP8, max_adjust="off", config=config, **kwargs))
  _assert_bitwise_equal(run(config), run(config.replace(producer=False)))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("numerics", [FP8, "fp8"])
@pytest.mark.parametrize("case", list(FP8_CASES))
@pytest.mark.parametrize("head_dim", mosaic.FP8_HEAD_DIMS)
def test_gpu_fp8_p_in_registers_matches_p_through_shared_memory(head_dim, case, numerics):
  """TuningConfig.fp8_p_registers: P's e4m3 registers relabelled as the 8-bit wgmma operand, V^T's
  keys stored in the matching order, give the P V product of P through shared memory: the LSE
  bitwise (the row sums do not see the order) and O within one bf16 ulp (the product adds its
  fp32 terms in another order). A key order that did not match would pair P with other keys'
  rows of V: O off by ~100%."""
  kwargs = _fp8_kwargs(case)
  rng = np.random.default_rng()
  q, k, v = (jnp.asarray(rng.standard_normal(s), bf16)
             for s in ((2, 384, 4, head_dim), (2, 384, 2, head_dim), (2, 384, 2, head_dim)))
  spec, ops = _spec_ops(shape=q.shape, kv_heads=2, is_causal=kwargs.get("is_causal", False),
                        numerics=numerics)
  config = mosaic.default_config(spec, ops)
  assert mosaic.fp8_forward(spec, bf16)

  def run(p_registers):
    return jax.device_get(stable_attn.dot_product_attention(
        q, k, v, implementation=IMPL, numerics=numerics, max_adjust="safe",
        config=config.replace(fp8_p_registers=p_registers), return_residuals=True, **kwargs))
  (o_smem, res_smem), (o_regs, res_regs) = run(False), run(True)
  _assert_bitwise_equal(res_regs, res_smem)
  a, b = np.asarray(o_regs, np.float32), np.asarray(o_smem, np.float32)
  np.testing.assert_array_less(np.abs(a - b), 2.0 ** -7 * np.maximum(np.abs(a), np.abs(b)) + 1e-30)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("group,p_registers", [(128, True), (64, True), (32, True), (32, False)])
@pytest.mark.parametrize("head_dim", mosaic.FP8_HEAD_DIMS)
def test_gpu_fp8_pv_promoted_keeps_o_unbiased_at_a_near_tail(head_dim, group, p_registers):
  """TuningConfig.fp8_pv_promote: each group of keys' P V into a fresh accumulator, added to O
  in fp32 (groups under the 128-key block slice P, in registers or shared memory, and V^T). The
  bias probe's rows with a near tail (two keys tied for the max, 1,022 keys 4-8 below it; head
  dim 64's columns, zeros beyond) under "fp8_fast" "safe": O's mean signed error against float64
  of the quantized inputs within 0.35 bf16 ulp (benchmarks/fp8_mma_model.py's 13-bit model of
  Hopper's FP8 accumulation: -0.10..-0.24 per 128 keys, -0.002..-0.034 per 32) and under a third
  of the one accumulator's along the row (modelled -3..-4 ulp: each 32-key instruction truncates
  the small products to ~13 bits below O's running sum). A group's slice of P paired with other
  keys' rows of V would put O off by ~100%."""
  from stable_attn import fp8, numerics
  from stable_attn.diagnostics.probe import signed_ulp_error
  seed = int(np.random.default_rng().integers(1 << 30))
  widen = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, head_dim - x.shape[-1])))
  q, k, v = (widen(x) for x in tie_inputs("positive", "random", batch=2, keys=1024, seed=seed,
                                          tail=(4.0, 8.0)))
  spec, ops = _spec_ops(shape=q.shape, kv_heads=1, numerics="fp8_fast", scale=0.125)
  config = mosaic.default_config(spec, ops)
  exact = exact_attention(*fp8.quantize_inputs(q, k, v, numerics.resolve("fp8_fast").qkv)[:3],
                          scale=0.125)

  def bias(promote):
    o = stable_attn.dot_product_attention(
        q, k, v, scale=0.125, implementation=IMPL, numerics="fp8_fast", max_adjust="safe",
        config=config.replace(fp8_pv_promote=promote, fp8_p_registers=p_registers))
    err = signed_ulp_error(jax.device_get(o), exact, bf16)
    assert np.isfinite(err).all()
    return float(err.mean())
  promoted, along_the_row = bias(group), bias(0)
  assert abs(promoted) < 0.35, (seed, promoted, along_the_row)
  assert abs(promoted) < abs(along_the_row) / 3, (seed, promoted, along_the_row)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("promote", ["default", 0])
@pytest.mark.parametrize("head_dim", mosaic.FP8_HEAD_DIMS)
def test_gpu_center_v_keeps_o_unbiased_at_a_near_tail(head_dim, promote):
  """numerics center_v on the Hopper FP8 forward (no kernel change: it attends the centred v's
  payload, and the mean joins O after it): the bias probe's near-tail rows (two keys tied for the
  max, 1,022 keys 4-8 below it, each row its own tail; head dim 64's columns, zeros beyond) under
  "fp8_fast+center_v=true" "safe" within 0.1 bf16 ulp of float64 of the attended values, with the
  table's promotion and with one accumulator along the row (benchmarks/fp8_mma_model.py's 13-bit
  model: +0.002..+0.028 either way, where plain fp8_fast is -0.20..-0.43 per block and -2.7..-4.9
  along the row, docs/fp8.md "V centred")."""
  from stable_attn import fp8
  from stable_attn.diagnostics.probe import signed_ulp_error
  seed = int(np.random.default_rng().integers(1 << 30))
  nx = "fp8_fast+center_v=true"
  widen = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, head_dim - x.shape[-1])))
  q, k, v = (widen(x) for x in tie_inputs("positive", "random", batch=4, keys=1024, seed=seed,
                                          tail=(4.0, 8.0), row_spread=0.5))
  spec, ops = _spec_ops(shape=q.shape, kv_heads=1, numerics=nx, scale=0.125)
  config = mosaic.default_config(spec, ops)
  if promote != "default":
    config = config.replace(fp8_pv_promote=promote)
  exact = exact_attention(*fp8.attended(q, k, v, nx), scale=0.125)
  o = stable_attn.dot_product_attention(q, k, v, scale=0.125, implementation=IMPL, numerics=nx,
                                        max_adjust="safe", config=config)
  err = signed_ulp_error(jax.device_get(o), exact, bf16)
  assert np.isfinite(err).all()
  assert abs(float(err.mean())) < 0.1, (seed, float(err.mean()))


# A bias without a mask: the forward's three warpgroups (grid and persistent) take its tiles of
# all their rows; the last CTA's first warpgroups idle (T not a multiple of 192), its bias tile
# starting above row 0 (TMA fills the rows before it with zeros, which no warpgroup reads).
BIAS_WGS = {
    "alibi_causal_h64": GPU_CASES["alibi_causal_h64"],
    "bias_full_h128": GPU_CASES["bias_full_h128"],
    "key_bias_fp32_window": GPU_CASES["key_bias_fp32_window"],
    # every query sees every key (the table's persistent forward in the grid's order), and every
    # batch row shares the bias (that order then runs the batch rows fastest)
    "alibi_full_h64": dict(B=3, T=200, S=233, N=4, K=2, H=64, bias=(1, 4, 200, 233),
                           q_lens=(200, 117, 64), kv_lens=(233, 190, 1)),
}


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("max_adjust", ["off", "safe"])
@pytest.mark.parametrize("wgs, persistent, order", [(3, False, "heaviest"), (3, True, "heaviest"),
                                                    (2, True, "heaviest"), (2, True, "grid")])
@pytest.mark.parametrize("name", list(BIAS_WGS))
def test_gpu_bias_forward_three_warpgroups_match_two(name, wgs, persistent, order, max_adjust):
  """The forward with a bias and three compute warpgroups (persistent or not), or two persistent
  ones (their ping-pong running on across tiles; the tiles in either order), computes every row
  as the grid of two does over the same key blocks: O, the LSE and the gradients (dbias
  included) bitwise equal. Three persistent warpgroups are taken at head dim 64, where their
  second Q buffer fits."""
  (q, k, v, bias, mask), kwargs, do = cases.make_inputs(dict(BIAS_WGS[name]), bf16, 7)
  spec, ops, _ = canonicalize(q, k, v, bias, mask, Options(implementation=IMPL, **kwargs))
  # with a producer, which the persistent forward needs (JAX 0.12's default has none)
  two = mosaic.default_config(spec, ops).replace(fwd_wgs=2, fwd_persistent=False,
                                                 fwd=tuning.Tiles(64, 64, 2), producer=True)
  variant = two.replace(fwd_wgs=wgs, fwd_persistent=persistent, persistent_order=order)
  if variant.smem_problem(q.shape[-1], 2, **mosaic._extras(ops)) is not None:
    pytest.skip("the second Q buffer does not fit beside the bias tiles at this head dim")

  run = lambda config: _outputs_and_grads((q, k, v, bias, mask), kwargs, do, max_adjust, config)
  _assert_bitwise_equal(run(two), run(variant))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("wgs, persistent", [(2, False), (3, False), (3, True), (2, True)])
@pytest.mark.parametrize("name", [*BIAS_WGS, "bias_mask_causal_gqa", "alibi_causal_gqa_h128"])
def test_gpu_bias_apart_matches_bias_with_k(name, wgs, persistent):
  """The forward's bias tiles streamed apart from K (TuningConfig.fwd_bias_apart: one buffer
  per warpgroup, a ring of its own in the producer's stream, across a persistent CTA's tiles,
  where a warpgroup idles and beside a mask that still travels with K) give the same O, LSE and
  gradients as the tiles in K's slots: bitwise equal, same key blocks."""
  (q, k, v, bias, mask), kwargs, do = cases.make_inputs(
      dict({**BIAS_WGS, **GPU_CASES}[name]), bf16, 11)
  if mask is not None and (wgs == 3 or persistent):
    pytest.skip("a persistent or three-warpgroup forward takes no mask")
  spec, ops, _ = canonicalize(q, k, v, bias, mask, Options(implementation=IMPL, **kwargs))
  with_k = mosaic.default_config(spec, ops).replace(   # a producer: the rings need one
      fwd_wgs=wgs, fwd_persistent=persistent, fwd=tuning.Tiles(64, 64, 2), fwd_bias_apart=False,
      producer=True)
  if with_k.smem_problem(q.shape[-1], 2, **mosaic._extras(ops)) is not None:
    pytest.skip("the second Q buffer does not fit beside the bias tiles at this head dim")

  run = lambda config: _outputs_and_grads((q, k, v, bias, mask), kwargs, do, "safe", config)
  _assert_bitwise_equal(run(with_k), run(with_k.replace(fwd_bias_apart=True)))


# A bias or mask that every batch row shares: the grids run the batch rows fastest
# (TuningConfig.batch_inner), so the CTAs that read one of its tiles run side by side.
BATCH_SHARED = {
    "bias_mask_causal_gqa": GPU_CASES["bias_mask_causal_gqa"],
    "bias_h256_gqa_lens": GPU_CASES["bias_h256_gqa_lens"],
    "shared_mask_bias_h128": dict(B=3, T=256, S=320, N=4, K=2, H=128, is_causal=True,
                                  bias=(1, 4, 256, 320), mask=(1, 1, 256, 320),
                                  sparse_blocks=(64, 0.5), q_lens=(256, 100, 200)),
}


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("max_adjust", ["off", "safe"])
@pytest.mark.parametrize("name", list(BATCH_SHARED))
def test_gpu_batch_inner_grid_matches_batch_outer(name, max_adjust):
  """The grids with the batch rows fastest compute every CTA's tile as the (batch, heads, rows)
  grids do: O, the LSE and the gradients (the bias's, summed over the batch, included) bitwise
  equal; only the order the CTAs start in differs."""
  (q, k, v, bias, mask), kwargs, do = cases.make_inputs(dict(BATCH_SHARED[name]), bf16, 6)
  spec, ops, _ = canonicalize(q, k, v, bias, mask, Options(implementation=IMPL, **kwargs))
  config = mosaic.default_config(spec, ops)

  run = lambda inner: _outputs_and_grads((q, k, v, bias, mask), kwargs, do, max_adjust,
                                         config.replace(batch_inner=inner))
  _assert_bitwise_equal(run(False), run(True))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("name", ["gqa_h128_lens", "packed_causal_gqa", "bias_mask_causal_gqa",
                                  "cross_window", "h256_gqa_lens", "bias_h256_gqa_lens"])
def test_gpu_heaviest_first_grids_match(name):
  """Grids that launch every head's heaviest CTAs first (TuningConfig.heaviest_first, every
  kernel, none persistent) compute every CTA's tile as the (batch, heads, rows) grids do: O, the
  LSE and the gradients bitwise equal."""
  (q, k, v, bias, mask), kwargs, do = cases.make_inputs(dict(GPU_CASES[name]), bf16, 7)
  spec, ops, _ = canonicalize(q, k, v, bias, mask, Options(implementation=IMPL, **kwargs))
  config = mosaic.default_config(spec, ops).replace(fwd_persistent=False, dkv_persistent=False)
  run = lambda c: _outputs_and_grads((q, k, v, bias, mask), kwargs, do, "safe", c)
  _assert_bitwise_equal(run(config.replace(heaviest_first=())),
                        run(config.replace(heaviest_first=("fwd", "dq", "dkv"))))


# More query tiles than an H100 or H200 has SMs (132): each persistent CTA takes two or three.
MANY_TILES = {
    "many_tiles_lens": dict(B=3, T=1000, S=1000, N=16, K=4, H=64, is_causal=True,
                            q_lens=(1000, 700, 333), kv_lens=(1000, 900, 200)),
    "many_tiles_packed": dict(B=2, T=2048, S=2048, N=8, K=8, H=64, is_causal=True,
                              segments=True, docs=5),
    # Every query sees every key, more query tiles than SMs (B * N * T / 192 = 288).
    "many_tiles_full_gqa": dict(B=3, T=1000, S=1100, N=16, K=4, H=64,
                                q_lens=(1000, 700, 333), kv_lens=(1100, 900, 200)),
    # More key tiles than SMs for the persistent dK/dV kernel (B * K * S / 128 = 448).
    "many_key_tiles_gqa_lens": dict(B=4, T=1800, S=1800, N=16, K=8, H=64, is_causal=True,
                                    q_lens=(1800, 1500, 700, 64), kv_lens=(1800, 1700, 900, 30)),
}


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("max_adjust, order", [("off", "heaviest"), ("paper", "heaviest"),
                                               ("safe", "heaviest"), ("off", "grid"),
                                               ("safe", "grid")])
@pytest.mark.parametrize("name", [n for n in WGS_CASES if GPU_CASES[n]["H"] == 64]
                         + list(MANY_TILES))
def test_gpu_persistent_forward_matches_grid(name, max_adjust, order):
  """The persistent forward (the table's at head dim 64: one CTA per SM taking the tiles in
  zigzag rounds, in either order, the next tile's Q loading during this one) computes every tile
  as a CTA of the grid does: O and the LSE bitwise equal."""
  case = GPU_CASES[name] if name in GPU_CASES else MANY_TILES[name]
  (q, k, v, _, _), kwargs, _ = cases.make_inputs(dict(case), bf16, 4)

  def run(persistent):
    config = tuning.table_config(64).replace(fwd_persistent=persistent, persistent_order=order)
    return jax.device_get(stable_attn.dot_product_attention(
        q, k, v, implementation=IMPL, max_adjust=max_adjust, config=config,
        return_residuals=True, **kwargs))

  _assert_bitwise_equal(run(False), run(True))


FUSED_CASES = ["gpt2", "gqa_h128_lens", "cross_window", "T_gt_S", "empty_rows",
               "softcap_sinks_gqa_h128", "packed_causal_gqa", "mask_packed"]


def _fused_config(case, dtype):
  extras = dict(beside=1, ds_itemsize=0) if "mask" in case else {}
  return tuning.fused_dq_config(case["H"], jnp.dtype(dtype).itemsize, **extras)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("max_adjust", ["off", "safe"])
@pytest.mark.parametrize("name", WGS_CASES + list(MANY_TILES))
def test_gpu_persistent_dkv_matches_grid(name, max_adjust):
  """The persistent dK/dV kernel (the table's at head dim 64 under a causal or window mask, with
  segment ids or GQA: one CTA per SM taking the key tiles in zigzag rounds, the next tile's K and V
  loading during this one) computes every tile as a CTA of the grid does: dK and dV bitwise equal,
  with two and three warpgroups (the last CTA's last ones idle where 192 keys do not divide S)
  and at head dim 128."""
  case = GPU_CASES[name] if name in GPU_CASES else MANY_TILES[name]
  (q, k, v, _, _), kwargs, do = cases.make_inputs(dict(case), bf16, 6)
  H = q.shape[-1]
  wgs_options = (2, 3) if H == 64 else (2,)

  def run(persistent, wgs):
    config = tuning.table_config(H).replace(dkv_persistent=persistent, dkv_wgs=wgs)
    attend = lambda q, k, v: stable_attn.dot_product_attention(
        q, k, v, implementation=IMPL, max_adjust=max_adjust, config=config, **kwargs)
    return jax.device_get(jax.vjp(attend, q, k, v)[1](do))

  for wgs in wgs_options:
    for a, b in zip(run(False, wgs), run(True, wgs)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("max_adjust", ["off", "safe"])
@pytest.mark.parametrize("name", FUSED_CASES)
def test_gpu_fused_dq_matches_exact(name, max_adjust):
  """FlashAttention-3's backward (dQ reduce-added by the dK/dV kernel, opt-in) against float64."""
  case = dict(name=name, **GPU_CASES[name])
  cases.check_case(IMPL, case, bf16, max_adjust, "fast", seed=5, config=_fused_config(case, bf16))


# Self-attention (T == S, K == N): what dot_product_attention_qkvpacked takes.
QKV_CASES = {
    "gpt2": GPU_CASES["gpt2"],
    "h128_lens_softcap_sinks": dict(B=2, T=300, S=300, N=4, K=4, H=128, is_causal=True,
                                    q_lens=(300, 217), kv_lens=(300, 190), soft_cap=20.0,
                                    sinks=True),
    "packed_docs": MANY_TILES["many_tiles_packed"],
    "bias_mask": dict(B=2, T=256, S=256, N=4, K=4, H=64, bias=(1, 4, 256, 256),
                      mask=(2, 1, 256, 256)),
    "h256": dict(B=1, T=256, S=256, N=2, K=2, H=256, is_causal=True),
}
QKV_RUNS = ([(name, "table") for name in QKV_CASES]
            + [("gpt2", "fused"), ("h128_lens_softcap_sinks", "fused"), ("gpt2", "lse_grad"),
               ("packed_docs", "lse_grad"), ("gpt2", "vmap")])


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("name, variant", QKV_RUNS)
def test_gpu_qkvpacked_matches_split(name, variant):
  """The kernels reading q, k and v in place from qkv [B, T, 3, N, H] and writing one packed
  gradient compute what they compute on separate q, k, v: O, the LSE and dqkv bitwise equal to
  (O, LSE, stacked dq, dk, dv) -- with the table's config, the fused dQ, a differentiated LSE
  (delta in XLA) and under jax.vmap."""
  case = QKV_CASES[name]
  (q, k, v, bias, mask), kwargs, do = cases.make_inputs(dict(case), bf16, 8)
  qkv = jnp.stack([q, k, v], axis=2)
  config = tuning.fused_dq_config(case["H"]) if variant == "fused" else None
  kwargs.update(implementation=IMPL, config=config, return_residuals=variant == "lse_grad")

  def attend(packed, qkv, bias):
    if packed:
      return stable_attn.dot_product_attention_qkvpacked(qkv, bias, mask, **kwargs)
    return stable_attn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], bias,
                                             mask, **kwargs)

  def run(packed):
    f = functools.partial(attend, packed)
    if variant == "vmap":   # two instances of the batch: the API folds them into it
      f = jax.vmap(f, in_axes=(0, None))
      out, vjp = jax.vjp(f, jnp.stack([qkv, qkv[::-1]]), bias)
      return jax.device_get((out, vjp(jnp.stack([do, do[::-1]]))))
    out, vjp = jax.vjp(f, qkv, bias)
    if variant == "lse_grad":
      dlse = jnp.asarray(np.random.default_rng(1).standard_normal(out[1].shape), jnp.float32)
      return jax.device_get((out, vjp((do, dlse))))
    return jax.device_get((out, vjp(do)))

  got, want = run(True), run(False)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@on_hopper
def test_gpu_default_and_fallback():
  assert stable_attn.default_implementation() == IMPL
  (q, k, v, _, _), kwargs, _ = cases.make_inputs(dict(GPU_CASES["gpt2"]), bf16, 0)
  a = stable_attn.dot_product_attention(q, k, v, **kwargs)
  b = stable_attn.dot_product_attention(q, k, v, implementation=IMPL, **kwargs)
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  choice = stable_attn.choose_implementation(q, k, v, numerics="paper", **kwargs)
  assert choice.name == "pallas_gpu" and "numerics" in choice.passed_over[IMPL]
  with pytest.raises(ValueError, match="does not cover.*numerics"):
    stable_attn.dot_product_attention(q, k, v, implementation=IMPL, numerics="paper", **kwargs)
  bias = jnp.zeros((1, 1, 1, q.shape[1]), f32)
  assert stable_attn.choose_implementation(q, k, v, bias, **kwargs).name == IMPL


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ["gqa_h128_lens", "cross_window", "gpt2"])
def test_gpu_backward_bitwise_deterministic(name, deterministic):
  """deterministic=True promises bitwise equal gradients over runs; the default (False) runs the
  same two-kernel backward today (the table picks no fused one), so it holds there too."""
  (q, k, v, _, _), kwargs, do = cases.make_inputs(dict(GPU_CASES[name]), bf16, 1)

  @jax.jit
  def grads(q, k, v):
    f = lambda q, k, v: stable_attn.dot_product_attention(q, k, v, implementation=IMPL,
                                                          deterministic=deterministic, **kwargs)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)

  first = jax.device_get(grads(q, k, v))
  for _ in range(3):
    again = jax.device_get(grads(q, k, v))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("name", ["gpt2", "gqa_h128_lens"])
def test_gpu_fused_backward_varies_only_by_rounding(name):
  """The fused backward (deterministic=False with config.fused_dq) sums dQ in CTA order: over
  runs its dQ may differ, by float32 rounding of the sum (within 1e-2 relative to dQ's scale,
  bf16's own rounding), while dK and dV, summed in registers, stay bitwise equal. Prints the
  run-to-run difference (docs/hopper_kernel.md reports it)."""
  case = dict(GPU_CASES[name])
  (q, k, v, _, _), kwargs, do = cases.make_inputs(dict(case), bf16, 2)
  config = _fused_config(case, bf16)

  @jax.jit
  def grads(q, k, v):
    f = lambda q, k, v: stable_attn.dot_product_attention(q, k, v, implementation=IMPL,
                                                          config=config, **kwargs)
    return jax.vjp(f, q, k, v)[1](do)

  as32 = lambda t: [np.asarray(x, np.float32) for x in t]
  first = as32(grads(q, k, v))
  worst = 0.0
  for _ in range(4):
    dq, dk, dv = as32(grads(q, k, v))
    np.testing.assert_array_equal(dk, first[1])
    np.testing.assert_array_equal(dv, first[2])
    worst = max(worst, float(np.max(np.abs(dq - first[0]))))
    assert worst <= 1e-2 * float(np.max(np.abs(first[0])))
  print(f"fused backward, {name}: run-to-run max |d dQ| {worst:.3g} "
        f"(max |dQ| {np.max(np.abs(first[0])):.3g})")


def _value_and_grads(mode, q, k, v, **kw):
  f = lambda q, k, v: stable_attn.dot_product_attention(q, k, v, implementation=IMPL,
                                                        max_adjust=mode, **kw)
  out, vjp = jax.vjp(jax.jit(f), q, k, v)
  return out, vjp(jnp.ones_like(out))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("mode", ["off", "safe"])
@pytest.mark.parametrize("logit_scale", [1e2, 1e4])
def test_gpu_huge_logits(mode, logit_scale):
  rng = np.random.default_rng(int(logit_scale))
  q, k, v = (jnp.asarray(rng.standard_normal(s), bf16)
             for s in ((1, 128, 2, 64), (1, 256, 2, 64), (1, 256, 2, 64)))
  out, grads = _value_and_grads(mode, q, k, v, scale=logit_scale, is_causal=True)
  chex.assert_tree_all_finite((out, grads))
  want = exact_attention(q, k, v, scale=logit_scale, is_causal=True)
  assert np.abs(np.asarray(out, np.float64) - want).max() < 0.05 * np.abs(want).max()


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("regime", REGIMES)
def test_gpu_exact_ties_never_nan(regime):
  q, k, v = tie_inputs(regime, "split", batch=1, rows=128, keys=256, seed=4)
  modes = ["off", "safe"] + (["paper"] if regime != "large" else [])
  for mode in modes:  # the paper's rule at large maxima is the documented hole (test_probe)
    chex.assert_tree_all_finite(_value_and_grads(mode, q, k, v))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("feature", [{}, {"logits_soft_cap": 10.0}, {"sink": 3.0}],
                         ids=["plain", "soft_cap", "sink"])
def test_gpu_probe_safe_removes_the_tie_bias(feature):
  """The bias probe (stable_attn.diagnostics.measure) on the compiled kernel: "safe" keeps the mean
  signed error of O within 0.05 bf16 ulp of the float64 truth, with no NaN, for tied maxima of
  three kinds and two placements, plain, under a logit soft cap and with a sink. Without a fix the
  same probe sees the fast rounding's inward bias at large maxima (-0.13 ulp for split ties on an
  H100, the sink's share negligible there; under a cap of 10 "off" has none to see)."""
  probe = dict(batch=2, rows=128, keys=512, **feature)
  for regime in ("positive", "zero", "large"):
    for placement in ("adjacent", "split"):
      r = measure(IMPL, "fast", "safe", regime, placement, **probe)
      assert abs(r.bias_ulp) <= 0.05 and r.nan_count == 0, r
  if "logits_soft_cap" not in feature:
    off = measure(IMPL, "fast", "off", "large", "split", **probe)
    assert off.bias_ulp < -0.05 and off.nan_count == 0, off


@pytest.mark.gpu
@on_hopper
def test_gpu_fully_masked_rows_are_zero():
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.standard_normal(s), bf16)
             for s in ((2, 128, 2, 64), (2, 192, 2, 64), (2, 192, 2, 64)))
  out, grads = _value_and_grads("safe", q, k, v, query_seq_lengths=jnp.array([128, 70]),
                                key_value_seq_lengths=jnp.array([0, 192]))
  chex.assert_tree_all_finite((out, grads))
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(out[1, 70:], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(grads[0][0], np.float32), 0.0)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("fp8_backward", [False, True], ids=["bf16_backward", "fp8_backward"])
@pytest.mark.parametrize("hazard", cases.FP8_HAZARDS)
def test_gpu_fp8_hazards_never_nan_nor_wrong(hazard, fp8_backward):
  """The compiled FP8 forward ("fp8_fast", "safe") and either backward on the hazards of
  tests/test_adversarial.py's CPU twin: finite values and gradients, O within FP8's error of
  float64 attention of the quantized inputs, zeros where no key is seen."""
  q, k, v, kw = cases.fp8_hazard(hazard, seed=7, shape=(2, 256, 2, 64))
  f = lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, implementation=IMPL, numerics="fp8_fast", max_adjust="safe",
      config={"fp8_backward": fp8_backward}, **kw)
  out, vjp = jax.vjp(jax.jit(f), q, k, v)
  cases.check_fp8_hazard(hazard, q, k, v, kw, out, vjp(jnp.ones_like(out)))


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused_dq"])
def test_gpu_vmap_matches_each_slice(fused):
  """jax.vmap folds the vmapped axis into the kernels' batch (stable_attn.partition): the output
  equals the unvmapped call on each slice bit for bit (same kernel, same rows); the gradients
  match each slice's to rounding (delta = rowsum(dO * O) is an XLA reduction whose rounding may
  differ with the batch; the fused backward's dQ reduce-adds run in any order) and the float64
  gradients within bf16 tolerance. The fused backward writes dQ in place (a new ref), which
  plgpu.kernel's own vmap rule does not take: the fold must happen before it."""
  rng = np.random.default_rng(5)
  q, k, v = (jnp.asarray(rng.standard_normal(s), bf16)
             for s in ((3, 2, 256, 4, 64), (3, 2, 320, 2, 64), (3, 2, 320, 2, 64)))
  do = jnp.asarray(rng.standard_normal(q.shape), bf16)
  config = tuning.fused_dq_config(64) if fused else None
  f = lambda q, k, v: stable_attn.dot_product_attention(q, k, v, implementation=IMPL,
                                                        is_causal=True, config=config)

  def value_and_grads(fn, d_out, *args):
    out, vjp = jax.vjp(jax.jit(fn), *args)
    return out, vjp(d_out)

  out, grads = value_and_grads(jax.vmap(f), do, q, k, v)
  _, tol_grad = cases.TOLERANCE[bf16]
  for i in range(q.shape[0]):
    one_out, one_grads = value_and_grads(f, do[i], q[i], k[i], v[i])
    np.testing.assert_array_equal(np.asarray(one_out, np.float32), np.asarray(out[i], np.float32))
    exact = exact_attention_vjp(q[i], k[i], v[i], do[i], is_causal=True)
    for name, g, one, want in zip("qkv", grads, one_grads, (exact.dq, exact.dk, exact.dv)):
      np.testing.assert_allclose(np.asarray(g[i], np.float32), np.asarray(one, np.float32),
                                 rtol=0, atol=1e-3 * float(np.abs(want).max()), err_msg=name)
      assert cases.relative_error(g[i], want) < tol_grad, name


@pytest.mark.parametrize("feature", ["segments", "sinks", "soft_cap", "bias", "mask"])
def test_features_lower_for_cuda(feature):
  """The whole Mosaic GPU lowering of forward, dK/dV and dQ (short of the GPU compiler) with each
  feature, on a CPU host: what the kernels use must lower (jnp.logaddexp, a custom_jvp, did not)."""
  B, T, N, K, H = 1, 512, 4, 2, 64
  ids = jnp.asarray(np.repeat(np.arange(4), T // 4)[None], jnp.int32)
  kwargs = dict(segments=dict(q_segment_ids=ids), sinks=dict(sinks=jnp.zeros(N, f32)),
                soft_cap=dict(logits_soft_cap=20.0), bias=dict(bias=jnp.zeros((1, N, T, T), bf16)),
                mask=dict(mask=jnp.ones((1, 1, T, T), bool)))[feature]

  def lowered(spec, ops):
    config = tuning.table_config(H, 2, **mosaic._extras(ops))

    def f(ops):
      o, vjp = jax.vjp(lambda o: mosaic._flash(spec, config, o)[0], ops)
      return o, vjp(o)
    return jax.jit(f).trace(ops).lower(lowering_platforms=("cuda",)).as_text()

  try:   # the plain call first: a jaxlib that cannot lower for CUDA at all skips the test
    lowered(*_spec_ops(shape=(B, T, N, H), kv_heads=K, is_causal=True))
  except NotImplementedError as e:
    pytest.skip(f"no CUDA lowering here: {e}")
  spec, ops = _spec_ops(shape=(B, T, N, H), kv_heads=K, is_causal=True, **kwargs)
  assert mosaic.covers(spec, ops) is None
  assert lowered(spec, ops).count("mosaic_gpu") >= 3   # a lowering error here fails the test


@pytest.mark.parametrize("fixed", [True, False])
def test_calls_take_the_tiles_of_this_jax(monkeypatch, fixed):
  """A call's default config follows the JAX it runs on (`tuning.registers_fixed_at_entry` of
  jax.__version__): on 0.12 the entry-register tiles (no producer warpgroup) at head dim 128,
  with a mask the table's tiles without a producer, at head dim 64 (causal) the table's;
  elsewhere the table's."""
  seen = []
  monkeypatch.setattr(tuning, "registers_fixed_at_entry",
                      lambda version: seen.append(version) or fixed)
  spec, ops = _spec_ops(shape=(2, 256, 4, 128), kv_heads=2, is_causal=True)
  config = mosaic.default_config(spec, ops)
  assert seen == [jax.__version__]
  assert config.producer is not fixed and config.fwd_wgs == 3
  spec, ops = _spec_ops(shape=(2, 256, 4, 128), kv_heads=2, is_causal=True,
                        mask=jnp.ones((1, 1, 256, 256), bool))
  config = mosaic.default_config(spec, ops)
  assert config.producer is not fixed and config.fwd_wgs == 2
  spec, ops = _spec_ops(shape=(2, 256, 4, 64), kv_heads=2, is_causal=True)
  assert mosaic.default_config(spec, ops).producer


@pytest.mark.parametrize("feature", ["plain", "segments", "sinks", "soft_cap", "qkvpacked"])
def test_entry_register_tiles_lower_for_cuda(feature):
  """JAX 0.12's head-dim-128 tiles (no producer warpgroup, three Q/dO stages in the dK/dV
  kernel: tuning._ENTRY_REGISTERS) lower for CUDA, forward and backward, with each feature they
  serve, on a CPU host (bias and mask: `test_entry_register_tiles_with_bias_or_mask_...`)."""
  B, T, N, K, H = 1, 384, 4, 2, 128
  ids = jnp.asarray(np.repeat(np.arange(3), T // 3)[None], jnp.int32)
  kwargs = dict(plain={}, qkvpacked={}, segments=dict(q_segment_ids=ids),
                sinks=dict(sinks=jnp.zeros(N, f32)), soft_cap=dict(logits_soft_cap=20.0))[feature]
  spec, ops = _spec_ops(shape=(B, T, N, H), kv_heads=N if feature == "qkvpacked" else K,
                        is_causal=True, **kwargs)
  config = tuning.table_config(H, 2, packed=feature == "segments", entry_registers=True)
  assert not config.producer and config.dkv.stages == 3
  if feature == "qkvpacked":
    ops = pack(jnp.stack([ops.q, ops.k, ops.v], axis=2), ops)
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  # the forward, the dQ kernel and the dK/dV kernel (a lowering error fails first)
  kernels = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
  assert len(kernels) == 3, (feature, len(kernels))


@pytest.mark.parametrize("feature,p_registers,promote", [
    (feature, False, 128) for feature in (
        "gqa", "segments_sinks_window", "soft_cap_paper", "qkvpacked", "head_dim_64", "preset",
        "preset_head_dim_64", "rounded_sum", "rounded_sum_top_bf16", "fp8_fast")] + [
    (feature, True, 128) for feature in ("gqa", "segments_sinks_window", "head_dim_64",
                                         "preset", "preset_head_dim_64", "fp8_fast",
                                         "fp8_fast_head_dim_64")] + [
    (feature, p_registers, group) for feature in ("preset", "fp8_fast", "fp8_fast_head_dim_64")
    for p_registers in (False, True) for group in (0, 32)] + [
    (feature, p_registers, 64) for feature in ("preset_head_dim_64", "fp8_fast_head_dim_64")
    for p_registers in (False, True)])
def test_fp8_forward_lowers_for_cuda(feature, p_registers, promote):
  """The FP8 forward (e4m3 Q K^T, P cast to e4m3 through shared memory or kept in registers:
  TuningConfig.fp8_p_registers, V^T; P V into a fresh accumulator per block, per 64 keys (two
  in turn, head dim 64's table) or 32 (P and V^T sliced) or one along the row: fp8_pv_promote)
  lowers for CUDA with the features it serves, and its backward is the bf16 kernels' (dQ, dK/dV)
  on the dequantized q, k, v; on a CPU host."""
  B, T, N, K, H = 1, 384, 4, 2, 64 if feature.endswith("head_dim_64") else 128
  ids = jnp.asarray(np.repeat(np.arange(3), T // 3)[None], jnp.int32)
  kwargs = dict(gqa={}, qkvpacked={}, head_dim_64={},
                segments_sinks_window=dict(q_segment_ids=ids, sinks=jnp.zeros(N, f32),
                                           local_window_size=(200, 0)),
                soft_cap_paper=dict(logits_soft_cap=20.0, max_adjust="paper"),
                # the "fp8" preset: its top keys' residual is a second e4m3 P V product
                preset=dict(numerics="fp8", sinks=jnp.zeros(N, f32)),
                preset_head_dim_64=dict(numerics="fp8"),
                # the other combinations `fp8_forward` accepts: a row sum of every rounded P_bar
                rounded_sum=dict(numerics="fp8+p_top=p+sum_keeps_max=false"),
                rounded_sum_top_bf16=dict(numerics="fp8+sum_keeps_max=false"),
                # "safe"'s dither on O (Numerics.dither="out"): the epilogue reads the offsets
                fp8_fast=dict(numerics="fp8_fast", max_adjust="safe", sinks=jnp.zeros(N, f32)),
                fp8_fast_head_dim_64=dict(numerics="fp8_fast", max_adjust="safe"))[feature]
  kwargs = dict(numerics=FP8) | kwargs
  spec, ops = _spec_ops(shape=(B, T, N, H), kv_heads=N if feature == "qkvpacked" else K,
                        is_causal=True, **kwargs)
  assert mosaic.covers(spec, ops) is None and mosaic.fp8_forward(spec, bf16)
  config = mosaic.default_config(spec, ops).replace(fp8_p_registers=p_registers,
                                                    fp8_pv_promote=promote)
  if feature == "qkvpacked":   # the forward reads split copies; the backward writes in place
    ops = pack(jnp.stack([ops.q, ops.k, ops.v], axis=2), ops)
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  kernels = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
  # the forward, the dQ kernel and the dK/dV kernel once per pass
  assert len(kernels) == 2 + config.dkv_passes, (feature, len(kernels))
  assert sum("f8E4M3FN" in line for line in kernels) == 1, feature   # the forward's operands




@pytest.mark.parametrize("feature", ["plain", "head_dim_64", "segments_window", "no_producer",
                                     "mha_soft_cap", "dv_along_the_column"])
def test_fp8_backward_lowers_for_cuda(feature):
  """The FP8 backward's kernels (pallas_kernels/mosaic_gpu/fp8_backward.py: dQ and dK/dV, e4m3
  products only, dS and P relabelled in registers) lower for CUDA, two kernels with e4m3
  operands, with GQA, segment ids and a window, a soft cap, without a producer warpgroup
  (JAX 0.12's tables), and with dV's accumulator along the column (fp8_dv_promote=False), on a
  CPU host."""
  from pallas_kernels.mosaic_gpu import fp8_backward
  B, T, N, H = 1, 384, 4, 64 if feature == "head_dim_64" else 128
  K = N if feature.startswith("mha") else 2
  ids = jnp.asarray(np.repeat(np.arange(3), T // 3)[None], jnp.int32)
  kwargs = dict(segments_window=dict(q_segment_ids=ids, local_window_size=(200, 0)),
                mha_soft_cap=dict(logits_soft_cap=20.0)).get(feature, {})
  spec, ops = _spec_ops(shape=(B, T, N, H), kv_heads=K, is_causal=True, numerics=FP8,
                        max_adjust="off", **kwargs)
  config = mosaic.default_config(spec, ops)
  if feature == "no_producer":
    config = config.replace(producer=False, fwd_persistent=False, dkv_persistent=False)
  assert config.fp8_dv_promote
  if feature == "dv_along_the_column":
    config = config.replace(fp8_dv_promote=False)
  o, lse = jnp.zeros((B, T, N, H), bf16), jnp.zeros((B, N, T), f32)
  grads = lambda ops, o, lse, do: fp8_backward.fp8_backward(spec, config, ops, o, lse, do)
  with cases.abstract_gpu():
    text = jax.jit(grads).trace(ops, o, lse, o).lower(lowering_platforms=("cuda",)).as_text()
  kernels = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
  assert len(kernels) == 2 and all("f8E4M3FN" in line for line in kernels), kernels


def test_config_as_changes_to_the_calls_default(monkeypatch):
  """config={field: value} is the call's default config with those changes (what a caller who
  cannot know the call's tiles passes: train's --fp8-backward), lowered as such: the FP8 forward
  and the FP8 backward's two kernels, all three with e4m3 operands; a field TuningConfig does
  not have is a ValueError naming it."""
  monkeypatch.setattr(mosaic, "is_available", lambda: True)   # the checks, not the device
  spec, ops = _spec_ops(shape=(1, 384, 4, 64), kv_heads=2, is_causal=True, numerics=FP8,
                        max_adjust="off")
  default = mosaic.default_config(spec, ops)
  got = mosaic._checked_config(spec, ops, {"fp8_backward": True})
  assert got == default.replace(fp8_backward=True) and got != default
  assert mosaic._checked_config(spec, ops, {}) == default
  with pytest.raises(ValueError, match="fields TuningConfig does not have: 'fp8_bwd'"):
    mosaic._checked_config(spec, ops, {"fp8_bwd": True})
  with cases.abstract_gpu():
    text = cases.lower_vjp_for_cuda(
        lambda o: mosaic.attention(spec, o, {"fp8_backward": True})[0], ops)
  kernels = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
  assert len(kernels) == 3 and all("f8E4M3FN" in line for line in kernels), kernels


@pytest.mark.parametrize("feature", ["plain", "gqa_window", "segments", "qkvpacked", "h128"])
def test_dkv_split_lowers_for_cuda(feature):
  """TuningConfig.dkv_split (dK and dV in one pass, one warpgroup each, P^T handed over through
  shared memory) lowers for CUDA with the features it serves, at head dim 256 (and 128), on a
  CPU host; it is one dK/dV kernel, and the API refuses it beside a bias."""
  H = 128 if feature == "h128" else 256
  ids = jnp.asarray(np.repeat(np.arange(3), 128)[None], jnp.int32)
  kwargs = dict(plain={}, h128={}, qkvpacked={}, gqa_window=dict(local_window_size=(200, 0)),
                segments=dict(q_segment_ids=ids))[feature]
  spec, ops = _spec_ops(shape=(1, 384, 4, H), kv_heads=2 if feature == "gqa_window" else 4,
                        is_causal=True, **kwargs)
  config = tuning.table_config(H).replace(dkv=tuning.Tiles(64, 64, 2), dkv_passes=1,
                                          dkv_persistent=False, dkv_split=True)
  if feature == "qkvpacked":
    ops = pack(jnp.stack([ops.q, ops.k, ops.v], axis=2), ops)
  text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  assert sum("custom_call @mosaic_gpu" in line for line in text.splitlines()) == 3
  spec, ops = _spec_ops(shape=(1, 384, 4, 128), kv_heads=4,
                        bias=jnp.zeros((1, 4, 384, 384), bf16))
  with pytest.raises(ValueError, match="dkv_split=True takes no bias"):
    mosaic._checked_config(spec, ops, mosaic.default_config(spec, ops).replace(dkv_split=True))
  # nor, at head dim 256, three forward warpgroups (which failed to compile there)
  spec, ops = _spec_ops(shape=(1, 384, 4, 256), kv_heads=4, is_causal=True)
  with pytest.raises(ValueError, match="fwd_wgs=3: at head dim 256"):
    mosaic._checked_config(spec, ops, tuning.table_config(256).replace(fwd=tuning.Tiles(64, 32, 2),
                                                                       fwd_wgs=3))
  with pytest.raises(ValueError, match="dkv_split"):
    config.replace(dkv_passes=2)


@pytest.mark.parametrize("feature, ordered", [
    ("plain", 0), ("bias_with_k", 1), ("bias_apart", 1), ("mask", 1), ("segments", 1),
    ("dkv_split", 1)])
def test_releases_after_thread_reads_wait_for_the_warpgroup(feature, ordered, monkeypatch):
  """A slot whose tiles threads read (a bias, mask or segment-id tile with K, the bias buffer
  apart from K, dkv_split's P^T) is released after a warpgroup barrier (common.release): Pallas
  arrives from one thread, and a lagging warp's reads could otherwise land after the producer's
  next TMA copy (as they did for the bias buffer without one). Counted while the kernels trace
  for CUDA: none where only the tensor cores read the slots."""
  barriers = []
  original = common._warpgroup_barrier
  monkeypatch.setattr(common, "_warpgroup_barrier", lambda: (barriers.append(1), original())[1])
  H = dict(bias_with_k=64, dkv_split=256).get(feature, 128)
  T = 256
  kwargs = dict(
      bias_with_k=dict(bias=jnp.zeros((1, 2, T, T), bf16)),
      bias_apart=dict(bias=jnp.zeros((1, 2, T, T), bf16)),
      mask=dict(mask=jnp.asarray(np.random.default_rng().random((1, 1, T, T)) < 0.8)),
      segments=dict(q_segment_ids=jnp.asarray(np.repeat(np.arange(2), T // 2)[None],
                                              jnp.int32))).get(feature, {})
  spec, ops = _spec_ops(shape=(1, T, 2, H), kv_heads=2, is_causal=feature != "mask", **kwargs)
  config = mosaic.default_config(spec, ops)
  assert config.fwd_bias_apart == (feature == "bias_apart")
  assert config.dkv_split == (feature == "dkv_split")
  cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  assert bool(barriers) == bool(ordered), (feature, len(barriers))


@pytest.mark.parametrize("feature", ["alibi", "block_mask", "bias_mask_h64", "bias_h256"])
def test_entry_register_tiles_with_bias_or_mask_lower_for_cuda(feature, monkeypatch):
  """JAX 0.12's tiles for calls with bias or mask tiles at head dims 128 and 256 (the table's, two
  compute warpgroups, no producer: the last compute warpgroup streams the tiles with K or Q and
  follows a mask's compacted block order; with a bias alone at 128 the forward keeps its
  producer: tuning._ENTRY_REGISTERS_BESIDE) lower for CUDA, forward and backward, on a CPU host;
  so does each with the other forward; at head dim 64 (the table's, with a producer) so do the
  kernels without one."""
  _as_on_jax_0_12(monkeypatch)
  monkeypatch.setattr(mosaic, "is_available", lambda: True)   # the checks, not the device
  T, H = (384, 256) if feature == "bias_h256" else (384, 64 if feature == "bias_mask_h64" else 128)
  bias = jnp.zeros((1, 4, T, T), bf16) if feature != "block_mask" else None
  mask = None
  if feature in ("block_mask", "bias_mask_h64"):   # every other 64 x 64 block
    blocks = (np.arange(T)[:, None] // 64 + np.arange(T)[None] // 64) % 2 == 0
    mask = jnp.asarray(blocks | np.eye(T, dtype=bool))[None, None]
  spec, ops = _spec_ops(shape=(2, T, 4, H), kv_heads=2, is_causal=feature != "block_mask",
                        bias=bias, mask=mask)
  config = mosaic.default_config(spec, ops)
  assert not (config.fwd_bias_apart or config.fwd_persistent), config
  assert (config.fwd_wgs, config.dq_wgs, config.dkv_wgs) == (2, 2, 2)
  if H == 64:   # the table's: a producer in every kernel
    assert config.producer and config.fwd_producer is None
    config = config.replace(producer=False)
  alone = mask is None and H == 128   # a bias alone at head dim 128: the forward's producer
  assert config.has_producer("fwd") == alone and not config.has_producer("dkv")
  for config in (config, config.replace(fwd_producer=not alone)):
    mosaic._checked_config(spec, ops, config)
    text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
    kernels = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(kernels) == 3 + (config.dkv_passes == 2), (feature, len(kernels))


_IDS = np.repeat(np.arange(4), 128)[None].repeat(2, 0)
SMEM_CASES = {   # name: (head dim, _spec_ops' keywords, a change to the default config or None)
    "h64": (64, {}, None), "h128_full": (128, dict(is_causal=False), None),
    "h256": (256, {}, None),
    "packed": (128, dict(q_segment_ids=_IDS, kv_segment_ids=_IDS), None),
    "bias_h64": (64, dict(bias=np.zeros((1, 4, 512, 512), np.float32)), None),
    "mask": (128, dict(mask=np.ones((1, 1, 512, 512), bool)), None),
    "fa3_fp8_h64": (64, dict(numerics=FP8), None),
    "fa3_fp8_p_smem": (128, dict(numerics=FP8), dict(fp8_p_registers=False)),
    "preset_p_smem": (128, dict(numerics="fp8"), dict(fp8_p_registers=False)),
    "fp8_backward": (128, dict(numerics="fp8"), dict(fp8_backward=True)),
    "fp8_backward_packed_h64": (64, dict(numerics=FP8, q_segment_ids=_IDS, kv_segment_ids=_IDS),
                                dict(fp8_backward=True, dkv=tuning.Tiles(64, 64, 3))),
}


@pytest.mark.parametrize("name", list(SMEM_CASES))
def test_smem_needs_bounds_what_the_kernels_allocate(name, monkeypatch):
  """tuning.TuningConfig.smem_needs, which decides what fits, against the shared memory each
  kernel allocates (its SMEM scratch, summed while the call lowers for CUDA): never under it, and
  over it by at most the segment ids' bytes a call without them is counted for (the FP8 forward
  included: e4m3 Q, K and V, O's staging and P's tiles; and the FP8 backward's kernels)."""
  H, kwargs, change = SMEM_CASES[name]
  kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
  causal = kwargs.pop("is_causal", True)
  spec, ops = _spec_ops(shape=(2, 512, 4, H), kv_heads=2, is_causal=causal, **kwargs)
  config = mosaic.default_config(spec, ops)
  config = config.replace(**change) if change else config
  allocated = {}
  launch = common.launch

  def counting(kernel, scratch, **kw):
    arrays = jax.tree.leaves(scratch[0], is_leaf=lambda x: hasattr(x, "dtype"))
    allocated[kw["name"]] = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)
    return launch(kernel, scratch, **kw)
  monkeypatch.setattr(common, "launch", counting)
  jax.clear_caches()   # the kernels are traced once per call (common.lowered_once)
  cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o), ops)
  needs = config.smem_needs(H, 2, **mosaic._extras(ops), **mosaic._fp8_smem(spec, ops))
  fp8_backward = config.fp8_backward   # its kernels: one grid CTA per tile
  prefix = "stable_attn_fp8_" if fp8_backward else "stable_attn_"
  for kernel, key in (("stable_attn_forward", "fwd"), (prefix + "dq", "dq"),
                      (prefix + "dkv", "dkv")):
    ids = 0 if ops.q_seg is not None else 4 * (   # int32 ids per resident and streamed row
        {"fwd": (1 + config.fwd_persistent) * config.fwd_wgs * config.fwd.block_q
                + config.fwd.stages * config.fwd.block_kv,
         "dq": config.dq_wgs * config.dq.block_q + config.dq.stages * config.dq.block_kv,
         "dkv": config.dkv_key_wgs * config.dkv.block_kv
                * (1 + (config.dkv_persistent and not fp8_backward))
                + config.dkv.stages * config.dkv.block_q}[key])
    assert 0 <= needs[key] - allocated[kernel] <= ids, (kernel, needs[key], allocated[kernel])


@pytest.mark.parametrize("H", tuning.HEAD_DIMS)
def test_without_a_producer_no_warpgroup_moves_registers(H, monkeypatch):
  """TuningConfig.producer=False: each kernel launches its compute warpgroups alone (no producer
  warpgroup) and none runs setmaxnreg, so every thread keeps its share of the register file at
  entry, what ptxas leaves where it ignores setmaxnreg (JAX 0.12). Counted while the kernels
  trace for CUDA, against the producer's kernels."""
  jax.clear_caches()   # the kernels are traced once per call (common.lowered_once)
  launched, moves = [], []
  original = common.launch
  monkeypatch.setattr(common, "launch", lambda *a, **kw: (
      launched.append((kw["compute_wgs"], kw.get("producer", True))), original(*a, **kw))[1])
  set_max = plgpu.set_max_registers
  monkeypatch.setattr(plgpu, "set_max_registers",
                      lambda *a, **kw: (moves.append(a), set_max(*a, **kw))[1])
  spec, ops = _spec_ops(shape=(1, 256, 4, H), kv_heads=2, is_causal=True)
  config = mosaic.default_config(spec, ops).replace(fwd_persistent=False, dkv_persistent=False)
  counts = {}
  # (producer, fwd_producer): everywhere, nowhere, the forward's only, the backward's only
  for producers in ((True, None), (False, None), (False, True), (True, False)):
    launched.clear(), moves.clear()
    changes = dict(zip(("producer", "fwd_producer"), producers))
    cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config.replace(**changes), o), ops)
    counts[producers] = (list(launched), len(moves))
  kernels = 3 + (config.dkv_passes == 2)   # forward, dQ, dK/dV (one or two passes)
  everywhere, nowhere = counts[True, None], counts[False, None]
  assert everywhere[0] == [(wgs, True) for wgs, _ in nowhere[0]]
  assert [p for _, p in nowhere[0]] == [False] * kernels
  assert everywhere[1] == 2 * kernels and nowhere[1] == 0
  # the forward launches first: its own producer, or the backward kernels' alone
  assert [p for _, p in counts[False, True][0]] == [True] + [False] * (kernels - 1)
  assert [p for _, p in counts[True, False][0]] == [False] + [True] * (kernels - 1)
  assert counts[False, True][1] == 2 and counts[True, False][1] == 2 * (kernels - 1)
  # a refill two steps after the slot's release (TuningConfig.refill_lag; capped at stages - 1)
  lagged = config.replace(producer=False, refill_lag=2,
                          dkv=tuning.Tiles(config.dkv.block_q, config.dkv.block_kv, 3))
  if lagged.smem_problem(H, 2) is None:
    cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, lagged, o), ops)


@pytest.mark.parametrize("H", tuning.HEAD_DIMS)
def test_refill_k_early_moves_the_forwards_k_copies(H, monkeypatch):
  """TuningConfig.refill_k_early: without a producer the forward's issuer copies K, and what
  travels with it (the keys' segment ids), in the step that freed its slot (named region
  refill_early), V still at the step's start (refill); with a producer the flag changes
  nothing. Copies counted by named region and destination dtype while the vjp lowers for CUDA,
  packed rows (segment ids beside K)."""
  from jax._src import source_info_util
  copies = collections.Counter()
  original = plgpu.copy_gmem_to_smem

  def counted(src, dst, *args, **kwargs):
    scopes = str(source_info_util.current_name_stack()).split("/")
    region = next((s for s in ("refill_early", "refill") if s in scopes), "other")
    copies[region, jnp.dtype(dst.dtype).name] += 1
    return original(src, dst, *args, **kwargs)
  monkeypatch.setattr(plgpu, "copy_gmem_to_smem", counted)
  ids = jnp.asarray(np.repeat([0, 1], 128)[None].repeat(2, 0), jnp.int32)
  spec, ops = _spec_ops(shape=(2, 256, 4, H), kv_heads=2, is_causal=True,
                        q_segment_ids=ids, kv_segment_ids=ids)
  config = mosaic.default_config(spec, ops).replace(fwd_persistent=False, dkv_persistent=False,
                                                     producer=False)
  lowered, counts = {}, {}
  for early, fwd_producer in itertools.product((False, True), (None, True)):
    jax.clear_caches(), copies.clear()
    changed = config.replace(refill_k_early=early, fwd_producer=fwd_producer)
    lowered[early, fwd_producer] = cases.lower_vjp_for_cuda(
        lambda o: mosaic._flash(spec, changed, o), ops)
    counts[early, fwd_producer] = dict(copies)
  plain, early = counts[False, None], counts[True, None]
  moved = {dtype: n for (region, dtype), n in early.items() if region == "refill_early"}
  assert moved == {"bfloat16": moved.get("int32"), "int32": moved.get("bfloat16")} and moved, early
  for dtype in ("bfloat16", "int32"):   # moved out of the refills, nothing else changed
    assert early["refill", dtype] + moved[dtype] == plain["refill", dtype], (plain, early)
  assert {k: n for k, n in early.items() if k[0] == "other"} == {
      k: n for k, n in plain.items() if k[0] == "other"}
  assert lowered[True, True] == lowered[False, True]   # a producer: the flag does nothing
  assert lowered[True, None] != lowered[False, None]


def test_without_a_producer_refuses_what_only_a_producer_streams(monkeypatch):
  monkeypatch.setattr(mosaic, "is_available", lambda: True)   # the checks, not the device
  base = tuning.table_config(128).replace(dkv_persistent=False)
  for changes in (dict(fwd_persistent=True), dict(dkv_persistent=True), dict(fused_dq=True)):
    with pytest.raises(ValueError, match="producer=False"):
      base.replace(producer=False, **changes)
  for lag in (0, -1, 1.5):
    with pytest.raises(ValueError, match="refill_lag"):
      base.replace(producer=False, refill_lag=lag)
  with pytest.raises(ValueError, match="fwd_persistent=False"):   # the forward's own
    base.replace(fwd_producer=False, fwd_persistent=True)
  base.replace(producer=False, fwd_producer=True, fwd_persistent=True)   # the forward's only
  with pytest.raises(ValueError, match="fwd_producer must be"):
    base.replace(fwd_producer="no")
  bias = jnp.zeros((1, 2, 256, 256), bf16)
  spec, ops = _spec_ops(shape=(1, 256, 2, 128), kv_heads=2, is_causal=True, bias=bias)
  config = mosaic.default_config(spec, ops)
  assert config.fwd_bias_apart   # the table's at head dim 128: one ring per warpgroup
  for changes in (dict(producer=False), dict(fwd_producer=False)):
    with pytest.raises(ValueError, match="fwd_bias_apart=True needs the forward's producer"):
      mosaic._checked_config(spec, ops, config.replace(**changes))
    # in K's slots (64-key blocks fit beside them) or in the backward kernels it needs none
    mosaic._checked_config(spec, ops, config.replace(fwd_bias_apart=False,
                                                     fwd=tuning.Tiles(64, 64, 2), **changes))
  mosaic._checked_config(spec, ops, config.replace(producer=False, fwd_producer=True))


def test_fp8_forward_takes_128_key_blocks():
  spec, ops = _spec_ops(shape=(1, 256, 2, 128), kv_heads=2, is_causal=True, numerics=FP8)
  config = mosaic.default_config(spec, ops)
  with pytest.raises(ValueError, match="block_kv=64"):
    mosaic._checked_config(spec, ops, config.replace(fwd=tuning.Tiles(64, 64, 2)))


@pytest.mark.parametrize("numerics", ["fast", "fast+qkv=e4m3"])
def test_fp8_backward_needs_the_fp8_forward(numerics):
  """TuningConfig.fp8_backward on a call whose forward is not FP8 (bf16 P, or bf16 inputs) is a
  ValueError naming the field, not a silent bf16 backward; on an FP8 call it is accepted."""
  spec, ops = _spec_ops(shape=(1, 256, 2, 128), kv_heads=2, is_causal=True, numerics=numerics)
  config = mosaic.default_config(spec, ops).replace(fp8_backward=True)
  with pytest.raises(ValueError, match="config.fp8_backward=True"):
    mosaic._checked_config(spec, ops, config)
  spec, ops = _spec_ops(shape=(1, 256, 2, 128), kv_heads=2, is_causal=True, numerics=FP8,
                        max_adjust="off")
  config = mosaic.default_config(spec, ops).replace(fp8_backward=True)
  try:   # on a CPU host the check passes and is_available() fails last
    mosaic._checked_config(spec, ops, config)
  except ValueError as e:
    assert "needs a Hopper" in str(e), e



@pytest.mark.parametrize("H", mosaic.FP8_HEAD_DIMS)
def test_fp8_preset_forward_takes_two_warpgroups_at_head_dim_128(H):
  """The "fp8" preset's forward (a top-key residual tile: tile.has_top_residual) runs two compute
  warpgroups at head dim 128 (tuning._TOP_RESIDUAL: three spill there), three at 64, and
  FlashAttention-3's arithmetic (no residual) keeps the table's three; the backward keeps its
  tiles either way."""
  def config(numerics):
    return mosaic.default_config(*_spec_ops(shape=(1, 256, 4, H), kv_heads=2, is_causal=True,
                                            numerics=numerics))
  preset, fa3, bf16_call = config("fp8"), config(FP8), config("fast")
  assert tile.has_top_residual(stable_attn.numerics.resolve("fp8").dtypes(bf16))
  assert not tile.has_top_residual(stable_attn.numerics.resolve(FP8).dtypes(bf16))
  assert preset.fwd_wgs == (2 if H == 128 else 3)
  assert fa3 == bf16_call and fa3.fwd_wgs == 3
  assert preset.replace(fwd_wgs=fa3.fwd_wgs) == fa3

def _count(jaxpr, primitive: str) -> int:
  """Equations of `primitive` in a jaxpr and the jaxprs under it, kernels' bodies left out."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "pallas_call":
      n += eqn.primitive.name == primitive
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
          sub = getattr(sub, "jaxpr", sub)
          n += _count(sub, primitive) if hasattr(sub, "eqns") else 0
  return n


def test_fp8_forward_measures_each_head_once():
  """The FP8 forward's e4m3 payloads are made under the scales the api quantized q, k and v with
  (the q_scale, k_scale and v_scale operands): the call takes each head's largest |value| once,
  as the bf16-P call on the same quantized inputs does (before, the backend took it again: one
  more pass over each of q, k and v, 0.06 ms apiece at B4 T4096 N16 H128 on an H200)."""
  def maxima(numerics):
    def f(q, k, v):
      spec, ops, _ = canonicalize(q, k, v, None, None, Options(is_causal=True, numerics=numerics))
      return mosaic._flash(spec, mosaic.default_config(spec, ops), ops)[0]
    x = jnp.zeros((1, 256, 4, 128), bf16)
    return _count(jax.make_jaxpr(f)(x, x, x).jaxpr, "reduce_max")
  assert maxima(FP8) == maxima("fast+qkv=e4m3") == maxima("fast") + 3
  spec, ops = _spec_ops(shape=(1, 256, 2, 128), kv_heads=2, is_causal=True, numerics=FP8)
  with pytest.raises(ValueError, match="q_scale, k_scale, v_scale"):
    mosaic.forward_inputs(spec, mosaic.default_config(spec, ops), ops._replace(k_scale=None))


@pytest.mark.parametrize("fp8_backward", [False, True])
def test_fp8_kernels_read_the_apis_payloads(fp8_backward):
  """The FP8 kernels' e4m3 operands are the api's payloads (the rows q_e4m3, k_e4m3, v_e4m3,
  cast from the unquantized inputs: one pass, where casting the quantized values again was a
  second), padded: bitwise what the backend casts from the quantized values without them, GQA
  with lengths and a length needing padding; and they are read (other payloads give other
  operands). Forward (Q, K, V^T) and the FP8 backward's inputs (Q, K, V and Q^T, K^T)."""
  rng = np.random.default_rng()
  B, T, N, K, H = 2, 300, 4, 2, 128
  q = jnp.asarray(rng.standard_normal((B, T, N, H)) * 3, bf16)
  k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), bf16) for _ in range(2))
  spec, ops, _ = canonicalize(q, k, v, None, None, Options(
      is_causal=True, max_adjust="off", numerics=FP8,
      key_value_seq_lengths=jnp.array([300, 170])))
  config = dataclasses.replace(mosaic.default_config(spec, ops), fp8_backward=fp8_backward)
  if fp8_backward:
    from pallas_kernels.mosaic_gpu import fp8_backward as fp8_bwd
    o = jnp.asarray(rng.standard_normal((B, T, N, H)), bf16)
    lse = jnp.zeros((B, N, T), jnp.float32)
    inputs = lambda ops: fp8_bwd.backward_inputs(spec, config, ops, o, lse, o)
    arrays = lambda got: (got[1].q, got[1].k, got[1].v, got[2].q_t, got[2].k_t)
  else:
    inputs = lambda ops: mosaic.forward_inputs(spec, config, ops)
    arrays = lambda got: (got[1].q, got[1].k, got[1].v)
  bits = lambda a: np.asarray(a).view(np.uint8)
  cast_again = ops._replace(**dict.fromkeys(mosaic.fp8.PAYLOAD_ROWS))
  run = jax.jit(lambda ops: arrays(inputs(ops)))
  for got, want in zip(run(ops), run(cast_again)):
    assert got.dtype == mosaic.fp8.E4M3 and got.shape == want.shape
    np.testing.assert_array_equal(bits(got), bits(want))
  other = ops._replace(q_e4m3=jnp.ones_like(ops.q_e4m3), k_e4m3=jnp.ones_like(ops.k_e4m3),
                       v_e4m3=jnp.ones_like(ops.v_e4m3))
  for got in run(other):
    real = np.asarray(got, np.float32)
    assert set(np.unique(real)) <= {0.0, 1.0} and real.max() == 1.0   # ones, and the padding


def test_safe_offsets_are_trace_time_constants():
  """max_adjust="safe" adds no per-call XLA work: its offsets (an operand, tile.safe_offset of every
  head and position) are computed when the call is traced and enter the program as a constant."""
  spec, ops = _spec_ops(shape=(2, 200, 4, 64), is_causal=True)
  want = tile.safe_offset(jnp.arange(200)[None, :], jnp.arange(4)[:, None], bf16)
  np.testing.assert_array_equal(np.asarray(ops.offset), np.asarray(want))
  config = tuning.table_config(64)
  text = jax.jit(lambda o: mosaic._flash(spec, config, o)).trace(ops).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.log" not in text and "stablehlo.floor" not in text


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_window_wider_than_the_sequence_is_no_window(causal):
  """A window wider than the sequence (2**31 - 9 once wrapped round int32 to "no key") gives the
  call without a window, bitwise: api.canonicalize clamps it to max(T, S)."""
  rng = np.random.default_rng()
  q, k, v = (jnp.asarray(rng.standard_normal((2, 300, 4, 64)), bf16) for _ in range(3))
  run = lambda **kw: stable_attn.dot_product_attention(q, k, v, is_causal=causal,
                                                       implementation=IMPL, **kw)
  want = np.asarray(run(), np.float32)
  for window in (2 ** 31 - 9, 10 ** 12, (2 ** 31 - 319, 0 if causal else 2 ** 31 - 319)):
    np.testing.assert_array_equal(np.asarray(run(local_window_size=window), np.float32), want)
