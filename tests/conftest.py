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

import collections  # noqa: E402

import pytest  # noqa: E402

# The README's test command (`-m 'not gpu and not slow'`) stays under 15 minutes on 2 CPU cores:
# of each of these large parametrized tests it runs one instance in `every` (collection order, so
# the same ones on every xdist worker), and marks the others `slow`, which CI runs next (`pytest
# -m slow`). Measured on 2026-11-28: these took 1,238 of the quick run's 2,260 worker-seconds,
# of which it keeps about 430.
QUICK_SHARE = {
    "test_pallas_tpu.py::test_equivalence_interpret": 4,
    "test_pallas_gpu.py::test_interpret_matches_exact": 4,
    "test_residuals.py::test_ring_identity_values_and_gradients": 3,
    "test_packed_softcap.py::test_packed_row_equals_documents_run_alone": 3,
    "test_adversarial.py::test_exact_ties_never_nan": 3,
    "test_segment_ranges.py::test_segment_sections_against_brute_force": 4,
    "test_equivalence.py::test_reference_modes_numerics_dtypes": 3,
    "test_sinks.py::test_matches_float64_with_own_vjp": 3,
    "test_equivalence.py::test_every_case_bf16_safe": 3,
    "test_context_parallel.py::test_shifted_rows_equal_the_full_call": 3,
    "test_pallas_tpu.py::test_block_skipping": 3,
    "test_pallas_mosaic_gpu.py::test_mask_schedule_streams_only_needed_blocks": 2,
    "test_fp8_numerics.py::test_fp8_inputs_reach_every_backend": 3,
    "test_fp8_numerics.py::test_fp8_scales_from_the_caller": 3,
    "test_train_model.py::test_attention_implementations_agree_in_model": 3,
    "test_api_edges.py::test_windows_wider_than_the_sequence_are_no_window": 3,
    "test_packed_softcap.py::test_soft_cap_tames_huge_logits": 3,
    "test_qkvpacked.py::test_packed_equals_split": 3,
    "test_sinks.py::test_extreme_sinks_never_nan": 3,
    "test_equivalence.py::test_masks_every_mode_fp32": 3,
    "test_adversarial.py::test_huge_logits": 3,
    "test_fp16_subnormals.py::test_long_fp16_rows_against_float64": 3,
    "test_pallas_mosaic_gpu.py::test_fp8_forward_lowers_for_cuda": 3,
    "test_pallas_mosaic_gpu.py::test_features_lower_for_cuda": 3,
    "test_pallas_mosaic_gpu.py::test_dkv_split_lowers_for_cuda": 5,
    "test_pallas_mosaic_gpu.py::test_entry_register_tiles_lower_for_cuda": 3,
    "test_debug_infs.py::test_flash_implementations_make_no_inf": 2,
    "test_train_model.py::test_linear_bias_in_matmul_matches_float64": 3,
    # 2026-12-03: the README command took 17:35 on a slower 2-core machine
    "test_pallas_mosaic_gpu.py::test_without_a_producer_no_warpgroup_moves_registers": 3,
    "test_pallas_mosaic_gpu.py::test_refill_k_early_moves_the_forwards_k_copies": 3,
}


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  seen = collections.Counter()
  for item in items:
    key = f"{item.path.name}::{item.originalname}"
    every = QUICK_SHARE.get(key)
    if every is None:
      continue
    if seen[key] % every:
      item.add_marker(pytest.mark.slow)
    seen[key] += 1
