"""Which e4m3 wgmma arrangements Mosaic GPU lowers (docs/fp8.md, "Step 2, planned"), on any host.

    PYTHONPATH=. python docs/repro/fp8_wgmma_lowering.py

Each case is one CTA's Pallas Mosaic GPU kernel lowered for CUDA on this host (no GPU, no ptxas:
what the FP8 Hopper kernel's design must get past first). One line per case: lowers, or the error.
"""
from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stable_attn import tile
from pallas_kernels.mosaic_gpu import common
from pallas_kernels.mosaic_gpu.common import load_tile
from tests import cases

F8, F32, M, SWIZZLE = jnp.float8_e4m3fn, jnp.float32, 64, 128
LAYOUT = plgpu.Layout
TRANSFORMS = (plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE))


def lowering_error(product, smem_shapes=None):
  """None if the kernel lowers, else its error's first line. product(acc_s, acc_o, a_smem,
  b_smem, p_smem) issues the wgmma(s) under test."""
  smem_shapes = smem_shapes or SHAPES
  def kernel(a_gmem, b_gmem, o_gmem):
    def body(a_smem, b_smem, p_smem, barrier):
      plgpu.copy_gmem_to_smem(a_gmem, a_smem, barrier.at[0])
      plgpu.copy_gmem_to_smem(b_gmem, b_smem, barrier.at[0])
      plgpu.barrier_wait(barrier.at[0])

      def scoped(acc_s, acc_o):
        product(acc_s, acc_o, a_smem, b_smem, p_smem)
        o_gmem[...] = acc_o[...]
      pl.run_scoped(scoped, plgpu.ACC((M, 128), F32), plgpu.ACC((M, 128), F32))
    pl.run_scoped(body, *(plgpu.SMEM(s, F8, transforms=TRANSFORMS) for s in smem_shapes),
                  plgpu.Barrier(num_arrivals=2, num_barriers=1))

  call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((M, 128), F32), grid=(1,),
                      grid_names=("x",))
  args = [jax.ShapeDtypeStruct(s, F8) for s in smem_shapes[:2]]
  try:
    with cases.abstract_gpu():
      jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))
  except Exception as e:  # noqa: BLE001 -- the point is to report what fails
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
  return None


def p_of(acc_s):
  """P cast to e4m3 from the f32 scores' accumulator (WGMMA layout), 2^8 pre-cast scale."""
  return (jnp.exp2(acc_s[...] - 3.0) * 256.0).astype(F8)


# P kept in registers: the accumulator's e4m3 registers relabelled as the 8-bit operand
# (`common.as_8bit_operand`, what the FP8 forward runs with TuningConfig.fp8_p_registers); each
# 16-key group of the operand is then in `common.RELABELLED_KEYS` order, so V^T's keys must be
# stored in that order.
RELABELLED_KEYS = np.array(common.RELABELLED_KEYS)
relabel = common.as_8bit_operand


def ds_online(acc_s, acc_o, a, b):
  """The FP8 backward's dQ step (docs/fp8.md, "The FP8 backward's kernel"): dS (here the scores'
  accumulator) scaled per row under its running max (tile.fp8_row_scale), cast to e4m3, its
  registers relabelled as the 8-bit operand, dQ += dS K^T's product, the accumulator rescaled."""
  plgpu.wgmma(acc_s, a, b.T)
  ds = acc_s[...]
  rows = plgpu.Layout.WGMMA.reduce(1)
  scaled = tile.fp8_row_scale(plgpu.layout_cast(jnp.zeros((M,), F32), rows), ds)
  widen = lambda x: lax.broadcast_in_dim(x, (M, 128), (0,))
  acc_o[...] = acc_o[...] * widen(scaled.ratio)
  plgpu.wgmma(acc_o, relabel((ds * widen(scaled.scale)).astype(F8)), b.T)


SHAPES = ((M, 128), (128, 128), (M, 128))   # Q or P [64, 128]; K, V or V^T [128, 128]; P staging
CASES = {
    # S = Q K^T: K [block_kv, H] as stored, viewed transposed (K-major, as 8-bit needs)
    "Q K^T, B = K.T": lambda s, o, a, b, p: plgpu.wgmma(o, a, b.T),
    # O += P V with V [block_kv, H] as stored: N-major, a transpose for the hardware
    "P V, B = V as stored": lambda s, o, a, b, p: plgpu.wgmma(o, a, b),
    # O += P V with V^T [H, block_kv] stored, viewed transposed
    "P V, B = (V^T).T": lambda s, o, a, b, p: plgpu.wgmma(o, a, b.T),
    # P in registers straight from the scores: needs WGMMA -> WGMMA_8BIT
    "P from S in registers": lambda s, o, a, b, p: (
        plgpu.wgmma(s, a, b.T), plgpu.wgmma(o, plgpu.layout_cast(p_of(s), LAYOUT.WGMMA_8BIT), b.T)),
    # P through shared memory, then A from shared memory
    "P through SMEM, A from SMEM": lambda s, o, a, b, p: (
        plgpu.wgmma(s, a, b.T), p.__setitem__(Ellipsis, p_of(s)), plgpu.commit_smem(),
        plgpu.wgmma(o, p, b.T)),
    # P through shared memory, loaded back in the 8-bit WGMMA layout, A from registers
    "P through SMEM, A registers (WGMMA_8BIT)": lambda s, o, a, b, p: (
        plgpu.wgmma(s, a, b.T), p.__setitem__(Ellipsis, p_of(s)), plgpu.commit_smem(),
        plgpu.wgmma(o, load_tile(p, LAYOUT.WGMMA_8BIT), b.T)),
    # P kept in registers: the accumulator's registers relabelled as the 8-bit operand (`relabel`)
    "P relabelled in registers": lambda s, o, a, b, p: (
        plgpu.wgmma(s, a, b.T), plgpu.wgmma(o, relabel(p_of(s)), b.T)),
    # the FP8 backward's dS under its online row scale, relabelled, dQ += dS K (`ds_online`)
    "dS scaled online, relabelled": lambda s, o, a, b, p: ds_online(s, o, a, b),
}

if __name__ == "__main__":
  print(f"jax {jax.__version__}")
  for case_name, case in CASES.items():
    print(f"{case_name}: {lowering_error(case) or 'lowers'}")
