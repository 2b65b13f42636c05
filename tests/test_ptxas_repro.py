"""docs/ptxas_setmaxnreg.md's reproduction, where a CUDA toolkit's ptxas is on the PATH: the PTX
assembles both ways, and only relocatable compilation (-c) ignores setmaxnreg with C7504."""
import shutil
import subprocess
from pathlib import Path

import pytest

PTX = Path(__file__).resolve().parents[1] / "docs" / "repro" / "setmaxnreg.ptx"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas on the PATH")
def test_relocatable_ptxas_ignores_setmaxnreg(tmp_path):
  run = lambda *flags: subprocess.run(["ptxas", "-arch=sm_90a", "-v", *flags, str(PTX), "-o",
                                       str(tmp_path / "out")], capture_output=True, text=True,
                                      timeout=120)
  whole, relocatable = run(), run("-c")
  assert whole.returncode == 0 and relocatable.returncode == 0, (whole.stderr, relocatable.stderr)
  assert "C7504" in relocatable.stderr and "'setmaxnreg' ignored" in relocatable.stderr
  assert "C75" not in whole.stderr, whole.stderr
  assert "Used 168 registers" in whole.stderr   # the count at entry the kernel's warpgroups share
