"""GPT-2 on several GPUs of one host (issue 44): scaling, FSDP, several processes, kill and resume.

Every measurement is its own process (or processes) on a subset of the GPUs
(CUDA_VISIBLE_DEVICES), logs under --out, results gathered into one table:

  python benchmarks/scale_out.py --parts dp           # GPT-2 124M data parallel, 16 x 1024 per GPU,
                                                      # on 1, 2, 4 GPUs: ours and cuDNN in one process
                                                      # each (train_speed.py); compile cold and warm
  python benchmarks/scale_out.py --parts fsdp         # gpt2-medium and gpt2-large (--remat) --fsdp on
                                                      # every GPU: ours and cuDNN
  python benchmarks/scale_out.py --parts processes    # python -m train: 1 process x 4 GPUs, then
                                                      # 2 processes x 2 GPUs (jax.distributed, a local
                                                      # coordinator): the same losses at each step?
  python benchmarks/scale_out.py --parts resume       # kill -9 a 4-GPU run mid-training and
                                                      # mid-checkpoint, resume on 4 (exact?), resume a
                                                      # checkpoint on 2 and on 1 GPU (orbax reshards)
  --smoke: tiny configs on CPU devices (XLA_FLAGS) instead of GPUs, to check the script itself.

"resume" compares with the 1 x 4 run of "processes" (run it first, or both in one call). The
training runs share one persistent compilation cache, so only the first of each program compiles
cold. Writes benchmarks/results/scale_out_<device>.md (+ .json, + a scaling plot with "dp").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


class Runner:
  """Starts the measurements' processes: GPUs by CUDA_VISIBLE_DEVICES (or, with smoke, that many
  CPU devices), output to log files under `out`."""

  def __init__(self, out: Path, smoke: bool, gpus: int):
    self.out, self.smoke, self.gpus = out, smoke, gpus

  def env(self, devices, **extra) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    if self.smoke:
      env.update(JAX_PLATFORMS="cpu",
                 XLA_FLAGS=f"--xla_force_host_platform_device_count={len(devices)}")
    else:
      env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    return env

  def start(self, name: str, args, devices, **extra) -> subprocess.Popen:
    log = open(self.out / f"{name}.log", "w")
    print(f"  [{name}] devices {list(devices)}: {' '.join(map(str, args))}", flush=True)
    return subprocess.Popen([PY, *map(str, args)], env=self.env(devices, **extra), cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

  def wait(self, procs: dict, timeout: float) -> dict:
    """{name: Popen} -> {name: return code} (None: killed at the timeout)."""
    deadline, codes = time.time() + timeout, {}
    for name, p in procs.items():
      try:
        codes[name] = p.wait(timeout=max(1.0, deadline - time.time()))
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        codes[name] = None
      if codes[name] != 0:
        print(f"  [{name}] exit {codes[name]}; the end of its log:\n" +
              _tail(self.out / f"{name}.log"), flush=True)
    return codes

  def run(self, name: str, args, devices, timeout: float, **extra) -> int | None:
    return self.wait({name: self.start(name, args, devices, **extra)}, timeout)[name]


def _tail(path: Path, n: int = 15) -> str:
  try:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
  except OSError:
    return "(no log)"


# ---------------------------------------------------------------------------------------------
# dp, fsdp: benchmarks/train_speed.py on subsets of the GPUs
# ---------------------------------------------------------------------------------------------

def _speed_args(r: Runner, name: str, config: str, arms: str, extra=(), cache: str = ""):
  """A train_speed.py command writing under out/<name>, with its own persistent cache (or the
  one named `cache`: a warm compile)."""
  return [ROOT / "benchmarks" / "train_speed.py", "--config", config, "--arms", arms,
          "--out", r.out / name, "--compilation-cache", r.out / "cache" / (cache or name), *extra]


def _result(r: Runner, name: str):
  """The JSON ({"header", "rows"}) that the train_speed.py process `name` wrote, or None."""
  found = sorted((r.out / name).glob("train_speed_*.json"))
  return json.loads(found[-1].read_text()) if found else None


def _speed(r: Runner, name: str, devices, config: str, arms: str, extra=(), cache: str = "",
           timeout=420):
  """One train_speed.py process on `devices` -> its JSON or None."""
  r.run(name, _speed_args(r, name, config, arms, extra, cache), devices, timeout)
  return _result(r, name)


def _rows(result) -> dict:
  return {row["arm"]: row for row in (result or {}).get("rows", [])}


def part_dp(r: Runner, counts, steps: int) -> list[dict]:
  """GPT-2 124M DP at 16 x 1024 per GPU (smoke: tiny) on each count, ours and cuDNN; then the
  largest count's step again from its persistent cache (warm compile)."""
  config = "tiny" if r.smoke else "gpt2"
  arms = "ours" if r.smoke else "ours,cudnn"
  common = ["--steps", steps, "--warmup", 3]
  # The smaller counts run side by side on disjoint GPUs (each compares its arms in-process).
  small = [n for n in counts if n < max(counts)]
  if sum(small) > r.gpus:
    raise ValueError(f"{small} GPUs side by side need {sum(small)} > {r.gpus}")
  procs, first = {}, 0
  for n in small:
    procs[f"dp_x{n}"] = r.start(f"dp_x{n}", _speed_args(r, f"dp_x{n}", config, arms, common),
                                range(first, first + n))
    first += n
  r.wait(procs, 600)
  results = {n: _result(r, f"dp_x{n}") for n in small}
  n = max(counts)
  results[n] = _speed(r, f"dp_x{n}", range(n), config, arms, common)
  warm = _speed(r, "dp_warm", range(n), config, "ours", ["--steps", 3, "--warmup", 1],
                cache=f"dp_x{n}", timeout=300)
  one = _rows(results.get(1))
  rows = []
  for n in counts:
    arm = _rows(results.get(n))
    row = {"part": "dp", "gpus": n, "config": config}
    for name in ("ours", "cudnn"):
      if "tokens_per_s" in arm.get(name, {}):
        row[f"{name}_tokens_per_s"] = arm[name]["tokens_per_s"]
        row[f"{name}_compile_s"] = arm[name]["compile_s"]
        row[f"{name}_memory_gib"] = arm[name].get("step_memory_gib")
        if "tokens_per_s" in one.get(name, {}):
          row[f"{name}_efficiency"] = arm[name]["tokens_per_s"] / (n * one[name]["tokens_per_s"])
      elif name in arm:
        row[f"{name}_error"] = arm[name].get("error")
    if n == max(counts) and "tokens_per_s" in _rows(warm).get("ours", {}):
      row["ours_compile_warm_s"] = _rows(warm)["ours"]["compile_s"]
    rows.append(row)
  return rows


def part_fsdp(r: Runner) -> list[dict]:
  """gpt2-medium and gpt2-large (with --remat) with --fsdp on every GPU, 8 x 1024 per GPU."""
  rows = []
  models = [("tiny", [])] if r.smoke else [("gpt2-medium", []), ("gpt2-large", ["--remat"])]
  for config, extra in models:
    result = _speed(r, f"fsdp_{config}", range(r.gpus), config,
                    "ours" if r.smoke else "ours,cudnn",
                    ["--fsdp", "--batch-size", 8, "--steps", 10, "--warmup", 2, *extra])
    row = {"part": "fsdp", "gpus": r.gpus, "config": config + (" --remat" if extra else "")}
    for name, arm in _rows(result).items():
      for key in ("tokens_per_s", "mfu", "step_memory_gib", "compile_s", "error"):
        if key in arm:
          row[f"{name}_{key}"] = arm[key]
    if result:
      row["peak_note"] = result["header"]["peak_note"]
    rows.append(row)
  return rows


# ---------------------------------------------------------------------------------------------
# processes, resume: python -m train
# ---------------------------------------------------------------------------------------------

STEPS, EVERY = 24, 8


def _train_args(r: Runner, out: Path, data: Path):
  config = (["--config", "tiny", "--block-size", "64", "--batch-size", "8"] if r.smoke else
            ["--config", "gpt2", "--block-size", "512", "--batch-size", "32"])
  return ["-m", "train", *config, "--grad-accum", "1", "--max-steps", STEPS,
          "--warmup-steps", 4, "--ckpt-every", EVERY, "--eval-every", EVERY, "--eval-batches", 2,
          "--log-every", 1, "--monitor-every", 0, "--sample-tokens", 0, "--keep-checkpoints", 5,
          "--data", data, "--out-dir", out, "--no-tensorboard", "--no-progress",
          "--compilation-cache", r.out / "cache" / "train"]


def losses(run_dir: Path) -> dict:
  """{step: training loss} from a run's metrics.jsonl (steps count from 0)."""
  out = {}
  path = run_dir / "metrics.jsonl"
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if "loss" in record and "step" in record:
      out[int(record["step"])] = float(record["loss"])
  return out


def _compare(got: dict, want: dict) -> dict:
  steps = sorted(set(got) & set(want))
  diffs = [abs(got[s] - want[s]) for s in steps]
  return {"steps": f"{steps[0]}-{steps[-1]}" if steps else "none", "n": len(steps),
          "equal": sum(d == 0 for d in diffs), "max_abs_diff": max(diffs) if diffs else None,
          "max_rel_diff": max((d / abs(want[s]) for d, s in zip(diffs, steps)), default=None)}


def part_processes(r: Runner, data: Path) -> list[dict]:
  """1 process x 4 GPUs (the reference the resume part compares with), then 2 processes x 2 GPUs
  through jax.distributed with a local coordinator."""
  ref = r.out / "run_1x4"
  shutil.rmtree(ref, ignore_errors=True)
  code = r.run("train_1x4", _train_args(r, ref, data), range(r.gpus), 420)
  row = {"part": "processes", "gpus": r.gpus, "reference": "1 process x 4 GPUs",
         "reference_exit": code, "reference_steps": len(losses(ref))}
  two = r.out / "run_2x2"
  shutil.rmtree(two, ignore_errors=True)
  half = r.gpus // 2
  port = 20000 + os.getpid() % 10000
  procs = {f"train_2x2_p{i}": r.start(
      f"train_2x2_p{i}", [*_train_args(r, two, data), "--distributed"],
      range(i * half, (i + 1) * half), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
      JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)}
  codes = r.wait(procs, 420)
  row.update(exits=list(codes.values()), **_compare(losses(two), losses(ref)))
  return [row]


def _kill_when(r: Runner, name: str, out: Path, data: Path, ready, timeout: float = 420):
  """Starts a 4-GPU run and kill -9s its process group once ready(out) holds -> what ready saw."""
  p = r.start(name, _train_args(r, out, data), range(r.gpus))
  deadline, seen = time.time() + timeout, None
  while time.time() < deadline and p.poll() is None:
    seen = ready(out)
    if seen:
      os.killpg(p.pid, signal.SIGKILL)
      break
    time.sleep(0.01)
  p.wait()
  return seen


def _checkpoints(out: Path) -> list[str]:
  d = out / "checkpoints"
  return sorted(x.name for x in d.iterdir()) if d.exists() else []


def part_resume(r: Runner, data: Path) -> list[dict]:
  want = losses(r.out / "run_1x4")
  rows = []
  # (a) mid-training: killed once step EVERY + 4 is logged (a checkpoint at EVERY behind it).
  mid = r.out / "run_kill_train"
  shutil.rmtree(mid, ignore_errors=True)
  seen = _kill_when(r, "kill_train", mid, data, lambda out: max(losses(out), default=0) >= EVERY + 4)
  at = max(losses(mid), default=None)
  code = r.run("resume_train_x4", _train_args(r, mid, data), range(r.gpus), 420)
  rows.append({"part": "resume", "case": "kill -9 mid-training, resume on 4", "killed_at": at,
               "caught": bool(seen), "exit": code, **_compare(losses(mid), want)})
  # (b) mid-checkpoint: killed while orbax writes the checkpoint of step 2 * EVERY (its temporary
  # directory exists): the resume must not take it.
  ckpt = r.out / "run_kill_ckpt"
  shutil.rmtree(ckpt, ignore_errors=True)
  seen = _kill_when(r, "kill_ckpt", ckpt, data,
                    lambda out: [n for n in _checkpoints(out) if "tmp" in n and
                                 n.startswith(str(2 * EVERY))])
  left = _checkpoints(ckpt)
  code = r.run("resume_ckpt_x4", _train_args(r, ckpt, data), range(r.gpus), 420)
  rows.append({"part": "resume", "case": "kill -9 mid-checkpoint, resume on 4",
               "caught": str(seen), "left": ", ".join(left), "exit": code,
               **_compare(losses(ckpt), want)})
  # (c) the mid-training run's checkpoint of step 2 * EVERY resumed on fewer GPUs.
  procs, first = {}, 0
  for n in (r.gpus // 2, 1):
    d = r.out / f"run_resume_x{n}"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(mid, d)
    for name in _checkpoints(d):
      if not name.isdigit() or int(name) > 2 * EVERY:
        shutil.rmtree(d / "checkpoints" / name)
    procs[f"resume_x{n}"] = r.start(f"resume_x{n}", _train_args(r, d, data),
                                    range(first, first + n))
    first += n
  codes = r.wait(procs, 420)
  for n in (r.gpus // 2, 1):
    got = {s: l for s, l in losses(r.out / f"run_resume_x{n}").items() if s > 2 * EVERY}
    rows.append({"part": "resume", "case": f"checkpoint {2 * EVERY} of 4 GPUs resumed on {n}",
                 "exit": codes[f"resume_x{n}"], **_compare(got, want)})
  return rows


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def _fmt(x, spec=",.0f"):
  if x is None:
    return "-"
  return format(x, spec) if isinstance(x, (int, float)) else str(x)


def _speed_row(x: dict, lead: list, cells) -> str:
  """A table row: lead, ours' and cuDNN's tokens/s and their ratio, then (key, format) cells."""
  ours, cudnn = x.get("ours_tokens_per_s"), x.get("cudnn_tokens_per_s")
  values = [*map(str, lead), _fmt(ours), _fmt(cudnn),
            _fmt(ours / cudnn if ours and cudnn else None, ".3f"),
            *(_fmt(x.get(key), spec) for key, spec in cells)]
  return "| " + " | ".join(values) + " |"


def markdown(rows: list[dict], device: str, jax_version: str) -> str:
  lines = [f"# Several GPUs: {device}, jax {jax_version}", ""]
  dp = [x for x in rows if x["part"] == "dp"]
  if dp:
    lines += ["## GPT-2 124M data parallel, 16 x 1024 per GPU (ours 'safe' and cuDNN in one "
              "process at each count)", "",
              "| GPUs | ours tokens/s | cuDNN tokens/s | ours / cuDNN | ours scaling | "
              "cuDNN scaling | ours compile s (cold) | ours compile s (warm) | cuDNN compile s |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_speed_row(x, [x["gpus"]], [("ours_efficiency", ".1%"), ("cudnn_efficiency", ".1%"),
                                          ("ours_compile_s", ".1f"), ("ours_compile_warm_s", ".1f"),
                                          ("cudnn_compile_s", ".1f")]) for x in dp]
    lines.append("")
  fsdp = [x for x in rows if x["part"] == "fsdp"]
  if fsdp:
    lines += ["## FSDP, 8 x 1024 per GPU", "",
              "| config | GPUs | ours tokens/s | cuDNN tokens/s | ours / cuDNN | ours MFU | "
              "ours GiB | cuDNN GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_speed_row(x, [x["config"], x["gpus"]], [("ours_mfu", ".1%"),
                                                       ("ours_step_memory_gib", ".1f"),
                                                       ("cudnn_step_memory_gib", ".1f")])
              for x in fsdp]
    lines.append("")
  runs = [x for x in rows if x["part"] in ("processes", "resume")]
  if runs:
    lines += [f"## python -m train (GPT-2 124M, 32 x 512, {STEPS} steps, checkpoints every "
              f"{EVERY}): losses against 1 process x {runs[0].get('gpus', 4)} GPUs", "",
              "| run | exit | steps compared | bitwise equal | max abs diff | max rel diff | "
              "note |", "|---|---|---:|---:|---:|---:|---|"]
    for x in runs:
      what = x.get("case") or "2 processes x 2 GPUs (jax.distributed)"
      note = ", ".join(f"{k} {x[k]}" for k in ("killed_at", "caught", "left") if k in x)
      lines.append(f"| {what} | {x.get('exit', x.get('exits'))} | {x['steps']} | "
                   f"{x['equal']}/{x['n']} | {_fmt(x['max_abs_diff'], '.3g')} | "
                   f"{_fmt(x['max_rel_diff'], '.2e')} | {note} |")
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  dp = [x for x in rows if x["part"] == "dp"]
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for name, label in (("ours", "stable_attn (safe)"), ("cudnn", "cuDNN")):
    pts = [(x["gpus"], x[f"{name}_tokens_per_s"]) for x in dp if f"{name}_tokens_per_s" in x]
    if pts:
      ax.plot(*zip(*pts), marker="o", label=label)
  one = next((x.get("ours_tokens_per_s") for x in dp if x["gpus"] == 1), None)
  if one:
    gpus = [x["gpus"] for x in dp]
    ax.plot(gpus, [one * g for g in gpus], ls=":", color="gray", label="linear (ours x1)")
  ax.set_xlabel("GPUs")
  ax.set_ylabel("tokens/s")
  ax.set_title("GPT-2 124M data parallel, 16 x 1024 per GPU")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--parts", default="dp,fsdp,processes,resume")
  p.add_argument("--gpus", type=int, default=4)
  p.add_argument("--steps", type=int, default=20, help="timed steps of the dp part")
  p.add_argument("--data", default=str(ROOT / "data" / "default"))
  p.add_argument("--out", default="/tmp/scale_out", help="logs, runs and caches")
  p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  r = Runner(out, args.smoke, args.gpus)
  parts = [x.strip() for x in args.parts.split(",") if x.strip()]
  counts = [n for n in (1, 2, 4, 8) if n <= args.gpus]
  rows = []
  saved = out / "rows.json"
  if saved.exists():   # an earlier call's parts, kept (the device machine keeps nothing else)
    rows = [x for x in json.loads(saved.read_text()) if x["part"] not in parts]
  for part in parts:
    t0 = time.time()
    print(f"== {part}", flush=True)
    if part == "dp":
      rows += part_dp(r, counts, args.steps)
    elif part == "fsdp":
      rows += part_fsdp(r)
    elif part == "processes":
      rows += part_processes(r, Path(args.data))
    elif part == "resume":
      rows += part_resume(r, Path(args.data))
    else:
      raise ValueError(f"--parts: unknown part {part!r}")
    print(f"== {part}: {time.time() - t0:.0f} s", flush=True)
    saved.write_text(json.dumps(rows, indent=1))
  device, version = _device()
  slug = device.lower().replace(" ", "_").replace("-", "_")
  results = Path(args.results)
  results.mkdir(parents=True, exist_ok=True)
  table = markdown(rows, device, version)
  stem = results / f"scale_out_{'smoke' if args.smoke else slug}"
  Path(f"{stem}.md").write_text(table)
  Path(f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
  if any(x["part"] == "dp" for x in rows):
    plot(rows, Path(f"{stem}.png"))
  print(table)
  return 0


def _device():
  """(device kind, jax version) from a child process: this one never touches the GPUs."""
  code = "import jax; print(jax.devices()[0].device_kind); print(jax.__version__)"
  try:
    lines = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"}).stdout.split("\n")
    return lines[0].strip() or "unknown", lines[1].strip()
  except (subprocess.SubprocessError, IndexError):
    return "unknown", "?"


if __name__ == "__main__":
  sys.exit(main())
