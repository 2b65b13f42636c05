"""stable_attn.dot_product_attention: argument checking, canonical operands, dispatch."""
from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from stable_attn import backends, context, fp8
from stable_attn import numerics as numerics_lib
from stable_attn.backends import IMPLEMENTATIONS, default_implementation
from stable_attn.numerics import Numerics
from stable_attn.reference import tile_dtypes
from stable_attn.spec import OPERANDS, AttentionSpec, Operand
from stable_attn import tile
from stable_attn.tile import MAX_ADJUST_MODES

__all__ = ["dot_product_attention", "dot_product_attention_qkvpacked", "attend",
           "choose_implementation", "default_implementation", "canonicalize", "Options",
           "IMPLEMENTATIONS"]
# float64 (under jax_enable_x64) as jax.nn takes it: computed with the fp32 tile math (see
# reference.tile_dtypes); the Pallas kernels refuse it in covers(), so implementation=None runs it on
# the reference.
_SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
# How error messages name the logical axes (stable_attn.spec).
_LETTERS = {"batch": "B", "query": "T", "key": "S", "heads": "N", "kv_heads": "K", "head_dim": "H"}


@dataclasses.dataclass(frozen=True)
class Options:
  """The keyword arguments of `dot_product_attention` (after query, key, value, bias, mask), as one
  object: what `canonicalize`, `choose_implementation` and `stable_attn.flax.make_attention_fn`
  take. Fields, defaults and meaning are dot_product_attention's (a test keeps them equal)."""
  scale: Optional[float] = None
  is_causal: bool = False
  query_seq_lengths: Any = None
  key_value_seq_lengths: Any = None
  local_window_size: Union[int, tuple[int, int], None] = None
  implementation: Optional[str] = None
  max_adjust: str = "safe"
  beta: float = 2.0
  numerics: Union[str, Numerics] = "fast"
  interpret: bool = False
  config: Any = None
  q_segment_ids: Any = None
  kv_segment_ids: Any = None
  logits_soft_cap: Optional[float] = None
  sinks: Any = None
  deterministic: bool = False
  return_residual: bool = False
  return_residuals: bool = False
  context_layout: str = "contiguous"
  context_strategy: str = "auto"
  fp8_scales: Any = None

  @classmethod
  def of(cls, arguments: dict) -> "Options":
    """The options among a function's arguments (its `locals()`)."""
    return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)})


def dot_product_attention(
    query, key, value, bias=None, mask=None, *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: Union[int, tuple[int, int], None] = None,
    implementation: Optional[str] = None,
    max_adjust: str = "safe",
    beta: float = 2.0,
    numerics: Union[str, Numerics] = "fast",
    interpret: bool = False,
    config=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    logits_soft_cap: Optional[float] = None,
    sinks=None,
    deterministic: bool = False,
    return_residual: bool = False,
    return_residuals: bool = False,
    context_layout: str = "contiguous",
    context_strategy: str = "auto",
    fp8_scales=None,
):
  """Scaled dot-product attention with the max adjustment; a drop-in for jax.nn's.

  B batch, T query length, S key length, N query heads, K key/value heads (K divides N), H head dim.

  Args:
    query: [B, T, N, H] (or [T, N, H]); bf16, fp16, fp32, or float64 (with jax_enable_x64;
      "reference" and "xla" only, computed with float32 tile math as jax.nn computes its
      softmax in float32: float64 results with float32 accuracy).
    key, value: [B, S, K, H] (or [S, K, H]), same dtype as query.
    bias: added to the scaled scores; 4-D (or fewer dims, left-padded) broadcastable to [B,N,T,S].
    mask: bool, broadcastable to [B, N, T, S]; True = attend.
    scale: multiplies Q K^T; default 1/sqrt(H).
    is_causal: key s is visible to query t only if s <= t (top-left aligned when T != S).
    query_seq_lengths, key_value_seq_lengths: int [B] (any integer dtype; jax.nn asks for
      int32); positions at or past the length are padding. Padded query rows return zeros.
      Lengths above T (S) mean T (S). Negative lengths raise ValueError when the values are
      concrete; traced values (under jit) cannot be checked and then mean 0.
    local_window_size: int w or (left, right): query t sees keys t - left .. t + right.
    implementation: None (the fastest available backend that covers the call, see
      `choose_implementation` and docs/dispatch.md), or one of IMPLEMENTATIONS: "pallas_mosaic_gpu"
      (Hopper), "pallas_gpu" (Pallas Triton, NVIDIA), "pallas_tpu", "reference" (blockwise FA2
      emulation in jnp), "xla" (materialised scores). A named backend that does not cover the call
      raises ValueError.
    max_adjust: "off", "paper" (Qiu & Yao's rule) or "safe" (ours; see stable_attn.tile).
    beta: the paper's beta, used by max_adjust="paper".
    numerics: "fast", "paper", "fast+fp32o", "paper+fp32o", "fp8", "fp8_fast", a preset with
      rounding points moved (stable_attn.numerics.resolve: e.g. "fast+p=e4m3+p_scale=256", P_bar
      cast to FP8 with a pre-cast scale) or a `Numerics`. An FP8 P_bar ("fp8", "fp8_fast",
      "p=e4m3") runs on reference, xla and in interpret mode; compiled, the Hopper kernel runs it
      with FP8 q, k, v too ("fast+qkv=e4m3+p=e4m3", any p_scale; "fp8" and "fp8_fast" with bf16
      inputs) at head dim 64 or 128 without a bias or mask, and refuses the rest, as compiled
      pallas_gpu and pallas_tpu do; with max_adjust="safe" use "fp8_fast" (its dither on O, the
      maximum's weight exact in e4m3) or "fp8" (its top key in bf16), not a P whose top key "safe" rounds to
      e4m3; FP8 q, k, v ("qkv=e4m3", in both) are quantized with per-head scales before any
      backend (stable_attn.fp8), and with "+center_v=true" (e.g. "fp8_fast+center_v=true") v
      less its mean over the keys is, the mean added back to O: the same attention, whose P V
      terms no longer all round one way where the Hopper FP8 tensor cores truncate (docs/fp8.md).
    interpret: run Pallas implementations in interpret mode (CPU).
    config: the named implementation's tuning object (e.g. pallas_kernels.gpu.tuning.Config,
      pallas_kernels.tpu.BlockSizes); None uses its defaults. pallas_mosaic_gpu also takes a
      mapping of TuningConfig fields to change in the call's default, e.g.
      {"fp8_backward": True} (an FP8 call's backward in e4m3 products: docs/fp8.md).
    q_segment_ids, kv_segment_ids: int [B, T] and [B, S] (or [T], [S]) document ids of packed
      sequences: query t sees key s only if their ids are equal (combined with everything else;
      causal stays relative to positions in the row). kv_segment_ids may be omitted when T == S.
      A query whose segment has no visible key returns 0 with zero gradients. Key blocks that
      share no document with a query block are skipped (exactly so for ids that do not decrease
      along the row, as packing produces).
    logits_soft_cap: None or a float > 0: the logits scale * QK^T + bias become
      cap * tanh(logits / cap) before masking and the max adjustment (Gemma-style).
    sinks: None or float [N] (finite), one logit per query head that joins every row's softmax
      denominator without a value (attention sinks, as in gpt-oss and splash attention): O is
      sum_s exp(S_s) V_s / (exp(sink) + sum_s exp(S_s)). Differentiable. Not capped, scaled or
      masked; a row with no visible key returns 0 (and LSE = sink). Concrete non-finite sinks
      raise ValueError; traced ones (under jit) cannot be checked, and NaN there gives NaN.
    deterministic: True: the gradients are bitwise reproducible run to run (same inputs, device
      and program; the switch of that name in flash-attn and cuDNN): the backward sums each
      gradient in a fixed order. False (the default) lets a backend pick a backward that
      reduce-adds in whatever order its thread blocks finish -- on Hopper FlashAttention-3's
      fused backward, `TuningConfig(fused_dq=True)` -- where its table measured that faster;
      today it measured slower at every shape, so False runs the same deterministic kernels
      (docs/dispatch.md). deterministic=True with a `config` that asks for such a backward
      raises ValueError. The forward is deterministic either way.
    return_residual: jax.nn's option, with jax.nn's semantics: also return the log-sum-exp of
      each query row as [B, T, N] (or [T, N]) in the input dtype, under stop_gradient.
    return_residuals: ours: also return the log-sum-exp of each query row as [B, N, T] float32,
      differentiable, so that attention over several key blocks can be combined (ring /
      context-parallel attention). At most one of return_residual and return_residuals may be set
      (ValueError otherwise: the two residuals differ in layout, dtype and differentiability).
    context_layout: how a sequence sharded over n devices (context parallelism: q, k, v split
      over their T / S dim on a mesh; each device computes its queries against every key) is
      ordered. "contiguous": device d holds positions [d T/n, (d+1) T/n). "zigzag": the
      sequence cut into 2n chunks, device d holds chunks d and 2n-1-d, so that every device does
      equal causal work; `stable_attn.context.zigzag(x, n)` puts tokens, positions and segment
      ids in that order once, and O and the log-sum-exp come back in it. Positions, lengths,
      causal and window masks are the natural order's; on a call not sharded over its sequence
      (n = 1) both orders are the natural one. "zigzag" takes no bias or mask, and runs on the
      GPU kernels (pallas_mosaic_gpu, pallas_gpu), which partition themselves (ValueError
      elsewhere: XLA would partition the others as if the order were natural).
    context_strategy: how a context-parallel call (see context_layout) meets the keys other
      devices hold. "allgather": K and V (and key segment ids, a bias's or mask's key columns)
      are gathered to every device, dK and dV reduce-scattered back. "ring": each device's K and
      V (and key segment ids) pass round the devices with ppermute, one block a step, the next
      block's transfer issued before this block's kernels; each step's O and log-sum-exp are
      merged in fp32 (tile.merge_blocks) and dK, dV travel round with their block in fp32. A
      device holds two key blocks at a time instead of every key. O is within bf16 rounding of
      the one-device call (pallas_gpu merges each step's unrounded O; the Hopper kernel's steps
      round O to the input dtype first); dQ, dK, dV differ by each step's share's rounding.
      "alltoall": an all-to-all gives each device every position of 1/n of the heads (n must
      divide the query and the key/value heads, times any head sharding), the one-device
      kernels run on them and O, LSE (dQ, dK, dV) are traded back: bitwise the one-device call.
      "auto" (the default): "alltoall" where the heads divide and no bias or mask is given,
      else "allgather" (measured fastest in that order: stable_attn.context.choose_strategy).
      "ring" and "alltoall" take no bias or mask, and run on the GPU kernels only (ValueError
      otherwise); on a call not sharded over its sequence every strategy is the one call.
    fp8_scales: None, or (q_scale [N], k_scale [K], v_scale [K]) float32 powers of two: the
      per-head scales q, k and v are quantized under where the numerics quantize them
      (qkv="e4m3"; ValueError otherwise), e.g. from the amax of earlier steps (delayed scaling:
      `stable_attn.fp8.head_amax`, `scales_from_amax`), so the call need not measure its inputs
      first. None: each call measures its own (`fp8.head_scales`). A value whose |x| * scale
      exceeds e4m3's 448 saturates there; the gradient passes the rounding straight through.
      With center_v, v_scale is that of v less its mean over the keys (`fp8.center`), which
      can be up to twice v's largest |value|: take its amax from the centred v.

  Returns:
    [B, T, N, H] (or [T, N, H]) in the input dtype. Rows with no visible key are 0 and get zero
    gradients. Differentiable in query, key, value and bias (flash backward). With
    return_residuals=True, (out, lse): lse [B, N, T] (or [N, T]) float32, the natural log of each
    row's softmax denominator over its visible keys and sink (-inf for rows with neither),
    differentiable too. With return_residual=True, (out, lse) as jax.nn returns them: lse
    [B, T, N] (or [T, N]) in the input dtype, not differentiated (stop_gradient), and for a row
    with no visible key (and no sink) jax.nn's value, its masked logit -0.7 * float32 max
    (-inf in float16); jax.nn's output in such rows is the mean of V (a softmax over equal masked
    logits) unless query_seq_lengths pads them, ours is 0.
  """
  return attend(query, key, value, bias, mask, Options.of(locals()))


def attend(query, key, value, bias=None, mask=None, options: Optional["Options"] = None):
  """dot_product_attention with its keyword arguments as one `Options` object."""
  options = Options() if options is None else options
  spec, ops, unbatched = canonicalize(query, key, value, bias, mask, options)
  out, lse = _run(options, spec, ops)
  return _results(options, ops, unbatched, out, lse)


def dot_product_attention_qkvpacked(qkv, bias=None, mask=None, **options):
  """Self-attention on a fused QKV projection: `dot_product_attention(q, k, v, bias, mask,
  **options)` with q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2] (flash-attn's
  qkvpacked form).

  qkv: [B, T, 3, N, H] (or [T, 3, N, H]): e.g. a [B, T, 3 * N * H] projection reshaped, whose
  columns are W_Q, W_K, W_V. Takes every keyword argument of dot_product_attention and returns
  the same values; the gradient with respect to qkv comes back in its packed layout.

  Why: on the Hopper kernel ("pallas_mosaic_gpu") q, k and v are read in place from qkv, and the
  backward writes dQ, dK and dV into one [B, T, 3, N, H] gradient -- the XLA copies that a split
  (forward) and its transpose, a concatenation (backward), cost around an attention call that
  takes q, k and v apart are not made. Other backends run on the slices.
  """
  opts = Options(**options)   # TypeError for an unknown keyword, as for any function
  qkv = jnp.asarray(qkv)
  if qkv.ndim not in (4, 5) or qkv.shape[-3] != 3:
    raise ValueError(f"qkv must be [B, T, 3, N, H] (or [T, 3, N, H]): q, k and v stacked on the "
                     f"third-last axis, got shape {qkv.shape}")
  q, k, v = (qkv[..., i, :, :] for i in range(3))
  spec, ops, unbatched = canonicalize(q, k, v, bias, mask, opts)
  packed = qkv[None] if unbatched else qkv
  # FP8 inputs are the quantized slices (stable_attn.fp8), not the packed array.
  out, lse = _run(opts, spec, ops, qkv=packed if spec.numerics.qkv == "input" else None)
  return _results(opts, ops, unbatched, out, lse)


def _run(options: Options, spec: AttentionSpec, ops, qkv=None):
  """backends.run; where T, S or H is 0, what jax.nn returns there without running a kernel: an
  empty output, or zeros when there are no keys (every row then has none: LSE -inf, or its sink's
  logit)."""
  B, T, N, H = ops.q.shape
  S = ops.k.shape[1]
  if min(T, S, H) > 0:
    return backends.run(options.implementation, spec, ops, options.config, qkv=qkv)
  if options.implementation is not None:
    backends.load(options.implementation)   # an unknown name is still refused
  if T and S and (options.return_residuals or options.return_residual):
    # Every row has keys but no scores to weigh them: its log-sum-exp is that of the bias alone.
    raise ValueError(f"head dim H=0 (query {ops.q.shape}) has no log-sum-exp to return: its rows "
                     f"have keys but no scores; drop return_residual(s)")
  if ops.sinks is not None:
    lse = jnp.broadcast_to(ops.sinks.astype(jnp.float32)[None, :, None], (B, N, T))
  else:
    lse = jnp.full((B, N, T), -jnp.inf if spec.return_residuals else tile.EMPTY_ROW_LSE,
                   jnp.float32)
  return jnp.zeros((B, T, N, ops.v.shape[-1]), ops.q.dtype), lse


def _results(options: Options, ops, unbatched: bool, out, lse):
  """The backend's (O, LSE) as dot_product_attention returns them."""
  if options.return_residual:
    lse = jax_nn_residual(lse, ops.q.dtype)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if options.return_residuals or options.return_residual else out


# jax.nn fills masked logits with -0.7 * the float32 maximum (jax._src.nn.functions.
# _get_large_negative, in float32 arithmetic; capped at float32's range for float64), and its
# log-sum-exp over a row where every logit is that value is the value itself (log S is far below
# its ulp). That is what jax.nn's residual holds for a row with no visible key.
_JAX_NN_MASKED_LOGIT = np.float32(-0.7) * np.finfo(np.float32).max


def jax_nn_residual(lse: jax.Array, dtype) -> jax.Array:
  """A backend's LSE [B, N, T] fp32 (rows without a visible key: tile.EMPTY_ROW_LSE, or -inf) ->
  jax.nn's return_residual: [B, T, N] in `dtype` (the input dtype), under stop_gradient, rows
  without a key holding jax.nn's masked logit (in float16 that is -inf, as jax.nn's)."""
  empty = tile.no_visible_key(lse)
  lse = jnp.where(empty, jnp.asarray(_JAX_NN_MASKED_LOGIT, lse.dtype), lse)
  return jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(dtype))


def choose_implementation(query, key, value, bias=None, mask=None, **options) -> backends.Choice:
  """What implementation=None runs for these arguments (same as dot_product_attention's), and why
  each faster backend was passed over: `Choice(name, passed_over={name: reason})`."""
  spec, ops, _ = canonicalize(query, key, value, bias, mask, Options(**options))
  return backends.choose(spec, ops)


choose_implementation.__signature__ = inspect.signature(dot_product_attention).replace(
    return_annotation=backends.Choice)
dot_product_attention_qkvpacked.__signature__ = inspect.signature(dot_product_attention).replace(
    parameters=[inspect.Parameter("qkv", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + list(inspect.signature(dot_product_attention).parameters.values())[3:])


# ---------------------------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------------------------

def _as_4d(x, name, allow_3d):
  try:
    x = jnp.asarray(x)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be an array [B, T|S, heads, H], got {type(x).__name__}") \
        from None
  if x.ndim == 3 and allow_3d:
    return x[None]
  if x.ndim != 4:
    raise ValueError(f"{name} must have rank 4 [B, T|S, heads, H]{' or 3' if allow_3d else ''}, "
                     f"got shape {x.shape}")
  return x


def _kind_ok(row: Operand, dtype) -> bool:
  if row.dtype == "bool":
    return dtype == jnp.bool_
  if row.dtype == "int":
    return jnp.issubdtype(dtype, jnp.integer)
  return jnp.issubdtype(dtype, jnp.floating)


_KIND_NAMES = {"int": "an integer", "float": "a floating-point", "bool": "a boolean",
               "float32": "a floating-point"}


def _check_broadcastable(row: Operand, x, sizes: dict):
  """bias / mask: rank <= 4, left-padded to 4, each dim 1 or the full size."""
  target = tuple(sizes[a] for a in row.axes)
  letters = ",".join(_LETTERS[a] for a in row.axes)
  if x.ndim > len(target):
    raise ValueError(f"{row.arg} must have rank <= 4 (broadcastable to [{letters}]={target}), "
                     f"got shape {x.shape}")
  x = x.reshape((1,) * (len(target) - x.ndim) + x.shape)
  for dim, (have, want) in enumerate(zip(x.shape, target)):
    if have not in (1, want):
      raise ValueError(f"{row.arg} of shape {x.shape} is not broadcastable to [{letters}]={target} "
                       f"(dimension {dim})")
  if not _kind_ok(row, x.dtype):
    if row.dtype == "bool":
      raise ValueError(f"mask must be boolean (True = attend), got {x.dtype}; pass additive masks "
                       f"as bias")
    raise ValueError(f"{row.arg} must be floating point, got {x.dtype}")
  return x


def _check_operand(row: Operand, x, sizes: dict, unbatched: bool):
  """An optional or per-row operand, checked against its table row -> the canonical array."""
  x = jnp.asarray(x)
  if row.broadcast:
    return _check_broadcastable(row, x, sizes)
  if unbatched and row.axes[0] == "batch" and x.ndim == len(row.axes) - 1 and x.ndim > 0:
    x = x[None]
  want = tuple(sizes[a] for a in row.axes)
  if x.shape != want or not _kind_ok(row, x.dtype):
    letters = ", ".join(_LETTERS[a] for a in row.axes)
    raise ValueError(f"{row.arg} must be {_KIND_NAMES[row.dtype]} array of shape [{letters}]="
                     f"{want}, got {x.dtype}{list(x.shape)}")
  return x.astype(jnp.int32) if row.dtype == "int" else x


def safe_offsets(heads: int, length: int, p_dtype) -> jax.Array:
  """[heads, length] fp32: tile.safe_offset of every query head and position. Static sizes only,
  so it is computed when the call is traced and enters the program as a constant."""
  with jax.ensure_compile_time_eval():
    return tile.safe_offset(jnp.arange(length, dtype=jnp.int32)[None, :],
                            jnp.arange(heads, dtype=jnp.int32)[:, None], p_dtype)


def _segment_ids(options: Options, T: int, S: int):
  q_ids, kv_ids = options.q_segment_ids, options.kv_segment_ids
  if q_ids is None:
    if kv_ids is not None:
      raise ValueError("kv_segment_ids was given without q_segment_ids; pass both (or only "
                       "q_segment_ids when T == S)")
    return None, None
  if kv_ids is None:
    if T != S:
      raise ValueError(f"kv_segment_ids is required when the key length S={S} differs from the "
                       f"query length T={T}")
    kv_ids = q_ids
  return q_ids, kv_ids


def _soft_cap(cap):
  if cap is None:
    return None
  try:
    cap = float(cap)
  except (TypeError, ValueError):
    raise ValueError(f"logits_soft_cap must be None or a number > 0, got {cap!r}") from None
  if not np.isfinite(cap) or cap <= 0:
    raise ValueError(f"logits_soft_cap must be a finite number > 0, got {cap!r}")
  return cap


def _window(local_window_size):
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)):
    local_window_size = (local_window_size, local_window_size)
  try:
    left, right = (int(w) for w in local_window_size)
  except (TypeError, ValueError):
    raise ValueError(f"local_window_size must be an int or (left, right), "
                     f"got {local_window_size!r}") from None
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be non-negative, got {(left, right)}")
  return left, right


def _qkv(query, key, value):
  """Checks q, k, v -> (q, k, v as 4-D, unbatched)."""
  unbatched = np.ndim(query) == 3   # np: no warning for a query that is not an array
  q = _as_4d(query, "query", True)
  k = _as_4d(key, "key", unbatched)
  v = _as_4d(value, "value", unbatched)
  B, T, N, H = q.shape
  if k.shape[0] != B or k.shape[3] != H:
    raise ValueError(f"key must be [B={B}, S, K, H={H}] to match query {q.shape}, got {k.shape}")
  if v.shape != k.shape:
    raise ValueError(f"value must have the shape of key {k.shape}, got {v.shape}")
  K = k.shape[2]
  if N % K:
    raise ValueError(f"the number of key/value heads K={K} (key {k.shape}) must divide the number "
                     f"of query heads N={N} (query {q.shape})")
  if q.dtype not in _SUPPORTED_DTYPES:
    # FP8 arrays as inputs would get FP8 cotangents back; FP8 attention quantizes its own.
    fp8 = (" (for FP8 attention pass q, k and v in one of those with numerics='fp8_fast', and "
           "fp8_scales= for scales of your own)" if jnp.issubdtype(q.dtype, jnp.floating) else "")
    raise ValueError(f"query dtype must be bfloat16, float16, float32 or float64, got "
                     f"{q.dtype}{fp8}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, "
                     f"{v.dtype}")
  return q, k, v, unbatched


def _spec(options: Options, head_dim: int) -> AttentionSpec:
  if options.return_residual and options.return_residuals:
    raise ValueError("return_residual (jax.nn's: lse [B, T, N] in the input dtype, stop_gradient) "
                     "and return_residuals (ours: lse [B, N, T] float32, differentiable) cannot "
                     "both be set; pick one")
  _one_of(options.max_adjust, MAX_ADJUST_MODES, "max_adjust")
  if not np.isfinite(options.beta) or options.beta < 1.0:
    raise ValueError(f"beta must be a finite number >= 1, got {options.beta!r}")
  scale = options.scale
  if scale is None:
    scale = 1.0 / float(np.sqrt(max(head_dim, 1)))   # H = 0: nothing to scale (an empty output)
  elif not _finite_number(scale):
    raise ValueError(f"scale must be a finite number, got {scale!r}")
  numerics = numerics_lib.resolve(options.numerics)
  return AttentionSpec(
      scale=float(scale), is_causal=bool(options.is_causal),
      window=_window(options.local_window_size), max_adjust=options.max_adjust,
      beta=float(options.beta), numerics=numerics,
      interpret=_flag(options.interpret, "interpret"),
      has_lengths=(options.query_seq_lengths is not None
                   or options.key_value_seq_lengths is not None),
      logits_soft_cap=_soft_cap(options.logits_soft_cap),
      # center_v with a sink: the mean's share of O, 1 - exp(sink - LSE), is differentiated
      # through the LSE (fp8.add_mean), whose cotangent the backward then takes
      return_residuals=bool(options.return_residuals
                            or (numerics.center_v and options.sinks is not None)),
      deterministic=_flag(options.deterministic, "deterministic"),
      context_layout=_one_of(options.context_layout, context.LAYOUTS, "context_layout"),
      context_strategy=_one_of(options.context_strategy, context.STRATEGIES, "context_strategy"))


def _one_of(value, choices: tuple, name: str) -> str:
  """value, one of the strings `choices`; ValueError naming the argument otherwise."""
  if not isinstance(value, str) or value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}")
  return value


def _finite_number(x) -> bool:
  try:
    return bool(np.isfinite(float(x)))
  except (TypeError, ValueError):
    return False


def _flag(value, name: str) -> bool:
  """A boolean option: True or False (NumPy's too), never a truthy stand-in such as a string."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False, got {value!r}")
  return bool(value)


def _concrete(x):
  """x's values as a NumPy array, or None when x is traced: under jit (or grad) its values exist
  only when the program runs, so they cannot be checked when it is traced."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def _check_values(row: Operand, x) -> None:
  """Values a shape and dtype check cannot see, for concrete arrays: negative lengths would
  silently make every row padding, a NaN sink every output NaN."""
  values = _concrete(x)
  if values is None:
    return
  if row.counts is not None and np.any(values < 0):
    raise ValueError(f"{row.arg} must be >= 0, got {values.tolist()}")
  if row.name == "sinks" and not np.all(np.isfinite(values)):
    raise ValueError(f"sinks must be finite, got {values.tolist()}")
  if row.name in fp8.SCALE_ROWS:
    mantissa, _ = np.frexp(values.astype(np.float64))
    if not (np.all(np.isfinite(values)) and np.all(values > 0) and np.all(mantissa == 0.5)):
      raise ValueError(f"{row.arg} must hold positive powers of two (they undo exactly), got "
                       f"{values.tolist()}")


def _fp8_scales(given, spec: AttentionSpec, sizes: dict):
  """fp8_scales checked against their operand rows (q_scale, k_scale, v_scale) -> None, or three
  float32 arrays [N], [K], [K]."""
  if given is None:
    return None
  if spec.numerics.qkv != "e4m3":
    raise ValueError(f"fp8_scales are the scales q, k and v are quantized under, but numerics "
                     f"{spec.numerics.name!r} keeps them as given (qkv={spec.numerics.qkv!r}); use "
                     f"numerics that quantize them, e.g. 'fast+qkv=e4m3+p=e4m3+p_scale=256'")
  if not isinstance(given, (tuple, list)) or len(given) != 3:
    what = (f"a {type(given).__name__} of {len(given)}" if isinstance(given, (tuple, list))
            else type(given).__name__)
    raise ValueError(f"fp8_scales must be (q_scale, k_scale, v_scale), got {what}")
  checked = []
  for name, x in zip(fp8.SCALE_ROWS, given):
    row = OPERANDS[name]
    checked.append(_check_operand(row, x, sizes, unbatched=False).astype(jnp.float32))
    _check_values(row, x)
  return tuple(checked)


SAFE_E4M3_TOP = (
    "stable_attn: max_adjust='safe' with P in e4m3 for every key (numerics {numerics!r}) rounds "
    "the weight it gives each row's maximum (0.55-0.95) on e4m3's 1/16 grid: on peaked rows dQ is "
    "then up to 26x further from exact than with max_adjust='off', and GPT-2 124M trained with it "
    "diverged in 2 of 2 seeds where 'off' trained as bf16 attention does (docs/fp8.md, step 4). "
    "Use numerics='fp8_fast' (dither=out: the maximum's weight on e4m3's grid, exact, and the "
    "dither on O), numerics='fp8' (p_top=input: each key block's top key in the input dtype), or "
    "max_adjust='off' with this numerics.")
_warned_safe_e4m3 = False


def _warn_if_safe_rounds_its_max_to_e4m3(spec: AttentionSpec) -> None:
  """One RuntimeWarning per process for "safe" over an e4m3 P whose block-top key is e4m3 too and
  gets the dither (Numerics.dither="max")."""
  global _warned_safe_e4m3
  n = spec.numerics
  if (spec.max_adjust != "safe" or n.p != "e4m3" or n.p_top != "p" or n.dither != "max"
      or _warned_safe_e4m3):
    return
  _warned_safe_e4m3 = True
  warnings.warn(SAFE_E4M3_TOP.format(numerics=n.name), RuntimeWarning,
                stacklevel=_callers_level())


def _callers_level() -> int:
  """The `stacklevel` of the first frame outside stable_attn, as seen from the function that calls
  this one: the user's call, whichever entry point (and adapter) it went through."""
  package = os.path.dirname(os.path.abspath(__file__))
  frame, level = inspect.currentframe().f_back, 1
  while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
    frame, level = frame.f_back, level + 1
  return level


def canonicalize(query, key, value, bias=None, mask=None, options: Optional[Options] = None):
  """Checks the arguments of dot_product_attention -> (AttentionSpec, Operands, unbatched).

  Every operand with an argument is checked against its row of the operand table
  (stable_attn.spec.OPERANDS): shape from its logical axes, dtype from its rule.
  """
  options = Options() if options is None else options
  q, k, v, unbatched = _qkv(query, key, value)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  sizes = dict(batch=B, query=T, key=S, heads=N, kv_heads=K, head_dim=H)
  spec = _spec(options, H)
  _warn_if_safe_rounds_its_max_to_e4m3(spec)
  v_mean = None
  if spec.numerics.center_v:
    v_dtype = v.dtype
    v, v_mean = fp8.center(v)
  q, k, v, scales = fp8.quantize_inputs(q, k, v, spec.numerics.qkv,
                                        _fp8_scales(options.fp8_scales, spec, sizes))
  if v_mean is not None:   # e4m3 values under a power of two: exact in the input dtype
    v = v.astype(v_dtype)
    scales["v_mean"] = v_mean
  if spec.window is not None:
    # No query and key are max(T, S) or more positions apart, so a wider window is no limit on
    # that side; clamped, position +- window stays within int32 (2**31 - 9 wrapped round to "no
    # key at all" and returned zeros).
    spec = dataclasses.replace(spec, window=tuple(min(w, max(T, S)) for w in spec.window))
  q_seg, kv_seg = _segment_ids(options, T, S)
  if spec.context_layout == "zigzag" and (bias is not None or mask is not None):
    raise ValueError("context_layout='zigzag' takes no bias or mask (their key columns would need "
                     "the zigzag order too); use segment ids, windows and lengths, or 'contiguous'")
  if spec.context_strategy in context.KEYS_SPLIT and (bias is not None or mask is not None):
    raise ValueError(f"context_strategy='{spec.context_strategy}' takes no bias or mask (their key "
                     f"columns would have to travel with the keys); use segment ids, windows and "
                     f"lengths, or 'allgather'")
  given = dict(bias=bias, mask=mask, q_lens=options.query_seq_lengths,
               kv_lens=options.key_value_seq_lengths, q_seg=q_seg, kv_seg=kv_seg,
               sinks=options.sinks)
  arrays = dict(q=q, k=k, v=v, **scales)
  for name, x in given.items():
    row = OPERANDS[name]
    if x is not None:
      arrays[name] = _check_operand(row, x, sizes, unbatched)
      _check_values(row, x)
    elif row.counts is not None:   # lengths are always present: the full extent
      arrays[name] = jnp.full((B,), sizes[row.counts], jnp.int32)
  if spec.max_adjust == "safe":
    # The dither's grid: where it rounds the max's weight (P's, or the output's for dither="out").
    dt = tile_dtypes(spec.numerics, q.dtype)
    grid = (dt.input if dt.input.itemsize < 4 else np.dtype(np.float32)) if dt.dither_out else dt.p
    arrays["offset"] = safe_offsets(N, T, grid)
  return spec, OPERANDS.make(**arrays), unbatched
