"""reference and xla against the exact float64 reference: values and gradients, every mode."""
import chex
import jax
import jax.numpy as jnp
import pytest

import stable_attn
from tests.cases import CASE_NAMES, case_by_name, check_case, make_inputs

IMPLS = ("reference", "xla")
MODES = ("off", "paper", "safe")
PRESETS = ("fast", "paper")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_every_case_bf16_safe(impl, case):
  check_case(impl, case_by_name(case), jnp.bfloat16, "safe", "fast", seed=hash(case) % 1000)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("numerics", PRESETS + ("paper+fp32o",))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_reference_modes_numerics_dtypes(mode, numerics, dtype):
  check_case("reference", case_by_name("gqa_causal"), dtype, mode, numerics, seed=7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("numerics", PRESETS)
def test_xla_modes_numerics(mode, numerics):
  check_case("xla", case_by_name("gqa_causal"), jnp.bfloat16, mode, numerics, seed=8)


@pytest.mark.parametrize("case", ["window_lengths", "bias_mask", "fully_masked_rows"])
@pytest.mark.parametrize("mode", MODES)
def test_masks_every_mode_fp32(case, mode):
  check_case("reference", case_by_name(case), jnp.float32, mode, "paper", seed=3)


class TestJitVariants(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_reference_matches_xla(self):
    (q, k, v, bias, mask), kwargs, _ = make_inputs(case_by_name("bias_mask"), jnp.float32, 11)
    fn = self.variant(lambda q, k, v: stable_attn.dot_product_attention(
        q, k, v, bias, mask, implementation="reference", **kwargs))
    want = stable_attn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **kwargs)
    chex.assert_trees_all_close(fn(q, k, v), want, atol=1e-5, rtol=1e-5)


def test_block_sizes_do_not_change_the_result():
  from stable_attn.reference import blockwise_attention
  from stable_attn.api import Options, canonicalize
  (q, k, v, bias, mask), kwargs, _ = make_inputs(case_by_name("window_lengths"), jnp.float32, 5)
  spec, ops, _ = canonicalize(q, k, v, bias, mask, Options(max_adjust="safe", **kwargs))
  outs = [blockwise_attention(spec, ops, block_q=bq, block_k=bk)
          for bq, bk in ((16, 16), (8, 32), (64, 64), (128, 16))]
  for o in outs[1:]:
    chex.assert_trees_all_close(o, outs[0], atol=2e-6, rtol=2e-6)


def test_vmap_over_heads_and_unbatched_inputs():
  (q, k, v, _, _), _, _ = make_inputs(case_by_name("mha"), jnp.float32, 2)
  batched = stable_attn.dot_product_attention(q, k, v, implementation="reference")
  unbatched = jax.vmap(lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, implementation="reference"))(q, k, v)
  chex.assert_trees_all_close(batched, unbatched, atol=1e-6)


def test_default_implementation_on_cpu_is_reference():
  assert stable_attn.default_implementation() == "reference"
