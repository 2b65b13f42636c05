"""Masked calls under jax.debug_infs(True) (issue 24, item 4).

jax.nn masks with a finite value, so its users may run with debug_infs on. Our tile math masked with
-inf, so implementation="xla" (jnp run op by op when not jitted) raised FloatingPointError on every
masked or causal call. Masked scores are now finite (tile.MASKED_SCORE) and no step of the tile
math makes an infinity; the results are unchanged (values checked against float64 here too).
Rows with no visible key keep a finite LSE unless the caller asks for our residual
(return_residuals: -inf there, as documented).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn.reference import exact_attention_vjp

B, T, S, N, H = 2, 24, 24, 2, 16


def _calls(rng):
  mask = rng.random((B, 1, T, S)) < 0.6
  mask[..., 0] = True                 # no empty row (those are tested below)
  mask[:, :, 8:16, 4:20] = False      # runs of masked keys
  mask[:, :, 8:16, 4] = True
  seg = np.repeat(np.arange(3), 8)[None].repeat(B, 0)
  return {
      "mask": dict(mask=mask),
      "causal": dict(is_causal=True),
      "window": dict(local_window_size=(3, 2)),
      "kv_lengths": dict(key_value_seq_lengths=np.array([9, S])),
      "segments": dict(q_segment_ids=seg),
  }


def _check(impl, call, numerics, mode, rng):
  q, k, v, do = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.bfloat16) for _ in range(4))
  kw = {name: jnp.asarray(x) for name, x in call.items() if not isinstance(x, (bool, tuple))}
  kw.update({name: x for name, x in call.items() if isinstance(x, (bool, tuple))})
  f = lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, implementation=impl, numerics=numerics, max_adjust=mode,
      interpret=impl.startswith("pallas"), **kw)
  with jax.debug_infs(True):
    out, vjp = jax.vjp(f, q, k, v)     # eager: every primitive is checked
    grads = vjp(do)
    jax.block_until_ready((out, grads))
  exact = exact_attention_vjp(q, k, v, do, mask=call.get("mask"),
                              is_causal=call.get("is_causal", False),
                              local_window_size=call.get("local_window_size"),
                              key_value_seq_lengths=call.get("key_value_seq_lengths"),
                              q_segment_ids=call.get("q_segment_ids"))
  for got, want in zip((out,) + tuple(grads), (exact.out, exact.dq, exact.dk, exact.dv)):
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.linalg.norm(got - want) < 3e-2 * np.linalg.norm(want)


@pytest.mark.parametrize("call", ["mask", "causal", "window", "kv_lengths", "segments"])
@pytest.mark.parametrize("numerics", ["fast", "paper"])
def test_xla_makes_no_inf(numerics, call):
  rng = np.random.default_rng()
  for mode in ("off", "paper", "safe"):
    _check("xla", _calls(rng)[call], numerics, mode, rng)


# The flash implementations run their tile math inside loops and kernels (one primitive each), so
# debug_infs sees only their wrappers; one call each guards those (eager Pallas is slow).
@pytest.mark.parametrize("impl,call", [("reference", "mask"), ("reference", "kv_lengths"),
                                       ("pallas_gpu", "mask"), ("pallas_tpu", "segments")])
def test_flash_implementations_make_no_inf(impl, call):
  rng = np.random.default_rng()
  _check(impl, _calls(rng)[call], "fast", "safe", rng)


# Rows with no visible key (padded queries, a key length of 0, a fully masked row): their LSE is
# -inf only when the caller asks for our residual (return_residuals); without it, and with jax.nn's
# return_residual (its masked logit, finite in bf16), no infinity is made.
@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_empty_rows(impl):
  rng = np.random.default_rng()
  q, k, v, do = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.bfloat16) for _ in range(4))
  mask = np.ones((B, 1, T, S), bool)
  mask[0, :, 3] = False   # a fully masked row
  kw = dict(implementation=impl, query_seq_lengths=jnp.array([T - 5, T]),
            key_value_seq_lengths=jnp.array([S, 0]), mask=jnp.asarray(mask))
  with jax.debug_infs(True):
    out, vjp = jax.vjp(lambda q, k, v: stable_attn.dot_product_attention(q, k, v, **kw), q, k, v)
    grads = vjp(do)
    _, res = stable_attn.dot_product_attention(q, k, v, return_residual=True, **kw)
    jax.block_until_ready((out, grads, res))
  for rows in (out[0, T - 5:], out[0, 3], out[1]):
    np.testing.assert_array_equal(np.asarray(rows, np.float32), 0.0)
  for g in grads:
    assert np.isfinite(np.asarray(g, np.float32)).all()
  want = jax.nn.dot_product_attention(q, k, v, return_residual=True, **{
      name: x for name, x in kw.items() if name != "implementation"})[1]
  np.testing.assert_array_equal(np.asarray(res[1], np.float32), np.asarray(want[1], np.float32))
  np.testing.assert_array_equal(np.asarray(res[0, 3], np.float32),
                                np.asarray(want[0, 3], np.float32))
  # Asked for: our residual's -inf (outside debug_infs).
  _, lse = stable_attn.dot_product_attention(q, k, v, return_residuals=True, **kw)
  assert np.isneginf(np.asarray(lse[1])).all() and np.isneginf(np.asarray(lse[0, :, 3])).all()
