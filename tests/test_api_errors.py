"""Bad input raises ValueError naming the argument."""
import jax
import jax.numpy as jnp
import pytest

import stable_attn

q = jnp.ones((2, 8, 4, 16), jnp.float32) * 0.1
k = jnp.ones((2, 10, 2, 16), jnp.float32) * 0.2


@pytest.mark.parametrize("kwargs, match", [
    (dict(query=q[0, 0]), "query"),
    (dict(key=k[..., :8], value=k[..., :8]), "key"),
    (dict(value=k[:, :9]), "value"),
    (dict(key=jnp.ones((2, 10, 3, 16)), value=jnp.ones((2, 10, 3, 16))), "divide"),
    (dict(query=q.astype(jnp.int32)), "dtype"),
    (dict(query=q.astype(jnp.float8_e4m3fn), key=k.astype(jnp.float8_e4m3fn),
          value=k.astype(jnp.float8_e4m3fn)), "float8_e4m3fn .for FP8 attention pass q, k and v"),
    (dict(key=k.astype(jnp.bfloat16)), "dtype"),
    (dict(bias=jnp.ones((2, 4, 8, 11))), "bias"),
    (dict(mask=jnp.ones((2, 4, 8, 10))), "mask"),
    (dict(mask=jnp.ones((3, 4, 8, 10), bool)), "mask"),
    (dict(query_seq_lengths=jnp.array([1, 2, 3])), "query_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.array([1.0, 2.0])), "key_value_seq_lengths"),
    (dict(local_window_size=(-1, 2)), "local_window_size"),
    (dict(local_window_size="wide"), "local_window_size"),
    (dict(implementation="cudnn"), "implementation"),
    (dict(max_adjust="always"), "max_adjust"),
    (dict(beta=0.5), "beta"),
    (dict(numerics="fp4"), "numerics"),
    # q is [2, 8, ...], k is [2, 10, ...]: T != S.
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), "kv_segment_ids is required"),
    (dict(kv_segment_ids=jnp.zeros((2, 10), jnp.int32)), "without q_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 9), jnp.int32), kv_segment_ids=jnp.zeros((2, 10), jnp.int32)),
     "q_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32), kv_segment_ids=jnp.zeros((1, 10), jnp.int32)),
     "kv_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 8)), kv_segment_ids=jnp.zeros((2, 10), jnp.int32)),
     "q_segment_ids must be an integer"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap"),
    (dict(logits_soft_cap=-3.0), "logits_soft_cap"),
    (dict(logits_soft_cap=float("nan")), "logits_soft_cap"),
    (dict(logits_soft_cap="big"), "logits_soft_cap"),
    # Values a shape check cannot see (concrete arrays only; see test_traced_values_are_not_checked).
    (dict(query_seq_lengths=jnp.array([-1, 2])), "query_seq_lengths must be >= 0"),
    (dict(key_value_seq_lengths=[3, -2]), "key_value_seq_lengths must be >= 0"),
    (dict(sinks=jnp.array([0.0, jnp.nan, 0.0, 0.0])), "sinks must be finite"),
    (dict(sinks=jnp.array([0.0, 0.0, -jnp.inf, 0.0])), "sinks must be finite"),
    (dict(return_residual=True, return_residuals=True), "return_residual .* return_residuals"),
    (dict(deterministic="yes"), "deterministic must be True or False"),
    (dict(deterministic=None), "deterministic must be True or False"),
    (dict(interpret="yes"), "interpret must be True or False"),
    (dict(scale="big"), "scale must be a finite number"),
    (dict(scale=float("nan")), "scale must be a finite number"),
    (dict(query=None), "query must be an array"),
    (dict(key=None), "key must be an array"),
])
def test_bad_input_raises_value_error(kwargs, match):
  args = dict(query=q, key=k, value=k)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    stable_attn.dot_product_attention(args.pop("query"), args.pop("key"), args.pop("value"),
                                      implementation=args.pop("implementation", "reference"),
                                      **args)


def test_traced_values_are_not_checked():
  """Under jit the lengths and sinks are tracers: their values cannot be checked when the call is
  traced, so it must still trace (no error), and a negative length then means 0 (as documented)."""
  lengths = jnp.array([-1, 10])
  run = jax.jit(lambda lengths, sinks: stable_attn.dot_product_attention(
      q, k, k, key_value_seq_lengths=lengths, sinks=sinks, implementation="reference"))
  out = run(lengths, jnp.zeros((4,), jnp.float32))
  assert not jnp.any(out[0]) and jnp.all(jnp.isfinite(out))
  assert bool(jnp.all(jnp.isnan(run(lengths, jnp.full((4,), jnp.nan))[1])))


def test_numerics_fields_are_checked():
  with pytest.raises(ValueError, match="Numerics.acc"):
    stable_attn.Numerics(acc="float64")


def test_unavailable_kernel_raises_clearly_on_cpu():
  with pytest.raises(ValueError, match="pallas_gpu"):
    stable_attn.dot_product_attention(q, k, k, implementation="pallas_gpu")


def test_numerics_with_moved_rounding_points():
  """"PRESET+FIELD=VALUE..." moves rounding points; moving every point in which "paper" differs
  from "fast" gives the fast arithmetic bit for bit; bad specs name what is wrong."""
  from stable_attn.numerics import resolve
  moved = resolve("paper+score=float32")
  assert moved.name == "paper+score=float32" and moved.score == "float32"
  assert moved.replace(name="paper", score="input") == stable_attn.PAPER
  assert resolve("paper+fp32o+out=float32").residual_o == "float32"
  all_moved = "paper+" + "+".join(["score=float32", "pv=float32", "acc=float32", "sum=float32",
                                   "sum_of_rounded_p=false", "out=float32"])
  assert resolve(all_moved).dtypes(jnp.bfloat16) == stable_attn.FAST.dtypes(jnp.bfloat16)
  qb = jnp.asarray(jax.random.normal(jax.random.PRNGKey(0), (1, 40, 2, 16)), jnp.bfloat16)
  attend = lambda nx: stable_attn.dot_product_attention(qb, qb, qb, is_causal=True, numerics=nx,
                                                        implementation="reference")
  assert bool(jnp.all(attend(all_moved) == attend("fast")))
  assert not bool(jnp.all(attend("paper") == attend("fast")))
  for bad, match in [("paper+foo=float32", "'foo' is not a rounding point"),
                     ("paper+score=float64", "Numerics.score"),
                     ("paper+sum_of_rounded_p=yes", "true or false"),
                     ("fastest+score=input", "'fastest' is not a preset")]:
    with pytest.raises(ValueError, match=match):
      resolve(bad)
  with pytest.raises(ValueError, match="numerics"):
    stable_attn.dot_product_attention(q, k, k, numerics="paper+score", implementation="reference")


def test_a_backend_that_fails_to_import_is_passed_over(tmp_path, monkeypatch):
  """A kernel module written against one JAX can fail to import on another with any exception
  (on JAX 0.12 the Hopper kernel's raises KeyError: plgpu.load lost a parameter). That must cost
  only that backend: implementation=None passes over it with the error as its reason, and naming
  it raises ValueError."""
  from stable_attn import backends
  (tmp_path / "broken_backend_for_test.py").write_text(
      "raise KeyError('idx')  # an API that changed shape, met at import time\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  broken = backends.Registration("broken", "broken_backend_for_test")
  monkeypatch.setattr(backends, "REGISTRY", (broken,) + backends.REGISTRY)
  monkeypatch.setattr(backends, "_BY_NAME", {**backends._BY_NAME, "broken": broken})
  choice = stable_attn.choose_implementation(q, k, k)
  assert choice.name == "reference" and "KeyError" in choice.passed_over["broken"]
  assert stable_attn.default_implementation() == "reference"
  with pytest.raises(ValueError, match="implementation='broken' is not available: KeyError"):
    stable_attn.dot_product_attention(q, k, k, implementation="broken")
