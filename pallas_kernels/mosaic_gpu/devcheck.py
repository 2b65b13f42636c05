"""Compiled check of the Hopper kernels: one line per case, each case in its own process with a
time limit (a pipeline deadlock then costs that limit, not the whole run).

    python -m pallas_kernels.mosaic_gpu.devcheck [--timeout 120] [--only NAME,...]

Each line: the case, compile+run time, relative errors of O, dQ, dK, dV against the exact float64
reference (tests/cases.py), or the failure. Exit status 1 if any case failed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = {
    "mha_h64_off": (dict(B=2, T=256, S=256, N=2, K=2, H=64), "bfloat16", "off"),
    "causal_gqa_h64_safe": (dict(B=2, T=384, S=384, N=4, K=2, H=64, is_causal=True),
                            "bfloat16", "safe"),
    "causal_mqa_h128_safe": (dict(B=1, T=512, S=512, N=4, K=1, H=128, is_causal=True),
                             "bfloat16", "safe"),
    "cross_h128_paper": (dict(B=2, T=200, S=333, N=2, K=1, H=128), "bfloat16", "paper"),
    "window_lens_h64": (dict(B=2, T=300, S=300, N=2, K=2, H=64, is_causal=True, window=(70, 0),
                             q_lens=(300, 177), kv_lens=(300, 150)), "bfloat16", "safe"),
    "empty_rows_f16": (dict(B=2, T=160, S=130, N=2, K=1, H=64, q_lens=(160, 90),
                            kv_lens=(0, 130)), "float16", "off"),
    "causal_T_gt_S_h128": (dict(B=1, T=320, S=192, N=2, K=2, H=128, is_causal=True),
                           "bfloat16", "safe"),
    "window_both_h128": (dict(B=1, T=512, S=512, N=2, K=2, H=128, window=(90, 130)),
                         "float16", "paper"),
}


def run_one(name: str) -> dict:
  import jax.numpy as jnp
  from tests import cases
  shape, dtype, max_adjust = CASES[name]
  case = dict(name=name, **shape)
  t0 = time.perf_counter()
  errors = cases.check_case("pallas_mosaic_gpu", case, jnp.dtype(dtype).type, max_adjust, "fast",
                            seed=7)
  return dict(errors=errors, seconds=time.perf_counter() - t0)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--timeout", type=float, default=120)
  p.add_argument("--only", default="")
  p.add_argument("--case", help=argparse.SUPPRESS)   # run one case in this process
  args = p.parse_args(argv)
  if args.case:
    print(json.dumps(run_one(args.case)))
    return 0
  names = [n for n in args.only.split(",") if n] or list(CASES)
  failures = 0
  for name in names:
    t0 = time.perf_counter()
    try:
      r = subprocess.run([sys.executable, "-m", "pallas_kernels.mosaic_gpu.devcheck", "--case",
                          name], capture_output=True, text=True, timeout=args.timeout)
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
    print(f"devcheck {name:22s} {time.perf_counter() - t0:6.1f}s {status}", flush=True)
  print(f"devcheck: {len(names) - failures}/{len(names)} passed")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
