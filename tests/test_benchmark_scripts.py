"""The benchmark scripts run end to end (smoke mode: interpret mode, tiny shapes, CPU).

Their timings mean nothing here; what is checked is that they still run against the current API,
so the next GPU session does not spend device time on a broken script.
"""
import pytest

from benchmarks import features


@pytest.mark.slow
def test_features_smoke(capsys):
  features.main(["--smoke", "--implementations", "pallas_mosaic_gpu,pallas_gpu"])
  text = capsys.readouterr().out
  assert "| pallas_gpu | packed / unpacked |" in text
  assert "not run: Mosaic GPU kernels have no interpret mode" in text
