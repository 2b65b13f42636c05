"""Compiled check of the GPU kernels on the device: one line per case, each case in its own process
with a time limit (a pipeline deadlock then costs that limit, not the whole run).

    python -m tests.devcheck [--implementation pallas_mosaic_gpu,pallas_gpu] [--timeout 120]
                             [--only NAME,...]

Each line: the implementation and case, compile+run time, relative errors of O, dQ, dK, dV (and
dbias) against the exact float64 reference (tests/cases.py), or the failure. Exit status 1 if any
case failed. A development tool of the repository, not of the installed library.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

# name -> (implementation, case shape and options, dtype, max_adjust, numerics)
CASES = {
    "mgpu_mha_h64_off": ("pallas_mosaic_gpu", dict(B=2, T=256, S=256, N=2, K=2, H=64),
                         "bfloat16", "off", "fast"),
    "mgpu_causal_gqa_h64_safe": ("pallas_mosaic_gpu", dict(B=2, T=384, S=384, N=4, K=2, H=64,
                                                           is_causal=True),
                                 "bfloat16", "safe", "fast"),
    "mgpu_causal_mqa_h128_safe": ("pallas_mosaic_gpu", dict(B=1, T=512, S=512, N=4, K=1, H=128,
                                                            is_causal=True),
                                  "bfloat16", "safe", "fast"),
    "mgpu_cross_h128_paper": ("pallas_mosaic_gpu", dict(B=2, T=200, S=333, N=2, K=1, H=128),
                              "bfloat16", "paper", "fast"),
    "mgpu_window_lens_h64": ("pallas_mosaic_gpu", dict(B=2, T=300, S=300, N=2, K=2, H=64,
                                                       is_causal=True, window=(70, 0),
                                                       q_lens=(300, 177), kv_lens=(300, 150)),
                             "bfloat16", "safe", "fast"),
    "mgpu_empty_rows_f16": ("pallas_mosaic_gpu", dict(B=2, T=160, S=130, N=2, K=1, H=64,
                                                      q_lens=(160, 90), kv_lens=(0, 130)),
                            "float16", "off", "fast"),
    "mgpu_causal_T_gt_S_h128": ("pallas_mosaic_gpu", dict(B=1, T=320, S=192, N=2, K=2, H=128,
                                                          is_causal=True),
                                "bfloat16", "safe", "fast"),
    "mgpu_window_both_h128": ("pallas_mosaic_gpu", dict(B=1, T=512, S=512, N=2, K=2, H=128,
                                                        window=(90, 130)),
                              "float16", "paper", "fast"),
    "mgpu_softcap_sinks_gqa_h128": ("pallas_mosaic_gpu", dict(B=2, T=300, S=333, N=8, K=2, H=128,
                                                              is_causal=True, q_lens=(300, 217),
                                                              kv_lens=(333, 190), soft_cap=20.0,
                                                              sinks=True),
                                    "bfloat16", "safe", "fast"),
    "mgpu_softcap_window_h64_f16": ("pallas_mosaic_gpu", dict(B=1, T=257, S=513, N=4, K=1, H=64,
                                                              window=(64, 32), soft_cap=2.5),
                                    "float16", "paper", "fast"),
    "mgpu_sinks_empty_rows": ("pallas_mosaic_gpu", dict(B=2, T=160, S=130, N=2, K=1, H=64,
                                                        q_lens=(160, 90), kv_lens=(0, 130),
                                                        sinks=True), "bfloat16", "off", "fast"),
    "mgpu_packed_causal_gqa_h64": ("pallas_mosaic_gpu", dict(B=2, T=1024, S=1024, N=4, K=2, H=64,
                                                             is_causal=True, segments=True,
                                                             docs=8), "bfloat16", "safe", "fast"),
    "mgpu_packed_cross_cap_h128": ("pallas_mosaic_gpu", dict(B=2, T=640, S=900, N=2, K=1, H=128,
                                                             segments=True, docs=6, soft_cap=20.0,
                                                             kv_lens=(900, 700)),
                                   "bfloat16", "paper", "fast"),
    "gpu_causal_gqa": ("pallas_gpu", dict(B=2, T=256, S=256, N=4, K=2, H=64, is_causal=True),
                       "bfloat16", "safe", "fast"),
    "gpu_h128_lens": ("pallas_gpu", dict(B=2, T=200, S=300, N=2, K=1, H=128, q_lens=(200, 150),
                                         kv_lens=(300, 99)), "bfloat16", "off", "fast"),
    "gpu_f16_window": ("pallas_gpu", dict(B=1, T=130, S=130, N=2, K=2, H=32, window=(20, 5)),
                       "float16", "paper", "paper"),
    "gpu_f32_bias_mask": ("pallas_gpu", dict(B=2, T=96, S=80, N=2, K=1, H=64, bias=(1, 2, 96, 80),
                                             mask=(2, 1, 96, 80)), "float32", "safe", "fast"),
    "gpu_bias_row_col": ("pallas_gpu", dict(B=2, T=64, S=100, N=4, K=2, H=96, bias=(2, 1, 1, 100),
                                            mask=(1, 4, 64, 1), is_causal=True, kv_lens=(100, 70)),
                         "bfloat16", "safe", "fast+fp32o"),
    "gpu_h256": ("pallas_gpu", dict(B=1, T=128, S=128, N=2, K=1, H=256, is_causal=True),
                 "bfloat16", "safe", "fast"),
    "gpu_f32_h128": ("pallas_gpu", dict(B=1, T=128, S=128, N=2, K=2, H=128, bias=(1, 1, 1, 128)),
                     "float32", "paper", "fast"),
    # Packed rows long enough for many blocks: the segment block ranges decide what runs.
    "gpu_packed_causal_gqa": ("pallas_gpu", dict(B=2, T=1024, S=1024, N=4, K=2, H=64,
                                                 is_causal=True, segments=True, docs=8),
                              "bfloat16", "safe", "fast"),
    "gpu_packed_cross_bias_cap": ("pallas_gpu", dict(B=2, T=640, S=900, N=2, K=1, H=128,
                                                     segments=True, docs=6, soft_cap=20.0,
                                                     bias=(1, 2, 640, 900), kv_lens=(900, 700)),
                                  "bfloat16", "paper", "fast"),
}


def run_one(name: str) -> dict:
  import jax.numpy as jnp
  from tests import cases
  implementation, shape, dtype, max_adjust, numerics = CASES[name]
  t0 = time.perf_counter()
  errors = cases.check_case(implementation, dict(name=name, **shape), jnp.dtype(dtype).type,
                            max_adjust, numerics, seed=7)
  return dict(errors=errors, seconds=time.perf_counter() - t0)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--implementation", default="pallas_mosaic_gpu,pallas_gpu")
  p.add_argument("--timeout", type=float, default=120)
  p.add_argument("--only", default="")
  p.add_argument("--case", help=argparse.SUPPRESS)   # run one case in this process
  args = p.parse_args(argv)
  if args.case:
    print(json.dumps(run_one(args.case)))
    return 0
  implementations = args.implementation.split(",")
  names = [n for n in args.only.split(",") if n] or [
      n for n, c in CASES.items() if c[0] in implementations]
  failures = 0
  for name in names:
    t0 = time.perf_counter()
    try:
      r = subprocess.run([sys.executable, "-m", "tests.devcheck", "--case", name],
                         capture_output=True, text=True, timeout=args.timeout)
      if r.returncode == 0:
        result = json.loads(r.stdout.strip().splitlines()[-1])
        status = " ".join(f"{k}={v:.1e}" for k, v in result["errors"].items())
      else:
        failures += 1
        tail = (r.stderr or r.stdout).strip().splitlines()
        status = "FAIL " + " | ".join(tail[-6:])[:1500]
    except subprocess.TimeoutExpired:
      failures += 1
      status = f"TIMEOUT after {args.timeout:.0f}s (deadlock?)"
    print(f"devcheck {name:28s} {time.perf_counter() - t0:6.1f}s {status}", flush=True)
  print(f"devcheck: {len(names) - failures}/{len(names)} passed")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
