"""Numerical hazards never produce NaN: huge logits, fully masked rows, -inf bias, exact ties;
under FP8 numerics too."""
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn.diagnostics import REGIMES, tie_inputs
from stable_attn.reference import exact_attention
from tests import cases

IMPLS = ("reference", "xla")


def _value_and_grads(impl, mode, q, k, v, bias=None, mask=None, **kw):
  f = lambda q, k, v: stable_attn.dot_product_attention(q, k, v, bias, mask, implementation=impl,
                                                        max_adjust=mode, **kw)
  out, vjp = jax.vjp(jax.jit(f), q, k, v)
  return out, vjp(jnp.ones_like(out))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["off", "safe"])
@pytest.mark.parametrize("logit_scale", [1e2, 1e3, 1e4])
def test_huge_logits(impl, mode, logit_scale):
  rng = np.random.default_rng(int(logit_scale))
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
             for s in ((1, 24, 2, 32), (1, 40, 2, 32), (1, 40, 2, 32)))
  out, grads = _value_and_grads(impl, mode, q, k, v, scale=logit_scale, is_causal=True)
  chex.assert_tree_all_finite((out, grads))
  want = exact_attention(q, k, v, scale=logit_scale, is_causal=True)
  err = np.abs(np.asarray(out, np.float64) - want).max()
  assert err < 0.05 * np.abs(want).max()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["off", "paper", "safe"])
def test_fully_masked_rows_and_minus_inf_bias(impl, mode):
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((2, 16, 2, 32), (2, 20, 2, 32), (2, 20, 2, 32)))
  bias = np.where(rng.random((2, 1, 16, 20)) < 0.3, -np.inf, 0.0).astype(np.float32)
  bias[:, :, 4] = -np.inf   # row 4: every key has -inf bias
  mask = np.ones((2, 1, 16, 20), bool)
  mask[:, :, 9] = False     # row 9: fully masked
  out, grads = _value_and_grads(impl, mode, q, k, v, jnp.asarray(bias), jnp.asarray(mask),
                                key_value_seq_lengths=jnp.array([20, 0], jnp.int32))
  chex.assert_tree_all_finite((out, grads))
  np.testing.assert_array_equal(np.asarray(out[:, [4, 9]]), 0.0)
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)   # key length 0: nothing visible
  np.testing.assert_array_equal(np.asarray(grads[0][:, [4, 9]]), 0.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("numerics", ["fast", "paper"])
def test_exact_ties_never_nan(impl, regime, numerics):
  q, k, v = tie_inputs(regime, "split", batch=1, rows=32, keys=256, seed=4)
  modes = ["off", "safe"] + (["paper"] if regime != "large" else [])
  for mode in modes:  # the paper's rule at large maxima is the documented hole (test_probe)
    out, grads = _value_and_grads(impl, mode, q, k, v, numerics=numerics)
    chex.assert_tree_all_finite((out, grads))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("numerics", ["fp8", "fp8_fast"])
@pytest.mark.parametrize("mode", ["off", "safe"])
@pytest.mark.parametrize("hazard", cases.FP8_HAZARDS)
def test_fp8_hazards_never_nan_nor_wrong(impl, numerics, mode, hazard):
  """Under FP8 numerics (e4m3 q, k, v under per-head scales, e4m3 P) each hazard gives finite
  values and gradients within FP8's error of float64 attention of the quantized inputs, and
  zeros where no key is seen (tests.cases.check_fp8_hazard)."""
  q, k, v, kw = cases.fp8_hazard(hazard, seed=zlib.crc32(f"{numerics}{mode}{hazard}".encode()))
  f = lambda q, k, v: stable_attn.dot_product_attention(q, k, v, implementation=impl,
                                                        max_adjust=mode, numerics=numerics, **kw)
  out, vjp = jax.vjp(jax.jit(f), q, k, v)
  cases.check_fp8_hazard(hazard, q, k, v, kw, out, vjp(jnp.ones_like(out)))
