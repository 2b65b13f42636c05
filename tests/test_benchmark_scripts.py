"""The benchmark scripts run end to end (smoke mode: interpret mode, tiny shapes, CPU).

Their timings mean nothing here; what is checked is that they still run against the current API,
so the next GPU session does not spend device time on a broken script.
"""
import numpy as np
import pytest

from benchmarks import attention, features, peers


@pytest.mark.slow
def test_features_smoke(capsys):
  features.main(["--smoke", "--implementations", "pallas_mosaic_gpu,pallas_gpu,tokamax",
                 "--no-compilation-cache"])
  text = capsys.readouterr().out
  assert "| pallas_gpu | packed / unpacked, 4 x 32 |" in text
  assert "| pallas_gpu | soft cap / no cap, B1 T64 N2 H32 causal, forward |" in text
  assert "not run: Mosaic GPU kernels have no interpret mode" in text
  assert "FAILED" not in text
  try:
    import tokamax  # noqa: F401
  except ImportError:
    assert "| tokamax | B1 T64 N2 H32 causal, soft cap 50 | nan | not run: tokamax is not " in text


def test_attention_arms_and_peer_columns():
  """tokamax is an arm where it imports (a note line where it does not), with x tokamax columns
  beside x cuDNN; JAX's deprecated Pallas Triton mha runs only when named."""
  shape = (2, 256, 4, 4, 64, True)
  arms = attention.implementations(shape)
  assert "pallas_mha" not in arms
  assert ("tokamax" in arms) == (peers.tokamax_attention() is not None)
  assert "cudnn" in arms and "mosaic_safe" in arms
  if peers.pallas_mha()[0] is not None:
    assert set(attention.implementations(shape, only=["pallas_mha", "cudnn"])) == {
        "pallas_mha", "cudnn"}
  rows = [attention.Row(shape, "cudnn", fwd_ms=1.0, fb_ms=3.0),
          attention.Row(shape, "tokamax", fwd_ms=1.1, fb_ms=3.3),
          attention.Row(shape, "mosaic_safe", fwd_ms=1.0, fb_ms=3.0)]
  notes = ["tokamax: not run, tokamax is not importable."]
  text = attention.markdown(rows, "cpu", np.dtype("bfloat16"), 30, 5, notes)
  assert notes[0] in text.splitlines()
  header = next(line for line in text.splitlines() if line.startswith("| shape | impl |"))
  assert "| fwd x cuDNN | x cuDNN | fwd x tokamax | x tokamax |" in header
  assert " x mha " not in header   # no mha row, no mha column
  row = next(line for line in text.splitlines() if "| mosaic_safe |" in line)
  assert "| 1.00 | 1.00 | 1.10 | 1.10 |" in row
  assert len(row.split("|")) == len(header.split("|"))
  if peers.tokamax_attention() is None:
    assert attention.peer_notes() == ["tokamax: not run, tokamax is not importable."]
    assert attention.peer_notes(["cudnn"]) == []
