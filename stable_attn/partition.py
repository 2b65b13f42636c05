"""Attention that partitions itself under jax.sharding: over batch and heads, never over sequence.

XLA cannot split a Pallas call: inside a jit over sharded arrays it would gather q, k and v onto
every device. `partitioned(forward, backward)` wraps a backend's two passes in
`jax.experimental.custom_partitioning`, so that each device runs the kernels on its own batch rows
and heads:

  q, o, dO, dq      [B, T, N, H]   batch and heads as the query is sharded
  k, v, dk, dv      [B, S, K, H]   the same axes (K must divide by the heads' shard count; a query
                                   head's kv head stays on its device)
  bias, mask        [Bb, Nb, T, S] like the query where full, replicated where broadcast (their
                                   gradient is then summed over the devices)
  lengths, ids      [B], [B, T|S]  like the batch;  safe offsets [N, T], sinks [N]: like the heads
  LSE, dLSE         [B, N, T]

Sequence (T, S) or head-dim sharding raises ValueError: the kernels need whole rows (with Auto
axes it is raised while XLA partitions the program, wrapped in its JaxRuntimeError; with Explicit
axes at trace time). Explicit axes are made Auto around the kernels (`jax.sharding.auto_axes`), the
results keep the inputs' shardings. A single-device program runs the kernels directly; so does
`shard_map` (Pallas needs `check_vma=False` there). Under `jax.vmap` the vmapped axis joins the
batch (custom_partitioning has no batching rule of its own).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, auto_axes

from stable_attn.spec import Operands


class _Layout(NamedTuple):
  """Static: which operand fields are present (in Operands order) and whether dLSE is passed."""
  names: tuple
  with_dlse: bool = False


def _ops(layout: _Layout, arrays) -> Operands:
  present = dict(zip(layout.names, arrays))
  return Operands(**{f: present.get(f) for f in Operands._fields})


def _flat(ops: Operands):
  names = tuple(f for f in Operands._fields if getattr(ops, f) is not None)
  return names, [getattr(ops, f) for f in names]


# ---------------------------------------------------------------------------------------------
# Shardings: everything follows the query's batch and head axes
# ---------------------------------------------------------------------------------------------

class _Axes(NamedTuple):
  batch: object   # mesh axis name(s) of the batch dim, or None
  heads: object   # mesh axis name(s) of the query-head dim, or None


def _spec(arg, ndim: int):
  spec = tuple(arg.sharding.spec) if isinstance(arg.sharding, NamedSharding) else ()
  return spec + (None,) * (ndim - len(spec))


def _axis_size(mesh, axes) -> int:
  if axes is None:
    return 1
  names = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[a] for a in names)


def _axes(mesh, layout: _Layout, args) -> _Axes:
  shapes = dict(zip(layout.names, args))
  q, k = shapes["q"], shapes["k"]
  b, t, n, h = _spec(q, 4)
  if t is not None or h is not None:
    raise ValueError(f"stable_attn.dot_product_attention partitions over batch and heads only; the "
                     f"query is sharded as {P(b, t, n, h)} (its sequence or head dim over {t or h})."
                     f" Reshard q/k/v to P(batch_axes, None, head_axes, None) first")
  kb, ks, kn, kh = _spec(k, 4)
  if ks is not None or kh is not None:
    raise ValueError(f"stable_attn.dot_product_attention partitions over batch and heads only; the "
                     f"key is sharded as {P(kb, ks, kn, kh)}. Reshard k/v to P(batch_axes, None, "
                     f"head_axes, None) first")
  shards = _axis_size(mesh, n)
  N, K = q.shape[2], k.shape[2]
  if n is not None and (N % shards or K % shards):
    raise ValueError(f"the query heads are sharded {shards} ways over {n}, which must divide both "
                     f"N={N} query heads and K={K} key/value heads (each device keeps whole GQA "
                     f"groups); shard fewer ways or replicate the heads")
  return _Axes(b, n)


def _arg_specs(layout: _Layout, args, axes: _Axes, extra: int = 0):
  """PartitionSpecs of the operands (in layout order) and of `extra` trailing backward inputs
  (O residual, LSE, dO and dLSE)."""
  b, n = axes
  shapes = dict(zip(layout.names, args))
  B, N = shapes["q"].shape[0], shapes["q"].shape[2]
  specs = []
  for name in layout.names:
    x = shapes[name]
    if name in ("q", "k", "v"):
      specs.append(P(b, None, n, None))
    elif name in ("bias", "mask"):
      specs.append(P(b if x.shape[0] == B > 1 else None, n if x.shape[1] == N > 1 else None,
                     None, None))
    elif name in ("q_lens", "kv_lens"):
      specs.append(P(b))
    elif name in ("q_seg", "kv_seg"):
      specs.append(P(b, None))
    elif name == "offset":
      specs.append(P(n, None))
    elif name == "sinks":
      specs.append(P(n))
    else:  # pragma: no cover - a new Operands field must be added here
      raise AssertionError(f"no sharding for operand {name!r}")
  backward_inputs = [P(b, None, n, None), P(b, n, None), P(b, None, n, None), P(b, n, None)]
  return specs + backward_inputs[:extra]


def _named(mesh, specs):
  return tuple(NamedSharding(mesh, s) for s in specs)


# ---------------------------------------------------------------------------------------------
# Shardy rules: the same statement as factors (GQA: the query's heads are (kv head, group))
# ---------------------------------------------------------------------------------------------

def _rule(layout: _Layout, value_types, n_results: int, backward: bool):
  shapes = [tuple(t.shape) for t in value_types]
  named = dict(zip(layout.names, shapes))
  B, T, N, _ = named["q"]
  S, K = named["k"][1], named["k"][2]
  G = N // K
  q_heads = CompoundFactor("kvh", "grp") if G > 1 else "kvh"
  sizes = {"grp": G} if G > 1 else {}
  unique = iter(f"one{i}" for i in range(64))
  one = lambda: next(unique)
  mappings = []
  for name, shape in zip(layout.names, shapes):
    if name == "q":
      mappings.append(ArrayMapping("b", "t", q_heads, "h"))
    elif name in ("k", "v"):
      mappings.append(ArrayMapping("b", "s", "kvh", "h"))
    elif name in ("bias", "mask"):
      Bb, Nb, Tb, Sb = shape
      mappings.append(ArrayMapping("b" if Bb == B else one(), q_heads if Nb == N else one(),
                                   "t" if Tb == T else one(), "s" if Sb == S else one()))
    elif name in ("q_lens", "kv_lens"):
      mappings.append(ArrayMapping("b"))
    elif name == "q_seg":
      mappings.append(ArrayMapping("b", "t"))
    elif name == "kv_seg":
      mappings.append(ArrayMapping("b", "s"))
    elif name == "offset":
      mappings.append(ArrayMapping(q_heads, "t"))
    elif name == "sinks":
      mappings.append(ArrayMapping(q_heads))
  rows = ArrayMapping("b", "t", q_heads, "h")
  lse = ArrayMapping("b", q_heads, "t")
  if backward:
    mappings += [rows, lse, rows] + ([lse] if layout.with_dlse else [])
    results = [rows, ArrayMapping("b", "s", "kvh", "h"), ArrayMapping("b", "s", "kvh", "h")]
    if "bias" in layout.names:
      results.append(mappings[layout.names.index("bias")])
  else:
    results = [rows, rows, lse]
  assert len(results) == n_results
  return SdyShardingRule(tuple(mappings), tuple(results),
                         # in order of first appearance (q's t and h, then k's s), as Shardy requires
                         need_replication_factors=("t", "h", "s"), **sizes)


# ---------------------------------------------------------------------------------------------
# The wrappers
# ---------------------------------------------------------------------------------------------

def _register(cp, partition, shardings, *, pick: int, backward: bool):
  """Give a custom_partitioning op its partitioner, its output-sharding inference (element `pick` of
  `shardings`) and its Shardy rule."""
  cp.def_partition(
      partition=partition,
      infer_sharding_from_operands=lambda spec, config, layout, mesh, args, result_shape:
          shardings(spec, config, layout, mesh, args)[pick],
      sharding_rule=lambda spec, config, layout, mesh, value_types, result_types:
          _rule(layout, value_types, len(result_types), backward=backward))


def partitioned(forward: Callable, backward: Callable, when: Callable = lambda spec: True):
  """(forward, backward) with make_flash_attention's signatures, partitioned over batch and heads
  for the specs where when(spec) holds (and run as given for the others)."""

  def fwd_flat(spec, config, layout, *arrays):
    return tuple(forward(spec, config, _ops(layout, arrays)))

  def bwd_flat(spec, config, layout, *arrays):
    n = len(layout.names)
    o_res, lse, do = arrays[n:n + 3]
    dlse = arrays[n + 3] if layout.with_dlse else None
    grads = backward(spec, config, _ops(layout, arrays[:n]), o_res, lse, do, dlse)
    return tuple(g for g in grads if g is not None)

  fwd_cp = custom_partitioning(fwd_flat, static_argnums=(0, 1, 2))
  bwd_cp = custom_partitioning(bwd_flat, static_argnums=(0, 1, 2))

  def fwd_shardings(spec, config, layout, mesh, args):
    axes = _axes(mesh, layout, args)
    specs = _arg_specs(layout, args, axes)
    b, n = axes
    outs = (P(b, None, n, None), P(b, None, n, None), P(b, n, None))
    return _named(mesh, specs), _named(mesh, outs)

  def fwd_partition(spec, config, layout, mesh, args, result_shape):
    in_shardings, out_shardings = fwd_shardings(spec, config, layout, mesh, args)
    return mesh, functools.partial(fwd_flat, spec, config, layout), out_shardings, in_shardings

  def bwd_shardings(spec, config, layout, mesh, args):
    n_ops = len(layout.names)
    axes = _axes(mesh, layout, args[:n_ops])
    specs = _arg_specs(layout, args[:n_ops], axes, extra=len(args) - n_ops)
    outs = list(specs[:3])   # dq like q, dk like k, dv like v
    if "bias" in layout.names:
      outs.append(specs[layout.names.index("bias")])
    return axes, _named(mesh, specs), _named(mesh, outs)

  def bwd_partition(spec, config, layout, mesh, args, result_shape):
    axes, in_shardings, out_shardings = bwd_shardings(spec, config, layout, mesh, args)
    bias_spec = in_shardings[layout.names.index("bias")].spec if "bias" in layout.names else None

    def local(*arrays):
      grads = bwd_flat(spec, config, layout, *arrays)
      if bias_spec is None:
        return grads
      # Where the bias is broadcast over a sharded dim, each device holds a partial sum.
      summed = [ax for ax, kept in ((axes.batch, bias_spec[0]), (axes.heads, bias_spec[1]))
                if ax is not None and kept is None]
      dbias = grads[3]
      for ax in summed:
        dbias = lax.psum(dbias, ax)
      return grads[:3] + (dbias,)

    return mesh, local, out_shardings, in_shardings

  _register(fwd_cp, fwd_partition, fwd_shardings, pick=1, backward=False)
  _register(bwd_cp, bwd_partition, bwd_shardings, pick=2, backward=True)

  def forward_partitioned(spec, config, ops):
    if not when(spec):
      return forward(spec, config, ops)
    names, arrays = _flat(ops)
    layout = _Layout(names)
    call = lambda *a: _batched(lambda *b: fwd_cp(spec, config, layout, *b), layout, a,
                               n_outputs=3)
    return _auto_axes(call, layout, arrays, lambda b, n, specs: (
        P(b, None, n, None), P(b, None, n, None), P(b, n, None)))

  def backward_partitioned(spec, config, ops, o_res, lse, do, dlse=None):
    if not when(spec):
      return backward(spec, config, ops, o_res, lse, do, dlse)
    names, arrays = _flat(ops)
    layout = _Layout(names, dlse is not None)
    extra = [o_res, lse, do] + ([dlse] if dlse is not None else [])
    n_out = 4 if ops.bias is not None else 3
    call = lambda *a: _batched(lambda *b: bwd_cp(spec, config, layout, *b), layout, a,
                               n_outputs=n_out)
    bias_at = names.index("bias") if ops.bias is not None else None
    grads = _auto_axes(call, layout, arrays + extra, lambda b, n, specs: tuple(specs[:3]) + (
        (specs[bias_at],) if bias_at is not None else ()))
    return tuple(grads) + ((None,) if ops.bias is None else ())

  return forward_partitioned, backward_partitioned


# ---------------------------------------------------------------------------------------------
# Explicit sharding: the types carry shardings that a Pallas call cannot take
# ---------------------------------------------------------------------------------------------

def _auto_axes(call: Callable, layout: _Layout, arrays, out_specs: Callable):
  """call(*arrays), with the mesh's Explicit axes made Auto inside it (where custom_partitioning
  splits the kernels) when the operands' types carry shardings; a sequence-sharded query is
  rejected here, at trace time. out_specs(batch_axes, head_axes, operand_specs) -> result specs."""
  sharding = jax.typeof(arrays[0]).sharding
  mesh = getattr(sharding, "mesh", None)
  explicit = tuple(name for name, kind in zip(getattr(mesh, "axis_names", ()),
                                              getattr(mesh, "axis_types", ()))
                   if kind == AxisType.Explicit)
  if not explicit:
    return call(*arrays)
  n_ops = len(layout.names)
  axes = _axes(mesh, layout, [jax.typeof(x) for x in arrays[:n_ops]])
  specs = [P(*_spec(jax.typeof(x), 4)) if name in ("q", "k", "v", "bias") else None
           for name, x in zip(layout.names, arrays[:n_ops])]
  return auto_axes(lambda *a: tuple(call(*a)), axes=explicit,
                   out_sharding=out_specs(*axes, specs))(*arrays)


# ---------------------------------------------------------------------------------------------
# vmap: custom_partitioning has no batching rule; fold the vmapped axis into the batch
# ---------------------------------------------------------------------------------------------

def _batched(call: Callable, layout: _Layout, arrays, n_outputs: int):
  """call(*arrays) under a custom_vmap rule: a vmapped axis becomes part of the batch dim (dim 0
  of every operand); a broadcast (size-1 batch) bias or mask that is vmapped is expanded first."""

  @jax.custom_batching.custom_vmap
  def run(*arrays):
    return call(*arrays)

  @run.def_vmap
  def rule(axis_size, in_batched, *arrays):
    B = arrays[0].shape[1] if in_batched[0] else arrays[0].shape[0]
    names = list(layout.names) + ["o_res", "lse", "do", "dlse"][:len(arrays) - len(layout.names)]
    merged = []
    for name, x, batched in zip(names, arrays, in_batched):
      if not batched:
        if name in ("bias", "mask") and x.shape[0] == 1:
          merged.append(x)   # still broadcast over the merged batch
          continue
        if name in ("offset", "sinks"):
          merged.append(x)   # per head (and position): the same for every batch row
          continue
        x = jnp.broadcast_to(x, (axis_size,) + x.shape)
      elif name == "sinks":
        raise ValueError("jax.vmap over attention sinks is not supported by the Pallas kernels "
                         "(their sinks are per head, shared by the batch); vmap over the other "
                         "operands only, or use implementation='reference' or 'xla'")
      if name in ("bias", "mask") and x.shape[1] == 1:
        x = jnp.broadcast_to(x, (axis_size, B) + x.shape[2:])
      merged.append(x.reshape((axis_size * x.shape[1],) + x.shape[2:]))
    outs = call(*merged)
    unmerge = lambda y: y.reshape((axis_size, y.shape[0] // axis_size) + y.shape[1:])
    outs = [unmerge(y) for y in outs]
    if len(outs) == 4 and "bias" in layout.names:   # dbias back to the bias's own batch dim
      bias = arrays[layout.names.index("bias")]
      batched = in_batched[layout.names.index("bias")]
      own_b = bias.shape[1] if batched else bias.shape[0]
      dbias = outs[3]
      if own_b == 1:
        dbias = jnp.sum(dbias, axis=1, keepdims=True)
      outs[3] = dbias if batched else jnp.sum(dbias, axis=0)
    return tuple(outs), (True,) * n_outputs

  return run(*arrays)
