"""Context parallelism: a sequence-sharded call (stable_attn.partition, allgather and ring).

Each device holds T / n consecutive queries and sees every key; its kernels take the q_shift
operand (where its rows stand among the keys). Checked here:
- one device: a call on rows [t0, t0 + C) with q_shift = t0 gives the full call's rows of O and
  LSE bitwise, and its rows of dQ (same kernels, same key blocks in the same order), on every
  backend that takes q_shift; the TPU kernels refuse it.
- 8 CPU devices (slow; a subprocess): the Pallas kernels (pallas_gpu in interpret mode) over a
  data x sequence mesh (and a heads x sequence one), Auto and Explicit axes, split and packed q,
  k, v, contiguous and zigzag orders: values and gradients
  equal the unsharded call -- O, LSE and dQ bitwise; dK and dV within one bf16 rounding of each
  device's share (each device's kernel rounds its share to bf16 before the fp32 sum over the
  devices; the one-device kernel sums every query block in fp32 and rounds once). The ring
  strategy within bf16 rounding: each step's O rounded before the fp32 merge, each step's share
  of dQ, dK, dV rounded before the fp32 sums.
- tile.merge_blocks (the ring's merge) against attention over all keys; the ring's refusals.
- 4 CPU devices (slow): alltoall's compiled fwd+bwd trades no O residual (11 row-sized
  all-to-alls on Auto axes, 8 on Explicit ones); the sinks' gradient under every strategy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn import api, backends, context, tile
from tests.cases import ROOT, run_on_cpu_devices


def _case(rng):
  """A random small call: causal or windowed, GQA, packed documents, "safe"."""
  B, T, N, K, H = 2, 64, 4, 2, 32
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  ids = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.05, axis=1), jnp.int32)
  masks = [dict(is_causal=True),
           dict(is_causal=True, local_window_size=(int(rng.integers(8, 30)), 0)),
           dict(local_window_size=(int(rng.integers(4, 20)), int(rng.integers(4, 20))))]
  kw = masks[rng.integers(len(masks))]
  return (normal(B, T, N, H), normal(B, T, K, H), normal(B, T, K, H)), dict(
      kw, q_segment_ids=ids, kv_segment_ids=ids,
      query_seq_lengths=jnp.asarray(rng.integers(T // 2, T + 1, B), jnp.int32))


def _rows(ops, t0: int, size: int):
  """ops for query rows [t0, t0 + size): what a context-parallel device's kernels get."""
  rows = slice(t0, t0 + size)
  return ops._replace(q=ops.q[:, rows], q_seg=None if ops.q_seg is None else ops.q_seg[:, rows],
                      offset=ops.offset[:, rows],
                      q_lens=jnp.clip(ops.q_lens - t0, 0, size),
                      q_shift=jnp.full(ops.q_lens.shape, t0, jnp.int32))


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_gpu"])
def test_shifted_rows_equal_the_full_call(impl):
  rng = np.random.default_rng()
  (q, k, v), kw = _case(rng)
  options = api.Options(implementation=impl, interpret=impl == "pallas_gpu", **kw)
  spec, ops, _ = api.canonicalize(q, k, v, options=options)
  run = lambda ops: backends.run(impl, spec, ops)
  o_full, lse_full = run(ops)
  d_out = jnp.asarray(rng.standard_normal(o_full.shape), jnp.float32)
  grad = lambda ops: jax.grad(lambda q: jnp.sum(run(ops._replace(q=q))[0] * d_out[:, :q.shape[1]]))
  dq_full = grad(ops)(ops.q)
  size = 32
  t0 = size   # the second half of the rows
  rows = slice(t0, t0 + size)
  local = _rows(ops, t0, size)
  o, lse = run(local)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_full[:, rows], np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_full[:, :, rows]))
  dq = jax.grad(lambda q: jnp.sum(run(local._replace(q=q))[0] * d_out[:, rows]))(local.q)
  if impl == "xla":   # autodiff of a differently shaped program: XLA may reorder its sums
    np.testing.assert_allclose(np.asarray(dq, np.float32), np.asarray(dq_full[:, rows], np.float32),
                               atol=2e-2, rtol=2e-2)
  else:
    np.testing.assert_array_equal(np.asarray(dq, np.float32),
                                  np.asarray(dq_full[:, rows], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_hopper_shifted_rows_equal_the_full_call(head_dim):
  """The compiled Hopper kernels: rows [t0, t0 + C) with q_shift = t0 give the full call's O, LSE
  and dQ bitwise (C a multiple of every block size, so the rows' key blocks are the same)."""
  mosaic = pytest.importorskip("pallas_kernels.mosaic_gpu")
  if not mosaic.is_available():
    pytest.skip("needs a Hopper GPU")
  rng = np.random.default_rng()
  B, T, N, K = 2, 1536, 4, 2
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v = normal(B, T, N, head_dim), normal(B, T, K, head_dim), normal(B, T, K, head_dim)
  ids = jnp.asarray(np.cumsum(rng.random((B, T)) < 4 / T, axis=1), jnp.int32)
  for kw in (dict(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids),
             dict(is_causal=True, local_window_size=(300, 0)),
             dict(local_window_size=(200, 100), query_seq_lengths=jnp.asarray([1000, 1536]))):
    spec, ops, _ = api.canonicalize(q, k, v, options=api.Options(
        implementation="pallas_mosaic_gpu", **kw))
    run = jax.jit(lambda ops: backends.run("pallas_mosaic_gpu", spec, ops))
    o_full, lse_full = run(ops)
    d_out = normal(B, T, N, head_dim)
    dq_of = jax.jit(lambda ops, d: jax.grad(lambda q: jnp.sum(
        (run(ops._replace(q=q))[0] * d).astype(jnp.float32)))(ops.q))
    dq_full = dq_of(ops, d_out)
    size = 384
    for t0 in (384, 1152):
      rows = slice(t0, t0 + size)
      local = _rows(ops, t0, size)
      o, lse = run(local)
      context = (head_dim, sorted(kw), t0)
      np.testing.assert_array_equal(np.asarray(o, np.float32),
                                    np.asarray(o_full[:, rows], np.float32), err_msg=str(context))
      np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_full[:, :, rows]))
      np.testing.assert_array_equal(np.asarray(dq_of(local, d_out[:, rows]), np.float32),
                                    np.asarray(dq_full[:, rows], np.float32), err_msg=str(context))


def test_zigzag_order_puts_chunks_d_and_2n_minus_1_minus_d_on_device_d():
  rng = np.random.default_rng()
  n = int(rng.integers(1, 5))
  size = int(rng.integers(1, 4))
  x = jnp.arange(2 * n * size * 3).reshape(1, 2 * n * size, 3)
  z = context.zigzag(x, n)
  np.testing.assert_array_equal(context.unzigzag(z, n), x)
  shards = np.split(np.asarray(z[0, :, 0]) // 3, n)   # each device's positions
  for d, positions in enumerate(shards):
    runs = context.device_chunks("zigzag", 2 * size, n, d)
    assert len(runs) == (2 if n > 1 else 1)
    for run in runs:   # each run: consecutive positions from its shift on
      np.testing.assert_array_equal(positions[run.start:run.stop],
                                    run.shift + np.arange(run.stop - run.start))
  with pytest.raises(ValueError, match="multiple of"):
    context.zigzag(jnp.zeros((1, 2 * n * size + 1)), n)


def test_zigzag_refusals_name_the_argument():
  q = jnp.zeros((1, 8, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match="context_layout must be one of"):
    stable_attn.dot_product_attention(q, q, q, context_layout="striped")
  with pytest.raises(ValueError, match="takes no bias or mask"):
    stable_attn.dot_product_attention(q, q, q, jnp.zeros((8, 8)), context_layout="zigzag",
                                      implementation="pallas_gpu", interpret=True)
  # XLA partitions the jnp backends, as if the order were natural: refused, not silently wrong.
  for impl in ("reference", "xla", None):
    with pytest.raises(ValueError, match="knows nothing of the order"):
      stable_attn.dot_product_attention(q, q, q, context_layout="zigzag", implementation=impl)


@pytest.mark.parametrize("strategy", ["ring", "alltoall"])
def test_strategy_refusals_name_the_argument(strategy):
  q = jnp.zeros((1, 8, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match="context_strategy must be one of"):
    stable_attn.dot_product_attention(q, q, q, context_strategy="tree")
  with pytest.raises(ValueError, match=f"context_strategy='{strategy}' takes no bias or mask"):
    stable_attn.dot_product_attention(q, q, q, mask=jnp.ones((8, 8), bool),
                                      context_strategy=strategy, implementation="pallas_gpu",
                                      interpret=True)
  for impl in ("reference", "xla"):
    with pytest.raises(ValueError, match="chooses its own collectives"):
      stable_attn.dot_product_attention(q, q, q, context_strategy=strategy, implementation=impl)
  # "auto" (the default) is no refusal: with a bias it runs allgather; XLA's backends take it.
  o = stable_attn.dot_product_attention(q, q, q, jnp.zeros((8, 8)), implementation="xla")
  assert o.shape == q.shape


def test_auto_strategy_is_alltoall_where_heads_divide():
  rng = np.random.default_rng()
  ways = int(rng.choice([2, 4, 8]))
  kv = ways * int(rng.integers(1, 4))
  heads = kv * int(rng.integers(1, 4))
  assert context.choose_strategy("auto", heads, kv, ways) == "alltoall"
  assert context.choose_strategy("auto", heads, kv, ways, bias=True) == "allgather"
  assert context.choose_strategy("auto", heads, kv, 2 * heads) == "allgather"
  assert context.choose_strategy("auto", 2 * ways, ways // 2, ways) == "allgather"   # GQA groups
  for named in ("allgather", "ring", "alltoall"):
    assert context.choose_strategy(named, heads, kv, 2 * heads, bias=True) == named


def test_merge_blocks_equals_attention_over_all_keys():
  """tile.merge_blocks, the ring's merge: key blocks' own (O, LSE) -> attention over all keys,
  sinks joined once; a row that sees no key of any block gets O = 0 and LSE = EMPTY_ROW_LSE (or
  the sink), never NaN."""
  rng = np.random.default_rng()
  B, T, S, N, H = 2, 8, 24, 2, 16
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = normal(B, T, N, H), normal(B, S, N, H), normal(B, S, N, H)
  mask = rng.random((B, 1, T, S)) < 0.5
  a, b = sorted(rng.choice(np.arange(1, S), 2, replace=False))
  mask[:, :, 0] = False                 # row 0 sees nothing at all
  mask[:, :, 1, a:] = False             # row 1 only the first block
  sinks = normal(N)
  run = lambda cols, **kw: backends.run("reference", *api.canonicalize(
      q, k[:, cols], v[:, cols], mask=jnp.asarray(mask[..., cols]),
      options=api.Options(implementation="reference", **kw))[:2])
  blocks = [run(slice(0, a)), run(slice(a, b)), run(slice(b, S))]
  for sink in (None, sinks):
    o, lse = tile.merge_blocks([o for o, _ in blocks], [l for _, l in blocks], sink=sink)
    want_o, want_lse = run(slice(0, S), sinks=sink)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6)
    assert np.all(np.asarray(o)[:, 0] == 0)
    no_keys = np.float32(tile.EMPTY_ROW_LSE) if sink is None else sink[None, :]
    empty = np.broadcast_to(no_keys, (B, N))
    np.testing.assert_array_equal(np.asarray(lse)[:, :, 0], empty)


def test_the_tpu_kernels_refuse_a_shift():
  from pallas_kernels import tpu
  (q, k, v), kw = _case(np.random.default_rng())
  spec, ops, _ = api.canonicalize(q, k, v, options=api.Options(**kw))
  assert tpu.covers(spec, ops) is None
  assert "no context parallelism" in tpu.covers(spec, _rows(ops, 32, 32))


SCRIPT = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import stable_attn
from stable_attn import context

assert jax.device_count() == 8, jax.devices()
B, T, N, K, H = 2, 64, 4, 2, 32
rng = np.random.default_rng({seed})
normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
q, k, v = normal(B, T, N, H), normal(B, T, K, H), normal(B, T, K, H)
# alltoall gives each of the 4 "seq" devices a quarter of the heads: 8 query heads, 4 kv heads.
q8, k4, v4 = normal(B, T, 8, H), normal(B, T, 4, H), normal(B, T, 4, H)
sinks8 = jnp.asarray(rng.standard_normal(8), jnp.float32)
qkv = normal(B, T, 3, N, H)
ids = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.05, axis=1), jnp.int32)
bias = jnp.asarray(rng.standard_normal((1, N, T, T)), jnp.float32)
sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
q_lens = jnp.asarray(rng.integers(T // 2, T + 1, B), jnp.int32)
w = jnp.asarray(rng.standard_normal(H), jnp.float32)
w_lse = jnp.asarray(rng.standard_normal((8, T)), jnp.float32)
CASES = {{
    "causal_segments_gqa": dict(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids),
    "window_lengths_cap": dict(local_window_size=(11, 3), query_seq_lengths=q_lens,
                               logits_soft_cap=20.0),
    "bias_sinks": dict(is_causal=True, sinks=sinks),
    # Inputs in the zigzag order over the 4 "seq" devices; outputs and gradients compared in the
    # natural one.
    "zigzag_segments_lengths_window": dict(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids,
                                           query_seq_lengths=q_lens, local_window_size=(30, 0),
                                           context_layout="zigzag"),
    # The ring strategy ("safe" only: its merge is what differs), sinks joined once at the merge.
    "ring_causal_segments_gqa": dict(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids,
                                     context_strategy="ring"),
    "ring_window_lengths_cap_sinks": dict(local_window_size=(11, 3), query_seq_lengths=q_lens,
                                          logits_soft_cap=20.0, sinks=sinks,
                                          context_strategy="ring"),
    "ring_zigzag_segments_lengths_window": dict(
        is_causal=True, q_segment_ids=ids, kv_segment_ids=ids, query_seq_lengths=q_lens,
        local_window_size=(30, 0), context_layout="zigzag", context_strategy="ring"),
    # alltoall: every position of a quarter of the heads on each device, GQA groups whole.
    "alltoall_causal_segments_gqa_sinks": dict(is_causal=True, q_segment_ids=ids,
                                               kv_segment_ids=ids, sinks=sinks8,
                                               context_strategy="alltoall"),
    # The default, "auto", is alltoall here (8 and 4 heads over 4 devices, no bias).
    "alltoall_auto_zigzag_window_lengths_cap": dict(
        is_causal=True, query_seq_lengths=q_lens, local_window_size=(30, 0), logits_soft_cap=20.0,
        context_layout="zigzag"),
}}
zz = lambda x, axis=1: context.zigzag(x, 4, axis)
natural = lambda x, axis=1: context.unzigzag(jnp.asarray(np.asarray(x, np.float32)), 4, axis)

def loss(name, mode, sharded, q, k, v, bias):
  kw, weights = dict(CASES[name], max_adjust=mode), w_lse[:q.shape[2]]
  if kw.pop("context_layout", None) == "zigzag" and sharded:   # ids, weights in the order of q
    if "q_segment_ids" in kw:
      kw.update(q_segment_ids=zz(ids), kv_segment_ids=zz(ids))
    kw["context_layout"] = "zigzag"
    weights = zz(weights)
  o, lse = stable_attn.dot_product_attention(q, k, v, bias if name == "bias_sinks" else None,
      implementation="pallas_gpu", interpret=True, return_residuals=True, **kw)
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(lse * weights), (o, lse)

def packed_loss(qkv, strategy):
  o = stable_attn.dot_product_attention_qkvpacked(qkv, is_causal=True, implementation="pallas_gpu",
                                                  interpret=True, context_strategy=strategy)
  return jnp.sum(o.astype(jnp.float32) * w), (o,)

def compare(got, ref):
  (_, got_out), got_grads = got
  (_, ref_out), ref_grads = ref
  if not isinstance(ref_grads, tuple):   # the packed call's one gradient, dqkv
    got_grads, ref_grads = (got_grads,), (ref_grads,)
  f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
  exact = [bool(np.array_equal(f32(a), f32(b))) for a, b in zip(got_out, ref_out)]
  # O against its row's largest value; the LSE's absolute difference where finite.
  o_rel = float(np.max(np.abs(f32(got_out[0]) - f32(ref_out[0])) / np.maximum(
      np.max(np.abs(f32(ref_out[0])), axis=-1, keepdims=True), 1e-6)))
  o_norm = float(np.linalg.norm(f32(got_out[0]) - f32(ref_out[0])) /
                 np.linalg.norm(f32(ref_out[0])))
  lse_err = (float(np.max(np.abs(f32(got_out[1]) - f32(ref_out[1])))) if len(got_out) > 1
             else 0.0)
  # dQ first; then dK, dV (or the packed dqkv): |difference| against the largest value of the
  # same key row (each device's share rounds at that scale).
  grads = [(f32(a), f32(b)) for a, b in zip(got_grads, ref_grads)]
  rel = [float(np.max(np.abs(a - b) / np.maximum(np.max(np.abs(b), axis=-1, keepdims=True), 1e-6)))
         for a, b in grads]
  norm_rel = [float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) for a, b in grads]
  return dict(exact=exact, dq_exact=bool(np.array_equal(*grads[0])) if len(grads) > 1 else None,
              rel=rel, norm_rel=norm_rel, o_rel=o_rel, o_norm=o_norm, lse_err=lse_err)

out = {{}}
for kind in ("auto", "explicit"):
  axis = AxisType.Auto if kind == "auto" else AxisType.Explicit
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(axis, axis))
  put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))
  for name in CASES:
    qkv_of = (q8, k4, v4) if name.startswith("alltoall") else (q, k, v)
    for mode in ("safe",) if name.startswith(("ring", "alltoall")) else ("safe", "off"):
      f = lambda sharded: jax.jit(jax.value_and_grad(
          lambda *a: loss(name, mode, sharded, *a), argnums=(0, 1, 2, 3), has_aux=True))
      ref = f(False)(*qkv_of, bias)
      zig = CASES[name].get("context_layout") == "zigzag"
      order = zz if zig else (lambda x, axis=1: x)
      with jax.set_mesh(mesh):
        args = (*(put(order(x), "data", "seq") for x in qkv_of), put(bias, None, None, "seq"))
        got = f(True)(*args)
        specs = [str(g.sharding.spec) for g in got[1][:3]]
      if zig:   # back to the natural order: O, LSE (its T is axis 2), dq, dk, dv
        (value, (o, lse)), grads = got
        got = (value, (natural(o), natural(lse, 2))), (*map(natural, grads[:3]), grads[3])
      out[f"{{kind}}_{{name}}_{{mode}}"] = dict(compare(got, ref), specs=specs)
  for strategy in ("allgather", "ring", "alltoall"):
    f = jax.jit(jax.value_and_grad(lambda qkv: packed_loss(qkv, strategy), has_aux=True))
    ref = f(qkv)
    with jax.set_mesh(mesh):
      got = f(put(qkv, "data", "seq"))
    out[f"{{kind}}_packed_{{strategy}}".replace("_allgather", "")] = compare(got, ref)
# Heads over one mesh axis, the sequence over the other ("safe" offsets the global heads).
mesh = jax.make_mesh((2, 4), ("heads", "seq"), axis_types=(AxisType.Explicit,) * 2)
put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "seq", "heads")))
f = lambda sharded: jax.jit(jax.value_and_grad(
    lambda *a: loss("causal_segments_gqa", "safe", sharded, *a), argnums=(0, 1, 2, 3),
    has_aux=True))
with jax.set_mesh(mesh):
  got = f(True)(put(q), put(k), put(v), bias)
out["heads_and_sequence"] = dict(compare(got, f(False)(q, k, v, bias)),
                                 specs=[str(g.sharding.spec) for g in got[1][:3]])
# alltoall over 2 head shards x 4 sequence devices needs heads in multiples of 8: K=4 refused.
try:
  with jax.set_mesh(mesh):
    jax.jit(lambda *a: loss("alltoall_causal_segments_gqa_sinks", "safe", True, *a))(
        put(q8), put(k4), put(v4), bias)
  out["alltoall_refusal"] = "ran"
except ValueError as e:
  out["alltoall_refusal"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_sequence_sharded_on_8_devices():
  seed = int(np.random.default_rng().integers(1 << 16))
  result = run_on_cpu_devices(SCRIPT.format(root=str(ROOT), seed=seed), timeout=1200)
  refusal = result.pop("alltoall_refusal")
  assert "context_strategy='alltoall'" in refusal and "K=4" in refusal, refusal
  for key, r in result.items():
    if "alltoall" in key:
      # Each device runs the one-device kernels on whole heads: everything bitwise.
      assert all(r["exact"]) and r["dq_exact"] in (True, None), (key, seed, r)
      assert max(r["rel"]) == 0, (key, seed, r)
      continue
    if "ring" in key:
      # Each step's O is rounded to bf16 before the fp32 merge, then the merged O once more: about
      # an ulp of the row's scale (more where steps' O cancel: up to 1.3 ulps seen), a third of
      # an ulp in norm; the LSE merges fp32 values. Every gradient is each step's bf16 share (up
      # to 8 under zigzag) summed in fp32: where they cancel a row's error can exceed its own
      # scale's ulps, so the gradients are held to a norm.
      assert r["o_rel"] <= 2 ** -5 and r["o_norm"] <= 3e-3, (key, seed, r)
      assert r["lse_err"] <= 1e-4 and max(r["norm_rel"]) <= 5e-3, (key, seed, r)
      continue
    assert all(r["exact"]), (key, seed, r)           # O and LSE bitwise
    if r["dq_exact"] is not None:
      # dQ bitwise; zigzag runs within rounding, as tests/test_multi_gpu.py says why.
      assert r["dq_exact"] or ("zigzag" in key and r["rel"][0] <= 2 ** -7), (key, seed, r)
      assert "'seq'" in r["specs"][0] and "'seq'" in r["specs"][1], r   # dK sharded like K
    # dK and dV (or dqkv): one bf16 rounding of each of the 4 devices' shares.
    assert max(r["rel"][1:] if r["dq_exact"] is not None else r["rel"]) <= 4 * 2 ** -8, (key, r)


# alltoall's fwd+bwd on 4 CPU devices, compiled, on an Auto and an Explicit mesh: the all-to-alls
# of per-position row arrays [B, T / n, N, H] (LSE and offsets are smaller and not counted).
ALLTOALL_TRADES = """
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import stable_attn

def step(q, k, v, w):
  o, pullback = jax.vjp(lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, is_causal=True, implementation="pallas_gpu", interpret=True,
      context_strategy="alltoall"), q, k, v)
  return o, pullback(w)

out = {}
for kind in (AxisType.Auto, AxisType.Explicit):
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(kind,))
  arg = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "seq")))
  with jax.set_mesh(mesh):
    text = jax.jit(step).lower(arg, arg, arg, arg).compile().as_text()
  trades = [l for l in text.splitlines() if " all-to-all(" in l]
  out[str(kind)] = dict(
      rows=sum(bool(re.search(r"= \\(?\\w+\\[\\d+,\\d+,\\d+,\\d+\\]", l)) for l in trades),
      total=len(trades))
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_alltoall_keeps_the_o_residual_on_its_device():
  """Per device, row-sized all-to-alls. Auto axes (a custom_partitioning op each for the forward
  and the backward): q, k, v in (the forward's, and the backward's again: XLA does not merge
  collectives across the two ops), O out, dO in, dQ, dK, dV out -- 11. Explicit axes (both passes
  shard_maps in one program, where XLA merges the second q, k, v trades): 8, what XLA's own
  resharding to heads and back makes. The O residual stays where the forward's kernels left it;
  trading it out and back cost one more in each (12 and 9) and 0.5-1.3% of fwd+bwd on 2 H200s at
  T 64k (Auto axes)."""
  result = run_on_cpu_devices(ALLTOALL_TRADES, devices=4)
  auto, explicit = result["AxisType.Auto"], result["AxisType.Explicit"]
  assert auto["rows"] <= 11 and explicit["rows"] <= 8, result
  assert auto["total"] > auto["rows"] and explicit["rows"] >= 8, result


# The sinks' gradient (flash.py, from the O residual and the LSE) under each strategy on 4 CPU
# devices against the unsharded call: a sinks case of its own (the 8-device script above
# differentiates q, k, v and a bias only).
SINKS_GRADIENT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import stable_attn
rows = NamedSharding(Mesh(np.array(jax.devices()), ("seq",)), P(None, "seq"))
rng = np.random.default_rng({seed})
q, k, v = (jnp.asarray(rng.standard_normal((1, 256, 4, 32)), jnp.bfloat16) for _ in range(3))
sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
w = jnp.asarray(rng.standard_normal((1, 256, 4, 32)), jnp.float32)
out = {{}}
for strategy in ("allgather", "ring", "alltoall"):
  def loss(q, k, v, s):
    o = stable_attn.dot_product_attention(q, k, v, is_causal=True, sinks=s,
                                          implementation="pallas_gpu", interpret=True,
                                          context_strategy=strategy)
    return jnp.sum(o.astype(jnp.float32) * w)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  want = grad(q, k, v, sinks)
  got = grad(*(jax.device_put(x, rows) for x in (q, k, v)), sinks)
  f64 = lambda x: np.asarray(x, np.float64)
  out[strategy] = [float(np.linalg.norm(f64(g) - f64(r)) / np.linalg.norm(f64(r)))
                   for g, r in zip(got, want)]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_sinks_gradient_under_every_strategy():
  """dq, dk, dv within bf16 rounding of the unsharded call's under allgather, ring and alltoall;
  dsinks within fp32 rounding (3e-8..1e-7 seen), except under the ring, whose O residual is the
  fp32 merge where the unsharded call's is O in bf16, so delta = rowsum(dO * O) differs by O's
  rounding (4e-5..1.1e-4 seen). An alltoall O residual left in its device's order and read as O
  for the sinks gave dsinks of the wrong sign."""
  seed = int(np.random.default_rng().integers(1 << 16))
  result = run_on_cpu_devices(SINKS_GRADIENT.format(seed=seed), devices=4)
  for strategy, (dq, dk, dv, dsinks) in result.items():
    bound = 1e-3 if strategy == "ring" else 1e-6
    assert max(dq, dk, dv) <= 1e-2 and dsinks <= bound, (strategy, seed, result[strategy])


@pytest.mark.parametrize("strategy", ["allgather", "ring", "alltoall"])
def test_a_sequence_split_call_makes_its_own_fp8_payloads(strategy):
  """Each device of a sequence-sharded FP8 call gets no e4m3 payload rows (q_e4m3, k_e4m3,
  v_e4m3): the strategies cut and move q, k and v by name, so a payload kept beside them would
  belong to other rows; the Hopper backend then casts the quantized values it gets. A call split
  over batch or heads only keeps them (its rows are the device's own)."""
  from stable_attn import fp8, partition
  rng = np.random.default_rng()
  q = jnp.asarray(rng.standard_normal((1, 8, 2, 4)), jnp.bfloat16)
  _, ops, _ = api.canonicalize(q, q, q, options=api.Options(
      numerics="fast+qkv=e4m3+p=e4m3+p_scale=256", max_adjust="off"))
  assert all(getattr(ops, name) is not None for name in fp8.PAYLOAD_ROWS)
  split = partition._Axes(batch=None, heads=None, seq="x", seq_devices=2, strategy=strategy)
  local = partition._sequence_local(split, ops)
  assert all(getattr(local, name) is None for name in fp8.PAYLOAD_ROWS)
  for name in set(ops._fields) - set(fp8.PAYLOAD_ROWS):
    assert getattr(local, name) is getattr(ops, name), name
  assert partition._sequence_local(partition._Axes(batch="x", heads=None), ops) is ops
