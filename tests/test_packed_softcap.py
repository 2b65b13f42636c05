"""Packed sequences (segment ids) and logit soft-capping, in every implementation that runs here.

The float64 reference with its own VJP (`stable_attn.reference.exact_attention_vjp`) is checked in
tests/cases.py's "packed_*" and "softcap_*" cases for every implementation; this file checks the
properties: a packed row equals its documents run alone, a query whose segment has no key gives 0
and zero gradients, and the soft cap bounds the logits without NaN.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn.reference import exact_attention
from tests.cases import FEATURE_IMPLS

# (implementation, interpret mode): the Pallas kernels run interpreted on a CPU.
IMPLS = FEATURE_IMPLS
DOCS = (7, 20, 1, 12)   # document lengths packed into one row of 40


def _attention(impl, interpret, max_adjust="safe", **kwargs):
  return lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, implementation=impl, interpret=interpret, max_adjust=max_adjust, **kwargs)


def _value_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(jax.jit(fn), q, k, v)
  return (out, *vjp(do))


# Every mode on the reference, the default mode on the others.
PACKED = ([("reference", False, mode) for mode in ("off", "paper")]
          + [pytest.param(*getattr(p, "values", p), "safe", marks=getattr(p, "marks", ()))
             for p in IMPLS])


@pytest.mark.parametrize("impl,interpret,max_adjust", PACKED)
def test_packed_row_equals_documents_run_alone(impl, interpret, max_adjust):
  rng = np.random.default_rng(sum(DOCS) + len(max_adjust))
  T = sum(DOCS)
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                 for s in ((1, T, 2, 32), (1, T, 1, 32), (1, T, 1, 32), (1, T, 2, 32)))
  segments = jnp.asarray(np.repeat(np.arange(len(DOCS)), DOCS)[None], jnp.int32)
  packed = _value_and_grads(_attention(impl, interpret, max_adjust, is_causal=True,
                                       q_segment_ids=segments), q, k, v, do)
  start = 0
  for n in DOCS:
    doc = slice(start, start + n)
    alone = _value_and_grads(_attention(impl, interpret, max_adjust, is_causal=True),
                             q[:, doc], k[:, doc], v[:, doc], do[:, doc])
    for got, want in zip(packed, alone):
      np.testing.assert_allclose(np.asarray(got[:, doc]), np.asarray(want), rtol=2e-5,
                                 atol=2e-6)
    start += n


@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_query_segment_without_keys_is_zero(impl, interpret):
  rng = np.random.default_rng(1)
  q, do = (jnp.asarray(rng.standard_normal((2, 24, 2, 32)), jnp.bfloat16) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((2, 40, 2, 32)), jnp.bfloat16) for _ in range(2))
  q_seg = np.zeros((2, 24), np.int32)
  q_seg[:, 10:17] = 5          # no key has id 5
  q_seg[:, 17:] = 1
  kv_seg = np.zeros((2, 40), np.int32)
  kv_seg[:, 25:] = 1
  out, dq, dk, dv = _value_and_grads(
      _attention(impl, interpret, q_segment_ids=jnp.asarray(q_seg),
                 kv_segment_ids=jnp.asarray(kv_seg)), q, k, v, do)
  chex.assert_tree_all_finite((out, dq, dk, dv))
  np.testing.assert_array_equal(np.asarray(out[:, 10:17], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(dq[:, 10:17], np.float32), 0.0)
  want = exact_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
  assert err < 2e-2


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("max_adjust", ["off", "safe"])
def test_soft_cap_tames_huge_logits(impl, interpret, max_adjust):
  """With scale 1e3 the raw logits reach ~1e4; capped at 30 they stay in [-30, 30], every value
  and gradient is finite and matches the float64 reference of the capped logits."""
  rng = np.random.default_rng(2)
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                 for s in ((1, 32, 2, 32), (1, 48, 2, 32), (1, 48, 2, 32), (1, 32, 2, 32)))
  kwargs = dict(scale=1e3, is_causal=True, logits_soft_cap=30.0)
  out, *grads = _value_and_grads(_attention(impl, interpret, max_adjust, **kwargs), q, k, v, do)
  chex.assert_tree_all_finite((out, grads))
  want = exact_attention(q, k, v, **kwargs)
  err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
  assert err < 2e-2


def test_large_cap_is_no_cap():
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 32)), jnp.float32) for _ in range(3))
  capped = stable_attn.dot_product_attention(q, k, v, implementation="reference",
                                             logits_soft_cap=1e6)
  plain = stable_attn.dot_product_attention(q, k, v, implementation="reference")
  np.testing.assert_allclose(np.asarray(capped), np.asarray(plain), rtol=1e-5, atol=1e-6)
