import os
import sys

# Tests import the shared cases as `tests.cases`; make the repo root importable without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# `python -m train` and the benchmarks turn on JAX's persistent compilation cache, by default in
# ~/.cache (train/jax_cache.py): tests, and the processes they start, write none there (an empty
# $JAX_COMPILATION_CACHE_DIR means none). A test that wants one names its directory.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")
