"""Metrics out: DIR/metrics.jsonl (one JSON object per logged step), TensorBoard, the loss plot,
MFU."""

from __future__ import annotations

import io
import json
import math
import os
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def write_atomically(path: Path, data: bytes | str, tmp: Path | None = None) -> None:
  """Replaces `path` with `data` so that a kill at any byte leaves either the old file or the new
  one, never a mix: written to `tmp` beside it (default .NAME.PID.tmp), flushed to disk, renamed
  over it."""
  path = Path(path)
  tmp = tmp or path.with_name(f".{path.name}.{os.getpid()}.tmp")
  with open(tmp, "wb") as f:
    f.write(data.encode() if isinstance(data, str) else data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def parse_metrics(path: Path) -> tuple[list[tuple[str, dict]], str | None]:
  """(line, record) of every record in a metrics.jsonl, and the torn last line if there is one.

  A kill (or a full disk) during an append leaves a last line cut short: that is returned apart,
  for the caller to drop. A line that does not parse anywhere else was not made by an append:
  ValueError naming the file and the line.
  """
  text = Path(path).read_bytes().decode("utf-8", errors="replace")
  lines = text.split("\n")
  # The last element is what follows the final newline: "" for a file of whole lines.
  records, tail = [], lines[-1]
  for number, line in enumerate(lines[:-1], 1):
    if line.strip():
      records.append((line, _record(line, path, number)))
  if not tail.strip():
    return records, None
  try:
    # A record whose newline alone was lost is whole.
    return records + [(tail, _record(tail, path, len(lines)))], None
  except ValueError:
    return records, tail


def _record(line: str, path: Path, number: int) -> dict:
  try:
    record = json.loads(line)
  except ValueError as e:
    raise ValueError(f"{path}, line {number}: not a JSON record ({e}); only the last line can be "
                     f"cut short by a kill, so the file was changed otherwise: repair or move it "
                     f"away") from None
  if not isinstance(record, dict):
    raise ValueError(f"{path}, line {number}: not a metrics record (a JSON object); repair or "
                     f"move the file away")
  return record


def _step(record: dict) -> int:
  step = record.get("step")
  return step if isinstance(step, int) else -1  # a record without a step is kept by every resume


class MetricsLogger:
  """Appends records to DIR/metrics.jsonl and mirrors scalars to TensorBoard (DIR/tb/).

  A run that starts at `start_step` (resumed from that checkpoint) first drops what a run killed
  after that checkpoint logged of steps >= start_step, from both, since it logs them again, and a
  last line or event cut short by the kill (`log` says so in one line).
  """

  def __init__(self, out_dir: Path, *, start_step: int = 0, enabled: bool = True,
               tensorboard: bool = True, log=print):
    self.path = Path(out_dir) / "metrics.jsonl"
    self.enabled = enabled
    self.tb = None
    if not enabled:
      return
    self._truncate_from(start_step, log)
    if tensorboard:
      tb_dir = Path(out_dir) / "tb"
      purge_tensorboard(tb_dir, start_step, log=log)
      self.tb = _EventFile(tb_dir, start_step)

  def _truncate_from(self, step: int, log) -> None:
    """Drop records of steps >= step, and a torn last line, from metrics.jsonl."""
    if not self.path.exists():
      return
    records, torn = parse_metrics(self.path)
    if torn is not None:
      shown = torn if len(torn) <= 60 else torn[:60] + "..."
      log(f"metrics: {self.path}: dropped its last line, cut short when the run before was killed "
          f"({len(torn.encode())} bytes: {shown!r})")
    kept = "".join(line + "\n" for line, record in records if _step(record) < step)
    # Also rewritten when only the last newline is missing: the next record would join its line.
    if kept.encode() != self.path.read_bytes():
      write_atomically(self.path, kept)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    # One write of one line: a kill leaves at most this line cut short, which the next run drops.
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
  """The records of DIR/metrics.jsonl, without a last line cut short (a run being written, or
  killed)."""
  path = Path(out_dir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [record for _, record in parse_metrics(path)[0]]


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
  png = io.BytesIO()
  fig.savefig(png, format="png")
  plt.close(fig)
  write_atomically(path, png.getvalue())
  return path


# Dense (no sparsity) bf16 tensor peak per device, TFLOP/s, from the vendors' datasheets: the
# denominator nanoGPT and PaLM's MFU use. NVIDIA's sheets print the figure with 2:4 sparsity, twice
# this. Keys are substrings of jax.devices()[0].device_kind, matched without case, the longest first
# ("H100 PCIe" before "H100", "GH200" before "H200", "TPU v5 lite" before "TPU v5"). A None entry
# is a kind that a shorter key would match wrongly ("TPU v4 lite" is not a v4): it is measured.
# Kinds whose figure we could not pin down (A10G, L4, the L40s, Blackwell) are left out: measured.
DATASHEET_BF16_TFLOPS: dict[str, float | None] = {
    "H100 80GB HBM3": 989.4,   # H100 SXM5
    "H100 SXM": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.4,             # H200 SXM
    "H200 NVL": 835.0,
    "GH200": 989.4,
    "A100": 312.0,             # SXM and PCIe alike
    "TPU v4": 275.0,
    "TPU v4 lite": None,       # v4i
    "TPU v5 lite": 197.0,      # v5e
    "TPU v5e": 197.0,
    "TPU v5": 459.0,           # v5p
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,      # v6e (Trillium)
    "TPU v6e": 918.0,
}


def datasheet_tflops(device_kind: str) -> float | None:
  """The datasheet's dense bf16 peak (TFLOP/s) of the kind, from the longest key of
  DATASHEET_BF16_TFLOPS it contains; None where no key matches (or a None entry does)."""
  kind = device_kind.lower()
  keys = [key for key in DATASHEET_BF16_TFLOPS if key.lower() in kind]
  return DATASHEET_BF16_TFLOPS[max(keys, key=len)] if keys else None


def measure_matmul_tflops(n: int = 8192, iters: int = 10, batches: int = 5,
                          warmup_s: float = 1.0) -> float:
  """Median bf16 matmul throughput of one device, TFLOP/s: `batches` timed batches of `iters`
  n x n x n products each (each batch ended by block_until_ready), after `warmup_s` seconds of the
  same products.

  Clocks ramp up under load: timed cold after one product, an H100 gave 207-292 (issue 48), where
  this gives 683-702 (jax 0.11.2). Random normal data: all-ones matrices toggle fewer bits and run
  faster than real ones.
  """
  key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(key_a, (n, n), jnp.bfloat16)
  b = jax.random.normal(key_b, (n, n), jnp.bfloat16)
  product = jax.jit(lambda a, b: a @ b)

  def batch() -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
      out = product(a, b)
    out.block_until_ready()
    return time.perf_counter() - t0

  batch()  # compiles
  warm_until = time.perf_counter() + warmup_s
  while time.perf_counter() < warm_until:
    batch()
  seconds = float(np.median([batch() for _ in range(batches)]))
  return 2 * n ** 3 * iters / seconds / 1e12


def check_peak_tflops(flag: float | None) -> None:
  """ValueError unless --peak-tflops is absent or a positive number (-1 printed MFU -12.2%)."""
  if flag is not None and not (math.isfinite(flag) and flag > 0):
    raise ValueError(f"--peak-tflops must be a positive number of TFLOP/s per device, got {flag}")


def peak_tflops(flag: float | None, device=None) -> tuple[float | None, str]:
  """Per-device peak for MFU and a phrase saying where it came from: `flag`, else the datasheet's
  dense bf16 peak of `device`'s kind (default jax.devices()[0]), else, for a kind not in
  DATASHEET_BF16_TFLOPS, measure_matmul_tflops. On a CPU without `flag`, None: no MFU (a CPU's
  bf16 matmuls say little of what a training step can reach)."""
  check_peak_tflops(flag)
  if flag is not None:
    return flag, f"{flag:g} TFLOP/s per device from --peak-tflops"
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    return None, "no peak on a CPU; --peak-tflops sets one"
  kind = device.device_kind
  value = datasheet_tflops(kind)
  if value is not None:
    return value, f"{value:.0f} TFLOP/s per device, datasheet dense bf16 peak of {kind}"
  value = measure_matmul_tflops()
  return value, (f"{value:.0f} TFLOP/s per device, measured bf16 matmul median on {kind} (kind not "
                 f"in the datasheet table; --peak-tflops sets one)")


def mfu_warning(fraction: float | None, peak_note: str) -> str | None:
  """For an MFU above 100%, which no step can reach, a phrase ("above 100%, so the peak ...")
  saying that the peak must be wrong and naming where it came from (`peak_note`, as peak_tflops
  gives it); None otherwise."""
  if fraction is None or fraction <= 1:
    return None
  return (f"above 100%, so the peak it divides by ({peak_note}) must be wrong; --peak-tflops sets "
          f"one")


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


def tensorboard_missing() -> str | None:
  """Why no TensorBoard file can be written here, in words (tensorboardX, what _EventFile writes
  with, does not import); None where one can."""
  try:
    import tensorboardX.event_file_writer  # noqa: F401
    import tensorboardX.proto.event_pb2  # noqa: F401
  except Exception as e:  # an install that breaks on import (protobuf's TypeError) too
    if isinstance(e, ModuleNotFoundError) and e.name == "tensorboardX":
      return "tensorboardX is not installed"
    return f"tensorboardX does not import ({type(e).__name__}: {e})"
  return None


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


def purge_tensorboard(tb_dir: Path, step: int, log=print) -> int:
  """Removes the summaries of steps >= step from the event files in tb_dir (a run killed after its
  last checkpoint logged them; the resumed run logs them again), and a tail cut short by the kill
  (`log` says so in one line). Returns how many summaries were removed."""
  removed = 0
  for path in _event_files(tb_dir):
    kept, dropped, size = [], 0, 0
    for raw, event in _event_records(path):
      size += len(raw)
      if event.HasField("summary") and event.step >= step:
        dropped += 1
      else:
        kept.append(raw)
    torn = path.stat().st_size - size
    if torn:
      log(f"metrics: {path}: dropped its last {torn} bytes, an event cut short when the run "
          f"before was killed")
    if dropped or torn:
      # A name without "tfevents": neither TensorBoard nor _event_files reads a half-written copy.
      write_atomically(path, b"".join(kept),
                       tmp=path.with_name(".purging-" + path.name.replace("tfevents", "tmp")))
      removed += dropped
  return removed
