"""dot_product_attention_qkvpacked: self-attention on a fused QKV projection, qkv [B, T, 3, N, H].

Every backend returns what dot_product_attention returns on the slices -- values and the gradient
with respect to qkv, bitwise (packing only moves memory) -- and that is float64-close; bad qkv
arrays raise ValueError; the packed table (PackedOperands) describes the same call and is
partitioned over batch and heads like q. The Hopper kernel's packed path (qkv read in place, one
packed gradient) is checked lowered for CUDA in tests/test_pallas_mosaic_gpu.py and compiled there
with -m gpu; the model's packed and split attention in tests/test_train_model.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn.api import Options, canonicalize
from stable_attn.layout import Geometry
from stable_attn.reference import exact_attention
from stable_attn.spec import OPERANDS, PACKED_OPERANDS, QKV_AXES, pack, unpack
from tests.cases import ROOT, run_on_cpu_devices



def _inputs(rng, B=2, T=72, N=4, H=32, dtype=jnp.bfloat16):
  qkv = jnp.asarray(rng.standard_normal((B, T, 3, N, H)), dtype)
  ids = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.05, axis=1), jnp.int32)
  return dict(
      qkv=qkv, bias=jnp.asarray(rng.standard_normal((1, N, T, T)), jnp.float32),
      sinks=jnp.asarray(rng.standard_normal(N), jnp.float32), ids=ids,
      lens=jnp.asarray(rng.integers(T // 2, T + 1, B), jnp.int32),
      w=jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32))


@pytest.mark.parametrize("impl, interpret", [("reference", False), ("xla", False),
                                             ("pallas_gpu", True)])
def test_packed_equals_split(impl, interpret):
  """Values and gradients (qkv, bias, sinks) bitwise equal to dot_product_attention on the
  slices, with a causal mask, segment ids, lengths, a bias, sinks and a soft cap."""
  x = _inputs(np.random.default_rng())
  kw = dict(is_causal=True, q_segment_ids=x["ids"], query_seq_lengths=x["lens"],
            logits_soft_cap=20.0, implementation=impl, interpret=interpret)

  def loss(packed, qkv, bias, sinks):
    if packed:
      o = stable_attn.dot_product_attention_qkvpacked(qkv, bias, sinks=sinks, **kw)
    else:
      o = stable_attn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], bias,
                                            sinks=sinks, **kw)
    return jnp.sum(o.astype(jnp.float32) * x["w"]), o

  grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
  args = (x["qkv"], x["bias"], x["sinks"])
  (_, o_packed), g_packed = grad(True, *args)
  (_, o_split), g_split = grad(False, *args)
  assert g_packed[0].shape == x["qkv"].shape and g_packed[0].dtype == x["qkv"].dtype
  for a, b in zip(jax.tree.leaves((o_packed, g_packed)), jax.tree.leaves((o_split, g_split))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_packed_is_float64_close_unbatched():
  """An unbatched [T, 3, N, H] qkv gives [T, N, H], within bf16 rounding of float64 attention."""
  rng = np.random.default_rng()
  qkv = jnp.asarray(rng.standard_normal((50, 3, 2, 64)), jnp.bfloat16)
  got = stable_attn.dot_product_attention_qkvpacked(qkv, is_causal=True)
  assert got.shape == (50, 2, 64) and got.dtype == jnp.bfloat16
  q, k, v = (np.asarray(qkv[None, :, i], np.float64) for i in range(3))
  want = np.asarray(exact_attention(q, k, v, is_causal=True))[0]
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", [(2, 8, 4, 16), (2, 8, 2, 4, 16), (8, 3, 4), (2, 8, 3, 4, 16, 1)])
def test_bad_qkv_raises(shape):
  with pytest.raises(ValueError, match=r"qkv must be \[B, T, 3, N, H\]"):
    stable_attn.dot_product_attention_qkvpacked(jnp.zeros(shape, jnp.bfloat16))


def test_options_are_checked():
  qkv = jnp.zeros((1, 8, 3, 2, 16), jnp.bfloat16)
  with pytest.raises(TypeError, match="no_such_option"):
    stable_attn.dot_product_attention_qkvpacked(qkv, no_such_option=1)
  with pytest.raises(ValueError, match="max_adjust"):
    stable_attn.dot_product_attention_qkvpacked(qkv, max_adjust="sometimes")


def test_packed_table_is_the_table_with_one_qkv_row():
  """PACKED_OPERANDS: qkv [B, T, 3, N, H] (with a gradient) in place of q, k and v, every other row
  the same; pack / unpack are inverse; the geometry is self-attention's."""
  assert PACKED_OPERANDS["qkv"].axes == QKV_AXES and PACKED_OPERANDS["qkv"].grad
  assert [r for r in PACKED_OPERANDS.rows if r.name != "qkv"] == [
      r for r in OPERANDS.rows if r.name not in ("q", "k", "v")]
  qkv = jnp.asarray(np.random.default_rng().standard_normal((2, 40, 3, 4, 16)), jnp.float32)
  spec, ops, _ = canonicalize(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], None, None,
                              Options(max_adjust="safe"))
  packed = pack(qkv, ops)
  assert Geometry.of(packed) == Geometry.of(ops) == Geometry(2, 40, 40, 4, 4, 16)
  for name in OPERANDS.by_name:
    a, b = getattr(unpack(packed), name), getattr(ops, name)
    assert (a is None) == (b is None), name
    if a is not None:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


SCRIPT = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from stable_attn import reference
from stable_attn.api import Options, canonicalize
from stable_attn.flash import make_flash_attention
from stable_attn.spec import pack, unpack

# The reference's two passes on PackedOperands, partitioned by the table like any backend's.
blocks = reference.Blocks(16, 16)
seen = []
def forward(spec, config, ops):
  seen.append(list(ops.qkv.shape))
  return reference._forward(spec, blocks, unpack(ops))
def backward(spec, config, ops, o, lse, do, dlse=None):
  dq, dk, dv, dbias = reference._backward(spec, blocks, unpack(ops), o, lse, do, dlse)
  return jnp.stack([dq, dk, dv], axis=2), dbias
flash = make_flash_attention(forward, backward, partition=True)

B, T, N, H = 4, 40, 8, 32
rng = np.random.default_rng({seed})
qkv = jnp.asarray(rng.standard_normal((B, T, 3, N, H)), jnp.float32)
sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
w = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)

def terms(qkv, sinks):
  spec, ops, _ = canonicalize(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], None, None,
                              Options(is_causal=True, sinks=sinks))
  o, _ = flash(spec, None, pack(qkv, ops))
  return o * w

def loss(qkv, sinks):
  return jnp.sum(terms(qkv, sinks))

grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
want = grad(qkv, sinks)
mesh = jax.make_mesh((2, 4), ("data", "model"))
put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
args = (put(qkv, "data", None, None, "model"), put(sinks, "model"))
with jax.set_mesh(mesh):
  hlo = grad.lower(*args).compile().as_text()
  got = grad(*args)
print("RESULT" + json.dumps(dict(
    gathers=[c for c in ("all-gather", "all-to-all", "collective-permute") if c in hlo],
    seen=seen, spec=str(got[1][0].sharding.spec),
    diff=[float(jnp.max(jnp.abs(a - b)))
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))],
    scale=[float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(want)],
    loss_l1=float(jnp.sum(jnp.abs(jax.jit(terms)(qkv, sinks)))))))
"""


def test_packed_operands_are_partitioned():
  """On 8 CPU devices, qkv sharded over batch and heads: each device's kernels see their own
  [B/2, T, 3, N/4, H] block, nothing is gathered, the packed gradient keeps qkv's sharding, and
  values and gradients are the unsharded ones (up to the loss sum's order)."""
  seed = int(np.random.default_rng().integers(1 << 16))
  result = run_on_cpu_devices(SCRIPT.format(root=str(ROOT), seed=seed))
  assert result["gathers"] == [], result
  assert [2, 40, 3, 2, 32] in result["seen"], result
  assert "'data'" in result["spec"] and "'model'" in result["spec"], result
  # The loss sums B*T*N*H = 40,960 terms of both signs, in another order when sharded: its
  # rounding scales with the terms' sum of magnitudes (~8,500), not with the cancelled loss (the CI
  # once saw 2.0e-5 against a loss of 1.19); 1e-7 of that sum is under one fp32 epsilon (1.19e-7)
  # of it.
  loss_diff, *grad_diffs = result["diff"]
  assert loss_diff <= 1e-7 * result["loss_l1"], result
  for diff, scale in zip(grad_diffs, result["scale"][1:]):
    assert diff <= 1e-5 * max(scale, 1.0), result
