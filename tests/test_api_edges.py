"""Edges of the API where jax.nn answers and we must answer the same: windows wider than the
sequence (no window: 2**31 - 9 once wrapped round int32 and returned zeros), and empty attention
(T, S or H = 0: an empty output, or zeros where there are no keys)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn

# Implementations that run on a CPU: (name, interpret).
CPU = [("reference", False), ("xla", False), ("pallas_gpu", True), ("pallas_tpu", True)]
WIDE = [2 ** 31 - 9, 2 ** 31 - 63, 2 ** 31 - 319, 10 ** 12]


def _normal(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("implementation, interpret", CPU)
def test_windows_wider_than_the_sequence_are_no_window(implementation, interpret):
  rng = np.random.default_rng()
  T, S = (8, 8) if interpret else (300, 280)
  q, k, v = _normal(rng, 2, T, 2, 32), _normal(rng, 2, S, 1, 32), _normal(rng, 2, S, 1, 32)
  # Where each length first failed (2**31 - 63 at T = 8, - 319 at T = 300), and far past int64.
  windows = [WIDE[1]] if interpret else [max(T, S), WIDE[2], WIDE[3]]
  attend = lambda **kw: stable_attn.dot_product_attention(
      q, k, v, implementation=implementation, interpret=interpret, **kw)
  for causal in (False, True):
    want = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    plain = attend(is_causal=causal)
    for w in windows:
      window = (w, 0) if causal else w   # an int is (w, w)
      got = attend(is_causal=causal, local_window_size=window)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(plain),
                                    err_msg=f"{implementation} window {window} causal {causal}")
    np.testing.assert_allclose(np.asarray(plain), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("numerics", ["fast", "fp8_fast+center_v=true"])
@pytest.mark.parametrize("shapes", [dict(T=0), dict(S=0), dict(H=0)], ids=lambda s: str(s))
def test_empty_attention_matches_jax_nn(shapes, numerics):
  """An empty output where T or H is 0, zeros (with zero gradients) where S is 0, as jax.nn;
  with S = 0 every row has no key: its LSE is -inf, or its sink's logit. FP8 numerics too (their
  per-head amax and v's mean over no values: 0, not an error or NaN)."""
  rng = np.random.default_rng()
  B, T, S, N, K, H = 2, 5, 6, 4, 2, 8
  dims = {"T": T, "S": S, "H": H, **shapes}
  q = _normal(rng, B, dims["T"], N, dims["H"])
  k, v = _normal(rng, B, dims["S"], K, dims["H"]), _normal(rng, B, dims["S"], K, dims["H"])
  want = jax.nn.dot_product_attention(q, k, v, is_causal=dims["T"] == dims["S"])
  for implementation in ("reference", "xla", None):
    got = stable_attn.dot_product_attention(q, k, v, is_causal=dims["T"] == dims["S"],
                                            implementation=implementation, numerics=numerics)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  call = lambda q, k, v: stable_attn.dot_product_attention(q, k, v, numerics=numerics)
  grads = jax.grad(lambda q, k, v: jnp.sum(call(q, k, v) * 3.0),
                   argnums=(0, 1, 2))(q, k, v)
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and not np.any(np.asarray(g))
  if dims["H"] == 0:
    with pytest.raises(ValueError, match="head dim H=0"):
      stable_attn.dot_product_attention(q, k, v, numerics=numerics, return_residuals=True)
    return
  _, lse = stable_attn.dot_product_attention(q, k, v, numerics=numerics, return_residuals=True)
  assert lse.shape == (B, N, dims["T"]) and np.all(np.asarray(lse) == -np.inf)
  sinks = _normal(rng, N)
  o, lse = stable_attn.dot_product_attention(q, k, v, sinks=sinks, numerics=numerics,
                                             return_residuals=True)
  np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(np.asarray(sinks)[None, :, None],
                                                                 lse.shape))
  assert not np.any(np.asarray(o))
  with pytest.raises(ValueError, match="implementation must be None or one of"):
    stable_attn.dot_product_attention(q, k, v, implementation="cudnn")
