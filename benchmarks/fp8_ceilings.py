"""What the FP8 backward kernels' online dS scale costs: the dQ and dK/dV kernels timed against
copies of themselves with parts of that work cut out (issue 49; docs/fp8.md).

    PYTHONPATH=. python benchmarks/fp8_ceilings.py     # on an H100 / H200

The copies are pallas_kernels/mosaic_gpu/fp8_backward.py with source lines replaced (CEILINGS);
their gradients are wrong by design, so they bound what a cheaper scheme could save, nothing more:
  no rescale    the fp32 dQ / dK accumulator is not multiplied by the scale's ratio each step
                (what a warpgroup-wide vote that skips unchanged rows could save at most)
  static scale  no running amax, no per-row scale, no rescale: dS cast to e4m3 as it is (what a
                scale known before the kernel, e.g. cuDNN's delayed per-tensor dP scale, could
                save at most)
Each kernel alone on the FP8 call's prepared operands (B4 T4096 and B1 T16384, N16 H128 causal),
the arms of a shape timed in alternating rounds (benchmarks/attention.py's protocol).
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import attention as bench  # noqa: E402
from benchmarks import fp8 as fp8_bench  # noqa: E402
from pallas_kernels import mosaic_gpu as mosaic  # noqa: E402
from pallas_kernels.mosaic_gpu import fp8_backward  # noqa: E402
from stable_attn.api import Options, canonicalize  # noqa: E402

_RESCALES = [("dq = dq * _rows(scaled.ratio, H)", "pass"),
             ("dk = dk * _rows(scaled.ratio, H)", "pass")]
CEILINGS = {
    "no rescale": _RESCALES,
    "static scale": _RESCALES + [
        ("scaled = tile.fp8_row_scale(running, ds)",
         "scaled = tile.Fp8RowScale(running, running * 0 + 1.0, running * 0 + 1.0)"),
        ("(ds * _rows(scaled.scale, bk)).astype(E4M3)", "ds.astype(E4M3)"),
        ("(ds * _rows(scaled.scale, bq)).astype(E4M3)", "ds.astype(E4M3)")],
}


def kernel_copy(name: str) -> types.ModuleType:
  """fp8_backward.py with CEILINGS[name]'s replacements (each must match: ValueError if the kernel
  source has moved on)."""
  with open(fp8_backward.__file__) as f:
    source = f.read()
  for old, new in CEILINGS[name]:
    if old not in source:
      raise ValueError(f"ceiling {name!r}: {old!r} is no longer in {fp8_backward.__file__}")
    source = source.replace(old, new)
  module = types.ModuleType(f"fp8_backward_{name.replace(' ', '_')}")
  module.__file__ = fp8_backward.__file__
  exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102
  return module


def ceilings(shape, rounds: int, calls: int, blocks: int) -> list[str]:
  """Markdown rows: each kernel and each copy's median time and its speed over the kernel's."""
  q, k, v, do = bench.make_inputs(*shape, jnp.bfloat16)
  spec, ops, _ = canonicalize(q, k, v, None, None, Options(
      is_causal=True, implementation="pallas_mosaic_gpu", numerics=fp8_bench.FP8_NUMERICS,
      max_adjust="off"))
  config = mosaic.default_config(spec, ops).replace(fp8_backward=True)
  o, lse = jax.jit(lambda ops: mosaic.attention(spec, ops, config))(ops)
  call, x, grads, dq_ranges, dkv_ranges = fp8_backward.backward_inputs(spec, config, ops, o, lse,
                                                                        do)
  arms = {}
  for name, module in [("kernel", fp8_backward)] + [(n, kernel_copy(n)) for n in CEILINGS]:
    arms["dQ", name] = (jax.jit(lambda x, g, m=module: m.dq_call(
        call, x, g, dq_ranges, jnp.bfloat16)), (x, grads))
    arms["dK/dV", name] = (jax.jit(lambda x, g, m=module: m.dkv_call(
        call, x, g, dkv_ranges, jnp.bfloat16)), (x, grads))
  t = bench.alternating_rounds(arms, rounds, calls, blocks)
  B, T, N, _, H = shape
  return [f"| B{B} T{T} N{N} H{H} | {kernel} | {name} | {t[kernel, name] * 1e6:.1f} | "
          f"{t[kernel, 'kernel'] / t[kernel, name]:.3f} |" for kernel, name in arms]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="0,1", help="indices into benchmarks/fp8.py's SHAPES")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--blocks", type=int, default=5)
  args = parser.parse_args(argv)
  lines = ["| shape | kernel | copy | us | x the kernel |", "|---|---|---|---:|---:|"]
  for i in args.shapes.split(","):
    lines += ceilings(fp8_bench.SHAPES[int(i)], args.rounds, args.calls, args.blocks)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
