"""What XLA's SPMD partitioner does with a custom_partitioning op, done by hand for CUDA on a CPU.

stable_attn partitions its Pallas kernels under Auto mesh axes with custom_partitioning
(stable_attn.partition). The per-device program of such an op is traced and lowered only when XLA
partitions the module -- at compile time, which needs a GPU for a CUDA program -- so lowering a
sharded call for CUDA on a CPU never reaches it (the crash of the packed-QKV gradient under 4
GPUs was there: "Cannot lower jaxpr with effects"). `recorded()` keeps every custom_partitioning
op a lowering emits; `lower_partitions(specs)` then runs each one's partitioner with the operand
shardings `specs` gives and lowers the per-device program for the lowering's platform, as the
partitioner callback does (jax/_src/custom_partitioning.py). Private JAX APIs: ImportError or
AttributeError where they moved (the tests skip).
"""
from __future__ import annotations

import contextlib

import jax
from jax.sharding import NamedSharding


@contextlib.contextmanager
def recorded():
  """Inside, every custom_partitioning op lowered is recorded: yields the list of
  (operand avals, result avals, callback info) it fills."""
  from jax._src import custom_partitioning as cp
  from jax._src.interpreters import mlir
  ops, rule = [], cp._custom_partitioning_lowering_rule

  def recording(ctx, *values, **params):
    before = set(cp._sharding_callbacks.keys())
    out = rule(ctx, *values, **params)
    new = [k for k in cp._sharding_callbacks.keys() if k not in before]
    if new:   # None where it lowered inline (one device, a fully manual context)
      ops.append((ctx.avals_in, ctx.avals_out, cp._sharding_callbacks[new[-1]]))
    return out

  mlir.register_lowering(cp.custom_partitioning_p, recording)
  try:
    yield ops
  finally:
    mlir.register_lowering(cp.custom_partitioning_p, rule)


def lower_partitions(ops, spec_of) -> list[str]:
  """Each recorded op's per-device program, lowered: its partitioner given the operands sharded
  as spec_of(aval) -> PartitionSpec says; -> the modules' text. Raises what the partitioner or the
  lowering raises."""
  from jax._src import core, sharding_impls
  from jax._src.interpreters import mlir
  texts = []
  for avals_in, avals_out, info in ops:
    mesh = info.mesh
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec_of(a)))
            for a in avals_in]
    results = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals_out]
    mesh, per_device, _, arg_shardings = info.partition(
        *info.static_args, mesh, info.in_tree.unflatten(args), info.out_tree.unflatten(results))
    tiled = [core.ShapedArray(s.shard_shape(a.shape), a.dtype)
             for s, a in zip(jax.tree.leaves(arg_shardings), avals_in)]
    jaxpr = jax.make_jaxpr(per_device, axis_env=list(mesh.shape.items()))(
        *info.in_tree.unflatten(tiled))
    context = sharding_impls.SPMDAxisContext(mesh, frozenset(mesh.axis_names))
    with core.extend_axis_env_nd(mesh.shape.items()):
      module = mlir.build_mlir_module_helper(
          jaxpr, name="per_device", platforms=info.module_context.platforms,
          backend=info.module_context.backend, axis_context=context)
    texts.append(str(module))
  return texts
