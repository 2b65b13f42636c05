"""Peers that the benchmarks time beside ours and that may not be importable here; each is imported
only when a benchmark asks for it, and one that does not import is reported, not fatal.

tokamax      tokamax.dot_product_attention with its sm90 Mosaic GPU kernel
             (../shared/tools/peer-wheels.sh prepares the wheel for a machine without a package
             index). benchmarks/attention.py and features.py run it when it imports.
pallas_mha   JAX's Pallas Triton flash attention, jax.experimental.pallas.ops.gpu.attention.mha:
             deprecated since JAX 0.11 (its import warns), so attention.py runs it only when named
             (--only ...,pallas_mha).
cudnn_fp8    cuDNN's FP8 attention, forward and backward, as JAX reaches it: the FP8 primitives of
             the private jax._src.cudnn.fused_attention_stablehlo, bound here (jax.nn does not
             expose them, and that module's own wrapper mis-orders the backward's scales:
             CUDNN_FP8_BACKWARD). e4m3 in and out, one scale per tensor, head dim 128, lengths
             multiples of 128. benchmarks/fp8.py runs it (arms cudnn_fp8, cudnn_fp8_kernel).
"""
from __future__ import annotations

import functools
import math


@functools.cache
def tokamax_attention():
  """f(q, k, v, **kwargs) -> O: tokamax's dot_product_attention on its Mosaic GPU kernel, or None
  when tokamax is not importable."""
  try:
    import tokamax
  except ImportError:
    return None
  return lambda q, k, v, **kw: tokamax.dot_product_attention(q, k, v, implementation="mosaic", **kw)


TOKAMAX_MISSING = "tokamax is not importable"


@functools.cache
def pallas_mha():
  """(JAX's Pallas Triton `mha`, None), or (None, why it did not import)."""
  try:
    from jax.experimental.pallas.ops.gpu import attention
  except Exception as e:  # pragma: no cover - depends on the installed JAX
    return None, f"{type(e).__name__}: {e}"
  return attention.mha, None


@functools.cache
def cudnn_fp8_module():
  """(jax._src.cudnn.fused_attention_stablehlo, None) when it has the FP8 primitives this file
  binds, else (None, why)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    (fa._dot_product_attention_fp8_fwd_p_wrapper, fa._dot_product_attention_fp8_bwd_p_wrapper,  # noqa: B018
     fa.AttentionLayout.BTNH, fa.fp8_params_keys_fwd, fa.fp8_params_keys_bwd)
  except Exception as e:  # pragma: no cover - depends on the installed JAX
    return None, f"{type(e).__name__}: {e}"
  return fa, None


# cuDNN's FP8 scales, each one power of two per tensor (TransformerEngine's recipe): x's e4m3
# value is x * scale; cuDNN takes 1 / scale as the "descale" of what it reads.
CUDNN_FP8_TENSORS = ("q", "k", "v", "s", "o", "do", "dp", "dq", "dk", "dv")
# The scalar operands of the forward and backward custom calls, in the order cuDNN reads them.
# The backward's was measured (JAX 0.11.2, H200: each operand scaled alone, docs/fp8.md): JAX's own
# FP8 wrapper passes the same values in the order of its fp8_params_keys_bwd, which is another
# (descale_o, descale_dO, descale_s and scale_dQ..scale_dP rotated), so its dQ, dK, dV come back
# mis-scaled unless every scale is 1; these calls bind the primitives with this order instead.
CUDNN_FP8_FORWARD = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
CUDNN_FP8_BACKWARD = ("descale_q", "descale_k", "descale_v", "descale_s", "descale_o",
                      "descale_dO", "descale_dP", "scale_s", "scale_dP", "scale_dQ", "scale_dK",
                      "scale_dV")


def cudnn_fp8_operands(scales: dict, names) -> list:
  """{tensor: scale} (CUDNN_FP8_TENSORS, powers of two) -> the (1, 1, 1, 1) fp32 operands `names`
  (CUDNN_FP8_FORWARD or _BACKWARD): descale_X = 1 / X's scale, scale_X = X's scale."""
  import jax.numpy as jnp
  out = []
  for name in names:
    kind, tensor = name.split("_", 1)
    scale = scales[tensor.lower()]
    out.append(jnp.full((1, 1, 1, 1), 1.0 / scale if kind == "descale" else scale, jnp.float32))
  return out


def _cudnn_fp8():
  fa, why = cudnn_fp8_module()
  if fa is None:
    raise RuntimeError(f"cuDNN FP8 attention is not importable: {why}")
  return fa


def _cudnn_fp8_forward(scales: dict, q8, k8, v8, is_causal: bool):
  """-> (O8, softmax stats, amax of O): cuDNN's FP8 forward (training: it keeps the stats)."""
  fa = _cudnn_fp8()
  o8, _, amax_o, stats = fa._dot_product_attention_fp8_fwd_p_wrapper.bind(
      q8, k8, v8, *cudnn_fp8_operands(scales, CUDNN_FP8_FORWARD),
      scale=1.0 / math.sqrt(q8.shape[-1]), use_causal_mask=is_causal,
      layout=fa.AttentionLayout.BTNH.value, is_training=True)
  return o8, stats, amax_o


def _cudnn_fp8_backward(scales: dict, residuals, do8, is_causal: bool):
  """-> ((dQ8, dK8, dV8), {"dq", "dk", "dv", "dp": amax}): cuDNN's FP8 backward."""
  fa = _cudnn_fp8()
  q8, k8, v8, o8, stats = residuals
  dq8, dk8, dv8, *amax = fa._dot_product_attention_fp8_bwd_p_wrapper.bind(
      q8, k8, v8, o8, do8, stats, *cudnn_fp8_operands(scales, CUDNN_FP8_BACKWARD),
      scale=1.0 / math.sqrt(q8.shape[-1]), use_causal_mask=is_causal,
      layout=fa.AttentionLayout.BTNH.value)
  return (dq8, dk8, dv8), dict(zip(("dq", "dk", "dv", "dp"), amax))


def _per_tensor_scale(x) -> float:
  """The largest power of two s with max |x| * s <= 448 (stable_attn.fp8.scales_from_amax)."""
  import jax.numpy as jnp
  from stable_attn import fp8
  return float(fp8.scales_from_amax(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32)))))


def cudnn_fp8_kernel(scales: dict, is_causal: bool = True):
  """f(q8, k8, v8) -> O8: cuDNN's FP8 attention on e4m3 [B, T, N, H] operands (q * scales["q"]
  and so on), its output e4m3 (O * scales["o"]), softmax scale 1 / sqrt(H); differentiable: the
  pullback of an e4m3 dO (times scales["do"]) is e4m3 dQ, dK, dV (times scales["dq"], ...)."""
  import jax

  @jax.custom_vjp
  def attention(q8, k8, v8):
    return _cudnn_fp8_forward(scales, q8, k8, v8, is_causal)[0]

  def forward(q8, k8, v8):
    o8, stats, _ = _cudnn_fp8_forward(scales, q8, k8, v8, is_causal)
    return o8, (q8, k8, v8, o8, stats)

  attention.defvjp(forward, lambda res, do8: _cudnn_fp8_backward(scales, res, do8, is_causal)[0])
  return attention


def cudnn_fp8_cast(x, scale: float):
  """x [B, T, N, H] times a per-tensor power of two, saturated, as e4m3."""
  import jax.numpy as jnp
  from stable_attn import fp8
  return fp8.payload_under(x, jnp.full((x.shape[2],), scale, jnp.float32))


def cudnn_fp8_scales(q, k, v, do, is_causal: bool = True, margin: float = 2.0) -> dict:
  """Per-tensor scales for `cudnn_fp8_kernel` (delayed scaling, as an amax history would hold
  them): q, k, v and dO's from their own largest |value|, P's 256 (its amax is 1: the 2^8 of
  FlashAttention-3), and O, dP, dQ, dK, dV's from the amaxes cuDNN reports for these inputs
  (two calls, the second under the first's scales), each `margin` below the largest that fits so
  that another draw of the same distribution does not saturate."""
  import jax.numpy as jnp
  from stable_attn import fp8
  scales = {name: _per_tensor_scale(x) for name, x in (("q", q), ("k", k), ("v", v), ("do", do))}
  scales.update(s=256.0, o=1.0, dp=1.0, dq=1.0, dk=1.0, dv=1.0)
  for _ in range(2):
    x8 = [cudnn_fp8_cast(x, scales[name]) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
    o8, stats, amax_o = _cudnn_fp8_forward(scales, *x8, is_causal)
    _, amax = _cudnn_fp8_backward(scales, (*x8, o8, stats), cudnn_fp8_cast(do, scales["do"]),
                                  is_causal)
    amax["o"] = amax_o
    scales.update({name: float(fp8.scales_from_amax(jnp.max(a))) / margin
                   for name, a in amax.items()})
  return scales


def cudnn_fp8_attention(scales: dict, is_causal: bool = True):
  """f(q, k, v) -> O, bf16 (or fp16) in and out, through cuDNN's FP8 attention: q, k, v cast to
  e4m3 under their scales (`cudnn_fp8_scales`), O read back from e4m3; the backward casts dO and
  reads dQ, dK, dV back the same way. What a model with bf16 activations pays around the
  kernel (the casts), under the scales it holds."""
  import jax
  import jax.numpy as jnp
  kernel = cudnn_fp8_kernel(scales, is_causal)
  cast = lambda x, name: cudnn_fp8_cast(x, scales[name])
  back = lambda x8, name, dtype: (x8.astype(jnp.float32) / scales[name]).astype(dtype)

  @jax.custom_vjp
  def attention(q, k, v):
    return back(kernel(cast(q, "q"), cast(k, "k"), cast(v, "v")), "o", q.dtype)

  def forward(q, k, v):
    o8, pullback = jax.vjp(kernel, cast(q, "q"), cast(k, "k"), cast(v, "v"))
    return back(o8, "o", q.dtype), pullback

  def backward(pullback, do):   # q, k, v and O share a dtype (jax.nn's contract)
    grads = pullback(cast(do, "do"))
    return tuple(back(g, name, do.dtype) for g, name in zip(grads, ("dq", "dk", "dv")))

  attention.defvjp(forward, backward)
  return attention
