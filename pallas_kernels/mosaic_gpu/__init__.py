"""implementation="pallas_mosaic_gpu": flash attention for Hopper (sm_90) in Pallas Mosaic GPU.

TMA loads through multi-stage shared-memory pipelines, wgmma, warp specialisation (a producer
warpgroup and two compute warpgroups that ping-pong in the forward, three that run free at head
dim 64), exp2 with log2(e) folded into the softmax scale, the max adjustment of stable_attn.tile;
a deterministic backward (dK/dV and dQ kernels, no atomics), or opt-in (TuningConfig.fused_dq,
refused with deterministic=True) FlashAttention-3's single backward kernel that reduce-adds dQ:
the default table keeps the two kernels at every shape, measured faster. See forward.py,
backward.py and docs/dispatch.md.

What it covers (`covers`): bf16/fp16 on an sm_90 GPU, head dims 64, 128 and 256, numerics "fast",
every max_adjust mode, causal, local windows, lengths, GQA/MQA, T != S and lengths that are not
block multiples (padded), a logits soft cap, attention sinks, segment ids (packed sequences), bias
(with its gradient) and boolean mask operands, streamed by TMA beside K/V (their all-False blocks
neither streamed nor computed: block ranges and a compacted block order per CTA). FP8: with
numerics qkv="e4m3" and p="e4m3" (FlashAttention-3's arithmetic, `fp8_forward`; the "fp8"
preset's top key in bf16 and the "fp8_fast" preset's dither on O too) the forward runs e4m3
wgmma at head dims 64 and 128 (no bias or mask) and the backward the bf16/fp16 kernels on the
dequantized inputs, or with TuningConfig.fp8_backward e4m3 products there too (fp8_backward.py;
docs/fp8.md). Everything else -- other numerics presets, fp32, other head
dims, a bias or mask whose tiles do not fit shared memory even beside 32-key blocks (head dim
256: an fp32 bias, a bias with a mask) -- is
implementation="pallas_gpu" (implementation=None picks it; naming this backend for such a call
raises ValueError with the reason).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Optional

import jax
import jax.numpy as jnp

from stable_attn import fp8
from stable_attn import numerics as numerics_lib
from stable_attn import tile
from stable_attn.flash import make_flash_attention, reduce_to_shape
from stable_attn.layout import Geometry, pad_operands, pad_to, unpad
from stable_attn.spec import (LSE_AXES, ROW_AXES, AttentionSpec, Operands, is_packed, pack,
                               unpack)

from pallas_kernels.mosaic_gpu import tuning
from pallas_kernels.mosaic_gpu.common import (Call, block_ranges, fp8_forward, input_dtype,
                                              relabelled_keys)

__all__ = ["attention", "attention_qkvpacked", "is_available", "covers", "tuning"]

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
  if fp8_forward(spec, ops.q.dtype):
    if H not in FP8_HEAD_DIMS:
      return (f"head dim {H}: the FP8 forward (numerics {spec.numerics.name!r}) covers "
              f"{FP8_HEAD_DIMS}")
    if ops.bias is not None or ops.mask is not None:
      return f"numerics {spec.numerics.name!r}: the FP8 forward takes no bias or mask operands"
    p_top = spec.numerics.dtypes(ops.q.dtype).p_top
    if p_top is not None and jnp.dtype(p_top) not in (jnp.dtype(fp8.E4M3), jnp.dtype(jnp.bfloat16)):
      return (f"numerics {spec.numerics.name!r}: the FP8 forward keeps a top key's P_bar in "
              f"bfloat16 only (its rounding residual is an e4m3 value: tile.rescale), "
              f"not {jnp.dtype(p_top).name}")
  elif spec.numerics.dtypes(ops.q.dtype) != numerics_lib.FAST.dtypes(ops.q.dtype):
    return (f"numerics {spec.numerics.name!r}: the Hopper kernels compute the 'fast' rounding "
            f"(fp32 scores and statistics, P in the input dtype), or that with qkv='e4m3' and "
            f"p='e4m3' (any p_scale): the FP8 forward")
  try:
    default_config(spec, ops)
  except ValueError as e:
    return f"the bias and mask tiles do not fit shared memory: {e}"
  return None


# The FP8 forward's head dim and key block: a 128-byte swizzle holds 128 e4m3 values, the K of
# one wgmma group (Q K^T reduces over the head dim, P V over the keys).
FP8_K = 128
FP8_HEAD_DIMS = (64, 128)


def default_config(spec: AttentionSpec, ops: Operands) -> tuning.TuningConfig:
  """The table's config for this call (`tuning.table_config`): its head dim, the bias and mask
  tiles' room, whether every query sees every key (no causal or window mask, no segment ids:
  equal dK/dV tiles, no persistent dK/dV kernel), and with it no GQA (whose dK/dV CTAs each walk
  a group of query heads: three warpgroups measured 0.96x there), whether it has segment ids, how
  many key tiles the dK/dV kernel has (few: persistent at head dim 128 too), whether it is causal
  with nothing else bounding a CTA's work (grids heaviest first), and whether it has a
  bias without a mask (the forward's three warpgroups take its tiles), and whether its forward
  is the "fp8" preset's (a top-key residual tile: two warpgroups at head dim 128). ValueError
  when the tiles do not fit."""
  full = not spec.is_causal and spec.window is None and ops.q_seg is None
  B, S, K, H = ops.k.shape
  return tuning.table_config(H, jnp.dtype(ops.q.dtype).itemsize, full=full,
                             dense=full and K == ops.q.shape[2], packed=ops.q_seg is not None,
                             causal=spec.is_causal and spec.window is None and ops.q_seg is None,
                             kv_shape=(B, K, S),
                             entry_registers=tuning.registers_fixed_at_entry(jax.__version__),
                             bias_only=ops.bias is not None and ops.mask is None,
                             top_residual=fp8_forward(spec, ops.q.dtype)
                             and tile.has_top_residual(spec.numerics.dtypes(ops.q.dtype)),
                             **_extras(ops))


def _ds_dtype(ops: Operands):
  """dS's dtype for a bias's gradient, or None without a bias: the bias's own (as tokamax does),
  also where dS is then summed over the bias's broadcast dims -- that sum accumulates in fp32, so
  the one extra rounding is of each dS element, the size of dbias's own final rounding. An fp32
  dS would double the bytes the dQ kernel writes and XLA reads back (measured: most of what a
  [1, N, T, T] bias cost over plain attention at the GPT-2 shape)."""
  return None if ops.bias is None else jnp.dtype(ops.bias.dtype)


def _fp8_smem(spec: AttentionSpec, ops: Operands) -> dict:
  """What the FP8 forward's tiles take (tuning.TuningConfig.smem_needs' fp8 arguments)."""
  if not fp8_forward(spec, ops.q.dtype):
    return {}
  return dict(fp8=True, fp8_residual=tile.has_top_residual(spec.numerics.dtypes(ops.q.dtype)))


def _extras(ops: Operands) -> dict:
  """The shared memory the bias and mask tiles take (tuning.TuningConfig.smem_problem)."""
  if ops.bias is None and ops.mask is None:
    return {}
  bias = 0 if ops.bias is None else jnp.dtype(ops.bias.dtype).itemsize
  ds = _ds_dtype(ops)
  return dict(beside=bias + (ops.mask is not None), bias=bias,
              ds_itemsize=0 if ds is None else jnp.dtype(ds).itemsize)


def _call(spec: AttentionSpec, config: tuning.TuningConfig, ops: Operands) -> Call:
  """ops: Operands or PackedOperands."""
  geo = Geometry.of(ops)
  return Call(spec, geo, geo.padded(config.q_multiple, config.kv_multiple),
              spec.numerics.dtypes(input_dtype(ops)), config, packed=ops.q_seg is not None)


def _padded(ops: Operands, call: Call) -> Operands:
  """The operands padded for the kernels; bias and mask with their query and key dims
  materialised (TMA copies tiles of them) and the mask as int8; without the FP8 scales and
  payloads (only `_fp8_operands` reads them, from the unpadded operands)."""
  x = pad_operands(ops, call.pad)
  pairwise = {}
  for name in ("bias", "mask"):
    a = getattr(x, name)
    if a is not None:
      a = jnp.broadcast_to(a, a.shape[:2] + (call.pad.T, call.pad.S))
      pairwise[name] = a.astype(jnp.int8) if name == "mask" else a
  return x._replace(**pairwise, **dict.fromkeys(fp8.ROWS))


def _fp8_operands(x: Operands, scales: Operands, pad, groups: int, relabelled: bool = False,
                  v_transposed: bool = True) -> Operands:
  """Padded Operands (q, k, v already quantized: stable_attn.fp8) -> q and k as e4m3 [B, Tp, N|K,
  H], v as e4m3 V^T [B, K, H, Sp] (FP8 wgmma takes both operands K-major: P V reduces over keys;
  relabelled: its keys in common.relabelled_keys order, for a P kept in registers; not
  v_transposed: V as stored, [B, Sp, K, H], for the FP8 backward's dO V^T), and their descale
  factors per query head: qk_descale (q's times its kv head's k's) and v_descale. The e4m3 values
  are the api's payloads (`scales`: the unpadded operands, with q_scale, k_scale, v_scale and
  q_e4m3, k_e4m3, v_e4m3), padded to `pad` (the call's Padded); where a payload is absent (a
  context-parallel step's keys, a caller of the backend), the quantized value times its scale,
  exact, one pass over it."""
  q_scale, k_scale, v_scale = (getattr(scales, name) for name in fp8.SCALE_ROWS)
  if q_scale is None or k_scale is None or v_scale is None:
    raise ValueError("the FP8 forward takes q, k and v with the per-head scales they were "
                     "quantized under (operands q_scale, k_scale, v_scale: "
                     "stable_attn.fp8.quantize_inputs, which dot_product_attention calls)")
  table = type(scales).TABLE

  def e4m3(name, scale):
    payload = getattr(scales, f"{name}_e4m3")
    if payload is not None:
      return pad_to(payload, table[f"{name}_e4m3"].axes, pad)
    return (getattr(x, name).astype(jnp.float32) * scale[None, None, :, None]).astype(fp8.E4M3)

  per_query_head = lambda kv_scale: jnp.repeat(kv_scale, groups)
  v = e4m3("v", v_scale)
  if v_transposed:
    v = jnp.transpose(v, (0, 2, 3, 1))
    if relabelled:
      # The key order as a pass of its own after the transpose: fused into it, XLA writes V^T and
      # the backward's bf16 V in one loop fusion (not its tiled transpose): fwd+bwd 2.33 -> 2.20
      # ms at B4 T4096 N16 H128 causal, the forward alone 0.655 -> 0.683 ms (H200, JAX 0.11.2,
      # one process).
      v = relabelled_keys(jax.lax.optimization_barrier(v))
  return x._replace(q=e4m3("q", q_scale), k=e4m3("k", k_scale), v=v,
                    qk_descale=1.0 / (q_scale * per_query_head(k_scale)),
                    v_descale=1.0 / per_query_head(v_scale))


def forward_inputs(spec: AttentionSpec, config: tuning.TuningConfig, ops: Operands):
  """-> (Call, padded operands, block ranges): what `forward.forward_call` takes for this call
  (the FP8 forward's e4m3 operands and descales included)."""
  call = _call(spec, config, ops)
  x = _padded(ops, call)
  if call.fp8:
    x = _fp8_operands(unpack(x), ops, call.pad, call.geo.G, config.fp8_p_registers)
  return call, x, block_ranges(x, config.fwd.block_q, config.fwd.block_kv, "query")


def _forward(spec: AttentionSpec, config: tuning.TuningConfig, ops: Operands):
  from pallas_kernels.mosaic_gpu.forward import forward_call
  call, x, ranges = forward_inputs(spec, config, ops)
  o, lse = forward_call(call, x, ranges)
  o = unpad(o, ROW_AXES, call.geo)
  return o, o, unpad(lse, LSE_AXES, call.geo)


def _backward(spec: AttentionSpec, config: tuning.TuningConfig, ops: Operands, o_res, lse, do,
              dlse=None):
  from pallas_kernels.mosaic_gpu.backward import backward_call
  call = _call(spec, config, ops)
  if call.fp8 and config.fp8_backward:   # e4m3 products (fp8_backward.py)
    from pallas_kernels.mosaic_gpu.fp8_backward import fp8_backward
    grads = fp8_backward(spec, config, unpack(ops), o_res, lse, do, dlse)
    return ((jnp.stack(grads, axis=2),) if is_packed(ops) else grads) + (None,)
  x = _padded(ops, call)._replace(offset=None)   # the backward reads the LSE instead
  rows = lambda a: pad_to(a.astype(input_dtype(ops)), ROW_AXES, call.pad)
  lse = pad_to(lse, LSE_AXES, call.pad, tile.EMPTY_ROW_LSE)
  if dlse is not None:
    dlse = pad_to(dlse, LSE_AXES, call.pad)
  *grads, ds = backward_call(call, x, rows(o_res), lse, rows(do), dlse, _ds_dtype(ops))
  dbias = None
  if ds is not None:
    geo = call.geo
    ds = ds[:, :, :geo.T, :geo.S].astype(jnp.float32)   # fused into the sum
    dbias = reduce_to_shape(ds, ops.bias.shape).astype(ops.bias.dtype)
  # dq, dk, dv (or the packed dqkv) unpadded by their table rows, then dbias.
  rows_of = [row for row in type(ops).TABLE.rows if row.grad and row.name != "bias"]
  return tuple(unpad(g, row.axes, call.geo) for row, g in zip(rows_of, grads)) + (dbias,)


_flash = make_flash_attention(_forward, _backward, partition=True, context_parallel=True)
SHARDS_ITSELF = True   # custom_partitioning / shard_map (stable_attn.partition)
CONTEXT_PARALLEL = True   # a sequence-sharded call runs context parallel (stable_attn.partition)
# Takes q, k and v's FP8 scales and e4m3 payloads (stable_attn.fp8.ROWS): `_fp8_operands`.
FP8_SCALES = True


def attention(spec: AttentionSpec, ops: Operands,
              config: Optional[tuning.TuningConfig] = None) -> jax.Array:
  """(O [B, T, N, H] in the input dtype, LSE fp32 [B, N, T]); differentiable in q, k and v."""
  return _flash(spec, _checked_config(spec, ops, config), ops)


def attention_qkvpacked(spec: AttentionSpec, ops: Operands, qkv: jax.Array,
                        config: Optional[tuning.TuningConfig] = None) -> jax.Array:
  """`attention` with ops.q, ops.k, ops.v the slices of qkv [B, T, 3, N, H] (checked and tuned on
  them): the kernels take PackedOperands and read q, k and v in place from qkv (TMA copies of its
  strided rows: no split copies), and the gradient comes back packed, the dQ kernel writing slot
  0 and the dK/dV kernel slots 1 and 2 of the same buffer (no concatenation). Same kernels, same
  results, bitwise."""
  return _flash(spec, _checked_config(spec, ops, config), pack(qkv, ops))


def _table_config_with(spec: AttentionSpec, ops: Operands,
                       changes: Mapping) -> tuning.TuningConfig:
  """The call's default config with `changes` (TuningConfig field -> value), for a caller who
  cannot know the call's tiles (a trainer asking for fp8_backward=True); ValueError naming a
  field TuningConfig does not have."""
  unknown = sorted(set(changes) - tuning.FIELDS)
  if unknown:
    raise ValueError(f"config for implementation='pallas_mosaic_gpu' changes fields TuningConfig "
                     f"does not have: {', '.join(map(repr, unknown))} (its fields: "
                     f"{', '.join(sorted(tuning.FIELDS))})")
  return default_config(spec, ops).replace(**changes)


def _checked_config(spec: AttentionSpec, ops: Operands, config) -> tuning.TuningConfig:
  """The config to run (the table's when None), checked against the call: ValueError naming what
  does not fit."""
  reason = covers(spec, ops)
  if reason is not None:
    raise ValueError(f"implementation='pallas_mosaic_gpu' does not cover this call: {reason}")
  H, itemsize = ops.q.shape[-1], jnp.dtype(ops.q.dtype).itemsize
  if config is None or isinstance(config, Mapping):
    config = _table_config_with(spec, ops, config or {})
  elif not isinstance(config, tuning.TuningConfig):
    raise ValueError(f"config for implementation='pallas_mosaic_gpu' must be a "
                     f"pallas_kernels.mosaic_gpu.tuning.TuningConfig or a mapping of its fields "
                     f"to change in the call's default, got {config!r}")
  if spec.deterministic and config.fused_dq:
    raise ValueError("config.fused_dq=True reduce-adds dQ in whatever order the CTAs finish, so "
                     "its gradients are not bitwise reproducible; deterministic=True takes the "
                     "two-kernel backward (fused_dq=False)")
  config.check_smem(H, itemsize, **_extras(ops), **_fp8_smem(spec, ops))
  if H == 256 and config.fwd_wgs != tuning.COMPUTE_WGS:
    # 160 registers a thread, of which the [64, 256] fp32 O takes 128: Mosaic GPU failed to
    # compile it (H200, JAX 0.11.2, "Pass pipeline failed"; 64-key blocks do not fit besides)
    raise ValueError(f"config.fwd_wgs={config.fwd_wgs}: at head dim 256 the forward runs "
                     f"{tuning.COMPUTE_WGS} compute warpgroups")
  if config.fp8_backward and not fp8_forward(spec, ops.q.dtype):
    raise ValueError("config.fp8_backward=True is the FP8 forward's backward: it needs numerics "
                     "with qkv='e4m3' and p='e4m3' (e.g. numerics='fp8') and bf16 or fp16 "
                     "inputs at head dim 64 or 128; use fp8_backward=False")
  if fp8_forward(spec, ops.q.dtype) and config.fwd.block_kv != FP8_K:
    raise ValueError(f"config.fwd.block_kv={config.fwd.block_kv}: the FP8 forward's P V product "
                     f"reduces over {FP8_K} keys at a time (e4m3 wgmma); use {FP8_K}")
  # The forward streams a bias tile of all its warpgroups' rows; a mask's compacted block order
  # and the backward kernels' bias and mask tiles are per pair of warpgroups.
  mask, either = ops.mask is not None, bool(_extras(ops))
  for name, takes, present in (("fwd_wgs", "mask", mask), ("dq_wgs", "bias or mask", either),
                               ("dkv_wgs", "bias or mask", either)):
    if getattr(config, name) != tuning.COMPUTE_WGS and present:
      raise ValueError(f"config.{name}={getattr(config, name)} takes no {takes} operands "
                       f"(their tiles stream per pair of warpgroups): use {name}="
                       f"{tuning.COMPUTE_WGS}")
  if config.fwd_persistent and mask:
    raise ValueError("config.fwd_persistent=True takes no mask operand (its blocks stream in a "
                     "per-call compacted order a persistent CTA does not follow): use "
                     "fwd_persistent=False")
  if config.dkv_split and _extras(ops):
    raise ValueError("config.dkv_split=True takes no bias or mask operands (the dK warpgroup "
                     "reads no tiles beside the blocks): use dkv_split=False")
  if config.fwd_bias_apart and ops.bias is not None and not config.has_producer("fwd"):
    raise ValueError("config.fwd_bias_apart=True needs the forward's producer warpgroup (the "
                     "bias streams in a ring per warpgroup that only a producer follows): use "
                     "fwd_bias_apart=False, or producer=True and fwd_producer=None")
  if config.dkv_persistent and _extras(ops):
    raise ValueError("config.dkv_persistent=True takes no bias or mask operands (their blocks "
                     "stream in a per-call order a persistent CTA does not follow): use "
                     "dkv_persistent=False")
  if not is_available():
    raise ValueError("implementation='pallas_mosaic_gpu' needs a Hopper (sm_90) GPU; the default "
                     f"backend is {jax.default_backend()!r}")
  warn_if_slow_toolchain()
  return config


SLOW_TOOLCHAIN = (
    "stable_attn: on JAX {version} ptxas ignores the Hopper kernels' register reallocation "
    "(setmaxnreg, C7504); implementation='pallas_mosaic_gpu' runs kernels without a producer "
    "warpgroup there, at JAX 0.11's speed on causal calls at head dims 128 and 256 but slower on "
    "others (measured: up to 1.2x its JAX 0.11 time, with GQA and at head dim 64); for full speed "
    "pin jax<0.12 (0.11.2 is tested). Why, and a workaround: docs/ptxas_setmaxnreg.md")
_warned = False


def warn_if_slow_toolchain(version: str = jax.__version__) -> bool:
  """Warns once per process (RuntimeWarning, SLOW_TOOLCHAIN) where `version` is JAX 0.12, whose
  Mosaic GPU hands ptxas the kernels in a form where it drops `setmaxnreg` (measured on 0.12.0.1;
  `tuning.registers_fixed_at_entry`, docs/ptxas_setmaxnreg.md). True if it warned on this call."""
  global _warned
  if _warned or not tuning.registers_fixed_at_entry(version):
    return False
  _warned = True
  warnings.warn(SLOW_TOOLCHAIN.format(version=version), RuntimeWarning, stacklevel=2)
  return True
