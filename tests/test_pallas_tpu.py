"""implementation="pallas_tpu" on CPU: TPU interpret mode (pltpu.InterpretParams) and TPU lowering.

What runs here (see docs/tpu_kernel.md): the shared equivalence cases against the exact float64
reference (values and gradients, every max_adjust mode and numerics preset, fp32 and bf16); block
skipping (causal, window, lengths) with several blocks per axis, against both the exact reference
and the blockwise reference with the same block sizes (the same tile math, so nearly bit-equal);
the Pallas -> Mosaic lowering for TPU chips (block shapes, memory spaces, ops), without a TPU;
and bad input. Speed and the Mosaic compiler proper (libtpu) are not exercised here.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

import stable_attn
from stable_attn.api import safe_offsets
from stable_attn import numerics as numerics_lib
from stable_attn import reference
from stable_attn.spec import AttentionSpec, Operands
from stable_attn.flash import make_flash_attention
from tests import cases
from tests.cases import CASES, case_by_name, check_case, relative_error, TOLERANCE

import pallas_kernels.tpu as pallas_tpu
from pallas_kernels.tpu import kernels

IMPL = "pallas_tpu"


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  yield
  # TPU interpret mode keeps global state that an exception inside a kernel leaves behind.
  pltpu.reset_tpu_interpret_mode_state()


# ---------------------------------------------------------------------------------------------
# The shared equivalence suite (default block sizes), in interpret mode
# ---------------------------------------------------------------------------------------------

# Every case in fp32 and in bf16; the (max_adjust, numerics) pairs rotate so that each mode and
# each preset (with and without the fp32 residual) meets several cases in both dtypes.
_MODES = [("safe", "fast"), ("paper", "paper"), ("off", "fast+fp32o"), ("safe", "paper"),
          ("paper", "fast"), ("off", "paper+fp32o")]
_EQUIVALENCE = [
    pytest.param(case["name"], dtype, *mode, id=f"{case['name']}-{dtype.__name__}-{'/'.join(mode)}")
    for dtype, shift in ((jnp.float32, 0), (jnp.bfloat16, 3))
    for index, case in enumerate(CASES)
    for mode in [_MODES[(index + shift) % len(_MODES)]]
]


@pytest.mark.parametrize("name,dtype,max_adjust,numerics", _EQUIVALENCE)
def test_equivalence_interpret(name, dtype, max_adjust, numerics):
  check_case(IMPL, case_by_name(name), dtype, max_adjust, numerics, interpret=True, seed=3)


def test_float16_interpret():
  check_case(IMPL, case_by_name("mha"), jnp.float16, "safe", "fast", interpret=True, seed=4)


def test_equivalence_without_jit():
  check_case(IMPL, case_by_name("gqa_causal"), jnp.bfloat16, "safe", "paper", interpret=True,
             seed=8, jit=False)


# ---------------------------------------------------------------------------------------------
# Block skipping: small blocks, several per axis
# ---------------------------------------------------------------------------------------------

_SKIP_CASES = {
    # causal + GQA + per-batch lengths; bias broadcast over the batch (index map).
    "causal_gqa_lengths": dict(B=2, T=40, S=300, N=4, K=2, H=32, is_causal=True, window=None,
                               q_lens=(40, 29), kv_lens=(300, 150), bias=(1, 4, 40, 300),
                               mask=None, blocks=(16, 128)),
    # a window that skips key blocks on both sides; mask broadcast over batch, heads and queries.
    "window_both_sides": dict(B=1, T=260, S=260, N=2, K=1, H=32, is_causal=False,
                              window=(100, 10), q_lens=None, kv_lens=None, bias=None,
                              mask=(1, 1, 1, 260), blocks=(128, 128)),
    # cross attention T != S; bias broadcast over heads and queries (a (1, bk) block), mask
    # broadcast over heads and keys (a (bq, 1) block: whole query rows).
    "cross_broadcast_bias": dict(B=2, T=24, S=200, N=2, K=1, H=16, is_causal=False, window=None,
                                 q_lens=None, kv_lens=(200, 90), bias=(2, 1, 1, 200),
                                 mask=(2, 1, 24, 1), blocks=(8, 128)),
}


def _skip_inputs(c, dtype, seed):
  rng = np.random.default_rng(seed)
  cast = lambda shape: jnp.asarray(rng.standard_normal(shape), dtype)
  q, k, v = cast((c["B"], c["T"], c["N"], c["H"])), cast((c["B"], c["S"], c["K"], c["H"])), \
      cast((c["B"], c["S"], c["K"], c["H"]))
  d_out = cast((c["B"], c["T"], c["N"], c["H"]))
  bias = None if c["bias"] is None else cast(c["bias"])
  mask = None
  if c["mask"] is not None:
    mask = rng.random(c["mask"]) > 0.25
    mask.reshape(-1)[0] = True
    mask = jnp.asarray(mask)
  lens = lambda x, n: jnp.full((c["B"],), n, jnp.int32) if x is None else jnp.asarray(x, jnp.int32)
  ops = Operands(q=q, k=k, v=v, bias=bias, mask=mask, q_lens=lens(c["q_lens"], c["T"]),
                 kv_lens=lens(c["kv_lens"], c["S"]))
  return ops, d_out


def _offsets_for(spec, ops):
  """max_adjust="safe" takes its per-row offsets as an operand (stable_attn.api.canonicalize adds
  them; these tests build operands by hand)."""
  if spec.max_adjust != "safe":
    return ops
  p_dtype = spec.numerics.dtypes(ops.q.dtype).p
  return ops._replace(offset=safe_offsets(ops.q.shape[2], ops.q.shape[1], p_dtype))


def _grads(fn, ops, d_out):
  def f(q, k, v, bias):
    return fn(ops._replace(q=q, k=k, v=v, bias=bias))
  out, vjp = jax.vjp(jax.jit(f), ops.q, ops.k, ops.v, ops.bias)
  return (out, *vjp(d_out))


@pytest.mark.parametrize("name,dtype,max_adjust,numerics", [
    ("causal_gqa_lengths", jnp.bfloat16, "paper", "paper"),
    ("causal_gqa_lengths", jnp.float32, "safe", "fast"),
    ("window_both_sides", jnp.bfloat16, "safe", "fast+fp32o"),
    ("cross_broadcast_bias", jnp.float32, "off", "paper"),
])
def test_block_skipping(name, dtype, max_adjust, numerics):
  c = _SKIP_CASES[name]
  ops, d_out = _skip_inputs(c, dtype, seed=5)
  spec = AttentionSpec(scale=c["H"] ** -0.5, is_causal=c["is_causal"], window=c["window"],
                       max_adjust=max_adjust, beta=2.0, numerics=numerics_lib.resolve(numerics),
                       interpret=True)
  ops = _offsets_for(spec, ops)
  bq, bk = c["blocks"]
  sizes = kernels.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=bq, block_k_dkv=bk,
                             block_q_dq=bq, block_k_dq=bk)
  config = kernels.resolve_block_sizes(sizes, ops)
  assert (config.bq, config.bk) == (bq, bk)
  assert -(-c["T"] // bq) > 1 and -(-c["S"] // bk) > 1   # several blocks on each axis

  got = _grads(lambda o: pallas_tpu.attention(spec, o, sizes)[0], ops, d_out)
  same_blocks = _grads(lambda o: reference.blockwise_attention(spec, o, block_q=bq, block_k=bk),
                       ops, d_out)
  names = ("out", "dq", "dk", "dv", "dbias")
  # Same tile math, same blocks, same order: equal up to fp32 summation order.
  for n, a, b in zip(names, got, same_blocks):
    if b is None:
      assert a is None
      continue
    assert a.dtype == b.dtype and a.shape == b.shape, n
    err = relative_error(a, np.asarray(jnp.asarray(b, jnp.float32), np.float64))
    assert err < (1e-5 if dtype == jnp.float32 else 1e-3), (n, err)

  exact = reference.exact_attention_vjp(
      ops.q, ops.k, ops.v, d_out, ops.bias, ops.mask, scale=spec.scale, is_causal=c["is_causal"],
      query_seq_lengths=ops.q_lens, key_value_seq_lengths=ops.kv_lens,
      local_window_size=c["window"])
  tol_value, tol_grad = TOLERANCE[dtype]
  for n, a, ref in zip(names, got, exact):
    if ref is not None:
      assert np.all(np.isfinite(np.asarray(a, np.float32))), n
      assert relative_error(a, ref) < (tol_value if n == "out" else tol_grad), n


def test_vmap_interpret():
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((2, 1, 16, 2, 32)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((2, 1, 20, 1, 32)), jnp.float32)
  run = lambda impl, **kw: jax.vmap(lambda q, kv: stable_attn.dot_product_attention(
      q, kv, kv, is_causal=True, implementation=impl, **kw))(q, kv)
  np.testing.assert_allclose(run(IMPL, interpret=True), run("reference"), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The Pallas -> Mosaic lowering for real TPU chips (no TPU needed; libtpu's compiler not run)
# ---------------------------------------------------------------------------------------------

def _tpu_abstract_mesh(device_kind):
  mesh = cases.abstract_mesh(device_kind, 1, "tpu")
  if mesh is None:
    pytest.skip("cannot describe a TPU without one in this JAX")
  return mesh


@pytest.mark.parametrize("device_kind,dtype,max_adjust,numerics,sinks", [
    ("TPU v5 lite", jnp.bfloat16, "safe", "fast", True),
    ("TPU v6 lite", jnp.bfloat16, "paper", "paper+fp32o", False),
    ("TPU v4", jnp.float32, "off", "fast", False),
])
def test_lowers_to_mosaic(device_kind, dtype, max_adjust, numerics, sinks):
  # dQ: default blocks (128 rows: lane-major LSE/delta); dK/dV: 32-row blocks (lane-broadcast).
  B, T, S, N, K, H = 2, 300, 300, 4, 2, 64
  z = lambda *shape: jnp.zeros(shape, dtype)
  ops = Operands(q=z(B, T, N, H), k=z(B, S, K, H), v=z(B, S, K, H), bias=z(1, N, 1, S),
                 mask=jnp.ones((B, 1, T, S), bool), q_lens=jnp.full((B,), T, jnp.int32),
                 kv_lens=jnp.full((B,), S, jnp.int32))
  spec = AttentionSpec(scale=0.125, is_causal=True, window=(64, 0), max_adjust=max_adjust,
                       beta=2.0, numerics=numerics_lib.resolve(numerics), interpret=False)
  sizes = kernels.BlockSizes(block_q=16, block_k=128, block_q_dkv=32, block_k_dkv=256)
  ops = _offsets_for(spec, ops)
  if sinks:   # a whole [N] fp32 array in SMEM, read as a scalar per head
    ops = ops._replace(sinks=jnp.zeros((N,), jnp.float32))

  # The kernels alone, without the partitioning wrapper: custom_partitioning cannot lower under
  # the abstract mesh that names the TPU on JAX 0.12.
  flash = make_flash_attention(kernels._forward, kernels._backward)

  def loss(q, k, v, bias):
    x = ops._replace(q=q, k=k, v=v, bias=bias)
    out, _ = flash(spec, kernels.resolve_block_sizes(sizes, x), x)
    return jnp.sum(out.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(_tpu_abstract_mesh(device_kind)):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(
        ops.q, ops.k, ops.v, ops.bias).lower(lowering_platforms=("tpu",))
  text = lowered.as_text()
  assert text.count("tpu_custom_call") == 3   # forward, dK/dV, dQ


# ---------------------------------------------------------------------------------------------
# Availability and bad input
# ---------------------------------------------------------------------------------------------

def _small(dtype=jnp.float32):
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.standard_normal((1, 16, 2, 32)), dtype)
  kv = jnp.asarray(rng.standard_normal((1, 16, 1, 32)), dtype)
  return q, kv


def test_not_available_without_tpu():
  if jax.default_backend() == "tpu":
    pytest.skip("running on a TPU")
  assert not pallas_tpu.is_available()
  assert stable_attn.default_implementation() != IMPL
  q, kv = _small()
  with pytest.raises(ValueError, match="interpret"):
    stable_attn.dot_product_attention(q, kv, kv, implementation=IMPL)


@pytest.mark.parametrize("sizes,match", [
    (kernels.BlockSizes(block_q=12), "block_q"),
    (kernels.BlockSizes(block_k=64), "block_k"),
    (kernels.BlockSizes(block_k_dq=0), "block_k_dq"),
    (kernels.BlockSizes(block_q_dkv=8), "block_q_dkv"),  # bf16 rows come in 16s
])
def test_bad_block_sizes(sizes, match):
  q, kv = _small(jnp.bfloat16)
  spec = AttentionSpec(scale=0.1, is_causal=False, window=None, max_adjust="safe", beta=2.0,
                       numerics=numerics_lib.FAST, interpret=True)
  ops = _offsets_for(spec, Operands(q=q, k=kv, v=kv, q_lens=jnp.array([16], jnp.int32),
                                    kv_lens=jnp.array([16], jnp.int32)))
  with pytest.raises(ValueError, match=match):
    pallas_tpu.attention(spec, ops, sizes)


@pytest.mark.parametrize("change,match", [
    (lambda q, k, v: (q, k[..., :16], v[..., :16]), "key"),                    # head dims differ
    (lambda q, k, v: (q[:, :, :1], k.repeat(2, axis=2), v.repeat(2, axis=2)), "divide"),  # K > N
    (lambda q, k, v: (q[0, 0], k, v), "rank"),
    (lambda q, k, v: (q.astype(jnp.int32), k, v), "dtype"),
])
def test_bad_input(change, match):
  q, kv = _small()
  q, k, v = change(q, kv, kv)
  with pytest.raises(ValueError, match=match):
    stable_attn.dot_product_attention(q, k, v, implementation=IMPL, interpret=True)


def test_bad_mask_dtype():
  q, kv = _small()
  with pytest.raises(ValueError, match="mask"):
    stable_attn.dot_product_attention(q, kv, kv, mask=jnp.ones((16, 16), jnp.int32),
                                      implementation=IMPL, interpret=True)
