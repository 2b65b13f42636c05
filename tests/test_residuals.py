"""return_residuals=True: the log-sum-exp, differentiable; and the residuals' checkpoint names."""
import io
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn.flash import RESIDUAL_NAMES
from stable_attn.reference import exact_attention_vjp
from tests.cases import FEATURE_IMPLS, TOLERANCE, on_gpu, relative_error

IMPLS = FEATURE_IMPLS


def _inputs(seed, dtype=jnp.float32, T=24, S=40):
  rng = np.random.default_rng(seed)
  shapes = ((2, T, 4, 32), (2, S, 2, 32), (2, S, 2, 32))
  return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _exact_lse(q, k, v, kv_lens=None):
  """float64 log-sum-exp of the visible scores (-inf for rows without a visible key)."""
  return exact_attention_vjp(q, k, v, np.zeros(q.shape), key_value_seq_lengths=kv_lens).lse


@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_lse_matches_float64(impl, interpret):
  q, k, v = _inputs(0)
  kv_lens = jnp.array([40, 0], jnp.int32)   # the second batch row sees no key
  out, lse = stable_attn.dot_product_attention(
      q, k, v, implementation=impl, interpret=interpret, key_value_seq_lengths=kv_lens,
      return_residuals=True)
  assert lse.shape == (2, 4, 24) and lse.dtype == jnp.float32
  want = _exact_lse(q, k, v, kv_lens=np.asarray(kv_lens))
  np.testing.assert_allclose(np.asarray(lse[0]), want[0], rtol=1e-5)
  assert np.all(np.isneginf(np.asarray(lse[1])))
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)


def _ring(impl, interpret, q, k, v, max_adjust):
  """Attention over all keys, composed from two halves through their log-sum-exps."""
  half = k.shape[1] // 2
  attend = lambda k, v: stable_attn.dot_product_attention(
      q, k, v, implementation=impl, interpret=interpret, max_adjust=max_adjust,
      return_residuals=True)
  (o1, l1), (o2, l2) = attend(k[:, :half], v[:, :half]), attend(k[:, half:], v[:, half:])
  lse = jnp.logaddexp(l1, l2)
  weight = lambda l: jnp.swapaxes(jnp.exp(l - lse), 1, 2)[..., None]   # [B, T, N, 1]
  return weight(l1) * o1.astype(jnp.float32) + weight(l2) * o2.astype(jnp.float32)


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("max_adjust", ["off", "safe"])
def test_ring_identity_values_and_gradients(impl, interpret, max_adjust):
  """Two halves of the keys, combined through their LSEs, give attention over all keys -- values
  and gradients (the gradient flows through the LSE outputs: their backward is delta - dLSE)."""
  q, k, v = _inputs(1)
  full = lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, implementation="reference", max_adjust=max_adjust).astype(jnp.float32)
  ring = lambda q, k, v: _ring(impl, interpret, q, k, v, max_adjust)
  np.testing.assert_allclose(np.asarray(jax.jit(ring)(q, k, v)), np.asarray(full(q, k, v)),
                             rtol=2e-5, atol=2e-6)
  w = jnp.asarray(np.random.default_rng(2).standard_normal((2, 24, 4, 32)), jnp.float32)
  # Jitted: eager, each interpret-mode kernel and jnp op dispatches alone (twice as slow).
  grads = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))
  got, want = grads(ring)(q, k, v), grads(full)(q, k, v)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_mosaic_gpu"])
def test_gpu_lse_and_ring_identity_bf16(impl):
  """Compiled, bf16, at a Hopper-kernel shape: LSE vs float64, and the two-halves composition's
  values and gradients vs float64 attention over all keys."""
  rng = np.random.default_rng()
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  q, k, v, w = draw(2, 256, 4, 64), draw(2, 512, 2, 64), draw(2, 512, 2, 64), draw(2, 256, 4, 64)
  out, lse = stable_attn.dot_product_attention(q, k, v, implementation=impl, return_residuals=True)
  want = exact_attention_vjp(q, k, v, w)
  np.testing.assert_allclose(np.asarray(lse), want.lse, rtol=1e-4, atol=1e-4)
  tol_value, tol_grad = TOLERANCE[jnp.bfloat16]
  ring = lambda q, k, v: _ring(impl, False, q, k, v, "safe")
  assert relative_error(ring(q, k, v), want.out) <= tol_value
  grads = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v) * w.astype(jnp.float32)),
                   argnums=(0, 1, 2))(q, k, v)
  for got, ref in zip(grads, (want.dq, want.dk, want.dv)):
    assert relative_error(got, ref) <= tol_grad


def test_lse_gradient_matches_autodiff_of_the_xla_path():
  """d(sum(lse * w))/dq from the flash backward equals plain autodiff through the XLA path."""
  q, k, v = _inputs(3)
  w = jnp.asarray(np.random.default_rng(4).standard_normal((2, 4, 24)), jnp.float32)
  grads = {}
  for impl in ("reference", "xla"):
    f = lambda q, k, v: jnp.sum(stable_attn.dot_product_attention(
        q, k, v, implementation=impl, is_causal=True, return_residuals=True)[1] * w)
    grads[impl] = jax.grad(f, argnums=(0, 1))(q, k, v)
  for a, b in zip(grads["reference"], grads["xla"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_residuals_are_named_for_remat_policies():
  q, k, v = _inputs(5)

  def saved(policy):
    f = jax.checkpoint(lambda q, k, v: jnp.sum(stable_attn.dot_product_attention(
        q, k, v, implementation="reference") ** 2), policy=policy)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      jax.ad_checkpoint.print_saved_residuals(f, q, k, v)
    return buf.getvalue()

  keep = saved(jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES))
  for name in RESIDUAL_NAMES:
    assert f"named '{name}'" in keep, keep
  assert "named 'attn_out'" not in saved(jax.checkpoint_policies.nothing_saveable)
