"""Where the Hopper kernel's time goes: Mosaic GPU's on-device profiler over one call.

  python -m benchmarks.profile_mosaic [--shapes targets|short|gpt2|h128|h64full|gqa|16k|h256,...]
                                      [--max-adjust safe] [--bias alibi] [--backward] [--fused]
                                      [--numerics fp8]

Runs each shape once unprofiled (compile, warm-up), then once inside `common.profiling`, which
makes every compute warpgroup record its named regions (`jax.named_scope` in the kernel bodies:
load_q, first_k, each step's kind with its qk / softmax / wait_v / pv parts, epilogue; in the
fused backward share_ds and dq; without a producer warpgroup, the issuer's refill and
refill_early: its waits for a freed slot and its copies) in clock cycles. Per kernel and shape
it prints, for each region, how often a warpgroup enters it and the mean cycles per entry and
per warpgroup (with the share of the warpgroup's span), and per SM the time from one CTA's
first event to the next CTA's (ns, globaltimer) against the CTA's span (cycles): the gap
between them is launch, prologue and exit cost no region sees. The profiler adds a
shared-memory store per event and a barrier at the end, so compare regions, not totals.
Markdown on stdout; --out also writes it to a file.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp

import stable_attn
from benchmarks.attention import H256, TARGETS, make_inputs, shape_name
from benchmarks.features import _alibi
import pallas_kernels.mosaic_gpu as mosaic
from pallas_kernels.mosaic_gpu import common, tuning
from stable_attn.api import Options, canonicalize


def traces(path):
  """{(sm, trace id): [(name, enter: bool, cycles since the trace's first event)]}, and the
  trace's first event in ns (globaltimer). The dump's ts is (start ns + cycles) / 1e3."""
  with open(path) as f:
    events = json.load(f)["traceEvents"]
  by_trace = collections.defaultdict(list)
  for e in events:
    by_trace[(e["pid"], e["tid"])].append(e)
  out, starts = {}, {}
  for key, evs in by_trace.items():
    t0 = evs[0]["ts"]
    out[key] = [(e["name"], e["ph"] == "B", (e["ts"] - t0) * 1e3) for e in evs]
    starts[key] = t0 * 1e3
  return out, starts


def regions(trace):
  """Region name (nested names joined by '/') -> list of durations in cycles."""
  stack, found = [], collections.defaultdict(list)
  for name, enter, t in trace:
    if enter:
      stack.append((name, t))
    else:
      opened, t_in = stack.pop()
      path = "/".join([n for n, _ in stack] + [opened])
      found[path].append(t - t_in)
  return found


def summarize(path, wgs: int = 2, producer: bool = True) -> list[str]:
  """wgs: the kernel's compute warpgroups per CTA; producer: whether the CTA has a producer
  warpgroup too (warpgroup wgs; TuningConfig.has_producer), whose trace is left out."""
  by_trace, starts = traces(path)
  # The dump's trace id is 1 + warpgroup + warpgroups * CTA; the producer names no region.
  per_cta = wgs + producer
  by_trace = {k: v for k, v in by_trace.items() if (k[1] - 1) % per_cta < wgs}
  spans = {k: v[-1][2] for k, v in by_trace.items() if v}
  per_region = collections.defaultdict(lambda: [0, 0.0])   # entries, cycles (over traces)
  for trace in by_trace.values():
    for name, durations in regions(trace).items():
      per_region[name][0] += len(durations)
      per_region[name][1] += sum(durations)
  n = len(by_trace)
  mean_span = statistics.mean(spans.values())
  lines = [f"{n} compute-warpgroup traces; mean span {mean_span:,.0f} cycles", "",
           "| region | entries per warpgroup | cycles per entry | cycles per warpgroup | share |",
           "|---|---|---|---|---|"]
  for name, (count, cycles) in sorted(per_region.items(), key=lambda kv: -kv[1][1]):
    lines.append(f"| {name} | {count / n:.2f} | {cycles / max(count, 1):,.0f} | "
                 f"{cycles / n:,.0f} | {cycles / n / mean_span:.1%} |")
  # Per SM, one CTA after another: warpgroup 0's traces.
  by_sm = collections.defaultdict(list)
  for (sm, tid), t in starts.items():
    if (tid - 1) % per_cta == 0:
      by_sm[sm].append((t, spans[(sm, tid)]))
  intervals, cta_spans = [], []
  for rows in by_sm.values():
    rows.sort()
    intervals += [b[0] - a[0] for a, b in zip(rows, rows[1:])]
    cta_spans += [a[1] for a in rows[:-1]]
  if intervals:
    lines += ["", f"per SM, CTA start to next CTA start: median {statistics.median(intervals):,.0f}"
              f" ns over {len(intervals)} pairs; a CTA's first warpgroup span: median "
              f"{statistics.median(cta_spans):,.0f} cycles"]
  return lines


_SMEM = "exceeds available shared memory"   # Mosaic GPU's error for a kernel that does not fit


def profiled(run, directory: str, ranges: int, least: int = 32) -> int:
  """run() inside common.profiling(directory, r) for r = ranges, then halved while the profiler's
  trace buffers leave a kernel too little shared memory (down to `least`, and only where this
  JAX bounds the traces: common.PROFILE_BOUNDS_CHECKED) -> the r that ran. Other errors, and the
  last shared-memory one, propagate; a failed attempt's traces are removed."""
  while True:
    try:
      with common.profiling(directory, ranges):
        run()
      return ranges
    except Exception as e:
      if _SMEM not in str(e) or ranges // 2 < least or not common.PROFILE_BOUNDS_CHECKED:
        raise
      ranges //= 2
      for path in glob.glob(os.path.join(directory, "*.json")):
        os.remove(path)


SHAPES = {"targets": ("issue 23's five shapes", TARGETS),
          "short": ("the first three (T <= 4096)", TARGETS[:3]), "gpt2": ("GPT-2's", TARGETS[:1]),
          "h128": ("B4 T4096 N16 H128 causal", TARGETS[1:2]),
          "h64full": ("B8 T2048 N16 H64 full", TARGETS[2:3]),
          "gqa": ("B2 T8192 N32 K8 H128 causal", TARGETS[3:4]),
          "16k": ("B1 T16384 N16 H128 causal", TARGETS[4:]),
          "h256": ("B2 T4096 N8 H256 causal", H256[:1])}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="targets",
                  help="comma-separated, of: " + "; ".join(f"{name} ({what})" for name, (what, _)
                                                            in SHAPES.items()))
  ap.add_argument("--max-adjust", default="safe", choices=["off", "safe", "paper"])
  ap.add_argument("--numerics", default="fast",
                  help="the call's numerics: e.g. fp8 (the preset) or "
                       "fast+qkv=e4m3+p=e4m3+p_scale=256 (FlashAttention-3's FP8 arithmetic), "
                       "whose forwards run the FP8 kernel")
  ap.add_argument("--bias", default="none", choices=["none", "alibi"],
                  help="alibi: a bf16 ALiBi bias [1, N, T, T] beside K (its tiles stream with K)")
  ap.add_argument("--backward", action="store_true", help="profile the backward kernels too")
  ap.add_argument("--fused", action="store_true",
                  help="with --backward: FlashAttention-3's fused backward (TuningConfig.fused_dq)")
  ap.add_argument("--ranges", type=int, default=384,
                  help="regions recorded per warpgroup (halved, down to 32, while the trace "
                       "buffers leave a kernel too little shared memory)")
  ap.add_argument("--out", help="also write the markdown here")
  args = ap.parse_args(argv)
  unknown = [name for name in args.shapes.split(",") if name not in SHAPES]
  if unknown:
    ap.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
  if args.fused and not args.backward:
    ap.error("--fused changes only the backward: pass --backward with it")
  if args.fused and args.bias != "none":
    ap.error("--fused profiles the table's fused backward, which has no bias tiles in its tiling")
  shapes = [shape for name in args.shapes.split(",") for shape in SHAPES[name][1]]
  report = [f"# Hopper kernel profile ({jax.devices()[0].device_kind}, bf16, "
            f"{'' if args.numerics == 'fast' else f'numerics={args.numerics}, '}"
            f"max_adjust={args.max_adjust}{', ALiBi bias' if args.bias == 'alibi' else ''}"
            f"{', fused backward' if args.fused else ''})", ""]
  for shape in shapes:
    B, T, N, K, H, causal = shape
    q, k, v, do = make_inputs(B, T, N, K, H, jnp.bfloat16)
    bias = _alibi((B, T, N, H)) if args.bias == "alibi" else None
    config = tuning.fused_dq_config(H) if args.fused else None
    spec, ops, _ = canonicalize(q, k, v, bias, None, Options(
        is_causal=causal, implementation="pallas_mosaic_gpu", max_adjust=args.max_adjust,
        numerics=args.numerics))
    used = config or mosaic.default_config(spec, ops)
    wgs = dict(forward=used.fwd_wgs, dq=used.dq_wgs)   # else a dK/dV kernel's
    producer = dict(forward=used.has_producer("fwd"), dq=used.has_producer("dq"))
    attend = lambda q, k, v: stable_attn.dot_product_attention(
        q, k, v, bias, is_causal=causal, implementation="pallas_mosaic_gpu",
        max_adjust=args.max_adjust, numerics=args.numerics, config=config)
    if args.backward:
      fn = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))
      operands = (q, k, v, do)
    else:
      fn, operands = jax.jit(attend), (q, k, v)
    jax.block_until_ready(fn(*operands))
    with tempfile.TemporaryDirectory() as directory:
      try:
        ranges = profiled(lambda: jax.block_until_ready(jax.jit(fn)(*operands)), directory,
                          args.ranges)
        if ranges < args.ranges:
          report += [f"({shape_name(shape)}: --ranges {ranges}: with {args.ranges} the trace "
                     f"buffers left a kernel too little shared memory; each warpgroup's trace "
                     f"stops after {ranges} regions, so its figures cover the steps recorded)",
                     ""]
      except Exception as e:   # e.g. too little shared memory even for the fewest ranges
        report += [f"## {shape_name(shape)}: not profiled: {type(e).__name__}: "
                   f"{str(e).splitlines()[0][:200]}", ""]
      for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        kernel = os.path.basename(path).split("-")[0]
        part = kernel.removeprefix("stable_attn_").split("_mosaic")[0]
        report += [f"## {shape_name(shape)}: {kernel}", ""]
        report += summarize(path, wgs.get(part, used.dkv_wgs),
                            producer.get(part, used.has_producer("dkv"))) + [""]
  text = "\n".join(report)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
