"""train.metrics: metrics.jsonl and TensorBoard hold each step once across a crash and a resume."""

import math
import sys
import time
from types import SimpleNamespace

import jax
import pytest

import train.metrics as metrics
from train.metrics import (MetricsLogger, _event_files, _event_records, datasheet_tflops,
                           measure_matmul_tflops, mfu, mfu_warning, peak_tflops, percent,
                           read_metrics, read_tensorboard, tensorboard_missing)


def _log(out, steps, start=0, scale=1.0):
  logger = MetricsLogger(out, start_step=start)
  for s in steps:
    logger.write({"step": s, "loss": scale * s, "tie_frac": [0.5, 0.25], "stopped": None})
  return logger  # not closed: a killed run closes nothing


def test_records_reach_tensorboard_at_once(tmp_path):
  _log(tmp_path, range(3))
  tb = read_tensorboard(tmp_path / "tb")
  assert tb["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]
  assert tb["tie_frac/layer1"] == [(0, 0.25), (1, 0.25), (2, 0.25)]
  assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]


def test_a_resume_drops_the_killed_runs_later_steps_from_both(tmp_path):
  _log(tmp_path, range(5))  # killed after logging step 4; its checkpoint is step 2's
  # The killed writer's last record was cut short on disk.
  (killed,) = _event_files(tmp_path / "tb")
  killed.write_bytes(killed.read_bytes()[:-7])
  _log(tmp_path, range(2, 4), start=2, scale=10.0).close()
  tb = read_tensorboard(tmp_path / "tb")
  assert tb["loss"] == [(0, 0.0), (1, 1.0), (2, 20.0), (3, 30.0)]
  assert [r["loss"] for r in read_metrics(tmp_path)] == [0.0, 1.0, 20.0, 30.0]
  # The killed file keeps whole records only, and the new file opens with TensorBoard's restart
  # marker at the resume step (for a TensorBoard that already read the purged events).
  files = _event_files(tmp_path / "tb")
  assert len(files) == 2
  sizes = sum(len(raw) for raw, _ in _event_records(files[0]))
  assert sizes == files[0].stat().st_size
  marks = [(e.step, e.session_log.status) for _, e in _event_records(files[1])
           if e.HasField("session_log")]
  assert marks == [(2, 1)]  # SessionLog.START


def test_nothing_is_dropped_before_the_start_step(tmp_path):
  _log(tmp_path, range(3)).close()
  before = (tmp_path / "metrics.jsonl").read_text()
  _log(tmp_path, [], start=3).close()
  assert (tmp_path / "metrics.jsonl").read_text() == before
  assert [s for s, _ in read_tensorboard(tmp_path / "tb")["loss"]] == [0, 1, 2]


def test_a_disabled_logger_writes_nothing(tmp_path):
  logger = MetricsLogger(tmp_path, enabled=False)
  logger.write({"step": 0, "loss": 1.0})
  logger.close()
  assert list(tmp_path.iterdir()) == []


def test_no_mfu_on_a_cpu_unless_a_peak_is_given():
  """A CPU gets no MFU by default (a nominal peak once printed 79.9% for the main job); a given
  peak gives tokens/s x FLOP/token over the devices' peak."""
  if jax.default_backend() != "cpu":
    pytest.skip("the default peak is measured on an accelerator")
  peak, note = peak_tflops(None)
  assert peak is None and "--peak-tflops" in note
  assert mfu(5000.0, 7e8, peak, 1) is None and percent(None) == "-"
  peak, note = peak_tflops(200.0)
  assert peak == 200.0 and "--peak-tflops" in note
  assert mfu(5000.0, 7e8, peak, 2) == pytest.approx(5000.0 * 7e8 / (200e12 * 2))
  assert percent(0.4567) == "45.7%"


@pytest.mark.parametrize("kind,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0), ("TPU v5", 459.0), ("TPU v5p", 459.0), ("TPU v6 lite", 918.0),
    # Not in the table: measured. "TPU v4 lite" holds "TPU v4", "NVIDIA L40S" would hold "L4".
    ("TPU v4 lite", None), ("NVIDIA A10G", None), ("NVIDIA L40S", None), ("NVIDIA H800", None),
    ("cpu", None),
])
def test_the_datasheet_peak_of_each_kind_matches_its_most_specific_key(kind, peak):
  assert datasheet_tflops(kind) == peak


def _device(kind, platform="gpu"):
  return SimpleNamespace(device_kind=kind, platform=platform)


def test_the_peak_comes_from_the_flag_the_datasheet_or_a_measurement_and_says_which(monkeypatch):
  """An H100's peak is its datasheet's 989 (a matmul timed at start-up once gave 292 and MFU
  135.7%, issue 48); only a kind the table lacks is measured, and the note says so."""
  monkeypatch.setattr(metrics, "measure_matmul_tflops", lambda: pytest.fail("measured"))
  h100 = _device("NVIDIA H100 80GB HBM3")
  assert peak_tflops(None, h100) == (989.4, "989 TFLOP/s per device, datasheet dense bf16 peak of "
                                            "NVIDIA H100 80GB HBM3")
  assert peak_tflops(500.0, h100) == (500.0, "500 TFLOP/s per device from --peak-tflops")
  assert peak_tflops(None, _device("cpu", "cpu"))[0] is None
  monkeypatch.setattr(metrics, "measure_matmul_tflops", lambda: 123.4)
  assert peak_tflops(None, _device("NVIDIA A10G")) == (
      123.4, "123 TFLOP/s per device, measured bf16 matmul median on NVIDIA A10G (kind not in the "
             "datasheet table; --peak-tflops sets one)")


def test_the_measured_peak_warms_up_before_it_times():
  t0 = time.perf_counter()
  value = measure_matmul_tflops(n=64, iters=2, batches=3, warmup_s=0.1)
  assert time.perf_counter() - t0 >= 0.1
  assert math.isfinite(value) and value > 0


def test_an_mfu_above_100_percent_is_called_wrong_naming_the_peak():
  note = "292 TFLOP/s per device, measured ..."
  said = mfu_warning(1.357, note)
  assert said.startswith("above 100%") and f"({note})" in said and "--peak-tflops" in said
  assert mfu_warning(1.0, note) is None and mfu_warning(0.45, note) is None
  assert mfu_warning(None, note) is None


def test_a_missing_tensorboardx_is_named(monkeypatch):
  assert tensorboard_missing() is None
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # what an import finds when not installed
  assert tensorboard_missing() == "tensorboardX is not installed"
