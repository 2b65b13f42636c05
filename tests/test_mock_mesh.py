"""tests/test_multi_gpu.py on one Hopper GPU (`-m gpu`), on a mock mesh of 4 devices.

Each of 12 groups of that file's tests runs in a subprocess under XLA's mock NCCL
(`MOCK_NUM_GPU_PROCESSES=4`): JAX sees the devices of 4 processes, so every sharded program
compiles as on 4 GPUs -- custom_partitioning's per-device programs lowered to the Hopper kernels
and through ptxas, where the 4-GPU crash of the packed QKV gradient was, which the CPU's sharding
tests never reach -- and this process's share runs. Values are compared where a program has no
collectives (the mock's move no data); the others compile, run and are skipped by name
(tests/test_multi_gpu.py says how). With 2 or more GPUs the file runs for real instead.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -m gpu -n 12 tests/test_mock_mesh.py

`MOCK_MESH_LOGS=DIR` keeps each group's pytest output as DIR/<group>.log.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

mosaic = pytest.importorskip("pallas_kernels.mosaic_gpu")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not mosaic.is_available(), reason="needs a Hopper (sm_90) GPU"),
    pytest.mark.skipif(jax.device_count() > 1 or os.environ.get("MOCK_NUM_GPU_PROCESSES"),
                       reason="several GPUs (or the mock itself) run tests/test_multi_gpu.py"),
]

# -k selections of tests/test_multi_gpu.py, one subprocess each (pytest-xdist spreads them).
GROUPS = {
    "entries_split": "test_sharded_equals_one_device and split-",
    "entries_packed": "test_sharded_equals_one_device and packed",
    "entries_flax": "test_sharded_equals_one_device and flax",
    "every_max_adjust": "test_sharded_every_max_adjust",
    "sequence": "test_sequence_sharded_runs_context_parallel",
    "sequence_zigzag": "test_sequence_sharded_zigzag",
    "fp8_auto_rows": "test_sharded_fp8_equals_one_device and auto and (batch or heads)",
    "fp8_auto_both_sequence": "test_sharded_fp8_equals_one_device and auto and (both or sequence)",
    "fp8_explicit_rows": "test_sharded_fp8_equals_one_device and explicit and (batch or heads)",
    "fp8_explicit_both_sequence": ("test_sharded_fp8_equals_one_device and explicit and "
                                   "(both or sequence)"),
    "heads_by_part_of_an_axis": "test_heads_split_by_part_of_a_mesh_axis",
    "train_step": "test_train_step_on_every_device_equals_one_device",
}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_multi_gpu_tests_on_a_mock_mesh(group):
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
  env.update(MOCK_NUM_GPU_PROCESSES="4", XLA_PYTHON_CLIENT_PREALLOCATE="false")
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
       "tests/test_multi_gpu.py", "-k", GROUPS[group]],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
  out = run.stdout + run.stderr
  if os.environ.get("MOCK_MESH_LOGS"):
    logs = Path(os.environ["MOCK_MESH_LOGS"])
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"{group}.log").write_text(out)
  counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}
  assert run.returncode == 0 and sum(counts.values()) > 0, out[-6000:]
  # every test either compared values (passed) or compiled and ran (skipped, naming collectives)
  skips = re.findall(r"SKIPPED \[\d+\] .*?: (.*)", out)
  assert all(s.startswith("mock mesh: compiled and ran") for s in skips), skips
