"""Quick compiled check of every kernel path on a GPU: one line per configuration, never stops early.

    PYTHONPATH=. python -m pallas_kernels.gpu.devcheck

Each line: the case, compile+run time, and the relative errors (O, dQ, dK, dV, dbias) against the
exact float64 reference; a failure prints its exception and the run goes on.
"""
from __future__ import annotations

import sys
import time

import jax.numpy as jnp

from tests import cases

CHECKS = [
    (dict(name="bf16_causal_gqa", B=2, T=256, S=256, N=4, K=2, H=64, is_causal=True),
     jnp.bfloat16, "safe", "fast"),
    (dict(name="bf16_h128_lens", B=2, T=200, S=300, N=2, K=1, H=128, q_lens=(200, 150),
          kv_lens=(300, 99)), jnp.bfloat16, "off", "fast"),
    (dict(name="f16_window", B=1, T=130, S=130, N=2, K=2, H=32, window=(20, 5)),
     jnp.float16, "paper", "paper"),
    (dict(name="f32_bias_mask", B=2, T=96, S=80, N=2, K=1, H=64, bias=(1, 2, 96, 80),
          mask=(2, 1, 96, 80)), jnp.float32, "safe", "fast"),
    (dict(name="bf16_bias_row_col", B=2, T=64, S=100, N=4, K=2, H=96, bias=(2, 1, 1, 100),
          mask=(1, 4, 64, 1), is_causal=True, kv_lens=(100, 70)), jnp.bfloat16, "safe", "fast+fp32o"),
    (dict(name="bf16_h256", B=1, T=128, S=128, N=2, K=1, H=256, is_causal=True),
     jnp.bfloat16, "safe", "fast"),
    (dict(name="f32_h128", B=1, T=128, S=128, N=2, K=2, H=128, bias=(1, 1, 1, 128)),
     jnp.float32, "paper", "fast"),
]


def main():
  failures = 0
  for case, dtype, max_adjust, numerics in CHECKS:
    t0 = time.perf_counter()
    try:
      errors = cases.check_case("pallas_gpu", case, dtype, max_adjust, numerics, seed=7)
      status = " ".join(f"{k}={v:.1e}" for k, v in errors.items())
    except Exception as e:  # report and go on
      failures += 1
      status = f"FAIL {type(e).__name__}: {str(e)[:600]}"
    print(f"devcheck {case['name']:18s} {jnp.dtype(dtype).name:8s} {max_adjust:5s} {numerics:10s} "
          f"{time.perf_counter() - t0:5.1f}s {status}", flush=True)
  print(f"devcheck: {len(CHECKS) - failures}/{len(CHECKS)} passed")
  return failures


if __name__ == "__main__":
  sys.exit(1 if main() else 0)
