"""`pip install .` ships the library and the trainer without generic top-level names."""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_wheel_has_no_generic_top_level_modules(tmp_path):
  """The wheel holds stable_attn, pallas_kernels and stable_attn_train (the checkout's train/, with
  its tokenizer assets) and the `stable-attn-train` entry point; no `train`, `benchmarks` or
  `tests` that would shadow a user's own modules."""
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
                  ROOT], check=True)
  (wheel,) = tmp_path.glob("stable_attn-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
  assert top == {"stable_attn", "pallas_kernels", "stable_attn_train"}, top
  assert "stable_attn_train/assets/encoder.json" in names
  assert "pallas_kernels/mosaic_gpu/forward.py" in names
  entry_points = next(n for n in names if n.endswith("entry_points.txt"))
  text = zipfile.ZipFile(wheel).read(entry_points).decode()
  assert "stable-attn-train = stable_attn_train.cli:main" in text
