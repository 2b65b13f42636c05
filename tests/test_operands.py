"""The operand table (stable_attn.spec.OPERANDS) and what is derived from it: the public keywords
written once (api.Options), the shared padding (stable_attn.layout), and partitioning of an operand
that is only a table row."""
from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn import flax as sa_flax
from stable_attn import fp8
from stable_attn.api import Options, canonicalize
from stable_attn.layout import Geometry, pad_operands
from stable_attn.spec import OPERANDS, Operands
from tests.cases import ROOT, run_on_cpu_devices



def _keyword_only(fn):
  return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
          if p.kind is inspect.Parameter.KEYWORD_ONLY]


def test_options_are_the_signature_of_dot_product_attention():
  """One list of keywords: dot_product_attention's keyword-only arguments are Options' fields with
  the same defaults, and choose_implementation and the Flax adapter show the same signature."""
  fields = [(f.name, f.default) for f in dataclasses.fields(Options)]
  assert _keyword_only(stable_attn.dot_product_attention) == fields
  assert _keyword_only(sa_flax.make_attention_fn) == fields
  ours = inspect.signature(stable_attn.dot_product_attention)
  chooser = inspect.signature(stable_attn.choose_implementation)
  assert list(chooser.parameters.values()) == list(ours.parameters.values())


def test_every_keyword_reaches_canonicalize():
  """Each option given to choose_implementation / make_attention_fn is the one canonicalize sees
  (a keyword dropped on the way would be silently ignored)."""
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match="max_adjust"):
    stable_attn.choose_implementation(q, q, q, max_adjust="sometimes")
  with pytest.raises(ValueError, match="logits_soft_cap"):
    sa_flax.make_attention_fn(logits_soft_cap=-1.0)(q, q, q)
  with pytest.raises(TypeError):
    stable_attn.choose_implementation(q, q, q, not_an_option=1)
  with pytest.raises(ValueError, match="unknown options"):
    sa_flax.make_attention_fn(not_an_option=1)
  for name in ("return_residual", "return_residuals"):
    with pytest.raises(ValueError, match=name):
      sa_flax.make_attention_fn(**{name: True})


def test_table_rows_describe_the_canonical_operands():
  """Operands is built from the table, and every array canonicalize makes has the shape its
  row's logical axes give (broadcast dims 1 or full), and its dtype rule."""
  assert Operands._fields == tuple(r.name for r in OPERANDS.rows)
  rng = np.random.default_rng()
  B, T, S, N, K, H = 2, 12, 10, 4, 2, 8
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  sizes = dict(batch=B, query=T, key=S, heads=N, kv_heads=K, head_dim=H)
  # q_shift only stable_attn.partition builds (a context-parallel device's), the FP8 descale
  # factors only the Hopper backend's FP8 forward; q, k and v's FP8 scales and payloads come with
  # e4m3 inputs, v's mean with center_v.
  built_later = {"q_shift", "qk_descale", "v_descale"}
  for numerics, absent in (("fast", built_later | set(fp8.ROWS) | {"v_mean"}),
                           ("fast+qkv=e4m3", built_later | {"v_mean"}),
                           ("fast+qkv=e4m3+center_v=true", built_later)):
    spec, ops, _ = canonicalize(q, kv, kv, jnp.zeros((N, 1, S)), jnp.ones((B, 1, T, 1), bool),
                                Options(q_segment_ids=jnp.zeros((B, T), jnp.int8),
                                        kv_segment_ids=jnp.zeros((B, S), jnp.int32),
                                        sinks=jnp.zeros(N), numerics=numerics,
                                        query_seq_lengths=jnp.array([3, 12])))
    for row, x in OPERANDS.present(ops):
      want = tuple(sizes[a] for a in row.axes)
      if row.broadcast:
        assert all(d in (1, w) for d, w in zip(x.shape, want)), (row.name, x.shape)
      else:
        assert x.shape == want, (row.name, x.shape, want)
      if row.dtype in ("int", "float32", "e4m3"):
        assert x.dtype == {"int": jnp.int32, "float32": jnp.float32,
                           "e4m3": jnp.float8_e4m3fn}[row.dtype], row.name
      if row.dtype == "input":
        assert x.dtype == q.dtype, row.name
    assert {r.name for r, _ in OPERANDS.present(ops)} == set(Operands._fields) - absent


def test_padding_follows_each_rows_rule():
  rng = np.random.default_rng()
  B, T, S, N, H = 2, 5, 7, 2, 4
  ids = np.sort(rng.integers(0, 3, (B, T)), axis=1)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((B, S, N, H)), jnp.float32)
  _, ops, _ = canonicalize(q, kv, kv, jnp.ones((1, N, 1, S)), jnp.ones((B, 1, T, S), bool),
                           Options(q_segment_ids=ids, kv_segment_ids=np.sort(
                               rng.integers(0, 3, (B, S)), axis=1),
                                   key_value_seq_lengths=jnp.array([100, 3])))
  pad = Geometry.of(ops).padded(8, 16, 6)
  x = pad_operands(ops, pad)
  assert x.q.shape == (B, 8, N, 6) and x.k.shape == (B, 16, N, 6)
  np.testing.assert_array_equal(x.q[:, T:], 0)
  np.testing.assert_array_equal(x.q[..., H:], 0)
  assert x.bias.shape == (1, N, 1, 16)            # broadcast dims stay 1
  assert x.mask.shape == (B, 1, 8, 16) and not bool(jnp.any(x.mask[:, :, T:]))
  np.testing.assert_array_equal(x.q_seg[:, T:], np.repeat(ids[:, -1:], 8 - T, axis=1))
  np.testing.assert_array_equal(x.kv_lens, [S, 3])   # lengths past the end mean S
  assert x.offset.shape == (N, 8)


@pytest.mark.parametrize("impl,interpret", [("reference", False), ("xla", False),
                                            ("pallas_gpu", True), ("pallas_tpu", True)])
def test_lengths_past_the_end_mean_the_whole_sequence(impl, interpret):
  """jax.nn's meaning of key_value_seq_lengths > S (and query_seq_lengths > T), with S not a block
  multiple: the padding the backends add must stay invisible."""
  rng = np.random.default_rng()
  q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 16)), jnp.float32) for _ in range(3))
  for kv_lens in ([17, 5], [100, 5]):
    kw = dict(key_value_seq_lengths=jnp.array(kv_lens, jnp.int32),
              query_seq_lengths=jnp.array([40, 16], jnp.int32))
    want = jax.nn.dot_product_attention(q, k, v, **kw)
    got = stable_attn.dot_product_attention(q, k, v, implementation=impl, interpret=interpret,
                                            **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


SCRIPT = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from stable_attn.partition import partitioned
from stable_attn.spec import OPERANDS, AttentionSpec, Operand
import stable_attn

# One new row: a per-(batch, head) scale. Nothing else in partition.py knows about it.
TABLE = OPERANDS.with_row(Operand("gain", ("batch", "heads"), "float", optional=True))
seen = []

def forward(spec, config, ops):
  seen.append(tuple(ops.gain.shape))
  o = ops.q * ops.gain[:, None, :, None].astype(ops.q.dtype)
  lse = jnp.broadcast_to(ops.gain[:, :, None], (o.shape[0], o.shape[2], o.shape[1]))
  return o, o, lse

fwd, _ = partitioned(forward, None)
spec = AttentionSpec(scale=1.0, is_causal=False, window=None, max_adjust="off", beta=2.0,
                     numerics=stable_attn.FAST)
B, T, N, K, H = 4, 8, 8, 4, 16
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
kv = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
gain = jnp.asarray(rng.standard_normal((B, N)), jnp.float32)
lens = jnp.full((B,), T, jnp.int32)
run = jax.jit(lambda q, kv, gain, lens: fwd(spec, None, TABLE.make(
    q=q, k=kv, v=kv, q_lens=lens, kv_lens=lens, gain=gain))[0])
want = run(q, kv, gain, lens)
mesh = jax.make_mesh((2, 4), ("data", "model"))
put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
args = (put(q, "data", None, "model"), put(kv, "data", None, "model"), put(gain, "data", "model"),
        put(lens, "data"))
with jax.set_mesh(mesh):
  hlo = run.lower(*args).compile().as_text()
  got = run(*args)
print("RESULT" + json.dumps(dict(
    gathers=[c for c in ("all-gather", "all-to-all", "collective-permute") if c in hlo],
    seen=seen, diff=float(jnp.max(jnp.abs(got - want))), spec=str(got.sharding.spec))))
"""


def test_a_new_row_is_partitioned():
  """An operand that exists only as a table row is split with the query's batch and heads: each
  device's forward sees its own [B/2, N/4] block, and nothing is gathered."""
  result = run_on_cpu_devices(SCRIPT.format(root=str(ROOT)))
  assert result["gathers"] == [], result
  assert [2, 2] in result["seen"], result   # the local block: batch 4 / 2, heads 8 / 4
  assert result["diff"] == 0.0, result
  assert "'data'" in result["spec"] and "'model'" in result["spec"], result
