"""numerics center_v (issue 49; docs/fp8.md, "V centred"): v less its mean over the keys is what is
quantized to e4m3 and attended, and the mean joins O in fp32 before O's rounding.

Checked against float64 built here from scratch (NumPy means, ml_dtypes' e4m3 cast under the
per-head power-of-two scale): O and the gradients of every jnp backend are the attention of the
centred values plus their mean, rows without a visible key stay 0, a sink takes its share of the
mean, a large mean costs V less quantization error, and the option is refused without FP8 q, k, v.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn import numerics
from stable_attn.reference import exact_attention, exact_attention_vjp
from tests import cases

CENTRED = "fast+qkv=e4m3+center_v=true"   # bf16 P: the centring's own error stands out


def _attended(q, k, v):
  """The float64 values a centred call attends: q, k quantized; v's mean over the keys (per
  batch row, kv head and column) taken out, the rest quantized, the mean added back."""
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  mean = f64(v).mean(axis=1, keepdims=True)
  return cases.numpy_e4m3(f64(q)), cases.numpy_e4m3(f64(k)), cases.numpy_e4m3(f64(v) - mean) + mean


def _inputs(rng, B=2, T=128, N=4, K=2, H=32, v_mean=-2.0):
  """q, k, dO standard normal; v uniform within 0.5 of v_mean, whose bf16 values (none near 0)
  sum exactly in fp32 in any order: the call's mean is the float64 one, bitwise, and so is every
  centred value it quantizes."""
  draw = lambda n: jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.bfloat16)
  v = jnp.asarray(rng.uniform(-0.5, 0.5, (B, T, K, H)) + v_mean, jnp.bfloat16)
  return draw(N), draw(K), v, draw(N)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_gpu"])
def test_center_v_is_the_attention_of_the_centred_values_plus_their_mean(impl):
  """O within bf16's rounding of the float64 attention of the attended values (GQA, causal), and
  dq, dk, dv the float64 gradients there (the centring's and the rounding's derivatives the
  identity); O is not that of v quantized as it is (the plain FP8 call's)."""
  rng = np.random.default_rng()
  q, k, v, d_out = _inputs(rng)
  call = lambda nx: lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, is_causal=True, implementation=impl, numerics=nx, interpret=impl == "pallas_gpu")
  o, pullback = jax.vjp(call(CENTRED), q, k, v)
  aq, ak, av = _attended(q, k, v)
  want = exact_attention_vjp(aq, ak, av, np.asarray(d_out, np.float64), is_causal=True)
  o64 = np.asarray(o, np.float64)
  # bf16 rounds within 2^-8 of a value: each P (the centred O moves by up to 2^-8 of the largest
  # centred |v|), the centred O itself, then O.
  centred = np.abs(av - av.mean(axis=1, keepdims=True)).max()
  bound = 2.0 ** -8 * (2 * centred + np.abs(want.out)) + 1e-6
  assert np.all(np.abs(o64 - want.out) <= bound), np.max(np.abs(o64 - want.out) / bound)
  plain = np.asarray(call("fast+qkv=e4m3")(q, k, v), np.float64)
  assert np.max(np.abs(plain - want.out) / bound) > 1
  for name, g, w in zip("qkv", pullback(d_out), (want.dq, want.dk, want.dv)):
    g = np.asarray(g, np.float64)
    assert np.linalg.norm(g - w) <= 2e-2 * np.linalg.norm(w), name


def test_center_v_leaves_rows_without_keys_at_zero_and_gives_a_sink_its_share():
  """A batch row with no visible key returns 0, not the mean; with a sink, O and every gradient
  (the sink's too, which the mean's share depends on) are the float64 attention with that sink."""
  rng = np.random.default_rng()
  q, k, v, d_out = _inputs(rng, N=2, K=2)
  lens = jnp.asarray([0, 100], jnp.int32)
  o = stable_attn.dot_product_attention(q, k, v, is_causal=True, numerics=CENTRED,
                                        key_value_seq_lengths=lens, implementation="reference")
  aq, ak, av = _attended(q, k, v)
  want = exact_attention(aq, ak, av, is_causal=True, key_value_seq_lengths=np.asarray(lens))
  assert np.all(np.asarray(o[0], np.float32) == 0)
  np.testing.assert_allclose(np.asarray(o[1], np.float64), want[1], atol=2e-2)
  # Asked for, the LSE of those rows is -inf: still no mean there.
  o_res, lse = stable_attn.dot_product_attention(
      q, k, v, is_causal=True, numerics=CENTRED, key_value_seq_lengths=lens,
      implementation="reference", return_residuals=True)
  assert np.all(np.asarray(lse[0]) == -np.inf)
  np.testing.assert_array_equal(np.asarray(o_res, np.float32), np.asarray(o, np.float32))

  sinks = jnp.asarray([1.5, -0.5], jnp.float32)
  call = lambda q, k, v, s: stable_attn.dot_product_attention(
      q, k, v, is_causal=True, numerics=CENTRED, sinks=s, implementation="reference")
  o, pullback = jax.vjp(call, q, k, v, sinks)
  want = exact_attention_vjp(aq, ak, av, np.asarray(d_out, np.float64), is_causal=True,
                             sinks=np.asarray(sinks, np.float64))
  np.testing.assert_allclose(np.asarray(o, np.float64), want.out, atol=2e-2)
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), pullback(d_out),
                        (want.dq, want.dk, want.dv, want.dsinks)):
    g = np.asarray(g, np.float64)
    assert np.linalg.norm(g - w) <= 2e-2 * np.linalg.norm(w), name


def test_center_v_costs_v_less_quantization_error_where_its_mean_is_large():
  """Against the float64 attention of the unquantized inputs, O's error with centring is under
  half the plain FP8 call's where V's columns sit within 0.5 of -2 (e4m3's grid at 2 is 1/4, at
  the centred values' 0.5 it is 1/32)."""
  rng = np.random.default_rng()
  q, k, v, _ = _inputs(rng)
  truth = exact_attention(*(np.asarray(jnp.asarray(x, jnp.float32), np.float64)
                            for x in (q, k, v)), is_causal=True)
  error = {}
  for nx in ("fp8_fast", "fp8_fast+center_v=true"):
    o = stable_attn.dot_product_attention(q, k, v, is_causal=True, numerics=nx,
                                          implementation="reference")
    error[nx] = np.linalg.norm(np.asarray(o, np.float64) - truth) / np.linalg.norm(truth)
  assert error["fp8_fast+center_v=true"] < 0.5 * error["fp8_fast"], error


def test_center_v_needs_fp8_inputs():
  """center_v centres v before its e4m3 quantization: without qkv="e4m3" it is a ValueError
  naming both, as a Numerics and as a preset string."""
  assert numerics.resolve("fp8_fast+center_v=true").center_v is True
  assert numerics.resolve("fp8_fast").center_v is False
  with pytest.raises(ValueError, match="center_v=True needs qkv='e4m3'"):
    numerics.Numerics(center_v=True)
  with pytest.raises(ValueError, match="center_v=True needs qkv='e4m3'"):
    numerics.resolve("fast+center_v=true")
  with pytest.raises(ValueError, match="center_v takes true or false"):
    numerics.resolve("fp8_fast+center_v=yes")


SHARDED = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import stable_attn

B, T, N, K, H = 2, 64, 4, 2, 32
rng = np.random.default_rng({seed})
draw = lambda n, mean=0.0: jnp.asarray(rng.standard_normal((B, T, n, H)) + mean, jnp.bfloat16)
q, k, v, w = draw(N), draw(K), draw(K, -2.0), draw(N)

def loss(q, k, v, strategy="auto"):
  o = stable_attn.dot_product_attention(
      q, k, v, is_causal=True, numerics="fp8_fast+center_v=true", implementation="pallas_gpu",
      interpret=True, context_strategy=strategy)
  return jnp.sum(o.astype(jnp.float32) * w), o

grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
               static_argnames="strategy")
(_, o_ref), g_ref = grad(q, k, v)
rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                         / np.linalg.norm(np.asarray(b, np.float64)))
out = {{}}
mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
for name, spec, strategy in (("batch and heads", P("data", None, "model"), "auto"),
                             ("sequence, alltoall", P("data", "model"), "alltoall"),
                             ("sequence, allgather", P("data", "model"), "allgather")):
  with jax.set_mesh(mesh):
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
    (_, o), g = grad(put(q), put(k), put(v), strategy=strategy)
  out[name] = [rel(o, o_ref)] + [rel(a, b) for a, b in zip(g, g_ref)]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow   # a subprocess on 4 CPU devices (the README's test command stays under 15 min)
def test_center_v_sharded_over_batch_heads_or_sequence_is_the_one_device_call():
  """On 4 CPU devices (an Explicit mesh, pallas_gpu in interpret mode): sharded over batch and
  heads, or over the sequence (context parallel: each device's keys centred by the mean of all),
  O is the one-device call's (to 1e-3: XLA may sum the mean in another order) and so are the
  gradients, to the 1e-2 the context-parallel tests allow (a split sequence's dK and dV sum their
  parts across devices in another order: 2.8e-3 was seen with allgather)."""
  from tests.cases import ROOT, run_on_cpu_devices
  seed = int(np.random.default_rng().integers(1 << 16))
  result = run_on_cpu_devices(SHARDED.format(root=str(ROOT), seed=seed), devices=4)
  for name, (o, *grads) in result.items():
    assert o <= 1e-3 and max(grads) <= 1e-2, (name, seed, o, grads)


def test_center_v_through_the_packed_entry_point_is_the_split_call():
  """dot_product_attention_qkvpacked (the GPT-2 model's default) with center_v: the split call's
  O and gradients, bitwise (FP8 inputs run on the slices; the mean joins O in the same place)."""
  rng = np.random.default_rng()
  q, k, v, d_out = _inputs(rng, N=2, K=2)
  options = dict(is_causal=True, numerics="fp8_fast+center_v=true", implementation="reference")
  o, pullback = jax.vjp(lambda q, k, v: stable_attn.dot_product_attention(q, k, v, **options),
                        q, k, v)
  o_packed, pullback_packed = jax.vjp(
      lambda qkv: stable_attn.dot_product_attention_qkvpacked(qkv, **options),
      jnp.stack([q, k, v], axis=2))
  np.testing.assert_array_equal(np.asarray(o_packed, np.float32), np.asarray(o, np.float32))
  (d_qkv,) = pullback_packed(d_out)
  for i, g in enumerate(pullback(d_out)):
    np.testing.assert_array_equal(np.asarray(d_qkv[:, :, i], np.float32), np.asarray(g, np.float32))
