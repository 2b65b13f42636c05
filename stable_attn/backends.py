"""The backend registry: every implementation by name, and what implementation=None picks.

A backend is a module with three functions (the `Backend` protocol):

    attention(spec, ops, config=None) -> (O, LSE)   # config: the backend's own tuning object
    is_available() -> bool                     # can it compile for the default JAX backend?
    covers(spec, ops) -> str | None            # None if it runs this call, else why not

A backend whose kernels split a sharded call themselves (custom_partitioning, or a shard_map on
Explicit mesh axes: stable_attn.partition) says so with `SHARDS_ITSELF = True`, and where they
also run a sequence-sharded call (context parallel) with `CONTEXT_PARALLEL = True`; the others
are jnp code that XLA partitions, run under a shard_map on Explicit axes
(`partition.on_explicit_axes`). A backend may also have
`attention_qkvpacked(spec, ops, qkv, config=None)`, the same call with
ops.q, ops.k, ops.v the slices of qkv [B, T, 3, N, H], which it reads in place (as
`PackedOperands`): what `dot_product_attention_qkvpacked` runs where it exists.

`implementation=None` takes the first registered backend with `auto=True` that is available and
covers the call (the registry's order is the priority order), so a call the fastest kernel does
not cover runs on the next one -- by this table, never silently: `choose_implementation` says
what runs and why the others did not. An explicitly named backend that does not cover a call
raises ValueError with its reason. Adding a backend is its own module plus one line below.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import NamedTuple, Optional, Protocol

import jax

from stable_attn import context, fp8, partition
from stable_attn.spec import AttentionSpec, Operands


class Backend(Protocol):
  def attention(self, spec: AttentionSpec, ops: Operands, config=None) -> tuple: ...
  def is_available(self) -> bool: ...
  def covers(self, spec: AttentionSpec, ops: Operands) -> Optional[str]: ...


@dataclasses.dataclass(frozen=True)
class Registration:
  name: str
  module: str
  auto: bool = True   # may implementation=None pick it?


REGISTRY = (
    Registration("pallas_mosaic_gpu", "pallas_kernels.mosaic_gpu"),
    Registration("pallas_gpu", "pallas_kernels.gpu"),
    Registration("pallas_tpu", "pallas_kernels.tpu"),
    Registration("reference", "stable_attn.reference"),
    Registration("xla", "stable_attn.xla", auto=False),
)
IMPLEMENTATIONS = tuple(r.name for r in REGISTRY)
_BY_NAME = {r.name: r for r in REGISTRY}


def load(name: str) -> Backend:
  """The backend module named `name`; ValueError for unknown or unimportable ones."""
  if name not in _BY_NAME:
    raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {name!r}")
  try:
    return importlib.import_module(_BY_NAME[name].module)
  except Exception as e:
    # Not only ImportError: a kernel module written against one JAX may fail to import on another
    # in any way (an API that changed shape raises KeyError or TypeError at import time), and that
    # must cost only that backend, never implementation=None on every platform.
    raise ValueError(f"implementation={name!r} is not available: {type(e).__name__}: {e}") from e


def _unavailable(name: str) -> Optional[str]:
  """None if the backend imports and can compile for the default JAX backend, else why not."""
  try:
    backend = load(name)
  except ValueError as e:
    return str(e)
  if not backend.is_available():
    return f"not available on the {jax.default_backend()!r} backend"
  return None


class Choice(NamedTuple):
  """What implementation=None runs for a call, and why each backend before it was passed over."""
  name: str
  passed_over: dict  # name -> reason


def choose(spec: AttentionSpec, ops: Operands) -> Choice:
  passed_over = {}
  for reg in REGISTRY:
    if not reg.auto:
      continue
    reason = _unavailable(reg.name)
    if reason is not None:
      passed_over[reg.name] = reason
      continue
    reason = _covers(load(reg.name), spec, ops)
    if reason is None:
      return Choice(reg.name, passed_over)
    passed_over[reg.name] = reason
  # The reference covers every call but a zigzag, ring or alltoall one (only a self-partitioning
  # kernel runs those).
  raise ValueError(f"no available backend runs this call: {passed_over}")


def _covers(backend: Backend, spec: AttentionSpec, ops: Operands) -> Optional[str]:
  """backend.covers, and a zigzag context_layout or a ring or alltoall context_strategy only where
  the backend partitions itself (`CONTEXT_PARALLEL = True`): XLA partitions the others, as if the
  order were natural and with its own collectives."""
  if not getattr(backend, "CONTEXT_PARALLEL", False):
    if spec.context_layout == "zigzag":
      return ("context_layout='zigzag': this backend is partitioned by XLA, which knows nothing "
              "of the order; the GPU kernels (pallas_mosaic_gpu, pallas_gpu) run it")
    if spec.context_strategy in context.KEYS_SPLIT:
      return (f"context_strategy='{spec.context_strategy}': this backend is partitioned by XLA, "
              f"which chooses its own collectives; the GPU kernels (pallas_mosaic_gpu, pallas_gpu) "
              f"run it")
  return backend.covers(spec, ops)


def default_implementation() -> str:
  """The first available backend implementation=None would try on this JAX backend."""
  return next(r.name for r in REGISTRY if r.auto and _unavailable(r.name) is None)


def run(implementation: Optional[str], spec: AttentionSpec, ops: Operands, config=None, qkv=None):
  """Dispatches one canonical call -> (O [B,T,N,H], LSE fp32 [B,N,T]). qkv: None, or the packed
  [B, T, 3, N, H] array that ops.q, ops.k and ops.v are slices of: a backend with
  `attention_qkvpacked` takes it in place of them (PackedOperands; its gradient comes back
  packed), the others run on the slices (the same results: packing only moves memory)."""
  if implementation is None:
    if config is not None:
      raise ValueError("config needs an explicit implementation (it belongs to one backend)")
    implementation = choose(spec, ops).name
  backend = load(implementation)
  reason = _covers(backend, spec, ops)
  if reason is not None:
    raise ValueError(f"implementation={implementation!r} does not cover this call: {reason}")
  if not getattr(backend, "FP8_SCALES", False):
    # q, k and v's FP8 scales and e4m3 payloads are for a backend whose kernels read e4m3
    # (FP8_SCALES = True); the others compute on the quantized values alone.
    ops = ops._replace(**dict.fromkeys(fp8.ROWS))
  # numerics center_v: every backend attends the centred v; the mean joins O here.
  mean, ops = ops.v_mean, ops._replace(v_mean=None)
  if qkv is not None and hasattr(backend, "attention_qkvpacked"):
    out, lse = backend.attention_qkvpacked(spec, ops, qkv, config)
  elif not getattr(backend, "SHARDS_ITSELF", False):
    out, lse = partition.on_explicit_axes(lambda ops: backend.attention(spec, ops, config), ops)
  else:
    out, lse = backend.attention(spec, ops, config)
  if mean is not None:
    out = fp8.add_mean(out, lse, mean, ops.sinks)
  return out, lse
