"""Where a GPT-2 training step spends GPU time, per kernel, with our attention and with cuDNN's.

    python benchmarks/train_profile.py                 # GPT-2 124M, batch 16 x 1024, on the GPU
    python benchmarks/train_profile.py --arms ours,cudnn --steps 3

The step timed by benchmarks/train_speed.py (its set-up, same tokens), traced with JAX's profiler
for --steps steps after two warm-up steps; every GPU kernel's duration summed per name (launch
gaps are not counted). Attention kernels are the ones named for it (ours: stable_attn_*; cuDNN's:
*sdpa*, cudnn::fusion::*); the XLA fusions around them (our delta pre-pass, cuDNN's memsets) are
in "other". Writes benchmarks/results/train_profile_<config>_<device>.md and prints it.
"""
from __future__ import annotations

import argparse
import collections
import glob
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from benchmarks import train_speed  # noqa: E402
from train.config import get_config  # noqa: E402
from train.sharding import make_mesh  # noqa: E402

ATTENTION = re.compile(r"stable_attn_|sdpa|cudnn::fusion")


def kernel_times(fn, steps: int) -> dict:
  """name -> GPU microseconds per call of fn() (its kernels, summed), from a profiler trace."""
  directory = tempfile.mkdtemp()
  jax.profiler.start_trace(directory)
  for _ in range(steps):
    out = fn()
  jax.block_until_ready(out)
  jax.profiler.stop_trace()
  trace = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0]
  total = collections.Counter()
  for plane in jax.profiler.ProfileData.from_file(trace).planes:
    if plane.name.startswith("/device:GPU"):
      for line in plane.lines:
        for event in line.events:
          total[event.name] += event.duration_ns / 1e3 / steps
  return dict(total)


def profile_arm(cfg, mesh, tokens, steps: int) -> dict:
  training, x, y = train_speed.set_up(cfg, mesh, tokens)
  state = [training.params, training.opt_state]
  step = training.train_step.lower(state[0], state[1], x, y).compile()

  def one():
    state[0], state[1], metrics = step(state[0], state[1], x, y)
    return metrics["loss"]
  for _ in range(2):
    jax.block_until_ready(one())
  return kernel_times(one, steps)


def markdown(times: dict, header: str) -> str:
  lines = [header, "", "| arm | GPU time per step ms | attention kernels ms | other ms | attention "
           "kernels, us per step |", "|---|---:|---:|---:|---|"]
  for arm, t in times.items():
    attn = {k: v for k, v in t.items() if ATTENTION.search(k)}
    total, a = sum(t.values()) / 1e3, sum(attn.values()) / 1e3
    detail = ", ".join(f"{k[:48]} {v:.0f}" for k, v in sorted(attn.items(), key=lambda kv: -kv[1]))
    lines.append(f"| {arm} | {total:.2f} | {a:.2f} | {total - a:.2f} | {detail} |")
  arms = list(times)
  if len(arms) == 2:
    lines += ["", f"Largest differences per kernel name ({arms[0]} - {arms[1]}, us per step):", ""]
    a, b = times[arms[0]], times[arms[1]]
    diffs = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0) - b.get(k, 0)))[:12]
    lines += [f"- {k[:90]}: {a.get(k, 0):.0f} - {b.get(k, 0):.0f} = {a.get(k, 0) - b.get(k, 0):+.0f}"
              for k in diffs]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="gpt2")
  p.add_argument("--arms", default="ours,cudnn")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  args = p.parse_args(argv)
  if args.steps < 1:
    raise ValueError(f"--steps must be >= 1, got {args.steps}")
  arms = [a for a in args.arms.split(",") if a]
  for arm in arms:
    if arm not in train_speed.ARMS:
      raise ValueError(f"--arms: {arm!r} is not one of {', '.join(train_speed.ARMS)}")
  base, mesh = get_config(args.config), make_mesh()
  shape = train_speed.arm_config(base, "ours")
  tokens = train_speed.tokens_for(shape)
  times = {arm: profile_arm(train_speed.arm_config(base, arm), mesh, tokens, args.steps)
           for arm in arms}
  device = jax.devices()[0].device_kind
  header = (f"# GPU time per training step by kernel: {args.config}, {device}\n\n"
            f"JAX {jax.__version__}; batch {shape.batch_size} x {shape.model.block_size}; "
            f"benchmarks/train_speed.py's step, {args.steps} traced steps after 2 warm-up; "
            f"kernel durations summed per name (launch gaps not counted).")
  table = markdown(times, header)
  slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"train_profile_{args.config}_{slug}.md").write_text(table)
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
