"""The one place where the model calls attention (`--attention IMPL`).

Values of IMPL:
- "auto" and the names in `stable_attn.IMPLEMENTATIONS` (reference, xla, the Pallas kernels, ...):
  ours, `stable_attn.dot_product_attention` (with max_adjust / numerics / beta); "auto" lets
  stable_attn choose the best available kernel.
- "cudnn", "jax_xla": JAX's own `jax.nn.dot_product_attention` (implementation "cudnn" / "xla"), the
  peers we compare against; max_adjust and numerics do not apply to them.
"""

from __future__ import annotations

import contextvars
import functools
from typing import NamedTuple

import jax
from jax.sharding import Mesh, PartitionSpec as P

import stable_attn

OURS = ("auto",) + stable_attn.IMPLEMENTATIONS
FP8_BACKWARD_IMPL = "pallas_mosaic_gpu"   # the one backend with an FP8 backward (--fp8-backward)
JAX_NN = {"cudnn": "cudnn", "jax_xla": "xla"}

def causal_attention(q, k, v, *, implementation: str = "auto", max_adjust: str = "safe",
                     numerics: str = "fast", beta: float = 2.0, fp8_backward: bool = False,
                     segment_ids=None):
  """Causal self-attention.

  q, k, v: [B, T, N, H] in the compute dtype (bf16 in training). segment_ids: None or int32 [B, T]
  document ids (a position attends only within its document). fp8_backward: the Hopper kernel's
  FP8 backward (an FP8 numerics' call, pallas_mosaic_gpu; `check_attention` refuses it
  elsewhere). Returns [B, T, N, H], same dtype.
  """
  if implementation in JAX_NN:
    # jax.nn takes no segment ids: the peers get the equivalent mask.
    mask = (None if segment_ids is None
            else segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                        implementation=JAX_NN[implementation])
  options = _ours(implementation, max_adjust, numerics, beta, fp8_backward)
  return _per_device(lambda q, k, v, ids: stable_attn.dot_product_attention(
      q, k, v, q_segment_ids=ids, **options), q, k, v, segment_ids)


def causal_attention_qkv(qkv, *, packed: bool = True, implementation: str = "auto", **options):
  """causal_attention on a fused projection, qkv [B, T, 3, N, H] (q, k, v on axis 2). packed: ours
  read it in place (stable_attn.dot_product_attention_qkvpacked: on the Hopper kernel no split
  copies in the forward and no concatenation of dq, dk, dv in the backward); False, or a jax.nn
  implementation (which takes q, k and v apart): split first. Same values either way."""
  if not reads_packed(implementation, packed):
    return causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                            implementation=implementation, **options)
  segment_ids = options.pop("segment_ids", None)
  options = _ours(implementation, **options)
  return _per_device(lambda qkv, ids: stable_attn.dot_product_attention_qkvpacked(
      qkv, q_segment_ids=ids, **options), qkv, segment_ids)


def reads_packed(implementation: str, packed: bool = True) -> bool:
  """Whether causal_attention_qkv reads qkv in place (ours, packed) or splits it first."""
  return packed and implementation not in JAX_NN


def _ours(implementation: str, max_adjust: str = "safe", numerics: str = "fast",
          beta: float = 2.0, fp8_backward: bool = False) -> dict:
  """stable_attn's keyword arguments for a causal call of `implementation` (ours or "auto");
  ValueError for a name that is neither ours nor jax.nn's."""
  if implementation not in OURS:
    raise ValueError(f"attention implementation {implementation!r} is not one of "
                     f"{', '.join(OURS + tuple(JAX_NN))}")
  # Pallas kernels (every implementation named pallas*) cannot compile for the CPU; there they run
  # in interpret mode (tests, smoke runs).
  interpret = implementation.startswith("pallas") and jax.default_backend() == "cpu"
  # Under a context-parallel on_mesh the sequence arrives in the zigzag order.
  placement = _MESH.get()
  split = placement is not None and placement.context > 1
  if fp8_backward:   # a config belongs to one backend, named: "auto" picks it on a Hopper GPU
    implementation = FP8_BACKWARD_IMPL
  return dict(is_causal=True, implementation=None if implementation == "auto" else implementation,
              max_adjust=max_adjust, beta=beta, numerics=numerics, interpret=interpret,
              context_layout="zigzag" if split else "contiguous",
              context_strategy=placement.strategy if split else "auto",
              config={"fp8_backward": True} if fp8_backward else None)


def resolved_implementation(mcfg) -> str:
  """The implementation the model's attention call runs (what "auto" picks for its shape, dtype,
  numerics and masking; a named one as given). mcfg: a train.config.ModelConfig."""
  if mcfg.attention != "auto":
    return mcfg.attention
  x = jax.numpy.zeros((1, mcfg.block_size, mcfg.n_head, mcfg.head_dim), mcfg.dtype)
  segments = jax.numpy.zeros((1, mcfg.block_size), "int32") if mcfg.pack_documents else None
  return stable_attn.choose_implementation(x, x, x, is_causal=True, max_adjust=mcfg.max_adjust,
                                           beta=mcfg.beta, numerics=mcfg.numerics,
                                           q_segment_ids=segments).name


def check_attention(cfg) -> None:
  """ValueError unless the run's attention can do what cfg (a train.config.TrainConfig) asks of it
  here: run context parallel (`check_context_parallel`), or its FP8 backward."""
  check_context_parallel(cfg)
  if not cfg.model.fp8_backward:
    return
  impl = resolved_implementation(cfg.model)
  if impl != FP8_BACKWARD_IMPL:
    where = "auto -> " if cfg.model.attention == "auto" else ""
    raise ValueError(f"--fp8-backward: the FP8 backward is the Hopper kernel's "
                     f"({FP8_BACKWARD_IMPL}, on an sm_90 GPU); the attention here is "
                     f"{where}{impl!r}")


def check_context_parallel(cfg) -> None:
  """ValueError unless the attention of a --context-parallel run (cfg: a train.config.TrainConfig)
  runs context parallel: a kernel that partitions itself (stable_attn's GPU kernels; XLA would
  partition the others as if the zigzag order were natural)."""
  if cfg.context_parallel == 1:
    return
  impl = resolved_implementation(cfg.model)
  if not getattr(stable_attn.backends.load(impl), "CONTEXT_PARALLEL", False):
    where = "auto -> " if cfg.model.attention == "auto" else ""
    raise ValueError(f"--context-parallel {cfg.context_parallel}: the attention here is "
                     f"{where}{impl!r}, which does not run context parallel; use a GPU kernel "
                     f"(--attention pallas_mosaic_gpu or pallas_gpu; pallas_gpu runs in "
                     f"interpret mode on a CPU)")


def describe(mcfg) -> str:
  """One line for the log saying what attention actually runs."""
  if mcfg.attention in JAX_NN:
    return (f"jax.nn.dot_product_attention(implementation={JAX_NN[mcfg.attention]!r}) "
            f"(no max adjustment)")
  impl = resolved_implementation(mcfg)
  impl = f"auto -> {impl}" if mcfg.attention == "auto" else impl
  fp8 = ", config={'fp8_backward': True}" if mcfg.fp8_backward else ""
  return (f"stable_attn.dot_product_attention(implementation={impl!r}, "
          f"max_adjust={mcfg.max_adjust!r}, numerics={mcfg.numerics!r}{fp8})")


def short_name(mcfg) -> str:
  """A few words for plot titles and tables, e.g. "stable_attn reference, max_adjust safe, fast"."""
  if mcfg.attention in JAX_NN:
    return f"jax.nn {JAX_NN[mcfg.attention]}"
  return (f"stable_attn {resolved_implementation(mcfg)}, max_adjust {mcfg.max_adjust}, "
          f"{mcfg.numerics}{', FP8 backward' if mcfg.fp8_backward else ''}")


# ---------------------------------------------------------------------------------------------
# Several devices: each device attends over its own rows of the batch (and, context parallel, its
# share of each sequence)
# ---------------------------------------------------------------------------------------------

class _Placement(NamedTuple):
  mesh: Mesh
  context: int  # devices each sequence is split over (the 'context' axis); 1: natural order
  strategy: str = "auto"  # stable_attn's context_strategy there


_MESH = contextvars.ContextVar("train_attention_mesh", default=None)


def on_mesh(mesh, fn, *, split_sequence: bool = True, strategy: str = "auto"):
  """fn, whose attention calls run on each device's rows of the batch under jax.shard_map over
  `mesh` (a jax.sharding.Mesh: the trainer's) while it is traced. What the trainer jits (train,
  eval and monitor steps) is wrapped in it.

  Context parallel (the mesh has a 'context' axis, split_sequence): fn's sequences come split over
  that axis in the zigzag order (train.loop lays batches out so); the model asks `context_devices()`
  for its positions and document ids, and the attention runs stable_attn's context-parallel path
  (keys and values all-gathered over the axis, passed round it, or positions traded for heads:
  `strategy`, stable_attn's context_strategy) with the sequence's sharding stated explicitly.
  split_sequence=False: fn's sequences are whole and in order (the monitors), its rows split over
  every device.

  Why not leave it to stable_attn's own partitioning (custom_partitioning, which the same call takes
  under a plain jit): XLA lowers that op's per-device program anew at every call site, so a 12-layer
  model lowered and compiled its kernels 12 times over (the sharded GPT-2 step compiled in 63 s
  against 20 s on one GPU); under shard_map, or with Explicit shardings (which stable_attn splits at
  trace time), the layers share one jitted kernel call, as on one device."""
  context = mesh.shape.get("context", 1) if split_sequence else 1

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    token = _MESH.set(_Placement(mesh, context, strategy))
    try:
      return fn(*args, **kwargs)
    finally:
      _MESH.reset(token)
  return traced


def jit_on_mesh(mesh, fn, *, split_sequence: bool = True, strategy: str = "auto",
                **jit_kwargs):
  """jax.jit(on_mesh(mesh, fn, split_sequence=..., strategy=...), **jit_kwargs). Context
  parallel, the result traces, lowers and runs with `mesh` set (jax.set_mesh): the attention's
  Explicit shardings (`_context_parallel`) are only built in a concrete mesh's context."""
  jitted = jax.jit(on_mesh(mesh, fn, split_sequence=split_sequence, strategy=strategy),
                   **jit_kwargs)
  if not split_sequence or mesh.shape.get("context", 1) == 1:
    return jitted
  return _InMesh(jitted, mesh)


class _InMesh:
  """A jitted function called and lowered inside jax.set_mesh(mesh)."""

  def __init__(self, jitted, mesh):
    self.jitted, self.mesh = jitted, mesh

  def __call__(self, *args, **kwargs):
    with jax.set_mesh(self.mesh):
      return self.jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args, **kwargs)


def context_devices() -> int:
  """How many devices the sequences being traced are split over, in the zigzag order of
  stable_attn.context (1: whole, natural order): the `context` of the enclosing on_mesh."""
  placement = _MESH.get()
  return 1 if placement is None else placement.context


def _per_device(call, *arrays):
  """call(*arrays) -- each [B, ...] or None -- on each device's rows under the mesh of `on_mesh`;
  directly where there is none or one device; whole on every device where the mesh does not
  divide the batch (the monitors' 4 rows on 8 devices). Context parallel: with the batch over
  'data' and the sequence over 'context' made Explicit, stable_attn splits the call itself."""
  placement = _MESH.get()
  if placement is not None and placement.context > 1:
    return _context_parallel(call, placement.mesh, *arrays)
  mesh = None if placement is None else placement.mesh
  if mesh is None or mesh.size == 1:
    return call(*arrays)
  # Not left to stable_attn's own partitioning: beside FSDP-split projections XLA offers it q, k
  # and v split over heads and head dim by parts of one mesh axis, which no PartitionSpec names,
  # and it would then run them whole on each device (docs/dispatch.md).
  rows = P() if arrays[0].shape[0] % mesh.size else P(tuple(mesh.axis_names))
  return jax.shard_map(call, mesh=mesh, in_specs=tuple(None if a is None else rows for a in arrays),
                       out_specs=rows, check_vma=False)(*arrays)


def _context_parallel(call, mesh, *arrays):
  """call(*arrays) with each present array's [B, T] dims over ('data', 'context') as Explicit
  types: stable_attn's Explicit route (a shard_map at trace time, keys and values all-gathered
  over 'context') instead of a custom_partitioning op per layer."""
  present = [i for i, a in enumerate(arrays) if a is not None]

  def run(*given):
    full = list(arrays)
    for i, a in zip(present, given):
      full[i] = a
    return call(*full)

  spec = P("data", "context")
  explicit = jax.sharding.explicit_axes(run, axes=tuple(mesh.axis_names),
                                        in_sharding=tuple(spec for _ in present))
  return explicit(*(arrays[i] for i in present))
