"""Devices and hosts: jax.distributed start-up, the mesh, parameter and batch shardings.

Data parallel: every device holds a slice of the batch; parameters and optimizer state are
replicated, or with FSDP sharded along their largest dimension divisible by the data axis (XLA
inserts the all-gathers and reduce-scatters). Context parallel (--context-parallel N): a second
mesh axis, 'context', splits each sequence over N devices; parameters are replicated over it.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Environment variables that mean "this process is one of several" to jax.distributed.initialize().
_MULTI_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
_WORLD_SIZE_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_NUM_PROCESSES")


def maybe_initialize_distributed(force: bool = False) -> bool:
  """Call jax.distributed.initialize() when the environment describes a multi-process job.

  Must run before anything touches a JAX backend. Returns whether it initialised.
  """
  multi = any(os.environ.get(k) for k in _MULTI_PROCESS_ENV) or any(
      int(os.environ.get(k, "1") or 1) > 1 for k in _WORLD_SIZE_ENV)
  if not (force or multi):
    return False
  # JAX reads the coordinator address from JAX_COORDINATOR_ADDRESS and detects SLURM / Open MPI /
  # ... itself; for a hand-launched job the process count and id come from JAX_NUM_PROCESSES and
  # JAX_PROCESS_ID.
  kwargs = {}
  if os.environ.get("JAX_NUM_PROCESSES"):
    kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
  if os.environ.get("JAX_PROCESS_ID"):
    kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
  jax.distributed.initialize(**kwargs)
  return True


def make_mesh(context: int = 1) -> Mesh:
  """Every device of every host: a 1-D mesh, axis 'data'; with context > 1, devices / context
  'data' rows of `context` consecutive devices (one host's, where it has that many), axes
  ('data', 'context'). ValueError where `context` does not divide the devices, or (several
  processes) each process's devices."""
  devices = np.asarray(jax.devices())
  if context == 1:
    return Mesh(devices, ("data",))
  if devices.size % context or jax.local_device_count() % context:
    raise ValueError(f"--context-parallel {context} must divide the {devices.size} devices and "
                     f"each process's {jax.local_device_count()} (a sequence's devices share a "
                     f"host)")
  return Mesh(devices.reshape(-1, context), ("data", "context"))


def data_devices(mesh: Mesh) -> int:
  """How many ways the batch is split (the size of the 'data' axis)."""
  return mesh.shape["data"]


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int) -> NamedSharding:
  """Token batches [..., B, T]: B (at batch_axis) over 'data', T (the next dim) over 'context'
  where the mesh has it."""
  spec = [None] * ndim
  spec[batch_axis] = "data"
  if "context" in mesh.axis_names:
    spec[batch_axis + 1] = "context"
  return NamedSharding(mesh, P(*spec))


def param_shardings(params, mesh: Mesh, fsdp: bool):
  """Sharding per parameter leaf: replicated, or (FSDP) split along its largest divisible dim."""
  n = mesh.shape["data"]

  def one(x):
    if not fsdp or n == 1 or x.ndim == 0:
      return replicated(mesh)
    dims = sorted(range(x.ndim), key=lambda d: -x.shape[d])
    for d in dims:
      if x.shape[d] % n == 0:
        spec = [None] * x.ndim
        spec[d] = "data"
        return NamedSharding(mesh, P(*spec))
    return replicated(mesh)

  return jax.tree.map(one, params)


def optimizer_shardings(tx: optax.GradientTransformation, abstract_opt_state, p_shardings,
                        mesh: Mesh):
  """Optimizer-state shardings: moments follow their parameters, scalars (counts) are replicated.

  abstract_opt_state: `jax.eval_shape(tx.init, params)`; p_shardings: `param_shardings(...)`.
  """
  rep = replicated(mesh)
  return optax.tree_map_params(tx, lambda _, s: s, abstract_opt_state, p_shardings,
                               transform_non_params=lambda _: rep,
                               is_leaf=lambda x: isinstance(x, nnx.Variable))


def host_rows(global_batch: int) -> slice:
  """This process's rows of the global batch (contiguous, in process order)."""
  n, i = jax.process_count(), jax.process_index()
  if global_batch % n:
    raise ValueError(f"batch_size {global_batch} is not divisible by the {n} processes")
  per = global_batch // n
  return slice(i * per, (i + 1) * per)


def to_global(local: np.ndarray, sharding: NamedSharding,
              global_shape: tuple[int, ...]) -> jax.Array:
  """Assemble a global jax.Array from each host's rows (works unchanged on a single host)."""
  return jax.make_array_from_process_local_data(sharding, local, global_shape)
