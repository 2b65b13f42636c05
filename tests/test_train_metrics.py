"""train.metrics: metrics.jsonl and TensorBoard hold each step once across a crash and a resume."""

import jax
import pytest

from train.metrics import (MetricsLogger, _event_files, _event_records, mfu, peak_tflops, percent,
                           read_metrics, read_tensorboard)


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
