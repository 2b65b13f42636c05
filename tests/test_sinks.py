"""Attention sinks (`sinks=`): one logit per query head in every row's denominator, with no value.

Against the float64 reference with its own VJP (`exact_attention_vjp`, where the sink is one more
score column), for values, the LSE and the gradients of q, k, v, sinks and through the LSE; extreme
sinks give no NaN; bad sinks raise ValueError naming the argument.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn.api import Options, canonicalize
from stable_attn.reference import exact_attention_vjp
from pallas_kernels import mosaic_gpu
from tests.cases import FEATURE_IMPLS, TOLERANCE, relative_error

IMPLS = FEATURE_IMPLS
B, T, S, N, K, H = 2, 40, 48, 4, 2, 32


def _inputs(rng, dtype):
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return draw(B, T, N, H), draw(B, S, K, H), draw(B, S, K, H)


def _run(impl, interpret, q, k, v, sinks, d_out, d_lse, **kwargs):
  """-> ((O, LSE), (dq, dk, dv, dsinks)) for the cotangents (d_out, d_lse)."""
  f = lambda q, k, v, sinks: stable_attn.dot_product_attention(
      q, k, v, sinks=sinks, implementation=impl, interpret=interpret, return_residuals=True,
      **kwargs)
  out, vjp = jax.vjp(jax.jit(f), q, k, v, sinks)
  return out, vjp((d_out, d_lse))


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("max_adjust", ["off", "safe"])
def test_matches_float64_with_own_vjp(impl, interpret, dtype, max_adjust):
  rng = np.random.default_rng()
  q, k, v = _inputs(rng, dtype)
  # Sinks below, around and above the rows' maxima (scores here are ~N(0, 1)).
  sinks = jnp.asarray([-2.0, 0.5, 2.0, 6.0], jnp.float32) + jnp.asarray(rng.normal(0, 0.1, N),
                                                                          jnp.float32)
  kv_lens = jnp.asarray([S, 11], jnp.int32)   # causal: rows 0-10 of batch 1 see few keys
  q_lens = jnp.asarray([T, 30], jnp.int32)    # rows 30+ of batch 1: no key, only the sink
  d_out = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
  d_lse = jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)
  kwargs = dict(is_causal=True, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                max_adjust=max_adjust)
  (out, lse), (dq, dk, dv, dsinks) = _run(impl, interpret, q, k, v, sinks, d_out, d_lse, **kwargs)
  want = exact_attention_vjp(q, k, v, d_out, is_causal=True, query_seq_lengths=q_lens,
                             key_value_seq_lengths=kv_lens, sinks=sinks, d_lse=d_lse)
  tol_value, tol_grad = TOLERANCE[dtype]
  assert out.dtype == dtype and lse.dtype == jnp.float32 and dsinks.dtype == jnp.float32
  assert relative_error(out, want.out) <= tol_value
  # A row with no visible key holds only the sink: O = 0 and LSE = sink.
  np.testing.assert_array_equal(np.asarray(out[1, 30:], np.float32), 0.0)
  np.testing.assert_allclose(np.asarray(lse[1, :, 30:]),
                             np.broadcast_to(np.asarray(sinks)[:, None], (N, T - 30)), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), want.lse, rtol=1e-5, atol=1e-5)
  for name, got, ref in (("dq", dq, want.dq), ("dk", dk, want.dk), ("dv", dv, want.dv),
                         ("dsinks", dsinks, want.dsinks)):
    assert relative_error(got, ref) <= tol_grad, name


@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_extreme_sinks_never_nan(impl, interpret):
  """A sink far above every score takes all the mass (O -> 0); one far below changes nothing."""
  rng = np.random.default_rng()
  q, k, v = _inputs(rng, jnp.bfloat16)
  sinks = jnp.asarray([1e4, -1e4, 80.0, -80.0], jnp.float32)
  d_out = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  d_lse = jnp.ones((B, N, T), jnp.float32)
  (out, lse), grads = _run(impl, interpret, q, k, v, sinks, d_out, d_lse, max_adjust="safe")
  for x in (out, lse) + tuple(grads):
    assert np.all(np.isfinite(np.asarray(x, np.float32)))
  np.testing.assert_array_equal(np.asarray(out[:, :, 0], np.float32), 0.0)
  np.testing.assert_allclose(np.asarray(lse[:, 0]), 1e4, rtol=1e-6)
  plain = stable_attn.dot_product_attention(q, k, v, implementation=impl, interpret=interpret)
  # Equal up to the two programs' rounding: XLA may order the fp32 epilogue differently, and on
  # the CPU its exp may differ by an fp32 ulp between fusions, which can round one bf16 P to the
  # neighbouring value and move an output by 2^-8 * p * |v| / l -- several of O's ulps where O is
  # small (seen in CI: 2.4e-4 at |O| = 0.018). A sink that counted would move O by far more.
  np.testing.assert_allclose(np.asarray(out[:, :, 1], np.float32),
                             np.asarray(plain[:, :, 1], np.float32),
                             rtol=2.0 ** -7, atol=2.0 ** -10)
  # The dominant sink's gradient is dLSE summed over its rows (its P is 1, delta is 0).
  np.testing.assert_allclose(float(grads[3][0]), B * T, rtol=1e-5)


def test_shared_sinks_under_vmap():
  rng = np.random.default_rng()
  q = jnp.asarray(rng.standard_normal((3, B, T, N, H)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((3, B, S, K, H)), jnp.float32)
  sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)

  def grads(impl, **kw):
    f = lambda q, kv, sinks: jnp.sum(jax.vmap(lambda q, kv: stable_attn.dot_product_attention(
        q, kv, kv, sinks=sinks, is_causal=True, implementation=impl, **kw))(q, kv) ** 2)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, kv, sinks)

  for g, r in zip(grads("pallas_gpu", interpret=True), grads("reference")):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5)
  # Sinks that differ along the vmapped axis would have to become per batch row in the kernels.
  per_layer = jnp.asarray(rng.standard_normal((3, N)), jnp.float32)
  with pytest.raises(ValueError, match="vmap over the sinks operand"):
    jax.vmap(lambda q, kv, s: stable_attn.dot_product_attention(
        q, kv, kv, sinks=s, implementation="pallas_gpu", interpret=True))(q, kv, per_layer)


@pytest.mark.parametrize("sinks,match", [
    (np.zeros(3, np.float32), r"sinks must be a floating-point array of shape \[N\]=\(4,\)"),
    (np.zeros((1, 4), np.float32), r"got float32\[1, 4\]"),
    (np.zeros(4, np.int32), r"got int32\[4\]"),
])
def test_bad_sinks_raise(sinks, match):
  q, k, v = _inputs(np.random.default_rng(0), jnp.float32)
  with pytest.raises(ValueError, match=match):
    stable_attn.dot_product_attention(q, k, v, sinks=sinks)


def test_hopper_kernel_covers_sinks():
  q = jnp.zeros((B, T, N, 64), jnp.bfloat16)
  kv = jnp.zeros((B, S, K, 64), jnp.bfloat16)
  spec, ops, _ = canonicalize(q, kv, kv, options=Options(is_causal=True, sinks=jnp.zeros(N)))
  assert mosaic_gpu.covers(spec, ops) is None
