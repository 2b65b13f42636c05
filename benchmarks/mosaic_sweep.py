"""Tiling sweep of the Hopper kernels (pallas_mosaic_gpu): one line per variant, same process.

    PYTHONPATH=. python benchmarks/mosaic_sweep.py [--shapes targets] [--kernels fwd,dkv,dq,...]

Each variant replaces one kernel's Tiles in the table's TuningConfig for this JAX (on 0.12 the
entry-register tiles: `tuning.registers_fixed_at_entry`); the forward's and the dQ kernel's also
their compute warpgroups, 2 or 3 (`TuningConfig.fwd_wgs`, `dq_wgs`), "dkv" one pass of the dK/dV
kernel, "dkv2" two (`dkv_passes`), "dkvs" one split between its warpgroups (`dkv_split`). "fwd"
variants are timed forward only, the others forward+backward, against cuDNN timed in the same run.
Protocol of benchmarks/attention.py (loops of back-to-back calls, median of blocks).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
from benchmarks import attention as bench  # noqa: E402
from pallas_kernels.mosaic_gpu import tuning  # noqa: E402

T = tuning.Tiles
_FWD = [T(64, 32, 2), T(64, 32, 3), T(64, 64, 2), T(64, 64, 3), T(64, 64, 4), T(64, 128, 2),
        T(64, 128, 3), T(64, 192, 2), T(64, 256, 2)]
VARIANTS = {   # TuningConfig fields each variant replaces
    # three warpgroups get 160 registers per thread: key blocks up to 128 rows; persistent CTAs
    # take three (their second Q buffer fits shared memory at head dim 64) and a producer
    "fwd": [dict(fwd=t, fwd_wgs=w, fwd_persistent=p, **({"producer": True} if p else {}))
            for w in (2, 3) for p in (False, True)
            for t in _FWD if (w == 2 and not p) or (w == 3 and t.block_kv <= 128)],
    "dkv": [dict(dkv=t, dkv_passes=1, dkv_split=False)
            for t in (T(64, 64, 2), T(64, 64, 3), T(64, 64, 4), T(128, 64, 2), T(32, 64, 2),
                      T(32, 64, 3), T(32, 64, 4))],
    # dK and dV in two passes, one fp32 accumulator each: what fits where the toolchain keeps
    # every thread at its entry registers (ptxas ignoring setmaxnreg: docs/ptxas_setmaxnreg.md)
    "dkv2": [dict(dkv=t, dkv_passes=2, dkv_split=False, dkv_persistent=False)
             for t in (T(64, 64, 2), T(64, 64, 3), T(32, 64, 2), T(32, 64, 4))],
    # dK and dV in one pass, one warpgroup each over one key tile (`dkv_split`): head dim 256's;
    # at 128, 128-row Q/dO blocks fit beside it
    "dkvs": [dict(dkv=t, dkv_passes=1, dkv_split=True, dkv_persistent=False)
             for t in (T(64, 64, 2), T(64, 64, 3), T(128, 64, 2), T(32, 64, 2), T(32, 64, 3))],
    "dq": [dict(dq=t, dq_wgs=w) for w in (2, 3)
           for t in (T(64, 32, 2), T(64, 32, 3), T(64, 64, 2), T(64, 64, 3), T(64, 128, 2),
                     T(64, 128, 3))],
}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="targets2",
                 choices=("targets2", "targets", "h128", "16k", "h256"),
                 help="h128: B4 T4096 N16 H128 causal alone; 16k: B1 T16384 N16 H128 causal; "
                      "h256: the head-dim-256 rows")
  p.add_argument("--kernels", default="fwd,dkv,dq")
  p.add_argument("--max-adjust", default="safe")
  p.add_argument("--soft-cap", type=float, default=None,
                 help="our calls' logits_soft_cap (cuDNN's line stays uncapped: jax.nn has none)")
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--blocks", type=int, default=3)
  args = p.parse_args(argv)
  shapes = {"targets2": bench.TARGETS[:2], "targets": bench.TARGETS,
            "h128": bench.TARGETS[1:2], "16k": bench.TARGETS[4:], "h256": bench.H256}[args.shapes]
  for shape in shapes:
    B, T_, N, K, H, causal = shape
    q, k, v, do = bench.make_inputs(*shape[:5], jnp.bfloat16)
    flops = bench.fwd_flops(*shape)

    def timed(fn, forward_only):
      f = jax.jit(fn) if forward_only else jax.jit(
          lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))
      a = (q, k, v) if forward_only else (q, k, v, do)
      ms = 1e3 * bench.time_calls(f, a, args.calls, args.blocks)
      return ms, flops * (1 if forward_only else 3.5) / ms / 1e9

    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation="cudnn")
    base = tuning.table_config(H, entry_registers=tuning.registers_fixed_at_entry(jax.__version__))
    for forward_only in (True, False):
      ms, tf = timed(cudnn, forward_only)
      print(f"sweep {bench.shape_name(shape)} cudnn {'fwd' if forward_only else 'f+b'}"
            f"{' (no cap)' if args.soft_cap else ''}: "
            f"{ms:.3f} ms {tf:.0f} TF", flush=True)
    for kernel in args.kernels.split(","):
      for variant in VARIANTS[kernel]:
        config = base.replace(**variant)
        tiles = variant["dkv" if kernel in ("dkv2", "dkvs") else kernel]
        tag = " (table)" if all(getattr(base, k) == v for k, v in variant.items()) else ""
        wgs = "".join(f" wg{w}" for name, w in variant.items() if name.endswith("_wgs"))
        wgs += " persistent" if variant.get("fwd_persistent") else ""
        wgs += " 2 passes" if variant.get("dkv_passes") == 2 else ""
        wgs += " split" if variant.get("dkv_split") else ""
        try:
          config.check_smem(H, 2)
          fn = functools.partial(
              lambda q, k, v, config: stable_attn.dot_product_attention(
                  q, k, v, is_causal=causal, implementation="pallas_mosaic_gpu",
                  max_adjust=args.max_adjust, logits_soft_cap=args.soft_cap, config=config),
              config=config)
          ms, tf = timed(fn, kernel == "fwd")
          line = f"{ms:.3f} ms {tf:.0f} TF{tag}"
        except Exception as e:
          line = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(f"sweep {bench.shape_name(shape)} {kernel} bq{tiles.block_q} bkv{tiles.block_kv} "
              f"s{tiles.stages}{wgs}: {line}", flush=True)


if __name__ == "__main__":
  main()
