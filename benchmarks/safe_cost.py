"""What max_adjust="safe" costs against "off" in the Hopper forward, by GPU time (issue 46).

    PYTHONPATH=. python benchmarks/safe_cost.py           # on an H100 / H200
    PYTHONPATH=. python benchmarks/safe_cost.py --smoke   # CPU: pallas_gpu interpreted, tiny

Host-timed blocks of these 0.1-0.5 ms calls spread by several percent between two identical arms
(benchmarks/results/safe_vs_off_nvidia_h200.md), more than the 2% bound being checked. Here an
arm's time per call is the sum of the durations of every GPU kernel it runs, from a profiler trace
(benchmarks.train_profile.kernel_times): the forward kernel and, for "safe", the XLA kernel that
computes the per-row offsets. Arms "off", "safe" and "off" again (a second jit of the same call:
the noise floor), interleaved over reps, one trace per arm and rep. Writes
benchmarks/results/safe_cost_<device>.md and prints it. Without a GPU (--smoke) the trace holds no
GPU kernels: the table then shows what ran, with no times.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
from benchmarks import attention as bench  # noqa: E402
from benchmarks.train_profile import kernel_times  # noqa: E402

SHAPES = [(16, 1024, 12, 12, 64, True), (8, 2048, 16, 16, 64, False),
          (4, 4096, 16, 16, 128, True), (2, 8192, 32, 8, 128, True), (1, 16384, 16, 16, 128, True)]
SMOKE_SHAPES = [(1, 128, 2, 2, 64, True)]
ARMS = ("off", "safe", "off2")


def gpu_us(fn, args, calls: int) -> float:
  """GPU microseconds per call of fn(*args): its kernels' durations summed (0 without a GPU)."""
  jax.block_until_ready(fn(*args))   # compiled and warm before the trace
  return sum(kernel_times(lambda: fn(*args), calls).values())


def measure(shape, calls: int, reps: int, smoke: bool) -> dict:
  """arm -> its GPU microseconds per call in each rep (smoke: the Triton kernel interpreted, as the
  Mosaic GPU kernels have no interpret mode)."""
  B, T, N, K, H, causal = shape
  q, k, v, _ = bench.make_inputs(B, T, N, K, H, jnp.bfloat16)
  def forward(mode):
    return jax.jit(lambda q, k, v: stable_attn.dot_product_attention(
        q, k, v, is_causal=causal, max_adjust=mode, interpret=smoke,
        implementation="pallas_gpu" if smoke else "pallas_mosaic_gpu"))
  fns = {arm: forward(arm.rstrip("2")) for arm in ARMS}
  times = {arm: [] for arm in ARMS}
  for _ in range(reps):
    for arm, fn in fns.items():
      times[arm].append(gpu_us(fn, (q, k, v), calls))
  return times


def ratio_cell(num, den) -> str:
  """Per-rep ratios: median (range); '-' without times."""
  if not all(den):
    return "-"
  r = [a / b for a, b in zip(num, den)]
  return f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"


def markdown(device, results, calls, reps) -> str:
  lines = [f"# \"safe\" against \"off\" in the Hopper forward, by GPU time: {device}, "
           f"JAX {jax.__version__}", "",
           "`PYTHONPATH=. python benchmarks/safe_cost.py`: bf16, the table's tiles, one process. "
           f"Per arm and rep, {calls} calls in one profiler trace; an arm's time per call is the "
           "sum of its GPU kernels' durations (the forward kernel, and for \"safe\" the offsets' "
           f"XLA kernel). {reps} reps, arms interleaved; ratios per rep: median (range). \"off "
           "again\" is a second jit of the \"off\" call: the noise between identical arms.", "",
           "| shape | off us | safe us | safe / off | off again / off |", "|---|---:|---:|---|---|"]
  for shape, t in results.items():
    med = lambda arm: f"{statistics.median(t[arm]):.1f}" if all(t[arm]) else "-"
    lines.append(f"| {bench.shape_name(shape)} | {med('off')} | {med('safe')} | "
                 f"{ratio_cell(t['safe'], t['off'])} | {ratio_cell(t['off2'], t['off'])} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="CPU: pallas_gpu interpreted, tiny")
  parser.add_argument("--calls", type=int, default=50)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--out", default=None, help="markdown path (default: benchmarks/results)")
  args = parser.parse_args(argv)
  shapes = SMOKE_SHAPES if args.smoke else SHAPES
  calls, reps = (2, 1) if args.smoke else (args.calls, args.reps)
  results = {}
  for shape in shapes:
    results[shape] = measure(shape, calls, reps, smoke=args.smoke)
    print(f"{bench.shape_name(shape)}: " + ", ".join(
        f"{arm} {statistics.median(t):.1f} us" for arm, t in results[shape].items()), flush=True)
  device = jax.devices()[0].device_kind
  text = markdown(device, results, calls, reps)
  if not args.smoke:
    out = args.out or os.path.join(bench.RESULTS, f"safe_cost_{bench.device_slug(device)}.md")
    with open(out, "w") as f:
      f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
