"""What clock each arm runs at: SM clock and board power per kernel or call (nvidia-smi).

    PYTHONPATH=. python benchmarks/clocks.py                        # bf16 and fp8_fast, on a GPU
    PYTHONPATH=. python benchmarks/clocks.py --arms bf16,fp8_fast --shapes 0 --seconds 4
    PYTHONPATH=. python benchmarks/clocks.py --what fwd_bwd --arms bf16,fp8_fast_bwd
    PYTHONPATH=. python benchmarks/clocks.py --what fwd_bwd --arms cudnn,bf16 --shapes 0,1,2
    PYTHONPATH=. python benchmarks/clocks.py --ramp 500              # bursts of 10 from idle

Each arm's forward kernel alone (--what kernel: benchmarks/fp8.py's `forward_kernel`, prepared
operands, no quantization), its whole forward call (--what forward: quantization and layout
passes included) or the call's fwd+bwd (--what fwd_bwd) runs back to back for --seconds at a
time, the arms in turn, --rounds times, with a second's idle gap between windows, while
nvidia-smi samples the SM clock, power draw, temperature and the active clock-event reasons every
100 ms: sustained work, as in training. Per window: the time per call and the samples' medians.
Under the board's power cap ("sw_power_cap") a kernel that draws more power per cycle runs at a
lower clock, so a ratio of two arms' times is not a ratio of their cycles there; and the sampled
clocks under the cap understate the clock the kernels effectively run at (an H100's bf16 kernel
by 13%), so time x sampled clock is not their cycles either. --ramp N instead times N bursts of
10 calls (the blocks `benchmarks/fp8.py --calls 10` times) from an idle GPU, each arm after 2 s
idle: the first bursts run at the full clock, where a ratio of times is one of cycles, and the
later ones show when the cap pulls the clock down.
Writes benchmarks/results/clocks[_forward|_fwd_bwd][_ramp]_<device>.md (a --ramp run also every
burst and sample as .json beside it, which --plot JSON PNG draws and --ratios JSON reads for each
arm's speed-up over the first) and prints the table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import attention as bench  # noqa: E402
from benchmarks import fp8  # noqa: E402

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
# nvidia-smi's clock-event reason bits (nvmlClocksEventReasons)
REASONS = {0x1: "idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
           0x100: "display_clocks"}


def parse_samples(lines) -> list[tuple[float, int, float, int, int]]:
  """nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits lines -> [(unix time, SM MHz,
  power W, temperature C, reasons bitmask)]; lines that are not samples are skipped. nvidia-smi
  writes local time, read here as local time: the same clock time.time() reads."""
  samples = []
  for line in lines:
    fields = [f.strip() for f in line.split(",")]
    try:
      t = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
      samples.append((t, int(fields[1]), float(fields[2]), int(fields[3]), int(fields[4], 16)))
    except (ValueError, IndexError):
      continue
  return samples


def reason_names(mask: int) -> str:
  return "+".join(name for bit, name in REASONS.items() if mask & bit) or "none"


def summarize(windows, samples, settle: float = 0.5) -> str:
  """windows: [{shape, arm, round, start, end, us}] -> a markdown table of each window's samples
  (those from `settle` s after its start to its end): median SM clock (min), median power (max),
  median temperature, the reasons seen."""
  lines = ["| shape | arm | round | us per call | samples | SM MHz median (min) | "
           "power W median (max) | temp C | clock-event reasons |",
           "|---|---|---:|---:|---:|---|---|---:|---|"]
  for w in windows:
    s = [x for x in samples if w["start"] + settle <= x[0] <= w["end"]]
    B, T, N, _, H = w["shape"]
    head = f"| B{B} T{T} N{N} H{H} causal | {w['arm']} | {w['round']} | {w['us']:.1f} | {len(s)} |"
    if not s:
      lines.append(head + " - | - | - | - |")
      continue
    sm, power = [x[1] for x in s], [x[2] for x in s]
    reasons = ", ".join(sorted({reason_names(x[4]) for x in s}))
    lines.append(head + f" {statistics.median(sm):.0f} ({min(sm)}) | {statistics.median(power):.0f}"
                 f" ({max(power):.0f}) | {statistics.median(x[3] for x in s):.0f} | {reasons} |")
  return "\n".join(lines)


WHAT = {"kernel": "the forward kernel alone", "forward": "the forward call",
        "fwd_bwd": "the call's fwd+bwd"}


def timed(what: str, arm: str, shape):
  """(f, args): what --what times for an arm at a shape, jitted."""
  if what == "kernel":
    return fp8.forward_kernel(arm, shape)
  import jax.numpy as jnp
  q, k, v, do = bench.make_inputs(*shape, jnp.bfloat16)
  forward, fwd_bwd = fp8.jitted_calls(arm, "pallas_mosaic_gpu", (q, k, v))
  return (forward, (q, k, v)) if what == "forward" else (fwd_bwd, (q, k, v, do))


def compiled(what: str, arms, shape) -> dict:
  """arm -> (f, args) of `timed`, each called once: compiled and warm before anything is timed."""
  import jax
  kernels = {arm: timed(what, arm, shape) for arm in arms}
  for f, args in kernels.values():
    jax.block_until_ready(f(*args))
  return kernels


def burst(f, args, calls: int) -> float:
  """`calls` back-to-back calls of f(*args), waited for -> the time they ended (time.time())."""
  import jax
  for _ in range(calls):
    out = f(*args)
  jax.block_until_ready(out)
  return time.time()


def run_windows(arms, shapes, seconds: float, rounds: int, what: str = "kernel") -> list[dict]:
  """Each arm's `what` back to back for `seconds`, arms in turn, `rounds` times a shape."""
  windows = []
  for shape in shapes:
    kernels = compiled(what, arms, shape)
    for rnd in range(rounds):
      for arm, (f, args) in kernels.items():
        calls, start = 0, time.time()
        end = start
        while end - start < seconds:
          end = burst(f, args, 20)
          calls += 20
        windows.append(dict(shape=shape, arm=arm, round=rnd, start=start, end=end,
                            us=1e6 * (end - start) / calls))
        time.sleep(1.0)
  return windows


RAMP_MARKS = (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)


def run_ramp(arms, shapes, bursts: int, what: str = "kernel", calls: int = 10) -> list[dict]:
  """Per shape and arm, after 2 s idle: `bursts` bursts of `calls` back-to-back calls, each timed
  to its block_until_ready -> [{shape, arm, start, ends: [unix time], us: [per call]}]."""
  ramps = []
  for shape in shapes:
    kernels = compiled(what, arms, shape)
    for arm, (f, args) in kernels.items():
      time.sleep(2.0)
      ends, us = [], []
      start = last = time.time()
      for _ in range(bursts):
        now = burst(f, args, calls)
        ends.append(now)
        us.append(1e6 * (now - last) / calls)
        last = now
      ramps.append(dict(shape=shape, arm=arm, start=start, ends=ends, us=us))
  return ramps


def ramp_table(ramps, samples, marks=RAMP_MARKS) -> str:
  """Markdown: per ramp, burst k's time per call, when it ended (ms after the first call) and the
  last nvidia-smi sample's SM clock by then, for each k in `marks` the ramp reached."""
  marks = [k for k in marks if any(k <= len(r["us"]) for r in ramps)]
  lines = ["| shape | arm | " + " | ".join(f"burst {k}" for k in marks) + " |",
           "|---|---|" + "---:|" * len(marks)]
  for r in ramps:
    B, T, N, _, H = r["shape"]
    cells = []
    for k in marks:
      if k > len(r["us"]):
        cells.append("-")
        continue
      end = r["ends"][k - 1]
      before = [x[1] for x in samples if x[0] <= end]
      clock = f", {before[-1]} MHz" if before else ""
      cells.append(f"{r['us'][k - 1]:.1f} us ({1e3 * (end - r['start']):.0f} ms{clock})")
    lines.append(f"| B{B} T{T} N{N} H{H} causal | {r['arm']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def ramp_ratios(ramps, first: int = 5, held: int = 100) -> str:
  """Markdown: per shape, each arm's speed-up over the shape's first arm (that arm's time per
  call over this one's), burst by burst for the first `first` bursts, where both run from idle at
  the full clock (a ratio of cycles, until the first arm's clock drops), and of the medians of
  the last `held` bursts (a ratio of times under the power cap, as in training)."""
  lines = ["| shape | arm | " + " | ".join(f"burst {k}" for k in range(1, first + 1))
           + f" | median of the last {held} |", "|---|---|" + "---:|" * (first + 1)]
  shapes = list(dict.fromkeys(tuple(r["shape"]) for r in ramps))
  for shape in shapes:
    base, *others = [r for r in ramps if tuple(r["shape"]) == shape]
    B, T, N, _, H = shape
    for r in others:
      n = min(len(base["us"]), len(r["us"]))
      cells = [f"{base['us'][k] / r['us'][k]:.3f}" if k < n else "-" for k in range(first)]
      tail = slice(n - min(held, n), n)
      cells.append(f"{statistics.median(base['us'][tail]) / statistics.median(r['us'][tail]):.3f}")
      lines.append(f"| B{B} T{T} N{N} H{H} causal | {base['arm']} / {r['arm']} | "
                   + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot_ramps(json_path: str, png_path: str) -> None:
  """From a --ramp run's .json: per shape, each arm's time per call (top) and nvidia-smi's SM
  clock (bottom) against the time since its first call, log-scaled."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(json_path) as f:
    run = json.load(f)
  shapes = list(dict.fromkeys(tuple(r["shape"]) for r in run["ramps"]))
  fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 6.5), sharex="col",
                           squeeze=False)
  for col, shape in enumerate(shapes):
    B, T, N, _, H = shape
    for r in (r for r in run["ramps"] if tuple(r["shape"]) == shape):
      ms = [1e3 * (t - r["start"]) for t in r["ends"]]
      line, = axes[0][col].plot(ms, r["us"], lw=1, label=r["arm"])
      clock = [(1e3 * (x[0] - r["start"]), x[1]) for x in run["samples"]
               if r["start"] <= x[0] <= r["ends"][-1]]
      axes[1][col].step([c[0] for c in clock], [c[1] for c in clock], where="post",
                        color=line.get_color(), label=r["arm"])
    axes[0][col].set_title(f"B{B} T{T} N{N} H{H} causal", fontsize=9)
    axes[0][col].set_ylabel("us per call (bursts of 10)")
    axes[1][col].set_ylabel("SM clock, MHz (nvidia-smi, 100 ms)")
    axes[1][col].set_xlabel("ms since the arm's first call, after 2 s idle")
    axes[1][col].set_xscale("log")
    axes[0][col].legend(fontsize=8)
  fig.suptitle(run["title"], fontsize=10)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--arms", default="bf16,fp8_fast",
                      help=f"comma list of benchmarks/fp8.py's numerics arms {tuple(fp8.NUMERICS)}"
                           f", and cudnn (jax.nn's) for --what forward or fwd_bwd")
  parser.add_argument("--shapes", default="1,0", help=f"comma list of indices into {fp8.SHAPES}")
  parser.add_argument("--seconds", type=float, default=4.0, help="one window's length")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--what", default="kernel", choices=tuple(WHAT),
                      help="; ".join(f"{k}: {v}" for k, v in WHAT.items()))
  parser.add_argument("--ramp", type=int, default=0,
                      help="time this many bursts of 10 calls from idle instead of windows")
  parser.add_argument("--out", default=None, help="markdown path (default: benchmarks/results)")
  parser.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"),
                      help="only draw a --ramp run's .json (written beside its .md) as PNG")
  parser.add_argument("--ratios", metavar="JSON",
                      help="only print a --ramp run's speed-ups over its first arm (.json)")
  args = parser.parse_args(argv)
  if args.plot:
    plot_ramps(*args.plot)
    return 0
  if args.ratios:
    try:
      with open(args.ratios) as f:
        ramps = json.load(f)["ramps"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      parser.error(f"--ratios {args.ratios!r}: not a --ramp run's .json ({e!r})")
    print(ramp_ratios(ramps))
    return 0
  arms = [a for a in args.arms.split(",") if a]
  # cuDNN (jax.nn's) has calls, no kernel of ours to time alone
  known = set(fp8.NUMERICS) | ({"cudnn"} if args.what != "kernel" else set())
  if not arms or set(arms) - known or (args.what == "kernel" and set(arms) & set(fp8.CONFIG)):
    parser.error(f"--arms {args.arms!r}: a comma list of {tuple(fp8.NUMERICS)}, or cudnn with "
                 f"--what forward or fwd_bwd (with --what kernel none of {tuple(fp8.CONFIG)}: "
                 f"the kernel alone runs the table's config)")
  picked = fp8.shape_indices(parser, args.shapes)
  if args.seconds <= 1.0 or args.rounds < 1 or args.ramp < 0:
    parser.error("--seconds must be over 1 (the first 0.5 s of a window is not read) and "
                 "--rounds at least 1; --ramp 0 or more")
  import jax
  device = jax.devices()[0]
  if device.platform != "gpu":
    raise SystemExit(f"benchmarks/clocks.py reads an NVIDIA GPU's clocks; this process's first "
                     f"device is {device.platform}")
  with tempfile.TemporaryFile("w+") as log:
    try:
      smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                              "-i", str(device.local_hardware_id or 0), "-lms", "100"],
                             stdout=log, stderr=subprocess.STDOUT, text=True)
    except FileNotFoundError:
      raise SystemExit("benchmarks/clocks.py samples the clocks with nvidia-smi, which is not on "
                       "PATH") from None
    time.sleep(0.5)
    if smi.poll() is not None:   # refused the query (a field this driver lacks) or the GPU index
      log.seek(0)
      raise SystemExit(f"nvidia-smi --query-gpu={QUERY} stopped: {log.read().strip()[:500]!r}")
    shapes = [fp8.SHAPES[i] for i in picked]
    try:
      if args.ramp:
        ramps = run_ramp(arms, shapes, args.ramp, args.what)
      else:
        windows = run_windows(arms, shapes, args.seconds, args.rounds, args.what)
    finally:
      smi.terminate()
      smi.wait()
    log.seek(0)
    smi_text = log.read()
  samples = parse_samples(smi_text.splitlines())
  if not samples:
    raise SystemExit(f"nvidia-smi gave no samples for --query-gpu={QUERY}; it said: "
                     f"{smi_text.strip()[:500]!r}")
  command = (f"python benchmarks/clocks.py --what {args.what} --arms {','.join(arms)} "
             f"--shapes {','.join(map(str, picked))}")
  if args.ramp:
    text = (f"# Clocks from idle, {WHAT[args.what]}: {device.device_kind}\n\n`{command} --ramp "
            f"{args.ramp}`: bursts of 10 back-to-back calls, each arm after 2 s idle; a cell is "
            f"the burst's time per call (when it ended, the SM clock sampled by then)\n\n"
            + ramp_table(ramps, samples) + "\n\nSpeed-ups over the first arm:\n\n"
            + ramp_ratios(ramps))
  else:
    text = (f"# Clocks and power, {WHAT[args.what]}: {device.device_kind}\n\n`{command} "
            f"--seconds {args.seconds:g} --rounds {args.rounds}`, windows of back-to-back calls "
            f"of {WHAT[args.what]}, nvidia-smi sampled every 100 ms\n\n"
            + summarize(windows, samples))
  suffix = ("" if args.what == "kernel" else f"_{args.what}") + ("_ramp" if args.ramp else "")
  path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                  f"clocks{suffix}_{bench.device_slug(device.device_kind)}.md")
  with open(path, "w") as f:
    f.write(text + "\n")
  if args.ramp:   # every burst and sample, for --plot
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
      json.dump(dict(title=text.splitlines()[0].lstrip("# "), ramps=ramps, samples=samples), f)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
