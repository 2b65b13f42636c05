"""Metrics out: DIR/metrics.jsonl (one JSON object per logged step), TensorBoard, the loss plot,
MFU."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


class MetricsLogger:
  """Appends records to DIR/metrics.jsonl and mirrors scalars to TensorBoard (DIR/tb/)."""

  def __init__(self, out_dir: Path, *, enabled: bool = True, tensorboard: bool = True):
    self.path = Path(out_dir) / "metrics.jsonl"
    self.enabled = enabled
    self.tb = None
    if enabled and tensorboard:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(str(Path(out_dir) / "tb"))

  def truncate_after(self, step: int) -> None:
    """Drop records of steps >= step (they were logged by a run that died after its last
    checkpoint)."""
    if not self.enabled or not self.path.exists():
      return
    keep = [line for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", -1) < step]
    self.path.write_text("".join(line + "\n" for line in keep))

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record, allow_nan=True) + "\n")
    if self.tb is not None:
      step = record["step"]
      for key, value in record.items():
        if key == "step" or isinstance(value, (str, bool)) or value is None:
          continue
        if isinstance(value, list):
          for i, v in enumerate(value):
            self.tb.add_scalar(f"{key}/layer{i}", v, step)
        else:
          self.tb.add_scalar(key, value, step)

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()


def read_metrics(out_dir: Path) -> list[dict]:
  path = Path(out_dir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(out_dir: Path, title: str = "") -> Path | None:
  """DIR/loss.png: train loss at every logged step and val loss where evaluated."""
  records = read_metrics(out_dir)
  if not records:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
  # loss_avg: mean train loss since the previous record, far less noisy than one step's loss.
  tr = [(r["step"], r.get("loss_avg", r["loss"])) for r in records
        if r.get("loss") is not None and math.isfinite(r.get("loss_avg", r["loss"]))]
  va = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
  if tr:
    ax.plot(*zip(*tr), label="train (mean over each log interval)", lw=1.2)
  if va:
    ax.plot(*zip(*va), "o-", label="val", lw=1.2, ms=4)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  path = Path(out_dir) / "loss.png"
  fig.savefig(path)
  plt.close(fig)
  return path


# Rough CPU figure used only to put an MFU on the progress bar of CPU runs: measured ~0.05 TFLOP/s
# per core for f32/bf16 XLA matmuls on the 2-core development machine.
CPU_NOMINAL_TFLOPS_PER_CORE = 0.05


def measure_matmul_tflops(n: int = 8192, iters: int = 10) -> float:
  """Measured bf16 matmul throughput of one device, TFLOP/s (the MFU ceiling on accelerators)."""
  a = jnp.ones((n, n), jnp.bfloat16)
  f = jax.jit(lambda a: (a @ a).astype(jnp.bfloat16))
  f(a).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(iters):
    out = f(a)
  out.block_until_ready()
  return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def peak_tflops(flag: float | None) -> tuple[float, str]:
  """Per-device peak for MFU and a phrase saying where it came from."""
  if flag:
    return flag, f"{flag:g} TFLOP/s per device from --peak-tflops"
  if jax.default_backend() == "cpu":
    cores = os.cpu_count() or 1
    value = CPU_NOMINAL_TFLOPS_PER_CORE * cores / max(1, jax.local_device_count())
    return value, f"{value:g} TFLOP/s per device, a nominal CPU figure (not measured)"
  value = measure_matmul_tflops()
  return value, (f"{value:.0f} TFLOP/s per device, measured bf16 8192^3 matmul ceiling on "
                 f"{jax.devices()[0].device_kind}")


def to_python(tree):
  """Device arrays -> floats / lists of floats for JSON."""
  def one(x):
    x = np.asarray(x)
    return float(x) if x.ndim == 0 else [float(v) for v in x.reshape(-1)]
  return jax.tree.map(one, tree)
