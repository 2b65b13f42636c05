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
  with pytest.raises(ValueError, match="block sizes must be positive"):
    Blocks(0, 16)


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
