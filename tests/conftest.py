import os
import sys

# Tests import the shared cases as `tests.cases`; make the repo root importable without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# `python -m train` and the benchmarks turn on JAX's persistent compilation cache, by default in
# ~/.cache (train/jax_cache.py): tests, and the processes they start, write none there (an empty
# $JAX_COMPILATION_CACHE_DIR means none). A test that wants one names its directory.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")

# STABLE_ATTN_GPUS_PER_HOST=N on a host with N GPUs: each pytest-xdist worker runs on its own GPU
# (worker gwI takes GPU I mod N), so single-GPU tests spread over the cards instead of all running
# on the first. Set here, before any test imports JAX.
_gpus, _worker = int(os.environ.get("STABLE_ATTN_GPUS_PER_HOST") or 0), os.environ.get(
    "PYTEST_XDIST_WORKER", "")
if _gpus and _worker.startswith("gw"):
  os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % _gpus)
