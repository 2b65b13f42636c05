"""The Flax adapters inside nnx.MultiHeadAttention and linen.MultiHeadDotProductAttention."""
import chex
import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax import nnx

from stable_attn.flax import make_attention_fn


def _x(seed=0):
  return jax.random.normal(jax.random.key(seed), (2, 12, 32))


@pytest.mark.parametrize("mode", ["off", "safe"])
def test_nnx_matches_flax_default(mode):
  x = _x()
  mask = nnx.make_causal_mask(jnp.ones((2, 12)))   # float mask, as Flax builds it
  ours = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0),
                                attention_fn=make_attention_fn(implementation="reference",
                                                               max_adjust=mode))
  theirs = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0))
  chex.assert_trees_all_close(ours(x, mask=mask), theirs(x, mask=mask), atol=1e-5)


def test_linen_matches_flax_default_values_and_grads():
  x = _x(1)
  mask = nn.make_causal_mask(jnp.ones((2, 12)))
  ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=make_attention_fn(
      implementation="reference"))
  theirs = nn.MultiHeadDotProductAttention(num_heads=4)
  params = ours.init(jax.random.key(2), x, x)
  loss = lambda m: lambda p: jnp.sum(m.apply(p, x, x, mask=mask) ** 2)
  chex.assert_trees_all_close(jax.grad(loss(ours))(params), jax.grad(loss(theirs))(params),
                              atol=1e-4, rtol=1e-4)


def test_dropout_in_training_raises():
  layer = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, dropout_rate=0.1,
                                 rngs=nnx.Rngs(0), attention_fn=make_attention_fn())
  with pytest.raises(ValueError, match="dropout"):
    layer(_x(), deterministic=False)
  layer(_x(), deterministic=True)   # evaluation is fine


def test_unknown_option_raises():
  with pytest.raises(ValueError, match="unknown options"):
    make_attention_fn(dropout=0.1)


def test_segment_ids_pass_through_and_match_a_flax_mask():
  """attention_fn's segment ids give what Flax's own segment mask gives in nnx.MultiHeadAttention
  (Flax cannot pass ids itself, so the ids are bound with functools.partial)."""
  import functools
  x = _x(3)
  ids = jnp.array([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3], jnp.int32)
  fn = make_attention_fn(implementation="reference", is_causal=True)
  with_ids = functools.partial(fn, q_segment_ids=ids, kv_segment_ids=ids)
  mask = nnx.combine_masks(nnx.make_causal_mask(jnp.ones((2, 12))),
                           nnx.make_attention_mask(ids, ids, jnp.equal))
  ours = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0),
                                attention_fn=with_ids)
  theirs = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0))
  chex.assert_trees_all_close(ours(x), theirs(x, mask=mask), atol=1e-5)


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("dropout_deterministic", [False, True])
def test_deterministic_option_is_not_flax_dropout_flag(monkeypatch, fixed, dropout_deterministic):
  """make_attention_fn(deterministic=...) is the backward's determinism; the `deterministic` that
  Flax passes at call time is dropout's. The call-time flag never changes the fixed option."""
  import stable_attn.flax as adapter
  seen = []
  real = adapter.attend
  monkeypatch.setattr(adapter, "attend",
                      lambda *args: seen.append(args[-1].deterministic) or real(*args))
  layer = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0),
                                 attention_fn=make_attention_fn(implementation="reference",
                                                                deterministic=fixed))
  layer(_x(4), deterministic=dropout_deterministic)
  assert seen == [fixed]
