"""The Pallas implementations partition themselves under jax.sharding (stable_attn.partition).

On 8 CPU devices (a subprocess with --xla_force_host_platform_device_count=8), the pallas_gpu
kernels in interpret mode: q/k/v sharded over ("data", "model") on batch and heads (with a bias,
sinks, segment ids and lengths) compile without any all-gather or all-to-all and give the unsharded
values and gradients, with Auto and with Explicit mesh axes. Head-dim-sharded inputs and head counts
the mesh does not divide raise errors that say so (sequence-sharded ones run context parallel:
tests/test_context_parallel.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from tests.cases import ROOT, run_on_cpu_devices

SCRIPT = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import stable_attn

IMPL = {impl!r}
assert jax.device_count() == 8, jax.devices()
B, T, N, K, H = 4, 40, 8, 4, 32
rng = np.random.default_rng({seed})
normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
q, k, v = normal(B, T, N, H), normal(B, T, K, H), normal(B, T, K, H)
bias = jnp.asarray(rng.standard_normal((1, N, T, T)), jnp.float32)  # broadcast over the batch
ids = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.1, axis=1), jnp.int32)
kv_lens = jnp.asarray(rng.integers(T // 2, T + 1, B), jnp.int32)
sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
w_out = jnp.asarray(rng.standard_normal(H), jnp.float32)
w_lse = jnp.asarray(rng.standard_normal((N, T)), jnp.float32)

def terms(q, k, v, bias, sinks, ids, kv_lens, **kw):
  o, lse = stable_attn.dot_product_attention(
      q, k, v, bias, is_causal=True, q_segment_ids=ids, key_value_seq_lengths=kv_lens, sinks=sinks,
      implementation=IMPL, interpret=True, return_residuals=True, **kw)
  return o.astype(jnp.float32) * w_out, jnp.where(jnp.isfinite(lse), lse, 0) * w_lse

def loss(*args, **kw):
  return sum(jnp.sum(t) for t in terms(*args, **kw))

grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), static_argnames="max_adjust")
args = (q, k, v, bias, sinks, ids, kv_lens)
out = {{}}
for mode in ("auto", "explicit"):
  kind = AxisType.Auto if mode == "auto" else AxisType.Explicit
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  heads = P("data", None, "model", None)
  sharded = (put(q, *heads), put(k, *heads), put(v, *heads), put(bias, None, "model"),
             put(sinks, "model"), put(ids, "data"), put(kv_lens, "data"))
  for max_adjust in ("safe", "off"):
    ref = grad(*args, max_adjust=max_adjust)
    with jax.set_mesh(mesh):
      hlo = grad.lower(*sharded, max_adjust=max_adjust).compile().as_text()
      got = grad(*sharded, max_adjust=max_adjust)
    out[f"{{mode}}_{{max_adjust}}"] = dict(
        gathers=[c for c in ("all-gather", "all-to-all", "collective-permute") if c in hlo],
        max_abs_diff=[float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
                      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))],
        scale=[float(jnp.max(jnp.abs(jnp.asarray(b, jnp.float32)))) for b in jax.tree.leaves(ref)],
        # the loss's terms' sum of magnitudes: what its rounding scales with (it cancels)
        loss_l1=sum(float(jnp.sum(jnp.abs(t))) for t in terms(*args, max_adjust=max_adjust)),
        specs=[str(a.sharding.spec) for a in jax.tree.leaves(got[1])])
  errors = {{}}
  # (A sequence-sharded q runs context parallel: tests/test_context_parallel.py.)
  bad = {{"head_dim": (put(q, "data", None, None, "model"),) + sharded[1:]}}
  mesh8 = jax.make_mesh((1, 8), ("data", "model"), axis_types=(kind, kind))
  put8 = lambda x, *spec: jax.device_put(x, NamedSharding(mesh8, P(*spec)))
  # 8 query heads over 8 devices, but the 4 kv heads cannot follow them
  bad["heads_8_ways"] = (put8(q, None, None, "model"), put8(k), put8(v)) + args[3:]
  for name, a in bad.items():
    try:
      with jax.set_mesh(mesh8 if name == "heads_8_ways" else mesh):
        jax.block_until_ready(grad(*a, max_adjust="safe"))
      errors[name] = None
    except Exception as e:  # Auto mode: our ValueError comes wrapped by the partitioner
      errors[name] = [type(e).__name__, str(e)]
  out[f"{{mode}}_errors"] = errors
print("RESULT" + json.dumps(out))
"""


# pallas_gpu only: pallas_tpu and mosaic_gpu share the partitioning code (flash.make_flash_attention)
# but cannot run it here; the TPU interpreter's io_callbacks cannot be custom-partitioned, and Mosaic
# GPU has no interpreter.
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_gpu"])
def test_sharded_over_batch_and_heads(impl):
  seed = int(np.random.default_rng().integers(1 << 16))
  result = run_on_cpu_devices(SCRIPT.format(root=str(ROOT), impl=impl, seed=seed), timeout=900)
  for mode in ("auto", "explicit"):
    for max_adjust in ("safe", "off"):
      r = result[f"{mode}_{max_adjust}"]
      assert r["gathers"] == [], (mode, max_adjust, r["gathers"])
      # Same kernels on the same rows: only the loss sum's and dbias's cross-device reductions
      # change order (fp32); the loss's rounding scales with its terms' magnitudes, not with the
      # loss, which cancels (tests/test_qkvpacked.py's twin once failed on that).
      loss_diff, *grad_diffs = r["max_abs_diff"]
      assert loss_diff <= 1e-7 * r["loss_l1"] + 1e-6, (mode, max_adjust, r)
      for diff, scale in zip(grad_diffs, r["scale"][1:]):
        assert diff <= 1e-5 * max(scale, 1.0) + 1e-6, (mode, max_adjust, r)
      q_spec, k_spec, v_spec, bias_spec, sinks_spec = r["specs"]
      assert "'data'" in q_spec and "'model'" in q_spec and "'model'" in k_spec
      assert "'model'" in bias_spec and "'model'" in sinks_spec
    errors = result[f"{mode}_errors"]
    assert errors["head_dim"] is not None, mode
    assert "partitions over batch, heads and the sequence" in errors["head_dim"][1], errors
    assert "must divide both N=8 query heads and K=4" in errors["heads_8_ways"][1]
  # Explicit sharding is seen at trace time: a plain ValueError, before anything compiles.
  assert result["explicit_errors"]["head_dim"][0] == "ValueError"


def test_vmap_with_broadcast_bias():
  """vmap over the partitioned kernels folds the vmapped axis into the batch; a vmapped bias that
  broadcasts over the batch gets its gradient summed back to its own shape."""
  rng = np.random.default_rng()
  V, B, T, N, H = 3, 2, 24, 2, 32
  q = jnp.asarray(rng.standard_normal((V, B, T, N, H)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((V, B, T, 1, H)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((V, 1, N, T, T)), jnp.float32)
  shared_bias = jnp.asarray(rng.standard_normal((1, 1, T, T)), jnp.float32)
  d_out = jnp.asarray(rng.standard_normal((V, B, T, N, H)), jnp.float32)

  def run(impl, **kw):
    def one(q, kv, bias):
      return stable_attn.dot_product_attention(q, kv, kv, bias + shared_bias, is_causal=True,
                                               implementation=impl, **kw)
    f = lambda q, kv, bias: jnp.sum(jax.vmap(one)(q, kv, bias) * d_out)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, kv, bias)

  got, ref = run("pallas_gpu", interpret=True), run("reference")
  for g, r in zip(got, ref):
    assert g.shape == r.shape
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-4, rtol=2e-4)


REPLICATED_PER_HEAD = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import stable_attn
rng = np.random.default_rng({seed})
B, T, N, K, H = 2, 64, 4, 2, 32
q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.float32) for n in (N, K, K))
bias = jnp.asarray(rng.standard_normal((1, N, T, T)), jnp.float32)
sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
w = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
out = {{}}
for impl in ("reference", "xla", "pallas_gpu"):
  def loss(q, k, v, bias, sinks):
    o = stable_attn.dot_product_attention(q, k, v, bias, is_causal=True, sinks=sinks,
                                          implementation=impl, interpret=impl == "pallas_gpu")
    return jnp.sum(o * w)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  want = grad(q, k, v, bias, sinks)
  with jax.set_mesh(mesh):
    heads = NamedSharding(mesh, P("data", None, "model"))
    put = lambda x, s: jax.device_put(x, s)
    got = grad(put(q, heads), put(k, heads), put(v, heads),
               put(bias, NamedSharding(mesh, P())), put(sinks, NamedSharding(mesh, P())))
  out[impl] = dict(
      rel=[float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) for g, r in zip(got, want)],
      specs=[str(jax.typeof(g).sharding.spec) for g in got])
print("RESULT" + json.dumps(out))
"""


def test_explicit_heads_split_with_replicated_per_head_operands():
  """On Explicit mesh axes with the heads split and the sinks and bias replicated (what a model
  holding them as whole parameters passes), every backend runs, each gradient comes back split as
  its operand is, and the values are the one-device call's. Before, the kernels' custom VJP refused
  the sinks' gradient (split over the heads, while the sinks were not: flash._like), and the jnp
  backends (reference, the default on a CPU, and xla) failed in jnp.repeat and their per-head
  vmaps; they now run under a shard_map over batch and heads (partition.on_explicit_axes)."""
  seed = int(np.random.default_rng().integers(1 << 16))
  result = run_on_cpu_devices(REPLICATED_PER_HEAD.format(seed=seed), devices=4)
  for impl, r in result.items():
    assert max(r["rel"]) <= 1e-5, (impl, seed, r)
    heads = "P('data', None, 'model', None)"
    assert r["specs"] == [heads] * 3 + ["P(None, None, None, None)", "P(None,)"], (impl, r)


PART_OF_AN_AXIS = r"""
import json, sys, warnings
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import stable_attn

B, T, D, N, H = 2, 48, 64, 2, 32
rng = np.random.default_rng({seed})
x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
w = jnp.asarray(rng.standard_normal((3, D, N * H)) / 8, jnp.float32)
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

def attend(x, w):
  q, k, v = (jnp.einsum("btd,de->bte", x, w[i]).reshape(B, T, N, H) for i in range(3))
  return stable_attn.dot_product_attention(q, k, v, is_causal=True, implementation="pallas_gpu",
                                           interpret=True)

def loss(x, w):
  return jnp.sum(jnp.sin(attend(x, w)))

f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
want = f(x, w)
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  # FSDP: the projections' output dim N*H split over the 4 devices of "data"
  got = f(x, jax.device_put(w, NamedSharding(mesh, P(None, None, "data"))))
texts = sorted({{str(c.message) for c in caught if c.category is RuntimeWarning}})
# The loss sums B*T*N*H terms of either sign, so its rounding scales with their magnitudes, not
# with |loss| (which cancellation can make small): its scale is the sum of |terms|.
terms = jax.jit(lambda x, w: jnp.sum(jnp.abs(jnp.sin(attend(x, w)))))(x, w)
print("RESULT" + json.dumps(dict(
    diff=[float(jnp.max(jnp.abs(a - b)))
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))],
    scale=[float(terms)] + [float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(want)[1:]],
    warnings=texts)))
"""


@pytest.mark.slow
def test_a_dim_split_by_part_of_a_mesh_axis():
  """FSDP weights [D, N*H] split over a 4-device axis, reshaped to N=2 heads x H: XLA splits heads
  over half of the devices and the head dim over the other half, which no PartitionSpec names. The
  ops decode shardings themselves (JAX's decoding raised IndivisibleError inside XLA: an INTERNAL
  error here, a segfault seen on GPUs), take such an operand whole on each device, and say so once
  (one text for every operand); values and gradients are those of the unsharded call."""
  seed = int(np.random.default_rng().integers(1 << 16))
  result = run_on_cpu_devices(PART_OF_AN_AXIS.format(root=str(ROOT), seed=seed), devices=4,
                              timeout=900)
  for diff, scale in zip(result["diff"], result["scale"]):
    assert diff <= 1e-5 * max(scale, 1.0), result
  assert len(result["warnings"]) == 1, result["warnings"]
  assert "by part of an axis of the mesh {'data': 4}" in result["warnings"][0]
