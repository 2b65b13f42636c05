"""Metrics out: DIR/metrics.jsonl (one JSON object per logged step), TensorBoard, the loss plot,
MFU."""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


class MetricsLogger:
  """Appends records to DIR/metrics.jsonl and mirrors scalars to TensorBoard (DIR/tb/).

  A run that starts at `start_step` (resumed from that checkpoint) first drops what a run killed
  after that checkpoint logged of steps >= start_step, from both, since it logs them again.
  """

  def __init__(self, out_dir: Path, *, start_step: int = 0, enabled: bool = True,
               tensorboard: bool = True):
    self.path = Path(out_dir) / "metrics.jsonl"
    self.enabled = enabled
    self.tb = None
    if not enabled:
      return
    self._truncate_from(start_step)
    if tensorboard:
      tb_dir = Path(out_dir) / "tb"
      purge_tensorboard(tb_dir, start_step)
      self.tb = _EventFile(tb_dir, start_step)

  def _truncate_from(self, step: int) -> None:
    """Drop records of steps >= step from metrics.jsonl."""
    if not self.path.exists():
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
      scalars = {}
      for key, value in record.items():
        if key == "step" or isinstance(value, (str, bool)) or value is None:
          continue
        if isinstance(value, list):
          scalars.update({f"{key}/layer{i}": v for i, v in enumerate(value)})
        else:
          scalars[key] = value
      self.tb.write(record["step"], scalars)

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
  if tr or va:   # a run stopped before its first finite loss plots no line to label
    ax.legend()
  fig.tight_layout()
  path = Path(out_dir) / "loss.png"
  fig.savefig(path)
  plt.close(fig)
  return path


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


def peak_tflops(flag: float | None) -> tuple[float | None, str]:
  """Per-device peak for MFU and a phrase saying where it came from; on a CPU without `flag`,
  None: no MFU (a CPU's bf16 matmuls say little of what a training step can reach)."""
  if flag:
    return flag, f"{flag:g} TFLOP/s per device from --peak-tflops"
  if jax.default_backend() == "cpu":
    return None, "no peak on a CPU; --peak-tflops sets one"
  value = measure_matmul_tflops()
  return value, (f"{value:.0f} TFLOP/s per device, measured bf16 8192^3 matmul ceiling on "
                 f"{jax.devices()[0].device_kind}")


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None,
        devices: int) -> float | None:
  """Model FLOP utilisation (a fraction) against `peak` TFLOP/s per device; None without one."""
  return None if peak is None else tokens_per_s * flops_per_token / (peak * 1e12 * devices)


def percent(fraction: float | None) -> str:
  return "-" if fraction is None else f"{100 * fraction:.1f}%"


def to_python(tree):
  """Device arrays -> floats / lists of floats for JSON."""
  def one(x):
    x = np.asarray(x)
    return float(x) if x.ndim == 0 else [float(v) for v in x.reshape(-1)]
  return jax.tree.map(one, tree)


# ----------------------------------------------------------------------------- TensorBoard files


class _EventFile:
  """A TensorBoard event file in tb_dir, each record's scalars written through at once.

  tensorboardX's SummaryWriter queues events for a thread that writes them and flushes every two
  minutes: a killed run would leave TensorBoard behind metrics.jsonl, with no telling which steps
  are on disk. Here both files hold the same steps whenever the process dies.
  """

  def __init__(self, tb_dir: Path, start_step: int):
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import SessionLog
    Path(tb_dir).mkdir(parents=True, exist_ok=True)
    # The name holds the time in whole seconds; the suffix keeps a run started again within the
    # same second from overwriting the file of the one before.
    self.writer = EventsWriter(str(Path(tb_dir) / "events"), filename_suffix=f".{time.time_ns()}")
    # TensorBoard's restart marker (what SummaryWriter(purge_step=...) writes): a TensorBoard
    # already running, which holds the killed run's later steps in memory, drops them too.
    self._write(start_step, session_log=SessionLog(status=SessionLog.START))

  def _write(self, step: int, **fields) -> None:
    from tensorboardX.proto.event_pb2 import Event
    self.writer.write_event(Event(wall_time=time.time(), step=step, **fields))
    self.writer.flush()

  def write(self, step: int, scalars: dict) -> None:
    from tensorboardX.proto.summary_pb2 import Summary
    self._write(step, summary=Summary(value=[Summary.Value(tag=tag, simple_value=float(v))
                                             for tag, v in scalars.items()]))

  def close(self) -> None:
    self.writer.close()


def _event_records(path: Path):
  """(raw record, Event) of one event file in order, stopping at a record cut short or garbled
  (the tail a killed writer can leave). TFRecord framing: uint64 length, its masked CRC32C, the
  serialized Event, the data's masked CRC32C."""
  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.record_writer import masked_crc32c
  data, pos = path.read_bytes(), 0
  while pos + 12 <= len(data):
    (n,) = struct.unpack_from("<Q", data, pos)
    end = pos + 12 + n + 4
    if end > len(data):
      return
    payload = data[pos + 12:pos + 12 + n]
    if struct.unpack_from("<I", data, end - 4)[0] != masked_crc32c(payload):
      return
    yield data[pos:end], Event.FromString(payload)
    pos = end


def _event_files(tb_dir: Path) -> list[Path]:
  # tensorboardX names them events.out.tfevents.<unix time>.<host>: by name is by age.
  return sorted(p for p in Path(tb_dir).glob("*tfevents*") if p.is_file())


def read_tensorboard(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] of every scalar in DIR/tb, in the order written, as stored: the way any
  reader sees the files (TensorBoard's own purge on a restart marker aside)."""
  out: dict[str, list[tuple[int, float]]] = {}
  for path in _event_files(tb_dir):
    for _, event in _event_records(path):
      for v in event.summary.value:
        value = v.simple_value if v.HasField("simple_value") else float(v.tensor.float_val[0])
        out.setdefault(v.tag, []).append((event.step, value))
  return out


def purge_tensorboard(tb_dir: Path, step: int) -> int:
  """Removes the summaries of steps >= step from the event files in tb_dir (a run killed after its
  last checkpoint logged them; the resumed run logs them again). Returns how many were removed."""
  removed = 0
  for path in _event_files(tb_dir):
    kept, dropped, size = [], 0, 0
    for raw, event in _event_records(path):
      size += len(raw)
      if event.HasField("summary") and event.step >= step:
        dropped += 1
      else:
        kept.append(raw)
    if dropped or size != path.stat().st_size:  # also drops a tail cut short by the kill
      # A name without "tfevents": neither TensorBoard nor _event_files reads a half-written copy.
      tmp = path.with_name(".purging-" + path.name.replace("tfevents", "tmp"))
      tmp.write_bytes(b"".join(kept))
      os.replace(tmp, path)
      removed += dropped
  return removed
