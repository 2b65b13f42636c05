"""Attention that partitions itself under jax.sharding: over batch, heads and (context parallel)
the sequence.

XLA cannot split a Pallas call: inside a jit over sharded arrays it would gather q, k and v onto
every device. `partitioned(forward, backward)` makes each device run the kernels on its own batch
rows, heads and queries, in one of three ways:

- Auto mesh axes (a `Mesh(...)`, or arrays placed by jit's in_shardings): the operands' shardings
  are known only when XLA partitions the program, so both passes are
  `jax.experimental.custom_partitioning` ops; XLA asks for each one's per-device program then.
  That program is traced and lowered on its own, and lowering refuses a jaxpr with ref effects:
  the Hopper kernels' in-place writes (the packed QKV gradient, the fused dQ accumulator) keep
  their refs inside a `pl.run_state` (pallas_kernels.mosaic_gpu.common.in_place), never a
  `jax.new_ref` whose effect would leave the function. Each call site's program is lowered apart
  (XLA calls the partitioner per op), so a model's layers compile their kernels once each.
- Explicit mesh axes (`jax.make_mesh`'s default; jax.set_mesh): the types say how every operand is
  split, so the call runs under `jax.shard_map` at trace time -- no partitioner callback, every
  layer shares one jitted kernel call, and each gradient is resharded back to its operand's
  sharding. A mesh that mixes Explicit and Auto axes takes the first way inside
  `jax.sharding.auto_axes`.
- One device, or inside a caller's `shard_map` (Pallas needs `check_vma=False` there): the kernels
  run directly. There each device sees its own heads as heads 0, 1, ..., so max_adjust="safe"
  takes their per-row offsets (tile.safe_offset is a function of the head index): an equally good
  rounding, not bitwise the one-device call's where heads are split.

Every rule is derived from the operand table (`stable_attn.spec`): an array is split along its
"batch" axis like the query's batch, along its "heads" / "kv_heads" axis like the query's heads
and along its "query" axis like the query's sequence; "head_dim" stays whole and so does "key"
(but under a ring or alltoall, below); a broadcast dim of size 1 is replicated (the gradient of
such a bias is then summed over the devices). The backward's own inputs (O residual, dO:
ROW_AXES; LSE, dLSE: LSE_AXES) and every output follow the same rule, so adding an operand is
one table row.

Context parallelism (backends built with `context_parallel`, whose kernels take the q_shift
operand: the GPU ones). Where q's sequence is split over mesh axes, each device holds T / n of
the queries and XLA all-gathers K and V (and the key segment ids, and a bias's or mask's key
columns) to every device, as the specs ask: the "allgather" strategy. A device runs its kernels
once per run of consecutive positions it holds (one run, or two in the zigzag order of
`stable_attn.context`), each with q_shift = the run's first global position, so causal and window
masks, lengths and "safe" offsets are the unsharded call's: O, LSE and dQ equal it bitwise. dK
and dV are each device's queries' share for every key: summed in fp32 over the devices and cut
back to each device's keys (a reduce-scatter); each share is rounded to the input dtype by its
kernel first, so they are within bf16 rounding of the one-device call, not bitwise. A packed qkv
is split on each device (its K and V gathered).

context_strategy="ring" keeps K and V split like the queries: in n steps each device runs its
queries against the key block it holds (block (d - s) mod n at step s; each pair of a query run
and a key run is one kernel call, q_shift = the difference of their first global positions;
a pair the causal mask or the window keeps apart runs no kernel, under `lax.cond`) while
`lax.ppermute` already passes that block on, so the transfer can overlap the kernels; the
steps' O and LSE are merged in fp32 (`tile.merge_blocks`, sinks joined once there). The backward
runs the same steps with the merged O and LSE: dQ sums on the device in fp32, dK and dV in fp32
accumulators that travel with their block and reach its owner after the last step. A device
holds two key blocks instead of every key. Where the backend's forward can return O before its
final rounding (make_flash_attention's fp32_residual: pallas_gpu), each step asks for it and
the merged O is rounded once, as the one-device call's; otherwise (the Hopper kernel) each step's
O comes rounded to the input dtype, about an ulp of the row's scale more. LSE within fp32
rounding. No bias or mask (refused in canonicalize).

context_strategy="alltoall" (DeepSpeed-Ulysses' idea) trades positions for heads: an all-to-all
over the sequence's devices gives each device every position of 1/n of its heads (GQA groups
whole: n must divide the query and the key/value heads), the one-device kernels run on those
heads (no q_shift: the zigzag order is undone on the device), and another all-to-all trades O
and LSE back (the backward likewise trades dO, LSE and dLSE in and dQ, dK, dV out, and re-trades
q, k and v; without sinks the O residual never leaves its device; per-head sinks are sliced).
Every head's arithmetic is the one-device call's, so values and gradients are bitwise. No bias or
mask.
"auto" (the default) runs alltoall where the heads divide and no bias or mask is given, else
allgather (stable_attn.context.choose_strategy, which says what measured this).

The TPU kernels have no q_shift: there a sequence-sharded call raises ValueError, as does
head-dim sharding everywhere (with Auto axes while XLA partitions the program, wrapped in its
JaxRuntimeError; with Explicit axes at trace time). Under `jax.vmap` the vmapped axis joins the
batch (custom_partitioning has no batching rule of its own).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, auto_axes

from stable_attn import context, fp8, tile
from stable_attn.spec import (LSE_AXES, PARTITIONABLE, ROW_AXES, Operand, OperandTable, is_packed,
                              unpack)

# The backward's inputs after the operands, in order: O residual, LSE, dO, dLSE (when given).
_BACKWARD_INPUTS = (Operand("o_res", ROW_AXES, "input"), Operand("lse", LSE_AXES, "float32"),
                    Operand("do", ROW_AXES, "input"), Operand("dlse", LSE_AXES, "float32"))
# The forward's outputs: O, O residual, LSE.
_FORWARD_OUTPUTS = (ROW_AXES, ROW_AXES, LSE_AXES)


class _Layout(NamedTuple):
  """Static: the operand table, the operands present (in table order), whether dLSE is passed,
  whether the backend's kernels take a q_shift (may run context parallel), and how a
  context-parallel call meets the other devices' keys (context_strategy: under "ring" and
  "alltoall" K and V stay split like the queries)."""
  table: OperandTable
  names: tuple
  with_dlse: bool = False
  sequence: bool = False
  strategy: str = "allgather"

  @property
  def keys_split(self) -> bool:
    return self.sequence and self.strategy != "allgather"

  def rows(self, n_arrays: int | None = None):
    """Table rows of the operands, then of the backward's inputs, for n_arrays arrays."""
    rows = [self.table[name] for name in self.names] + list(_BACKWARD_INPUTS)
    return rows[:len(self.names) if n_arrays is None else n_arrays]

  def ops(self, arrays):
    return self.table.make(**dict(zip(self.names, arrays)))

  def grad_rows(self):
    """The operands whose gradients the backward kernels return, in order."""
    return [self.table[name] for name in self.names if self.table[name].grad]


def _flat(ops):
  present = type(ops).TABLE.present(ops)
  return _Layout(type(ops).TABLE, tuple(r.name for r, _ in present)), [x for _, x in present]


def _sizes(rows, shapes) -> dict:
  """{axis: full size}, read off the arrays that are neither broadcast nor lengths."""
  sizes = {}
  for row, shape in zip(rows, shapes):
    if not row.broadcast and row.counts is None:
      sizes.update(zip(row.axes, shape))
  return sizes


def _broadcast_dim(row: Operand, dim: int, shape, sizes) -> bool:
  return row.broadcast and shape[dim] == 1 and sizes[row.axes[dim]] != 1


# ---------------------------------------------------------------------------------------------
# Shardings: everything follows the query's batch and head axes
# ---------------------------------------------------------------------------------------------

class _Axes(NamedTuple):
  batch: object   # mesh axis name(s) of the batch dim, or None
  heads: object   # mesh axis name(s) of the query-head dim, or None
  seq: object = None   # mesh axis name(s) of the query's sequence dim (context parallel), or None
  seq_devices: int = 1  # how many devices split it
  keys: object = None   # mesh axis name(s) of the key dim: the sequence's unless allgather
  strategy: str = "allgather"   # context_strategy (where seq is split)

  def of(self, axis: str):
    """The mesh axes an operand's `axis` is split over on each device. Keys stay whole (a
    context-parallel device sees every key: XLA all-gathers K and V before the kernels), except
    under a ring (each device holds its own keys and passes them on) and under alltoall (each
    device trades its positions for its share of the heads)."""
    return {"batch": self.batch, "heads": self.heads, "kv_heads": self.heads,
            "query": self.seq, "key": self.keys}.get(axis)


def _decoded(mesh, args):
  """args (ShapeDtypeStructs) with the shardings XLA hands a custom_partitioning op named on
  `mesh`. The ops take them undecoded (decode_shardings=False): JAX's own decoding raises
  IndivisibleError inside XLA (an INTERNAL error on CPUs, a segfault seen on GPUs) for a dim split
  by part of a mesh axis, as XLA propagates from FSDP weights [D, N*H] (data) reshaped to heads x
  head dim: heads over half of the axis' devices, head dim over the other half."""
  if mesh.empty:
    return args
  return [a if a.sharding is None or isinstance(a.sharding, NamedSharding) else
          jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_named_on(mesh, a.sharding, a.ndim))
          for a in args]


@functools.lru_cache(maxsize=None)
def _named_on(mesh, sharding, ndim: int) -> NamedSharding:
  """The NamedSharding on `mesh` equivalent to `sharding`, found among the specs that give each
  mesh axis (of size > 1) to one dim or none, in either order within a dim. Where none is, the
  operand is taken whole on each device (XLA gathers it first), with one RuntimeWarning."""
  axes = [name for name in mesh.axis_names if mesh.shape[name] > 1]
  for dims in itertools.product(range(ndim + 1), repeat=len(axes)):
    per_dim = [[a for a, d in zip(axes, dims) if d == i] for i in range(ndim)]
    for order in itertools.product(*(itertools.permutations(names) for names in per_dim)):
      named = NamedSharding(mesh, P(*(None if not o else o[0] if len(o) == 1 else o
                                      for o in order)))
      if named.is_equivalent_to(sharding, ndim):
        return named
  # One text per mesh, so that Python's default filter shows it once, not once per operand.
  warnings.warn(f"stable_attn.dot_product_attention: XLA split an operand by part of an axis of "
                f"the mesh {dict(mesh.shape)}, which no PartitionSpec names; that operand runs "
                f"whole on each device, XLA gathering it first. Reshard q, k and v to "
                f"P(batch_axes, None, head_axes, None) to keep them split", RuntimeWarning,
                stacklevel=2)
  return NamedSharding(mesh, P())


def _spec(arg, ndim: int):
  spec = tuple(arg.sharding.spec) if isinstance(arg.sharding, NamedSharding) else ()
  return spec + (None,) * (ndim - len(spec))


def _axis_size(mesh, axes) -> int:
  if axes is None:
    return 1
  names = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[a] for a in names)


def _axes(mesh, layout: _Layout, args) -> _Axes:
  """The mesh axes of the query's batch, heads and (context parallel) sequence; ValueError where
  q, k or v are split along an axis the kernels need whole, or the heads cannot follow the
  query's."""
  shapes = dict(zip(layout.names, args))
  inputs = [name for name in ("q", "k", "v", "qkv") if name in shapes]
  splittable = PARTITIONABLE + (("query", "key") if layout.sequence else ())
  for name in inputs:
    row = layout.table[name]
    spec = _spec(shapes[name], len(row.axes))
    split = [(a, s) for a, s in zip(row.axes, spec) if s is not None and a not in splittable]
    if split:
      what = {"q": "query", "k": "key", "v": "value", "qkv": "packed qkv"}[name]
      over = ("batch, heads and the sequence (context parallel)" if layout.sequence else
              "batch and heads only (this backend has no context parallelism)")
      raise ValueError(f"stable_attn.dot_product_attention partitions over {over}; the {what} is "
                       f"sharded as {P(*spec)} (its {split[0][0]} dim over {split[0][1]}). "
                       f"Reshard it to P(batch_axes, ..., head_axes, None) first")
  row = layout.table[inputs[0]]   # q, or the packed qkv
  q_spec = dict(zip(row.axes, _spec(shapes[inputs[0]], len(row.axes))))
  n, seq = q_spec["heads"], q_spec["query"]
  shards = _axis_size(mesh, n)
  sizes = _sizes([layout.table[name] for name in inputs], [shapes[x].shape for x in inputs])
  N, K = sizes["heads"], sizes.get("kv_heads", sizes["heads"])
  if n is not None and (N % shards or K % shards):
    raise ValueError(f"the query heads are sharded {shards} ways over {n}, which must divide both "
                     f"N={N} query heads and K={K} key/value heads (each device keeps whole GQA "
                     f"groups); shard fewer ways or replicate the heads")
  if seq is not None and sizes["query"] % _axis_size(mesh, seq):
    raise ValueError(f"the query's sequence is sharded {_axis_size(mesh, seq)} ways over {seq}, "
                     f"which must divide its length T={sizes['query']} (context parallel: each "
                     f"device holds T / devices consecutive positions)")
  devices = _axis_size(mesh, seq)
  bias = any(name in layout.names for name in ("bias", "mask"))
  strategy = (context.choose_strategy(layout.strategy, N, K, shards * devices, bias)
              if seq is not None else "allgather")
  keys = seq if strategy != "allgather" else None
  S = sizes.get("key", sizes["query"])   # a packed qkv: S = T
  if keys is not None and S % devices:
    raise ValueError(f"context_strategy='{strategy}' over {devices} devices ({seq}) splits the "
                     f"keys as the queries: their length S={S} must be a multiple of it")
  if strategy == "alltoall" and (N % (shards * devices) or K % (shards * devices)):
    raise ValueError(f"context_strategy='alltoall' gives each of the {devices} devices of {seq} "
                     f"a share of the heads (of {shards} head shards): {shards * devices} must "
                     f"divide both N={N} query heads and K={K} key/value heads; use 'allgather' "
                     f"or 'ring'")
  return _Axes(q_spec["batch"], n, seq, devices, keys, strategy)


def _partition_spec(row: Operand, shape, sizes, axes: _Axes) -> P:
  return P(*(None if _broadcast_dim(row, d, shape, sizes) else axes.of(a)
             for d, a in enumerate(row.axes)))


def _arg_specs(layout: _Layout, args, axes: _Axes):
  """PartitionSpecs of the operands (in layout order), then of the backward's inputs."""
  rows = layout.rows(len(args))
  sizes = _sizes(rows, [a.shape for a in args])
  return [_partition_spec(row, a.shape, sizes, axes) for row, a in zip(rows, args)]


def _named(mesh, specs):
  return tuple(NamedSharding(mesh, s) for s in specs)


# ---------------------------------------------------------------------------------------------
# Shardy rules: the same statement as factors (GQA: the query's heads are (kv head, group))
# ---------------------------------------------------------------------------------------------

def _rule(layout: _Layout, value_types, n_results: int, backward: bool):
  rows = layout.rows(len(value_types))
  shapes = [tuple(t.shape) for t in value_types]
  sizes = _sizes(rows, shapes)
  G = sizes["heads"] // sizes.get("kv_heads", sizes["heads"])
  factors = {"batch": "b", "query": "t", "key": "s", "kv_heads": "kvh", "head_dim": "h",
             "qkv": "qkv", "heads": CompoundFactor("kvh", "grp") if G > 1 else "kvh"}
  unique = iter(f"one{i}" for i in range(1 << 10))

  def mapping(row: Operand, shape):
    return ArrayMapping(*(next(unique) if _broadcast_dim(row, d, shape, sizes) else factors[a]
                          for d, a in enumerate(row.axes)))

  mappings = [mapping(row, shape) for row, shape in zip(rows, shapes)]
  if backward:
    by_name = dict(zip(layout.names, mappings))
    results = [by_name[row.name] for row in layout.grad_rows()]
  else:
    results = [ArrayMapping(*(factors[a] for a in axes)) for axes in _FORWARD_OUTPUTS]
  assert len(results) == n_results
  # The factors the kernels need whole, in order of first appearance (as Shardy requires); the
  # query's sequence may be split where the kernels run context parallel, the keys too under a
  # ring or alltoall.
  splittable = (PARTITIONABLE + (("query",) if layout.sequence else ())
                + (("key",) if layout.keys_split else ()))
  whole = [factors[a] for row in rows for a in row.axes if a not in splittable]
  return SdyShardingRule(tuple(mappings), tuple(results),
                         need_replication_factors=tuple(dict.fromkeys(whole)),
                         **({"grp": G} if G > 1 else {}))


# ---------------------------------------------------------------------------------------------
# The wrappers
# ---------------------------------------------------------------------------------------------

def _register(cp, partition, shardings, *, backward: bool):
  """Give a custom_partitioning op its partitioner, its output-sharding inference (the outputs'
  shardings of `shardings`, which gives (axes, operands' shardings, outputs')) and its Shardy
  rule."""
  cp.def_partition(
      partition=partition, decode_shardings=False,
      infer_sharding_from_operands=lambda spec, config, layout, mesh, args, result_shape:
          shardings(spec, config, layout, mesh, args)[2],
      sharding_rule=lambda spec, config, layout, mesh, value_types, result_types:
          _rule(layout, value_types, len(result_types), backward=backward))


def _forward_specs(axes: _Axes, specs=None):
  """The forward's outputs' specs (O, O residual, LSE); `specs` (the operands') are not needed."""
  return [P(*(axes.of(a) for a in out_axes)) for out_axes in _FORWARD_OUTPUTS]


def partitioned(forward: Callable, backward: Callable, when: Callable = lambda spec: True, *,
                sequence: bool = False, fp32_steps: bool = False):
  """(forward, backward) with make_flash_attention's signatures, partitioned over batch and heads
  for the specs where when(spec) holds (and run as given for the others); with `sequence` (the
  kernels take a q_shift) over the query's sequence too, context parallel. fp32_steps: the
  forward returns an fp32 O residual where the numerics ask (the ring merges those)."""

  def fwd_local(spec, config, layout, axes: _Axes):
    """One device's forward."""
    def local(*arrays):
      return _context_forward(forward, spec, config, axes, layout.ops(arrays), fp32_steps)
    return local

  def bwd_flat(spec, config, layout, axes: _Axes, *arrays):
    n = len(layout.names)
    o_res, lse, do = arrays[n:n + 3]
    dlse = arrays[n + 3] if layout.with_dlse else None
    grads = _context_backward(backward, spec, config, axes, layout.ops(arrays[:n]), o_res, lse,
                              do, dlse)
    return tuple(g for g in grads if g is not None)

  def bwd_local(spec, config, layout, axes: _Axes, grad_specs):
    """One device's backward: where an operand is broadcast over a split axis (its gradient's spec
    keeps that dim whole), each device holds a partial sum, summed over the devices here."""
    def local(*arrays):
      grads = list(bwd_flat(spec, config, layout, axes, *arrays))
      for i, (row, kept) in enumerate(zip(layout.grad_rows(), grad_specs)):
        for axis, dim_spec in zip(row.axes, kept):
          if axes.of(axis) is not None and dim_spec is None:
            grads[i] = lax.psum(grads[i], axes.of(axis))
      return tuple(grads)
    return local

  # What XLA traces where it does not partition (one device): axes that split nothing.
  fwd_cp = custom_partitioning(lambda spec, config, layout, *arrays:
                               fwd_local(spec, config, layout, _Axes(None, None))(*arrays),
                               static_argnums=(0, 1, 2))
  bwd_cp = custom_partitioning(lambda spec, config, layout, *arrays:
                               bwd_flat(spec, config, layout, _Axes(None, None), *arrays),
                               static_argnums=(0, 1, 2))

  def fwd_shardings(spec, config, layout, mesh, args):
    args = _decoded(mesh, args)
    axes = _axes(mesh, layout, args)
    return axes, _named(mesh, _arg_specs(layout, args, axes)), _named(mesh, _forward_specs(axes))

  def fwd_partition(spec, config, layout, mesh, args, result_shape):
    axes, in_shardings, out_shardings = fwd_shardings(spec, config, layout, mesh, args)
    local = fwd_local(spec, config, layout, axes)
    return mesh, _per_device(mesh, local), out_shardings, in_shardings

  def bwd_shardings(spec, config, layout, mesh, args):
    args = _decoded(mesh, args)
    axes = _axes(mesh, layout, args[:len(layout.names)])
    specs = _arg_specs(layout, args, axes)
    return axes, _named(mesh, specs), _named(mesh, _grad_specs(layout, specs, axes))

  def bwd_partition(spec, config, layout, mesh, args, result_shape):
    axes, in_shardings, out_shardings = bwd_shardings(spec, config, layout, mesh, args)
    local = bwd_local(spec, config, layout, axes, [s.spec for s in out_shardings])
    return mesh, _per_device(mesh, local), out_shardings, in_shardings

  _register(fwd_cp, fwd_partition, fwd_shardings, backward=False)
  _register(bwd_cp, bwd_partition, bwd_shardings, backward=True)

  def flat(spec, ops, **fields):
    """_flat's layout and arrays, with what this backend and the spec say of the sequence."""
    layout, arrays = _flat(ops)
    return layout._replace(sequence=sequence, strategy=spec.context_strategy, **fields), arrays

  def forward_partitioned(spec, config, ops):
    if not when(spec):
      return forward(spec, config, ops)
    layout, arrays = flat(spec, ops)
    batched = lambda run: lambda *a: _batched(run, layout, a, grads=False)
    mesh = explicit_mesh(arrays)
    if mesh is not None:
      return _shard_mapped(lambda axes, specs: batched(fwd_local(spec, config, layout, axes)),
                           layout, arrays, mesh, _forward_specs)
    call = batched(lambda *b: fwd_cp(spec, config, layout, *b))
    return _auto_axes(call, layout, arrays, _forward_specs)

  def backward_partitioned(spec, config, ops, o_res, lse, do, dlse=None):
    if not when(spec):
      return backward(spec, config, ops, o_res, lse, do, dlse)
    layout, arrays = flat(spec, ops, with_dlse=dlse is not None)
    arrays = arrays + [o_res, lse, do] + ([dlse] if dlse is not None else [])
    batched = lambda run: lambda *a: _batched(run, layout, a, grads=True)
    grad_specs = lambda axes, specs: _grad_specs(layout, specs, axes)
    mesh = explicit_mesh(arrays)
    if mesh is not None:
      grads = _shard_mapped(
          lambda axes, specs: batched(bwd_local(spec, config, layout, axes,
                                                grad_specs(axes, specs))),
          layout, arrays, mesh, grad_specs, restore=True)
    else:
      call = batched(lambda *b: bwd_cp(spec, config, layout, *b))
      grads = _auto_axes(call, layout, arrays, grad_specs)
    by_name = dict(zip([row.name for row in layout.grad_rows()], grads))
    return tuple(by_name.get(row.name) for row in layout.table.rows if row.grad)

  return forward_partitioned, backward_partitioned


def _grad_specs(layout: _Layout, specs, axes: _Axes):
  """Each gradient's spec: its operand's (a broadcast dim whole: summed over the devices), but
  split over the sequence's devices along the keys of a key-only operand (dK, dV:
  `_context_backward` scatters them)."""
  by_name = dict(zip(layout.names, specs))
  out = []
  for row in layout.grad_rows():
    spec = by_name[row.name]
    if axes.seq is not None and "key" in row.axes and "query" not in row.axes:
      spec = P(*(axes.seq if a == "key" else d for a, d in zip(row.axes, spec)))
    out.append(spec)
  return out


# ---------------------------------------------------------------------------------------------
# Context parallel: each device holds T / n of the queries and sees every key
# ---------------------------------------------------------------------------------------------

def _query_runs(spec, axes: _Axes, ops, device):
  """The runs of consecutive positions among one device's queries (stable_attn.context: one
  contiguous run, or two under the zigzag order): each run's Chunk (its rows, and `shift`, its
  first global position) and its query-side operands -- its queries, segment ids, "safe" offsets
  (at its global positions) and query lengths counted from its first row."""
  T, n = ops.q.shape[1], axes.seq_devices
  if _zigzag(spec, axes) and T % 2:
    raise ValueError(f"context_layout='zigzag' over {n} devices needs a sequence length divisible "
                     f"by {2 * n} (two equal chunks on each device), got {T * n}")
  offsets = ops.offset
  if _zigzag(spec, axes) and offsets is not None:
    # Each device's share of the offsets is at natural positions; a zigzag run's are elsewhere.
    offsets = lax.all_gather(offsets, axes.seq, axis=1, tiled=True)
  runs = []
  for chunk in context.device_chunks(spec.context_layout, T, n, device):
    rows, size = slice(chunk.start, chunk.stop), chunk.stop - chunk.start
    offset = offsets
    if offsets is not None:
      offset = (lax.dynamic_slice_in_dim(offsets, chunk.shift, size, axis=1)
                if _zigzag(spec, axes) else offsets[:, rows])
    runs.append((chunk, dict(q=ops.q[:, rows], offset=offset,
                             q_seg=None if ops.q_seg is None else ops.q_seg[:, rows],
                             q_lens=jnp.clip(ops.q_lens - chunk.shift, 0, size))))
  return runs


def _context_calls(spec, axes: _Axes, ops):
  """One device's kernel calls of a sequence-sharded call under the allgather strategy: for each
  run of its queries (`_query_runs`), the run's rows (start, stop) and its operands, with every
  key in natural order (XLA gathered K and V to each device as the specs ask; a packed q, k, v
  becomes split operands, K and V gathered here) and q_shift the run's first global position.
  Not sequence-sharded: the one call as it is."""
  if axes.seq is None:
    return [((None, None), ops)]
  n = axes.seq_devices
  device = lax.axis_index(axes.seq).astype(jnp.int32)
  if is_packed(ops):
    kv = lax.all_gather(ops.qkv[:, :, 1:], axes.seq, axis=1, tiled=True)
    ops = unpack(ops)._replace(k=kv[:, :, 0], v=kv[:, :, 1])
  runs = _query_runs(spec, axes, ops, device)
  if _zigzag(spec, axes):
    # The keys came in the caller's zigzag order.
    natural = lambda x: None if x is None else context.unzigzag(x, n)
    ops = ops._replace(k=natural(ops.k), v=natural(ops.v), kv_seg=natural(ops.kv_seg))
  return [((chunk.start, chunk.stop),
           ops._replace(**fields, q_shift=jnp.full_like(ops.q_lens, chunk.shift)))
          for chunk, fields in runs]


def _sequence_local(axes: _Axes, ops):
  """ops without q, k and v's e4m3 payloads where the sequence is split: the strategies cut and
  move q, k and v by name (runs, ring blocks), so a kernel call makes its payloads from the
  quantized values it gets (pallas_kernels.mosaic_gpu._fp8_operands), never from another run's."""
  if axes.seq is None or not hasattr(ops, fp8.PAYLOAD_ROWS[0]):
    return ops
  return ops._replace(**dict.fromkeys(fp8.PAYLOAD_ROWS))


def _zigzag(spec, axes: _Axes) -> bool:
  return spec.context_layout == "zigzag" and axes.seq_devices > 1


def _context_forward(forward: Callable, spec, config, axes: _Axes, ops, fp32_steps=False):
  """(O, O residual, LSE) of one device: its runs' kernel calls, joined along the queries."""
  ops = _sequence_local(axes, ops)
  if axes.strategy == "ring":   # _axes: "allgather" wherever the sequence is whole
    return _ring_forward(forward, spec, config, axes, ops, fp32_steps)
  if axes.strategy == "alltoall":
    return _alltoall_forward(forward, spec, config, axes, ops)
  outs = [forward(spec, config, run_ops) for _, run_ops in _context_calls(spec, axes, ops)]
  if len(outs) == 1:
    return tuple(outs[0])
  return tuple(jnp.concatenate(parts, axis=axis)
               for parts, axis in zip(zip(*outs), (1, 1, 2)))


def _context_backward(backward: Callable, spec, config, axes: _Axes, ops, o_res, lse, do, dlse):
  """One device's gradients of its own operands: each run's backward on its rows; dK and dV hold
  the device's queries' share for every key, summed in fp32 over the runs and the devices and
  each device's keys kept (a reduce-scatter, in the caller's key order); a packed call's dq, dk,
  dv stacked into its dqkv."""
  if axes.seq is None:
    return backward(spec, config, ops, o_res, lse, do, dlse)
  ops = _sequence_local(axes, ops)
  if axes.strategy == "ring":
    return _ring_backward(backward, spec, config, axes, ops, o_res, lse, do, dlse)
  if axes.strategy == "alltoall":
    return _alltoall_backward(backward, spec, config, axes, ops, o_res, lse, do, dlse)
  calls = _context_calls(spec, axes, ops)
  runs = [backward(spec, config, run_ops, _rows(o_res, a, b, 1), _rows(lse, a, b, 2),
                   _rows(do, a, b, 1), _rows(dlse, a, b, 2))
          for (a, b), run_ops in calls]
  if len(runs) > 1 and any(g is not None for run in runs for g in run[3:]):
    raise AssertionError("a zigzag call has no bias (refused by canonicalize)")
  dq = jnp.concatenate([run[0] for run in runs], axis=1)
  keys = lambda i: sum(run[i].astype(jnp.float32) for run in runs)
  dk, dv = keys(1), keys(2)
  if _zigzag(spec, axes):
    dk, dv = context.zigzag(dk, axes.seq_devices), context.zigzag(dv, axes.seq_devices)
  scatter = lambda g, like: lax.psum_scatter(g, axes.seq, scatter_dimension=1,
                                             tiled=True).astype(like.dtype)
  dk, dv = scatter(dk, runs[0][1]), scatter(dv, runs[0][2])
  return _packed_grads(is_packed(ops), dq, dk, dv, runs[0][3:])


def _rows(x, start, stop, axis):
  return None if x is None else lax.slice_in_dim(x, start, stop, axis=axis)


def _packed_grads(packed: bool, dq, dk, dv, rest):
  """The backward's results: (dq, dk, dv, *rest), or (dqkv, *rest) for a packed call."""
  if packed:
    return (jnp.stack([dq, dk, dv], axis=2), *rest)
  return (dq, dk, dv, *rest)


# ---------------------------------------------------------------------------------------------
# Context parallel, ring: each device keeps its own keys and passes them round
# ---------------------------------------------------------------------------------------------

def _ring_steps(spec, axes: _Axes, ops):
  """(the device's query runs, its own key block (k, v, kv_seg), pairs): pairs(step, block)
  lists that step's kernel calls as (query run index, key Chunk, reachable, operands), reachable
  False where no query of the run can see a key of the key run (`_reachable`). At step s a device
  holds the block of device (d - s) mod n, each of whose key runs pairs with each query run:
  q_shift = the query run's first global position - the key run's, each side's lengths counted
  from its own first row, and no sinks (the merge joins them once)."""
  n = axes.seq_devices
  device = lax.axis_index(axes.seq).astype(jnp.int32)
  runs = _query_runs(spec, axes, ops, device)
  S = ops.k.shape[1]

  def pairs(step: int, block):
    k, v, kv_seg = block
    src = (device - step) % n
    out = []
    for i, (q_chunk, fields) in enumerate(runs):
      for k_chunk in context.device_chunks(spec.context_layout, S, n, src):
        cols, size = slice(k_chunk.start, k_chunk.stop), k_chunk.stop - k_chunk.start
        out.append((i, k_chunk, _reachable(spec, q_chunk, fields["q"].shape[1], k_chunk, size),
                    ops._replace(
            **fields, k=k[:, cols], v=v[:, cols],
            kv_seg=None if kv_seg is None else kv_seg[:, cols],
            kv_lens=jnp.clip(ops.kv_lens - k_chunk.shift, 0, size),
            q_shift=jnp.full_like(ops.q_lens, q_chunk.shift - k_chunk.shift), sinks=None)))
    return out

  return runs, (ops.k, ops.v, ops.kv_seg), pairs


def _reachable(spec, q_chunk, q_size: int, k_chunk, k_size: int):
  """Whether the causal mask and the window let some query of a run see some key of another
  (int32 scalar bool; True where neither limits them): a ring step that cannot is not run. Runs
  of consecutive global positions from their chunks' shifts."""
  q_first, q_last = q_chunk.shift, q_chunk.shift + q_size - 1
  k_first, k_last = k_chunk.shift, k_chunk.shift + k_size - 1
  ok = jnp.bool_(True)
  if spec.is_causal:
    ok = ok & (k_first <= q_last)
  if spec.window is not None:
    left, right = spec.window
    ok = ok & (k_first <= q_last + right) & (k_last >= q_first - left)
  return ok


def _pass_on(arrays, axes: _Axes):
  """Each device's arrays to the next device round the ring (None stays None)."""
  n = axes.seq_devices
  perm = [(i, (i + 1) % n) for i in range(n)]
  return tuple(None if x is None else lax.ppermute(x, axes.seq, perm) for x in arrays)


def _ring_forward(forward: Callable, spec, config, axes: _Axes, ops, fp32_steps: bool = False):
  """(O, O residual, LSE) of one device under the ring: n steps, each the device's queries
  against the key block it holds (the next block already on its way), merged in fp32 by
  tile.merge_blocks (the sinks joined once, there). fp32_steps (the backend's forward honours
  an fp32 residual_o): each step returns its O before the final rounding, so the merged O is
  rounded once, as the one-device call's; otherwise each step's O comes rounded to the input
  dtype."""
  ops = unpack(ops)
  runs, block, pairs = _ring_steps(spec, axes, ops)
  step_spec = (dataclasses.replace(spec, numerics=spec.numerics.with_fp32_residual())
               if fp32_steps and spec.numerics.residual_o != "float32" else spec)
  parts = [[] for _ in runs]
  for step in range(axes.seq_devices):
    # Issued before this block's kernels, the transfer of the next block can overlap them.
    upcoming = _pass_on(block, axes) if step < axes.seq_devices - 1 else None
    for i, _, reachable, pair in pairs(step, block):
      # A pair the masks keep apart runs no kernel: O 0, LSE "no key" (the merge drops it).
      _, o_res, lse = lax.cond(
          reachable, lambda pair: forward(step_spec, config, pair),
          lambda pair: _no_keys(step_spec, pair), pair)
      parts[i].append((o_res, lse))
    block = upcoming
  merged = [tile.merge_blocks([o for o, _ in p], [l for _, l in p], sink=ops.sinks)
            for p in parts]
  o = jnp.concatenate([m[0] for m in merged], axis=1)
  lse = jnp.concatenate([m[1] for m in merged], axis=2)
  dt = spec.numerics.dtypes(ops.q.dtype)
  out = tile.round_convert(o, dt.out).astype(dt.input)
  residual = o if jnp.dtype(dt.residual_o) == jnp.float32 else out
  return out, residual.astype(dt.residual_o), lse


def _no_keys(spec, ops):
  """A forward's results where no query sees any key: (O, O residual, LSE) = (0, 0, no key)."""
  dt = spec.numerics.dtypes(ops.q.dtype)
  rows = ops.q.shape
  lse = jnp.full((rows[0], rows[2], rows[1]), tile.EMPTY_ROW_LSE, jnp.float32)
  return jnp.zeros(rows, dt.input), jnp.zeros(rows, dt.residual_o), lse


def _no_grads(ops):
  """A backward's results where no query sees any key: zero dq, dk, dv (no bias: the ring
  refuses one)."""
  return (jnp.zeros_like(ops.q), jnp.zeros_like(ops.k), jnp.zeros_like(ops.v), None)


def _ring_backward(backward: Callable, spec, config, axes: _Axes, ops, o_res, lse, do, dlse):
  """One device's gradients under the ring: at each step the backward of its queries against
  the key block it holds (with the call's own O and LSE); dQ sums in fp32 on the device, dK and
  dV in fp32 accumulators that travel with their block and reach its owner after the last step."""
  packed, ops = is_packed(ops), unpack(ops)
  runs, block, pairs = _ring_steps(spec, axes, ops)
  f32 = jnp.float32
  dq = [jnp.zeros(fields["q"].shape, f32) for _, fields in runs]
  dkv = (jnp.zeros(ops.k.shape, f32), jnp.zeros(ops.v.shape, f32))
  rest = ()
  for step in range(axes.seq_devices):
    upcoming = _pass_on(block, axes) if step < axes.seq_devices - 1 else None
    dk, dv = dkv
    for i, k_chunk, reachable, pair in pairs(step, block):
      a, b = runs[i][0].start, runs[i][0].stop
      args = (pair, _rows(o_res, a, b, 1), _rows(lse, a, b, 2), _rows(do, a, b, 1),
              _rows(dlse, a, b, 2))
      grads = lax.cond(reachable, lambda *args: tuple(backward(spec, config, *args)),
                       lambda pair, *_: _no_grads(pair), *args)
      dq[i] = dq[i] + grads[0].astype(f32)
      cols = slice(k_chunk.start, k_chunk.stop)
      dk = dk.at[:, cols].add(grads[1].astype(f32))
      dv = dv.at[:, cols].add(grads[2].astype(f32))
      rest = grads[3:]
    # The gradients follow their block; the pass after the last step brings them home.
    dkv = _pass_on((dk, dv), axes)
    block = upcoming
  dq = jnp.concatenate(dq, axis=1).astype(ops.q.dtype)
  dk, dv = dkv[0].astype(ops.k.dtype), dkv[1].astype(ops.v.dtype)
  return _packed_grads(packed, dq, dk, dv, rest)


# ---------------------------------------------------------------------------------------------
# Context parallel, alltoall: each device trades its positions for a share of the heads
# ---------------------------------------------------------------------------------------------

def _dims(row: Operand, names) -> list:
  return [d for d, a in enumerate(row.axes) if a in names]


def _to_heads(x, axes: _Axes, heads: int, seq: int, zigzag: bool):
  """x split over the devices along its sequence dim `seq` (in the zigzag order where `zigzag`)
  -> every position, in natural order, of the device's 1/n of its heads (dim `heads`)."""
  x = lax.all_to_all(x, axes.seq, heads, seq, tiled=True)
  return context.unzigzag(x, axes.seq_devices, axis=seq) if zigzag else x


def _to_sequence(x, axes: _Axes, heads: int, seq: int, zigzag: bool):
  """The inverse of `_to_heads`: the device's 1/n of the heads at every position -> all its
  heads at its own positions."""
  x = context.zigzag(x, axes.seq_devices, axis=seq) if zigzag else x
  return lax.all_to_all(x, axes.seq, seq, heads, tiled=True)


def _heads_ops(spec, axes: _Axes, ops):
  """One device's operands under alltoall: its 1/n of the (kv) heads at every position, in natural
  order -- per-head arrays (q, k, v, qkv, offsets) through an all-to-all, per-position ones
  (segment ids) gathered, per-head ones (sinks) sliced; lengths as they are. The kernels then
  run the one-device call on those heads: no q_shift, nothing to merge."""
  device, zigzag = lax.axis_index(axes.seq), _zigzag(spec, axes)
  fields = {}
  for row, x in type(ops).TABLE.present(ops):
    heads, seq = _dims(row, ("heads", "kv_heads")), _dims(row, ("query", "key"))
    if heads and seq:
      # The offsets are the api's, at natural positions; the rest come in the caller's order.
      x = _to_heads(x, axes, heads[0], seq[0], zigzag and row.name != "offset")
    elif seq:
      x = lax.all_gather(x, axes.seq, axis=seq[0], tiled=True)
      x = context.unzigzag(x, axes.seq_devices, axis=seq[0]) if zigzag else x
    elif heads:
      size = x.shape[heads[0]] // axes.seq_devices
      x = lax.dynamic_slice_in_dim(x, device * size, size, axis=heads[0])
    fields[row.name] = x
  return ops._replace(**fields)


def _relabel(x, n: int, to_block: bool):
  """A device's O residual in the heads layout [B, T, N / n, H] <-> the shape of its block of O
  [B, T / n, N, H] (to_block): the same elements, batch and head dim in place, nothing moved."""
  B, T, N, H = x.shape
  return x.reshape((B, T // n, N * n, H) if to_block else (B, T * n, N // n, H))


def _o_residual(x, ops, axes: _Axes, zigzag: bool, to_block: bool):
  """The O residual between alltoall's forward and backward (to_block: leaving the forward).
  Without sinks it stays on its device, relabelled (`_relabel`): only this module's backward
  reads it. With sinks it is traded like O, since flash.py reads it as O for the sinks' gradient."""
  if ops.sinks is None:
    return _relabel(x, axes.seq_devices, to_block)
  trade = _to_sequence if to_block else _to_heads
  return trade(x, axes, 2, 1, zigzag)


def _alltoall_forward(forward: Callable, spec, config, axes: _Axes, ops):
  """(O, O residual, LSE) of one device under alltoall: the one-device forward on its share of
  the heads, O and LSE traded back for its own positions and every head, the O residual as
  `_o_residual` says (without sinks it crosses no device: trading it out and back cost 0.5-1.3%
  of fwd+bwd on 2 H200s at T 64k)."""
  zigzag = _zigzag(spec, axes)
  o, o_res, lse = forward(spec, config, _heads_ops(spec, axes, ops))
  return (_to_sequence(o, axes, 2, 1, zigzag), _o_residual(o_res, ops, axes, zigzag, True),
          _to_sequence(lse, axes, 1, 2, zigzag))


def _alltoall_backward(backward: Callable, spec, config, axes: _Axes, ops, o_res, lse, do, dlse):
  """One device's gradients under alltoall: the one-device backward on its share of the heads
  (dO, LSE and dLSE traded like the operands, the O residual as `_o_residual` says), each
  gradient (dq, dk, dv or dqkv; no bias here) traded back. The
  sinks' gradient is not the kernels' (flash.py)."""
  zigzag = _zigzag(spec, axes)
  stats = lambda x: None if x is None else _to_heads(x, axes, 1, 2, zigzag)
  grads = backward(spec, config, _heads_ops(spec, axes, ops),
                   _o_residual(o_res, ops, axes, zigzag, False), stats(lse),
                   _to_heads(do, axes, 2, 1, zigzag), stats(dlse))
  out = []
  for row, g in zip([r for r in type(ops).TABLE.rows if r.grad], grads):
    if g is not None:
      heads, seq = _dims(row, ("heads", "kv_heads")), _dims(row, ("query", "key"))
      g = _to_sequence(g, axes, heads[0], seq[0], zigzag)
    out.append(g)
  return tuple(out)


# ---------------------------------------------------------------------------------------------
# Explicit sharding: the types say how the operands are split, so the call is split at trace time
# ---------------------------------------------------------------------------------------------

def explicit_mesh(arrays):
  """The mesh of the first operand's type where every one of its axes that splits anything is
  Explicit (the types then say how every operand is split), else None."""
  mesh = getattr(jax.typeof(arrays[0]).sharding, "mesh", None)
  kinds = [kind for kind, size in zip(getattr(mesh, "axis_types", ()),
                                      getattr(mesh, "axis_sizes", ())) if size > 1]
  if kinds and all(kind == AxisType.Explicit for kind in kinds):
    return mesh
  return None


def _shard_mapped(make_local: Callable, layout: _Layout, arrays, mesh, out_specs: Callable,
                  restore: bool = False):
  """make_local(axes, specs)(*shards), each device's call, under jax.shard_map over `mesh`: the
  operands resharded to the table's specs first (a no-op where they already are), results split
  by out_specs(axes, specs); with `restore`, each result resharded back to its operand's own
  sharding (gradients). Inputs split where the kernels cannot take them are refused here, at trace
  time."""
  n_ops = len(layout.names)
  types = [jax.typeof(x) for x in arrays]
  axes = _axes(mesh, layout, types[:n_ops])
  specs = _arg_specs(layout, types, axes)
  arrays = [jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]
  outs = jax.shard_map(make_local(axes, specs), mesh=mesh, in_specs=tuple(specs),
                       out_specs=tuple(out_specs(axes, specs)), check_vma=False)(*arrays)
  if not restore:
    return outs
  own = {name: NamedSharding(mesh, P(*_spec(t, t.ndim))) for name, t in zip(layout.names, types)}
  return tuple(jax.sharding.reshard(g, own[row.name])
               for row, g in zip(layout.grad_rows(), outs))


def on_explicit_axes(call: Callable, ops):
  """call(ops) -> (O, LSE) of a backend that does not split itself (jnp code XLA partitions:
  reference, xla), where the operands' types carry Explicit mesh axes: under jax.shard_map over the
  query's batch and head axes, each device on its own rows and heads as the kernels run, the
  operands resharded to the table's specs first (sinks, bias and offsets follow the heads) and
  the gradients back to their operands' shardings. Without Explicit axes, call(ops). A split the
  kernels could not take either (a sequence, a head dim) is refused with the same ValueError."""
  layout, arrays = _flat(ops)
  mesh = explicit_mesh(arrays)
  if mesh is None:
    return call(ops)
  outputs = lambda axes, specs: [P(*(axes.of(a) for a in out)) for out in (ROW_AXES, LSE_AXES)]
  return _shard_mapped(lambda axes, specs: lambda *shards: tuple(call(layout.ops(shards))),
                       layout, arrays, mesh, outputs)


def _per_device(mesh, fn: Callable) -> Callable:
  """fn, the per-device computation custom_partitioning traces at compile time, traced with the
  mesh's axes Auto: under a caller's Explicit mesh (jax.set_mesh), JAX 0.12 traces it with the
  ambient explicit types, whose sharding annotations then stay in the partitioned module (CPU:
  "No registered implementation for untyped custom call to Sharding"); JAX 0.10 and 0.11 trace it
  in the partitioner's own axis context."""
  names = tuple(getattr(mesh, "axis_names", ()))
  if not names or not hasattr(mesh, "abstract_mesh"):
    return fn
  auto = mesh.abstract_mesh.update(axis_types=(AxisType.Auto,) * len(names))

  def run(*arrays):
    with jax.sharding.use_abstract_mesh(auto):
      return fn(*arrays)
  return run


def _auto_axes(call: Callable, layout: _Layout, arrays, out_specs: Callable):
  """call(*arrays), with the mesh's Explicit axes made Auto inside it (where custom_partitioning
  splits the kernels) when the operands' types carry some (a mesh of Explicit and Auto axes); a
  query sharded where the kernels cannot take it is rejected here, at trace time. out_specs(axes,
  operand specs) -> result specs. auto_axes works in the context's mesh: without jax.set_mesh it
  is entered here, or the types inside keep their Explicit shardings (and a Pallas kernel's refs
  with them)."""
  mesh = getattr(jax.typeof(arrays[0]).sharding, "mesh", None)
  explicit = tuple(name for name, kind in zip(getattr(mesh, "axis_names", ()),
                                              getattr(mesh, "axis_types", ()))
                   if kind == AxisType.Explicit)
  if not explicit:
    return call(*arrays)
  n_ops = len(layout.names)
  types = [jax.typeof(x) for x in arrays[:n_ops]]
  axes = _axes(mesh, layout, types)
  specs = [P(*_spec(t, t.ndim)) for t in types]
  run = auto_axes(lambda *a: tuple(call(*a)), axes=explicit,
                  out_sharding=tuple(out_specs(axes, specs)))
  context = (jax.sharding.use_abstract_mesh(mesh) if jax.sharding.get_abstract_mesh().empty
             else contextlib.nullcontext())
  with context:
    return run(*arrays)


# ---------------------------------------------------------------------------------------------
# vmap: custom_partitioning has no batching rule; fold the vmapped axis into the batch
# ---------------------------------------------------------------------------------------------

def _batched(call: Callable, layout: _Layout, arrays, *, grads: bool):
  """call(*arrays) under a custom_vmap rule: a vmapped axis becomes part of the batch axis of every
  array that has one (its dim 0); a broadcast batch dim is expanded where the vmapped instances
  differ. An array without a batch axis (per-head sinks and offsets) cannot be vmapped. With
  `grads`, the outputs are the gradients of layout.grad_rows(), each returned per instance and
  summed back over a broadcast batch dim."""
  n_outputs = len(layout.grad_rows()) if grads else len(_FORWARD_OUTPUTS)

  @jax.custom_batching.custom_vmap
  def run(*arrays):
    return call(*arrays)

  @run.def_vmap
  def rule(axis_size, in_batched, *arrays):
    rows = layout.rows(len(arrays))
    B = arrays[0].shape[1] if in_batched[0] else arrays[0].shape[0]
    merged = []
    for row, x, batched in zip(rows, arrays, in_batched):
      if "batch" not in row.axes:
        if batched:
          raise ValueError(f"jax.vmap over the {row.arg or row.name} operand is not supported by "
                           f"the Pallas kernels (it has no batch axis, {list(row.axes)}, and is "
                           f"shared by the batch); vmap over the other operands only, or use "
                           f"implementation='reference' or 'xla'")
        merged.append(x)
        continue
      if not batched:
        if row.broadcast and x.shape[0] == 1 and not (grads and row.grad):
          merged.append(x)   # still broadcast over the merged batch
          continue
        x = jnp.broadcast_to(x, (axis_size,) + x.shape)
      if row.broadcast and x.shape[1] == 1:
        x = jnp.broadcast_to(x, (axis_size, B) + x.shape[2:])
      merged.append(x.reshape((axis_size * x.shape[1],) + x.shape[2:]))
    outs = [y.reshape((axis_size, y.shape[0] // axis_size) + y.shape[1:]) for y in call(*merged)]
    if grads:
      outs = _own_batch(layout, arrays, in_batched, outs)
    return tuple(outs), (True,) * n_outputs

  return run(*arrays)


def _own_batch(layout: _Layout, arrays, in_batched, grads):
  """Each broadcast operand's gradient summed back over the batch dim it broadcast over."""
  own = {name: x.shape[1] if batched else x.shape[0]
         for name, x, batched in zip(layout.names, arrays, in_batched)}
  return [jnp.sum(g, axis=1, keepdims=True) if row.broadcast and own[row.name] == 1 else g
          for row, g in zip(layout.grad_rows(), grads)]
