"""implementation="pallas_mosaic_gpu": flash attention for Hopper (sm_90) in Pallas Mosaic GPU.

TMA loads through multi-stage shared-memory pipelines, wgmma, warp specialisation (a producer
warpgroup and two compute warpgroups that ping-pong in the forward), exp2 with log2(e) folded
into the softmax scale, the max adjustment of stable_attn.tile; a deterministic backward (dK/dV and
dQ kernels, no atomics). See forward.py, backward.py and docs/dispatch.md.

What it covers (`covers`): bf16/fp16 on an sm_90 GPU, head dims 64 and 128, numerics "fast", every
max_adjust mode, causal, local windows, lengths, GQA/MQA, T != S and lengths that are not block
multiples (padded), a logits soft cap, attention sinks, segment ids (packed sequences). Everything
else -- bias or mask operands, other numerics presets, fp32, other head dims -- is
implementation="pallas_gpu" (implementation=None picks it; naming this backend for such a call
raises ValueError with the reason).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from stable_attn import numerics as numerics_lib
from stable_attn import tile
from stable_attn.flash import make_flash_attention
from stable_attn.layout import Geometry, pad_operands, pad_to, unpad
from stable_attn.spec import LSE_AXES, OPERANDS, ROW_AXES, AttentionSpec, Operands

from pallas_kernels.mosaic_gpu import tuning
from pallas_kernels.mosaic_gpu.common import Call, segment_sections

__all__ = ["attention", "is_available", "covers", "tuning"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_available() -> bool:
  """True on a CUDA backend whose first device is a Hopper GPU (compute capability 9.x)."""
  try:
    if jax.default_backend() != "gpu":
      return False
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    return capability.split(".")[0] == "9"
  except Exception:  # any backend probing failure means "not available"
    return False


def covers(spec: AttentionSpec, ops: Operands) -> Optional[str]:
  """None if the Hopper kernels run this call, else why not (docs/dispatch.md)."""
  H = ops.q.shape[-1]
  if spec.interpret:
    return "Mosaic GPU kernels have no interpret mode here (use pallas_gpu or reference)"
  if jnp.dtype(ops.q.dtype) not in _DTYPES:
    return f"dtype {jnp.dtype(ops.q.dtype).name}: the Hopper kernels take bfloat16 and float16"
  if H not in tuning.HEAD_DIMS:
    return f"head dim {H}: the Hopper kernels cover {tuning.HEAD_DIMS}"
  if ops.bias is not None or ops.mask is not None:
    return "bias and mask operands run on pallas_gpu"
  if spec.numerics.dtypes(ops.q.dtype) != numerics_lib.FAST.dtypes(ops.q.dtype):
    return (f"numerics {spec.numerics.name!r}: the Hopper kernels compute the 'fast' rounding "
            f"(fp32 scores and statistics, P in the input dtype)")
  return None


def _call(spec: AttentionSpec, config: tuning.TuningConfig, ops: Operands) -> Call:
  geo = Geometry.of(ops)
  return Call(spec, geo, geo.padded(config.q_multiple, config.kv_multiple),
              spec.numerics.dtypes(ops.q.dtype), config, packed=ops.q_seg is not None)


def _forward(spec: AttentionSpec, config: tuning.TuningConfig, ops: Operands):
  from pallas_kernels.mosaic_gpu.forward import forward_call
  call = _call(spec, config, ops)
  x = pad_operands(ops, call.pad)
  fwd = config.fwd
  o, lse = forward_call(call, x, segment_sections(x, fwd.block_q, fwd.block_kv, "query"))
  o = unpad(o, ROW_AXES, call.geo)
  return o, o, unpad(lse, LSE_AXES, call.geo)


def _backward(spec: AttentionSpec, config: tuning.TuningConfig, ops: Operands, o_res, lse, do,
              dlse=None):
  from pallas_kernels.mosaic_gpu.backward import backward_call
  call = _call(spec, config, ops)
  x = pad_operands(ops, call.pad)._replace(offset=None)   # the backward reads the LSE instead
  rows = lambda a: pad_to(a.astype(ops.q.dtype), ROW_AXES, call.pad)
  lse = pad_to(lse, LSE_AXES, call.pad, tile.EMPTY_ROW_LSE)
  if dlse is not None:
    dlse = pad_to(dlse, LSE_AXES, call.pad)
  dq, dk, dv = backward_call(call, x, rows(o_res), lse, rows(do), dlse)
  kv_axes = OPERANDS["k"].axes
  return (unpad(dq, ROW_AXES, call.geo), unpad(dk, kv_axes, call.geo),
          unpad(dv, kv_axes, call.geo), None)


_flash = make_flash_attention(_forward, _backward, partition=True)


def attention(spec: AttentionSpec, ops: Operands,
              config: Optional[tuning.TuningConfig] = None) -> jax.Array:
  """(O [B, T, N, H] in the input dtype, LSE fp32 [B, N, T]); differentiable in q, k and v."""
  reason = covers(spec, ops)
  if reason is not None:
    raise ValueError(f"implementation='pallas_mosaic_gpu' does not cover this call: {reason}")
  if not is_available():
    raise ValueError("implementation='pallas_mosaic_gpu' needs a Hopper (sm_90) GPU; the default "
                     f"backend is {jax.default_backend()!r}")
  H = ops.q.shape[-1]
  if config is None:
    config = tuning.table_config(H)
  elif not isinstance(config, tuning.TuningConfig):
    raise ValueError(f"config for implementation='pallas_mosaic_gpu' must be a "
                     f"pallas_kernels.mosaic_gpu.tuning.TuningConfig, got {config!r}")
  config.check_smem(H, jnp.dtype(ops.q.dtype).itemsize)
  return _flash(spec, config, ops)
