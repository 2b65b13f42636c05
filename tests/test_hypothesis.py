"""Shapes drawn by hypothesis: odd lengths, T != S, GQA, head dims 32..128."""
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st

from tests.cases import check_case


@settings(max_examples=12, deadline=None, derandomize=True)
@given(T=st.integers(1, 70), S=st.integers(1, 70), K=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 2]), H=st.sampled_from([32, 64, 128]), causal=st.booleans(),
       mode=st.sampled_from(["off", "paper", "safe"]), seed=st.integers(0, 2**16))
def test_reference_random_shapes(T, S, K, G, H, causal, mode, seed):
  case = dict(name="hypothesis", B=1, T=T, S=S, N=K * G, K=K, H=H, is_causal=causal)
  check_case("reference", case, jnp.float32, mode, "fast", seed=seed)
