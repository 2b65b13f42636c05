"""implementation="pallas_gpu": values and gradients against the exact float64 reference.

On CPU the kernels run in Pallas interpret mode (small tiles from tuning.INTERPRET, so every test
sequence spans several blocks); the `gpu`-marked tests run them compiled (Triton) with the table's
tiles and larger shapes, and are skipped unless the default backend is a GPU:

    python -m pytest -m gpu tests/test_pallas_gpu.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from pallas_kernels import gpu as pallas_gpu
from pallas_kernels.gpu import kernels as gpu_kernels, tuning
from stable_attn.flash import make_flash_attention
from tests import cases

IMPL = "pallas_gpu"
bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")

# Cases beyond the shared suite that reach the kernel's own branches: broadcast bias/mask dims
# (row, column, scalar), a non-power-of-two GQA group (G = 3) and a head dim padded to 64.
EXTRA_CASES = [
    dict(name="bias_row_mask_col", B=2, T=24, S=40, N=2, K=2, H=32, bias=(2, 1, 1, 40),
         mask=(1, 2, 24, 1), is_causal=True),
    dict(name="bias_col_scalar_mask", B=1, T=33, S=20, N=2, K=1, H=32, bias=(1, 2, 33, 1),
         mask=(1, 1, 1, 1)),
    dict(name="bias_scalar_gqa3", B=1, T=20, S=20, N=6, K=2, H=32, bias=(1, 1, 1, 1),
         is_causal=True),
    dict(name="odd_head", B=1, T=19, S=37, N=2, K=1, H=40, window=(9, 4)),
]
EXTRA = {c["name"]: c for c in EXTRA_CASES}


def _case(name):
  return EXTRA[name] if name in EXTRA else cases.case_by_name(name)


def _check(case, dtype, max_adjust, numerics, *, interpret, seed):
  """cases.check_case, except that a bias broadcast over keys (Sb = 1) has dbias = 0 exactly
  (each row of dS sums to 0), so its dbias is bounded absolutely instead of relatively."""
  if "bias" not in case or case["bias"][-1] != 1:
    return cases.check_case(IMPL, case, dtype, max_adjust, numerics, interpret=interpret,
                            seed=seed)
  out, grads, exact = cases.run_case(IMPL, case, dtype, max_adjust, numerics,
                                     interpret=interpret, seed=seed)
  tol_value, tol_grad = cases.TOLERANCE[dtype]
  assert out.dtype == dtype
  assert cases.relative_error(out, exact[0]) <= tol_value
  for g, ref in zip(grads[:3], exact[1:4]):
    assert cases.relative_error(g, ref) <= tol_grad
  dbias = np.asarray(jnp.asarray(grads[3], jnp.float32))
  assert dbias.shape == case["bias"]
  assert np.all(np.isfinite(dbias))
  assert np.abs(dbias).max() <= tol_grad * np.abs(exact[1]).max()


# --- interpret mode (CPU) ----------------------------------------------------------------------

# Every shared case in bf16 with the default "safe"/"fast"; then the other modes, numerics presets
# and dtypes spread over the cases.
INTERPRET_CHECKS = (
    [(name, bf16, "safe", "fast") for name in cases.CASE_NAMES]
    + [("gqa_causal", bf16, "off", "fast"),
       ("gqa_causal", bf16, "paper", "fast"),
       ("window_lengths", bf16, "paper", "paper"),
       ("bias_mask", bf16, "safe", "paper+fp32o"),
       ("mha", f16, "off", "paper"),
       ("mqa_cross", f16, "safe", "fast+fp32o"),
       ("fully_masked_rows", f16, "paper", "fast"),
       ("causal_T_gt_S", f32, "off", "fast"),
       ("bias_mask", f32, "safe", "fast"),
       ("window_symmetric", f32, "paper", "fast")]
    + [(name, bf16, "safe", "fast") for name in EXTRA]
    + [("bias_row_mask_col", f32, "paper", "fast")]
)


@pytest.mark.parametrize("name,dtype,max_adjust,numerics", INTERPRET_CHECKS,
                         ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-{c[2]}-{c[3]}"
                              for c in INTERPRET_CHECKS])
def test_interpret_matches_exact(name, dtype, max_adjust, numerics):
  _check(_case(name), dtype, max_adjust, numerics, interpret=True, seed=3)


def test_interpret_other_tiles():
  """A different tiling (a single key block per query block, larger dK/dV tiles), passed as the
  static config, agrees too."""
  K = tuning.KernelConfig
  config = tuning.Config(fwd=K(32, 64, 4, 1), dkv=K(32, 16, 4, 1), dq=K(16, 64, 4, 1))
  cases.check_case(IMPL, cases.case_by_name("window_lengths"), bf16, "safe", "fast",
                   interpret=True, seed=4, config=config)
  q = jnp.ones((1, 16, 2, 32), bf16)
  with pytest.raises(ValueError, match="tuning.Config"):
    stable_attn.dot_product_attention(q, q, q, implementation=IMPL, interpret=True,
                                      config=(16, 16))
  with pytest.raises(ValueError, match="explicit implementation"):
    stable_attn.dot_product_attention(q, q, q, config=config)


def test_not_available_on_cpu():
  if jax.default_backend() == "gpu":
    pytest.skip("CPU-only check")
  assert not pallas_gpu.is_available()
  assert stable_attn.default_implementation() != IMPL
  q = jnp.ones((1, 16, 2, 32), bf16)
  with pytest.raises(ValueError, match="pallas_gpu"):
    stable_attn.dot_product_attention(q, q, q, implementation=IMPL)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=[pytest.mark.gpu, on_gpu])])
def test_bad_input_raises(interpret):
  q = jnp.ones((1, 16, 3, 32), bf16)
  kv = jnp.ones((1, 16, 2, 32), bf16)
  with pytest.raises(ValueError, match="divide"):
    stable_attn.dot_product_attention(q, kv, kv, implementation=IMPL, interpret=interpret)
  big = jnp.ones((1, 16, 1, 512), bf16)
  with pytest.raises(ValueError, match="head dim"):
    stable_attn.dot_product_attention(big, big, big, implementation=IMPL, interpret=interpret)
  with pytest.raises(ValueError, match="max_adjust"):
    stable_attn.dot_product_attention(kv, kv, kv, implementation=IMPL, max_adjust="on",
                                      interpret=interpret)


def test_full_block_ranges():
  """The unmasked sub-ranges lie inside the block ranges and hold only fully visible tiles."""
  from stable_attn import blocks, tile
  rng = np.random.default_rng(0)
  for _ in range(60):
    bq, bk = (int(x) for x in rng.choice([16, 32, 64], 2))
    T, S = (int(x) for x in rng.integers(1, 150, 2))
    Tp, Sp = blocks.cdiv(T, 64) * 64, blocks.cdiv(S, 64) * 64
    q_len, kv_len = int(rng.integers(0, T + 1)), int(rng.integers(0, S + 1))
    causal = bool(rng.integers(2))
    window = None if rng.integers(2) else tuple(int(x) for x in rng.integers(0, 70, 2))
    vis = lambda qs, ks: np.asarray(tile.visible(
        qs + np.arange(bq, dtype=np.int32), ks + np.arange(bk, dtype=np.int32), q_len, kv_len,
        causal=causal, window=window))
    for i in range(Tp // bq):
      lo, hi = blocks.kv_block_range(i * bq, bq, bk, Sp // bk, causal=causal, window=window,
                                     kv_len=kv_len)
      flo, fhi = (int(x) for x in blocks.full_kv_range(i * bq, bq, bk, lo, hi, causal=causal,
                                                 window=window, q_len=q_len, kv_len=kv_len,
                                                 has_mask=False))
      assert int(lo) <= flo <= fhi <= int(hi)
      for j in range(flo, fhi):
        assert vis(i * bq, j * bk).all(), (i, j)
    for j in range(Sp // bk):
      lo, hi = blocks.q_block_range(j * bk, bk, bq, Tp // bq, causal=causal, window=window,
                                    q_len=q_len)
      flo, fhi = (int(x) for x in blocks.full_q_range(j * bk, bk, bq, lo, hi, causal=causal,
                                                window=window, q_len=q_len, kv_len=kv_len,
                                                has_mask=False))
      assert int(lo) <= flo <= fhi <= int(hi)
      for i in range(flo, fhi):
        assert vis(i * bq, j * bk).all(), (i, j)


def test_tuning_table():
  for h in (16, 32, 40, 64, 80, 128, 256):
    for dtype in (bf16, f16, f32):
      c = tuning.resolve(h, dtype, 4096, 4096)
      for kc in (c.fwd, c.dkv, c.dq):
        assert kc.block_q >= tuning.MIN_BLOCK and kc.block_k >= tuning.MIN_BLOCK
  small = tuning.resolve(64, bf16, 17, 5)
  assert small.fwd.block_q == 32 and small.fwd.block_k == 16
  with pytest.raises(ValueError):
    tuning.KernelConfig(48, 64, 4, 2)


# --- compiled on the GPU ------------------------------------------------------------------------

GPU_CASES = [
    dict(name="gpt2_causal", B=2, T=512, S=512, N=4, K=4, H=64, is_causal=True),
    dict(name="gqa_long_odd", B=2, T=300, S=333, N=8, K=2, H=128, is_causal=True,
         q_lens=(300, 217), kv_lens=(333, 190)),
    dict(name="cross_window_bias", B=1, T=257, S=513, N=4, K=1, H=64, window=(64, 32),
         bias=(1, 4, 257, 513), mask=(1, 1, 257, 513)),
    dict(name="head96_bias_row", B=2, T=200, S=200, N=2, K=1, H=96, bias=(2, 1, 1, 200)),
]
GPU_CHECKS = (
    [(c["name"], bf16, "safe", "fast") for c in cases.CASES]
    + [(c["name"], (f16, f32)[i % 2], ("off", "paper")[i % 2], "fast")
       for i, c in enumerate(cases.CASES)]
    + [(c["name"], bf16, m, "fast") for c in GPU_CASES for m in ("off", "paper", "safe")]
    + [(c["name"], bf16, "safe", "paper") for c in GPU_CASES]
    + [(c["name"], f32, "safe", "fast") for c in GPU_CASES]
    + [(name, bf16, "paper", "paper+fp32o") for name in EXTRA]
)
GPU = {c["name"]: c for c in GPU_CASES}


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name,dtype,max_adjust,numerics", GPU_CHECKS,
                         ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-{c[2]}-{c[3]}" for c in GPU_CHECKS])
def test_gpu_matches_exact(name, dtype, max_adjust, numerics):
  case = GPU[name] if name in GPU else _case(name)
  _check(case, dtype, max_adjust, numerics, interpret=False, seed=5)


@pytest.mark.gpu
@on_gpu
def test_gpu_default_implementation():
  """pallas_gpu is what implementation=None runs for calls the Hopper kernel does not take (the
  "paper" numerics preset here), and for every call on GPUs other than Hopper."""
  from pallas_kernels import mosaic_gpu
  assert pallas_gpu.is_available()
  hopper = mosaic_gpu.is_available()
  assert stable_attn.default_implementation() == ("pallas_mosaic_gpu" if hopper else IMPL)
  (q, k, v, _, _), kwargs, _ = cases.make_inputs(GPU["gpt2_causal"], bf16, 0)
  kwargs["numerics"] = "paper"
  assert stable_attn.choose_implementation(q, k, v, **kwargs).name == IMPL
  a = stable_attn.dot_product_attention(q, k, v, **kwargs)
  b = stable_attn.dot_product_attention(q, k, v, implementation=IMPL, **kwargs)
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name", ["gqa_long_odd", "cross_window_bias"])
def test_gpu_backward_deterministic(name):
  (q, k, v, bias, mask), kwargs, do = cases.make_inputs(GPU[name], bf16, 1)

  @jax.jit
  def grads(q, k, v, bias):
    f = lambda q, k, v, bias: stable_attn.dot_product_attention(
        q, k, v, bias, mask, implementation=IMPL, **kwargs)
    out, vjp = jax.vjp(f, q, k, v, bias)
    return out, vjp(do)

  first = jax.device_get(grads(q, k, v, bias))
  second = jax.device_get(grads(q, k, v, bias))
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("bias", [False, True])
def test_lowers_for_cuda(bias):
  """The compiled kernels (Triton lowering, not interpret mode) lower on a CPU host for CUDA:
  forward, delta, dK/dV and dQ, with and without the dS output of a bias."""
  from stable_attn.api import Options, canonicalize
  q = jnp.zeros((2, 300, 4, 64), bf16)
  kv = jnp.zeros((2, 300, 2, 64), bf16)
  b = jnp.zeros((1, 1, 1, 300), f32) if bias else None
  spec, ops, _ = canonicalize(q, kv, kv, b, options=Options(is_causal=True))
  config = tuning.resolve(64, bf16, 300, 300, writes_ds=bias)
  # The kernels alone, without the partitioning wrapper: custom_partitioning cannot lower under
  # the abstract mesh that names the GPU on JAX 0.12 (cases.abstract_gpu).
  flash = make_flash_attention(gpu_kernels.forward, gpu_kernels.backward)
  with cases.abstract_gpu():
    text = cases.lower_vjp_for_cuda(lambda o: flash(spec, config, o), ops)
  assert text.count("triton") >= 4
