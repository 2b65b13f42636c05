"""The backend registry: names defined once, implementation=None by capability, clear errors."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import stable_attn
from stable_attn import backends

q = jnp.ones((1, 32, 2, 64), jnp.bfloat16)


def test_every_registered_backend_has_the_protocol():
  assert stable_attn.IMPLEMENTATIONS == tuple(r.name for r in backends.REGISTRY)
  for name in stable_attn.IMPLEMENTATIONS:
    module = backends.load(name)
    for fn in ("attention", "is_available", "covers"):
      assert callable(getattr(module, fn)), (name, fn)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU dispatch")
def test_cpu_picks_reference_and_says_why():
  choice = stable_attn.choose_implementation(q, q, q, is_causal=True)
  assert choice.name == "reference" == stable_attn.default_implementation()
  for name in ("pallas_mosaic_gpu", "pallas_gpu", "pallas_tpu"):
    assert "not available" in choice.passed_over[name]
  assert "xla" not in choice.passed_over   # never picked automatically


def test_unknown_implementation_and_stray_config():
  with pytest.raises(ValueError, match="implementation must be None or one of"):
    stable_attn.dot_product_attention(q, q, q, implementation="cuda")
  with pytest.raises(ValueError, match="config needs an explicit implementation"):
    stable_attn.dot_product_attention(q, q, q, config=object())
  with pytest.raises(ValueError, match="takes no config"):
    stable_attn.dot_product_attention(q, q, q, implementation="xla", config=object())


def test_reference_takes_its_block_config():
  from stable_attn.reference import Blocks
  a = stable_attn.dot_product_attention(q, q * 0.5, q, implementation="reference",
                                        config=Blocks(8, 16))
  b = stable_attn.dot_product_attention(q, q * 0.5, q, implementation="reference")
  assert jnp.allclose(a.astype(jnp.float32), b.astype(jnp.float32), atol=1e-2)
  # A mapping of Blocks' fields is those tiles (the others keep their defaults), bitwise.
  c = stable_attn.dot_product_attention(q, q * 0.5, q, implementation="reference",
                                        config={"block_q": 8, "block_k": 16})
  assert bool(jnp.all(c == a))
  with pytest.raises(ValueError, match="block sizes must be positive"):
    Blocks(0, 16)
  # Another backend's config (the Hopper kernel's fp8_backward) is refused by name, not an
  # AttributeError from deep inside the tiling.
  for config in ({"fp8_backward": True}, object()):
    with pytest.raises(ValueError, match="config for implementation='reference' must be"):
      stable_attn.dot_product_attention(q, q, q, implementation="reference", config=config)


def test_flax_adapters_load_lazily():
  code = ("import sys, stable_attn; assert 'flax' not in sys.modules, 'flax imported eagerly'; "
          "fn = stable_attn.flax.make_attention_fn(); assert 'flax' in dir(stable_attn)")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_spec_records_whether_lengths_were_given():
  from stable_attn.api import Options, canonicalize
  lens = jnp.array([20], jnp.int32)
  assert not canonicalize(q, q, q)[0].has_lengths
  assert canonicalize(q, q, q, options=Options(query_seq_lengths=lens))[0].has_lengths
  assert canonicalize(q, q, q, options=Options(key_value_seq_lengths=lens))[0].has_lengths


@pytest.mark.parametrize("shape", [(1, 64, 2, 1, 32), (1, 64, 4, 1, 16), (2, 100, 4, 2, 16)])
def test_reference_gradients_compiled_with_the_forward(shape):
  """jit of grad compiles the reference's forward and backward together. jaxlib 0.10's CPU compiler
  merged their repeated V wrongly where one key/value head serves several query heads in a single
  key block (B1 K1 T64: dQ and dK 160-210% off the xla path's, dV right); the backward keeps its
  operands apart (an optimization barrier). Against implementation="xla" (jax autodiff), fp32."""
  import numpy as np
  B, T, N, K, H = shape
  rng = np.random.default_rng()
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.float32) for n in (N, K, K))
  w = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)

  def grads(impl):
    loss = lambda q, k, v: jnp.sum(stable_attn.dot_product_attention(
        q, k, v, is_causal=True, implementation=impl) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for got, want in zip(grads("reference"), grads("xla")):
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= 1e-5
