"""FP8 attention (issue 49) against the bf16 Hopper kernel and cuDNN, in one process.

    PYTHONPATH=. python benchmarks/fp8.py            # on an H100 / H200
    PYTHONPATH=. python benchmarks/fp8.py --smoke    # tiny shapes, arms that run on the CPU
    PYTHONPATH=. python benchmarks/fp8.py --sweep [--sweep-arm preset]   # the FP8 forward's tilings
    PYTHONPATH=. python benchmarks/fp8.py --plot benchmarks/results/fp8_nvidia_h200.md   # its .png
  PYTHONPATH=. python benchmarks/fp8.py --backward   # the FP8 backward's kernels alone
  PYTHONPATH=. python benchmarks/fp8.py --backward --sweep   # the FP8 backward's tilings
  PYTHONPATH=. python benchmarks/fp8.py --profile --shapes 0 --arms bf16,fp8_bwd   # by kernel
  PYTHONPATH=. python benchmarks/fp8.py --payloads --shapes 0,1   # the api's e4m3 payloads, A/B

Arms (bf16 inputs, max_adjust "safe", causal, implementation="pallas_mosaic_gpu" unless named):
  cudnn     jax.nn.dot_product_attention(implementation="cudnn")
  cudnn_fp8 cuDNN's FP8 attention as JAX reaches it (benchmarks/peers.py; e4m3 in and out, one
            scale per tensor, no tie adjustment), bf16 in and out around it: q, k, v (dO) cast to
            e4m3, O (dQ, dK, dV) read back, under delayed scales measured before the timed calls
            (peers.cudnn_fp8_scales)
  cudnn_fp8_kernel  the same kernels alone, on e4m3 operands cast outside the timed calls, O and
            the gradients left in e4m3 (fwd "x bf16" is then against bf16_kernel)
  bf16      numerics "fast": the bf16 kernels
  bf16_q    numerics "fast+qkv=e4m3": the bf16 kernels on e4m3-quantized q, k, v (the FP8 arm's
            inputs and backward; isolates the forward kernel from the quantization)
  fp8       numerics FP8_NUMERICS: the FP8 forward (e4m3 Q K^T and P V, P cast with a 2^8 scale),
            the bf16 backward on the dequantized inputs
  fp8_given the fp8 arm with the caller's per-head scales (fp8_scales=, delayed scaling: here
            the inputs' own, measured outside the timed calls), so no call measures its inputs
  preset    numerics "fp8": the FP8 forward with each key block's top key in bf16 (its residual
            a second e4m3 P V product: stable_attn.tile.rescale's split_top) and the row sum of the
            rounded P_bar, what "safe" needs under an FP8 P (docs/fp8.md)
  fp8_fast  numerics "fp8_fast": FlashAttention-3's FP8 forward with the row sum of the rounded
            P_bar and "safe"'s dither on O (Numerics.dither="out": the row maximum's weight exact)
  fp8_fast_cv  numerics "fp8_fast+center_v=true": the fp8_fast arm on v less its mean over the
            keys, the mean added to O after the kernel (Numerics.center_v; docs/fp8.md)
  fp8_bwd, preset_bwd, fp8_fast_bwd, fp8_fast_cv_bwd  those arms with the FP8 backward
            (TuningConfig.fp8_backward: e4m3 products in the dQ and dK/dV kernels;
            pallas_kernels/mosaic_gpu/fp8_backward.py)
  fp8_fast_cv_row_bwd  fp8_fast_cv_bwd with P V in one accumulator along the row
            (fp8_pv_promote=0: no per-block promotion, which centring may make unneeded)
  quantize  what the fp8 arm does before its kernel: q, k, v quantized, scaled to e4m3 payloads,
            V transposed (forward only)
  *_kernel  the bf16 / FP8 forward kernel alone, on operands prepared outside the timed calls
            (forward only; "fwd x bf16" is then against bf16_kernel)
Times: the median of blocks of back-to-back calls (benchmarks/attention.py's protocol); fwd+bwd
is jax.vjp and the pullback. Errors: the relative Frobenius error of O, dQ, dK, dV against
float64 attention of the unquantized inputs (stable_attn.reference.exact_attention_vjp) at
ERROR_SHAPE. Writes benchmarks/results/fp8_<device>.md and .png (`plot`) and prints the table.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
from benchmarks import attention as bench  # noqa: E402
from benchmarks import peers  # noqa: E402
from pallas_kernels import mosaic_gpu as mosaic  # noqa: E402
from stable_attn import fp8  # noqa: E402
from stable_attn.api import Options, canonicalize  # noqa: E402
from stable_attn.layout import Geometry  # noqa: E402
from stable_attn.reference import exact_attention_vjp  # noqa: E402
from stable_attn.spec import OPERANDS  # noqa: E402

FP8_NUMERICS = "fast+qkv=e4m3+p=e4m3+p_scale=256"
NUMERICS = {"bf16": "fast", "bf16_q": "fast+qkv=e4m3", "fp8": FP8_NUMERICS,
            "fp8_given": FP8_NUMERICS, "preset": "fp8", "fp8_bwd": FP8_NUMERICS,
            "preset_bwd": "fp8", "fp8_fast": "fp8_fast", "fp8_fast_bwd": "fp8_fast",
            "fp8_fast_cv": "fp8_fast+center_v=true", "fp8_fast_cv_bwd": "fp8_fast+center_v=true",
            "fp8_fast_cv_row_bwd": "fp8_fast+center_v=true"}
# Changes to the Hopper kernel's default config: TuningConfig.fp8_backward, the FP8 backward
# kernels; fp8_pv_promote=0, P V in one accumulator along the row (what centring may allow)
CONFIG = {"fp8_bwd": dict(fp8_backward=True), "preset_bwd": dict(fp8_backward=True),
          "fp8_fast_bwd": dict(fp8_backward=True), "fp8_fast_cv_bwd": dict(fp8_backward=True),
          "fp8_fast_cv_row_bwd": dict(fp8_backward=True, fp8_pv_promote=0)}
ARMS = ("cudnn", "bf16", "bf16_q", "fp8", "fp8_given", "preset", "fp8_fast", "fp8_fast_cv",
        "fp8_bwd", "preset_bwd", "fp8_fast_bwd", "fp8_fast_cv_bwd", "fp8_fast_cv_row_bwd",
        "quantize", "bf16_kernel", "fp8_kernel", "preset_kernel", "fp8_fast_kernel", "cudnn_fp8",
        "cudnn_fp8_kernel")
CUDNN = ("cudnn", "cudnn_fp8")   # attention arms that are not ours
# (B, T, N, K, H), causal: issue 49's two targets, and head dim 64
SHAPES = [(4, 4096, 16, 16, 128), (1, 16384, 16, 16, 128), (4, 4096, 16, 16, 64)]
ERROR_SHAPE = (1, 2048, 4, 4, 128)


def attention_fn(arm: str, implementation: str, inputs=None):
  """f(q, k, v) -> O for an arm; inputs: the (q, k, v) whose per-head scales fp8_given passes."""
  if arm == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation="cudnn")
  if arm == "cudnn_fp8":   # its scales from these inputs and a dO drawn as the benchmarks' are
    do = jax.random.normal(jax.random.PRNGKey(99), inputs[0].shape).astype(inputs[0].dtype)
    return peers.cudnn_fp8_attention(peers.cudnn_fp8_scales(*inputs, do))
  given = {}
  if arm == "fp8_given":
    given = dict(fp8_scales=tuple(jax.device_get(fp8.head_scales(x)) for x in inputs))
  if arm in CONFIG and implementation == "pallas_mosaic_gpu":
    spec, ops, _ = canonicalize(*inputs, None, None, Options(
        is_causal=True, implementation=implementation, numerics=NUMERICS[arm]))
    given = dict(config=mosaic.default_config(spec, ops).replace(**CONFIG[arm]))
  return lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation, numerics=NUMERICS[arm], **given)


def quantize_only(q, k, v):
  """The fp8 arm's preamble: quantize (the API) and e4m3 payloads with V^T (the backend's)."""
  q, k, v, scales = fp8.quantize_inputs(q, k, v, "e4m3")
  ops = OPERANDS.make(q=q, k=k, v=v, **scales)
  x = mosaic._fp8_operands(ops, ops, Geometry.of(ops).padded(1, 1), q.shape[2] // k.shape[2],
                           mosaic.tuning.table_config(q.shape[-1]).fp8_p_registers)
  return x.q, x.k, x.v, x.qk_descale, x.v_descale


def forward_kernel(arm, shape, changes=None):
  """(the forward kernel alone as f(x), (its prepared operands x,)): no quantization, no
  transpose, no padding (the shapes need none) -- what a caller holding FP8 q, k, V^T would run.
  changes: to the table's config (TuningConfig.replace)."""
  from pallas_kernels.mosaic_gpu.forward import forward_call
  q, k, v, _ = bench.make_inputs(*shape, jnp.bfloat16)
  spec, ops, _ = canonicalize(q, k, v, None, None, Options(
      is_causal=True, implementation="pallas_mosaic_gpu", numerics=NUMERICS[arm]))
  config = mosaic.default_config(spec, ops).replace(**(changes or {}))
  call, x, ranges = mosaic.forward_inputs(spec, config, ops)
  return jax.jit(lambda x: forward_call(call, x, ranges)), (x,)


# --sweep: the FP8 forward kernel's tilings (changes to the table's config).
SWEEP = {"table": {}, "2 warpgroups": dict(fwd_wgs=2), "3 warpgroups": dict(fwd_wgs=3),
         "3 stages": dict(fwd=mosaic.tuning.Tiles(64, 128, 3)),
         "2 warpgroups with 3 stages": dict(fwd_wgs=2, fwd=mosaic.tuning.Tiles(64, 128, 3)),
         # P kept in registers (TuningConfig.fp8_p_registers), no shared-memory tile or fence
         "P in registers": dict(fp8_p_registers=True),
         "P in registers + 2 warpgroups": dict(fp8_p_registers=True, fwd_wgs=2),
         "P in registers + 3 warpgroups": dict(fp8_p_registers=True, fwd_wgs=3),
         "P in registers + 3 stages": dict(fp8_p_registers=True,
                                          fwd=mosaic.tuning.Tiles(64, 128, 3)),
         # one CTA per SM taking the query tiles in rounds (Q is e4m3: its second buffer fits)
         "persistent": dict(fwd_persistent=True),
         "persistent in grid order": dict(fwd_persistent=True, persistent_order="grid"),
         "grid order": dict(heaviest_first=()),
         # P V into a fresh accumulator per 128-key block, 64 or 32 keys (the table's: per 64
         # keys at head dim 64, per block at 128), or one accumulator along the row, as
         # FlashAttention-3 (TuningConfig.fp8_pv_promote)
         "P V promoted per block": dict(fp8_pv_promote=128),
         "P V promoted per 64 keys": dict(fp8_pv_promote=64),
         "P V promoted per 32 keys": dict(fp8_pv_promote=32),
         "P V promoted per 64 keys + 2 warpgroups": dict(fp8_pv_promote=64, fwd_wgs=2),
         "P V promoted per 32 keys + 2 warpgroups": dict(fp8_pv_promote=32, fwd_wgs=2),
         "P V along the row": dict(fp8_pv_promote=0)}

# --backward --sweep: the FP8 backward kernels' tilings (changes to the call's default config)
BACKWARD_SWEEP = {
    "table": {}, "dq: 2 warpgroups": dict(dq_wgs=2),
    "dq: 2 warpgroups with 128-key blocks": dict(dq_wgs=2, dq=mosaic.tuning.Tiles(64, 128, 2)),
    "dq: 3 stages": dict(dq=mosaic.tuning.Tiles(64, 64, 3)),
    "dq: heaviest first": dict(heaviest_first=("fwd", "dq")),
    "dkv: 3 stages": dict(dkv=mosaic.tuning.Tiles(64, 64, 3)),
    "dkv: 128-query blocks": dict(dkv=mosaic.tuning.Tiles(128, 64, 2)),
    "dkv: 3 warpgroups": dict(dkv_wgs=3),
    "dkv: heaviest first": dict(heaviest_first=("fwd", "dkv")),
    # dV's accumulator along the whole column (the table's: a fresh one per query block)
    "dkv: dV along the column": dict(fp8_dv_promote=False)}


def sweep(shapes, calls, blocks, arm="fp8", variants=tuple(SWEEP)) -> str:
  """Markdown: each SWEEP variant's FP8 forward kernel time (arm: "fp8", FlashAttention-3's
  arithmetic, or "preset") against the bf16 kernel's."""
  lines = ["| shape | FP8 forward config | ms | x bf16 kernel |", "|---|---|---:|---:|"]
  for shape in shapes:
    base = bench.time_calls(*forward_kernel("bf16", shape), calls, blocks)
    for name in variants:
      changes = SWEEP[name]
      try:
        t = bench.time_calls(*forward_kernel(arm, shape, changes), calls, blocks)
        lines.append(f"| {shape} | {name} | {t * 1e3:.3f} | {base / t:.3f} |")
      except Exception as e:  # noqa: BLE001 -- a variant that does not compile is a result
        lines.append(f"| {shape} | {name} | {type(e).__name__}: {str(e).splitlines()[0][:80]} "
                     f"| - |")
  return "\n".join(lines) + "\n"


def backward_kernels(shape, variants=None):
  """{name: (f, args)}: each backward kernel alone on its prepared inputs, delta given to all:
  the bf16 dQ and dK/dV kernels (numerics "fast+qkv=e4m3": the FP8 arms' bf16 backward), the FP8
  ones (pallas_kernels/mosaic_gpu/fp8_backward.py), and "fp8_prep", the FP8 kernels' input
  preparation (dO quantized per batch row and kv head and transposed, V cast, K^T and Q^T
  relabelled, delta of the cast dO). variants: {name: changes to the FP8 call's config}, whose
  FP8 kernels come as "fp8_dq NAME" and "fp8_dkv NAME" instead (and no bf16 kernels)."""
  from pallas_kernels.mosaic_gpu import backward, common, fp8_backward
  from stable_attn import tile
  from stable_attn.spec import BackwardInputs
  q, k, v, do = bench.make_inputs(*shape, jnp.bfloat16)
  arms = {}
  for kind, numerics in (("bf16", NUMERICS["bf16_q"]), ("fp8", FP8_NUMERICS)):
    if kind == "bf16" and variants is not None:
      continue
    spec, ops, _ = canonicalize(q, k, v, None, None, Options(
        is_causal=True, implementation="pallas_mosaic_gpu", numerics=numerics, max_adjust="off"))
    config = mosaic.default_config(spec, ops)
    o, lse = jax.jit(lambda ops: mosaic.attention(spec, ops, config))(ops)
    if kind == "bf16":   # no padding at these shapes
      call = mosaic._call(spec, config, ops)
      x = mosaic._padded(ops, call)._replace(offset=None)
      grads = BackwardInputs(do, lse, jnp.swapaxes(tile.delta(do, o), 1, 2))
      dq_ranges = common.block_ranges(x, config.dq.block_q, config.dq.block_kv, "query")
      dkv_ranges = common.block_ranges(x, config.dkv.block_q, config.dkv.block_kv, "key",
                                       call.geo.G)
      arms["bf16_dq"] = (jax.jit(lambda x, g: backward._dq_call(call, x, g, None, dq_ranges,
                                                                None)), (x, grads))
      arms["bf16_dkv"] = (jax.jit(lambda x, g: backward._dkv_call(call, x, g, dkv_ranges)),
                          (x, grads))
      continue
    prep = jax.jit(lambda ops, o, lse, do: fp8_backward.backward_inputs(
        spec, config, ops, o, lse, do)[1:3])
    arms["fp8_prep"] = (prep, (ops, o, lse, do))
    x, grads = prep(ops, o, lse, do)
    for name, changes in (variants or {"": {}}).items():
      varied = config.replace(fp8_backward=True, **changes)
      call, _, _, dq_ranges, dkv_ranges = fp8_backward.backward_inputs(spec, varied, ops, o, lse,
                                                                       do)
      suffix = f" {name}" if variants else ""
      arms["fp8_dq" + suffix] = (jax.jit(lambda x, g, call=call, r=dq_ranges:
                                         fp8_backward.dq_call(call, x, g, r, jnp.bfloat16)),
                                 (x, grads))
      arms["fp8_dkv" + suffix] = (jax.jit(lambda x, g, call=call, r=dkv_ranges:
                                          fp8_backward.dkv_call(call, x, g, r, jnp.bfloat16)),
                                  (x, grads))
  return arms


def backward_sweep(shapes, calls, blocks, variants=tuple(BACKWARD_SWEEP)) -> str:
  """Markdown: the FP8 dQ and dK/dV kernels under each BACKWARD_SWEEP variant against the
  table's (3 alternating rounds, medians), and whether their outputs are the table's bitwise
  (a variant that adds the same products in the same order gives "yes")."""
  lines = ["| shape | FP8 backward config | dQ ms | x table | same | dK/dV ms | x table | same |",
           "|---|---|---:|---:|---|---:|---:|---|"]
  for shape in shapes:
    arms = {name: fn for name, fn in backward_kernels(
        shape, {v: BACKWARD_SWEEP[v] for v in ("table",) + tuple(variants)}).items()
            if name != "fp8_prep"}
    outs = {name: jax.tree.leaves(f(*args)) for name, (f, args) in arms.items()}
    t = bench.alternating_rounds(arms, 3, calls, blocks)
    same = lambda a, b: "yes" if all(bool(jnp.array_equal(x, y)) for x, y in zip(a, b)) else "no"
    for v in variants:
      cells = [f"{t[f'{k} {v}'] * 1e3:.3f} | {t[f'{k} table'] / t[f'{k} {v}']:.3f} | "
               f"{same(outs[f'{k} {v}'], outs[f'{k} table'])}" for k in ("fp8_dq", "fp8_dkv")]
      lines.append(f"| {shape} | {v} | {' | '.join(cells)} |")
  return "\n".join(lines) + "\n"


def backward_table(shapes, calls, blocks) -> str:
  """Markdown: the FP8 backward kernels' times against the bf16 ones' (`backward_kernels`), the
  median of 3 alternating rounds."""
  lines = ["| shape | dQ bf16 ms | dQ FP8 ms | x bf16 | dK/dV bf16 ms | dK/dV FP8 ms | x bf16 | "
           "FP8 prep ms |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for shape in shapes:
    t = {name: 1e3 * s for name, s in
         bench.alternating_rounds(backward_kernels(shape), 3, calls, blocks).items()}
    lines.append(f"| {shape} | {t['bf16_dq']:.3f} | {t['fp8_dq']:.3f} | "
                 f"{t['bf16_dq'] / t['fp8_dq']:.3f} | {t['bf16_dkv']:.3f} | {t['fp8_dkv']:.3f} | "
                 f"{t['bf16_dkv'] / t['fp8_dkv']:.3f} | {t['fp8_prep']:.3f} |")
  return "\n".join(lines) + "\n"


def preamble(shape, calls, blocks) -> str:
  """Markdown: what the FP8 arm's operand preparation costs, piece by piece (forward only)."""
  q, k, v, _ = bench.make_inputs(*shape, jnp.bfloat16)
  x = fp8.quantize(v)
  s = fp8.head_scales(x)[None, None, :, None]
  payload = lambda a, s: a.astype(jnp.float32) * s
  B, S, K, H = x.shape
  parts = {
      "fp8.quantize (one of q, k, v)": (fp8.quantize, x),
      "fp8.head_scales": (fp8.head_scales, x),
      "e4m3 payload, scales given": (lambda a, s: payload(a, s).astype(fp8.E4M3), x, s),
      "V^T e4m3, scales given": (lambda a, s: jnp.transpose(payload(a, s), (0, 2, 3, 1))
                                 .astype(fp8.E4M3), x, s),
      "V^T e4m3 as [B, S, K*H] swapped": (lambda a, s: jnp.swapaxes(
          payload(a, s).astype(fp8.E4M3).reshape(B, S, K * H), 1, 2), x, s),
      "V^T bf16 (no cast)": (lambda a: jnp.transpose(a, (0, 2, 3, 1)), x),
      "one of q, k: scales, quantize, e4m3 payload": (lambda a: quantize_only(a, a, a)[0], q),
      "all of it (quantize_only)": (quantize_only, q, k, v),
  }
  lines = ["| shape | step | ms |", "|---|---|---:|"]
  for name, (fn, *args) in parts.items():
    t = bench.time_calls(jax.jit(fn), tuple(args), calls, blocks)
    lines.append(f"| {shape} | {name} | {t * 1e3:.3f} |")
  return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _casting_again():
  """Calls traced inside see no e4m3 payload rows (fp8.PAYLOAD_ROWS): the Hopper backend casts the
  quantized values again, as before the api handed the payloads over."""
  full = fp8.quantize_inputs

  def scales_only(*args, **kwargs):
    q, k, v, rows = full(*args, **kwargs)
    return q, k, v, {name: rows[name] for name in fp8.SCALE_ROWS if name in rows}
  fp8.quantize_inputs = scales_only
  try:
    yield
  finally:
    fp8.quantize_inputs = full


def payload_ab(shapes, calls, blocks, rounds=5, implementation="pallas_mosaic_gpu") -> str:
  """Markdown: the FP8 arms with the api's e4m3 payloads ("payloads") against the backend casting
  the quantized values again ("cast again"), bf16 beside them, every arm of a shape timed in
  alternating rounds (bench.alternating_rounds); and whether O and the gradients are bitwise
  the same both ways."""
  lines = ["| shape | arm | operands | fwd ms | fwd+bwd ms | fwd x bf16 | fwd+bwd x bf16 |"
           " bitwise |", "|---|---|---|---:|---:|---:|---:|---|"]
  for shape in shapes:
    q, k, v, do = bench.make_inputs(*shape, jnp.bfloat16)
    calls_of = {}
    for arm in ("bf16", "fp8", "fp8_given", "fp8_bwd"):
      for how in (("payloads", "cast again") if arm != "bf16" else ("-",)):
        with _casting_again() if how == "cast again" else contextlib.nullcontext():
          f, g = jitted_calls(arm, implementation, (q, k, v))
          # Both traced here, inside the context (jit traces at the first call).
          out = jax.block_until_ready((f(q, k, v), g(q, k, v, do)))
        calls_of[arm, how] = (f, g, out)
    arms = {}
    for key, (f, g, _) in calls_of.items():
      arms[key + ("fwd",)] = (f, (q, k, v))
      arms[key + ("fb",)] = (g, (q, k, v, do))
    t = bench.alternating_rounds(arms, rounds, calls, blocks)
    for (arm, how), (_, _, out) in calls_of.items():
      other = calls_of.get((arm, "cast again"))
      same = "-" if how != "payloads" else str(all(
          bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(out),
                                                      jax.tree.leaves(other[2]))))
      fwd, fb = t[arm, how, "fwd"], t[arm, how, "fb"]
      B, T, N, _, H = shape
      lines.append(f"| B{B} T{T} N{N} H{H} | {arm} | {how} | {fwd * 1e3:.3f} | "
                   f"{fb * 1e3:.3f} | {t['bf16', '-', 'fwd'] / fwd:.3f} | "
                   f"{t['bf16', '-', 'fb'] / fb:.3f} | {same} |")
  return "\n".join(lines) + "\n"


def timings(arm, implementation, shape, calls, blocks) -> dict:
  q, k, v, do = bench.make_inputs(*shape, jnp.bfloat16)
  if arm == "quantize":
    return dict(fwd=bench.time_calls(jax.jit(quantize_only), (q, k, v), calls, blocks))
  if arm == "cudnn_fp8_kernel":
    return cudnn_fp8_kernel_timings(q, k, v, do, calls, blocks)
  if arm.endswith("_kernel"):
    return dict(fwd=bench.time_calls(*forward_kernel(arm[:-len("_kernel")], shape), calls, blocks))
  fwd, fwd_bwd = jitted_calls(arm, implementation, (q, k, v))
  return dict(fwd=bench.time_calls(fwd, (q, k, v), calls, blocks),
              fb=bench.time_calls(fwd_bwd, (q, k, v, do), calls, blocks))


def cudnn_fp8_kernel_timings(q, k, v, do, calls, blocks) -> dict:
  """cuDNN's FP8 attention alone: e4m3 q, k, v (and dO) cast before the timed calls, O and the
  gradients left in e4m3."""
  scales = peers.cudnn_fp8_scales(q, k, v, do)
  f = peers.cudnn_fp8_kernel(scales)
  x8 = tuple(peers.cudnn_fp8_cast(x, scales[name])
             for x, name in ((q, "q"), (k, "k"), (v, "v"), (do, "do")))

  @jax.jit
  def fwd_bwd(q8, k8, v8, do8):
    o8, pullback = jax.vjp(f, q8, k8, v8)
    return o8, pullback(do8)
  return dict(fwd=bench.time_calls(jax.jit(f), x8[:3], calls, blocks),
              fb=bench.time_calls(fwd_bwd, x8, calls, blocks))


def jitted_calls(arm, implementation, inputs):
  """(forward f(q, k, v) -> O, fwd+bwd g(q, k, v, dO) -> (O, (dq, dk, dv))), both jitted."""
  f = attention_fn(arm, implementation, inputs)

  @jax.jit
  def fwd_bwd(q, k, v, do):
    o, pullback = jax.vjp(f, q, k, v)
    return o, pullback(do)
  return jax.jit(f), fwd_bwd


def profile(shapes, arms, implementation="pallas_mosaic_gpu", calls=10) -> str:
  """Markdown: each arm's GPU time per call by kernel and XLA fusion, forward and fwd+bwd (the
  profiler's device events summed per name over `calls` calls after 3:
  benchmarks.train_profile.kernel_times), largest first."""
  from benchmarks.train_profile import kernel_times
  lines = []
  for shape in shapes:
    q, k, v, do = bench.make_inputs(*shape, jnp.bfloat16)
    for arm in arms:
      fwd, fwd_bwd = jitted_calls(arm, implementation, (q, k, v))
      for what, fn, args in (("fwd", fwd, (q, k, v)), ("fwd+bwd", fwd_bwd, (q, k, v, do))):
        for _ in range(3):
          jax.block_until_ready(fn(*args))
        t = kernel_times(lambda: fn(*args), calls)
        lines += [f"{shape} {arm}, {what}: {sum(t.values()):.1f} us per call", "",
                  "| kernel | us |", "|---|---:|"]
        lines += [f"| {name} | {us:.1f} |" for name, us in sorted(t.items(), key=lambda x: -x[1])]
        lines.append("")
  return "\n".join(lines)


def errors(arm, implementation, shape) -> dict:
  """Relative errors of O, dQ, dK, dV against float64 attention of the unquantized inputs."""
  q, k, v, do = bench.make_inputs(*shape, jnp.bfloat16, seed=1)
  o, pullback = jax.vjp(jax.jit(attention_fn(arm, implementation, (q, k, v))), q, k, v)
  got = (o,) + tuple(pullback(do))
  exact = exact_attention_vjp(q, k, v, do, is_causal=True)
  want = (exact.out, exact.dq, exact.dk, exact.dv)
  rel = lambda x, ref: float(np.linalg.norm(np.asarray(x, np.float64) - ref) /
                             np.linalg.norm(ref))
  return {name: rel(jnp.asarray(x, jnp.float32), ref)
          for name, x, ref in zip(("O", "dQ", "dK", "dV"), got, want)}


def markdown(device, results, errs, calls, blocks) -> str:
  lines = [f"# FP8 attention on {device}, JAX {jax.__version__}",
           "", f"`PYTHONPATH=. python benchmarks/fp8.py` ({blocks} blocks of {calls} calls, "
           f"median). bf16 inputs, causal, max_adjust \"safe\"; fp8 = numerics "
           f"`{FP8_NUMERICS}`.", "",
           "| shape | arm | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd x bf16 | fwd+bwd x bf16 | "
           "fwd x cuDNN | fwd+bwd x cuDNN |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for shape, by_arm in results.items():
    B, T, N, K, H = shape
    flops = bench.fwd_flops(B, T, N, K, H, True)
    peer = by_arm.get("cudnn", {})
    for arm, t in by_arm.items():
      base = by_arm.get("bf16_kernel" if arm.endswith("_kernel") else "bf16", {})
      ratio = lambda ref, key: (f"{ref[key] / t[key]:.3f}"
                                if key in t and key in ref and arm != "quantize" else "-")
      lines.append(f"| B{B} T{T} N{N} H{H} | {arm} | {t['fwd'] * 1e3:.3f} | "
                   f"{t['fb'] * 1e3:.3f} | " if "fb" in t else
                   f"| B{B} T{T} N{N} H{H} | {arm} | {t['fwd'] * 1e3:.3f} | - | ")
      tflops = "-" if arm == "quantize" else f"{flops / t['fwd'] / 1e12:.0f}"
      lines[-1] += (f"{tflops} | {ratio(base, 'fwd')} | {ratio(base, 'fb')} | "
                    f"{ratio(peer, 'fwd')} | {ratio(peer, 'fb')} |")
  B, T, N, K, H = ERROR_SHAPE
  lines += ["", f"Relative Frobenius error against float64 attention of the unquantized inputs, "
            f"B{B} T{T} N{N} H{H} causal:", "", "| arm | O | dQ | dK | dV |",
            "|---|---:|---:|---:|---:|"]
  for arm, e in errs.items():
    lines.append(f"| {arm} | " + " | ".join(f"{e[name]:.2e}" for name in ("O", "dQ", "dK", "dV"))
                 + " |")
  return "\n".join(lines) + "\n"


# --plot: the latest run's ratios to our bf16 attention (the first table of a results file).
PLOTTED = {"fwd": ("fp8_kernel", "preset_kernel", "fp8_fast_kernel", "cudnn_fp8_kernel", "fp8",
                   "fp8_given", "preset", "fp8_fast", "fp8_fast_cv", "fp8_bwd", "preset_bwd",
                   "fp8_fast_bwd", "fp8_fast_cv_bwd", "fp8_fast_cv_row_bwd", "cudnn", "cudnn_fp8"),
           "fb": ("fp8", "fp8_given", "preset", "fp8_fast", "fp8_fast_cv", "fp8_bwd", "preset_bwd",
                  "fp8_fast_bwd", "fp8_fast_cv_bwd", "fp8_fast_cv_row_bwd", "cudnn", "cudnn_fp8")}
TARGETS = {"fwd": 1.4, "fb": 1.15}   # issue 49's: FP8 forward and fwd+bwd over our bf16


def plot(markdown_path: str, png_path: str) -> None:
  """Bars of each arm's forward and fwd+bwd time ratio to the bf16 arm (`fwd x bf16`, `fwd+bwd x
  bf16`; the kernels' to the bf16 kernel) per shape, from the first table of a results file
  this script wrote, with issue 49's targets drawn."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(markdown_path) as f:
    text = f.read()
  table = next(block for block in text.split("\n\n") if block.startswith("| shape | arm |"))
  ratios = {}
  for line in table.splitlines()[2:]:
    shape, arm, *_, fwd, fb, _, _ = (c.strip() for c in line.strip("|").split("|"))
    ratios[shape, arm] = {"fwd": fwd, "fb": fb}
  shapes = list(dict.fromkeys(shape for shape, _ in ratios))
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  for ax, which, title in ((axes[0], "fwd", "forward"), (axes[1], "fb", "forward + backward")):
    arms = [arm for arm in PLOTTED[which] if any((shape, arm) in ratios for shape in shapes)]
    if not arms:   # e.g. a table of the bf16 arm alone
      ax.set_title(f"{title}: no FP8 arm in the table", fontsize=9)
      continue
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
      vals = [float(ratios.get((shape, arm), {}).get(which, "nan").replace("-", "nan"))
              for shape in shapes]
      ax.bar(np.arange(len(shapes)) + i * width, vals, width, label=arm)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(TARGETS[which], color="red", lw=0.8, ls="--", label=f"target {TARGETS[which]}x")
    ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2)
    ax.set_xticklabels(shapes, fontsize=8)
    ax.set_ylabel("speed x our bf16 (kernels: x the bf16 kernel)")
    ax.set_title(f"{title}: {text.splitlines()[0].lstrip('# ')}", fontsize=9)
    ax.set_ylim(0, 1.25 * TARGETS["fwd"])
    ax.legend(fontsize=7, ncol=4, loc="upper center")
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)


def shape_indices(parser, text) -> list[int]:
  """--shapes: a comma list of indices into SHAPES (None: all) -> the indices; a parser error
  names any other text."""
  picked = text.split(",") if text else [str(i) for i in range(len(SHAPES))]
  if not all(i.isdigit() and int(i) < len(SHAPES) for i in picked):
    parser.error(f"--shapes {text!r}: a comma list of indices into {SHAPES}")
  return [int(i) for i in picked]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes, the reference implementation, no cuDNN (CPU)")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--blocks", type=int, default=5)
  parser.add_argument("--out", default=None, help="markdown path (default: benchmarks/results)")
  parser.add_argument("--sweep", action="store_true",
                      help="the FP8 forward's tilings only (with --backward: the FP8 backward's)")
  parser.add_argument("--sweep-arm", default="fp8", choices=("fp8", "preset", "fp8_fast"),
                      help="with --sweep: FlashAttention-3's arithmetic or the fp8 preset")
  parser.add_argument("--sweep-variants", default=None,
                      help=f"with --sweep: a comma list of {tuple(SWEEP)}; with --backward "
                      f"--sweep, of {tuple(BACKWARD_SWEEP)} (default: all)")
  parser.add_argument("--plot", metavar="MD", help="render MD's first table (a results file of "
                      "this script) to MD with .png, and stop")
  parser.add_argument("--preamble", action="store_true",
                      help="the cost of the FP8 operands' preparation only")
  parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {ARMS}")
  parser.add_argument("--shapes", default=None,
                      help="comma list of indices into SHAPES (default: all)")
  parser.add_argument("--backward", action="store_true",
                      help="the FP8 backward's kernels alone against the bf16 ones, only")
  parser.add_argument("--payloads", action="store_true",
                      help="the FP8 arms with and without the api's e4m3 payloads (A/B), only")
  parser.add_argument("--profile", action="store_true",
                      help="each of --arms' GPU time by kernel and XLA pass (profiler), only")
  args = parser.parse_args(argv)
  if args.plot:
    plot(args.plot, os.path.splitext(args.plot)[0] + ".png")
    return 0
  shapes = [SHAPES[i] for i in shape_indices(parser, args.shapes)]
  if args.backward and args.sweep:
    variants = tuple(v for v in (args.sweep_variants or ",".join(BACKWARD_SWEEP)).split(",")
                     if v and v != "table")
    if set(variants) - set(BACKWARD_SWEEP):
      parser.error(f"--sweep-variants: unknown {sorted(set(variants) - set(BACKWARD_SWEEP))}")
    print(backward_sweep(shapes, args.calls, args.blocks, variants))
    return 0
  if args.backward:
    print(backward_table(shapes, args.calls, args.blocks))
    return 0
  if args.preamble:
    print(preamble(SHAPES[0], args.calls, args.blocks))
    return 0
  if args.payloads:   # --smoke: the code path on the CPU (the reference reads no payloads)
    print(payload_ab([(1, 256, 2, 2, 128)], 2, 2, 1, "reference") if args.smoke else
          payload_ab(shapes, args.calls, args.blocks))
    return 0
  if args.sweep:
    variants = tuple(v for v in (args.sweep_variants or ",".join(SWEEP)).split(",") if v)
    if set(variants) - set(SWEEP):
      parser.error(f"--sweep-variants: unknown {sorted(set(variants) - set(SWEEP))}")
    print(sweep(shapes, args.calls, args.blocks, args.sweep_arm, variants))
    return 0
  implementation, error_shape = "pallas_mosaic_gpu", ERROR_SHAPE
  arms = tuple(a for a in args.arms.split(",") if a)
  if set(arms) - set(ARMS):
    parser.error(f"--arms: unknown {sorted(set(arms) - set(ARMS))}; choose from {ARMS}")
  if args.profile:
    calls = tuple(a for a in arms if a in NUMERICS or a in CUDNN)
    if calls != arms:
      parser.error(f"--profile takes attention arms ({', '.join(CUDNN + tuple(NUMERICS))})")
    print(profile(shapes, arms))
    return 0
  if args.smoke:
    implementation, shapes = "reference", [(1, 256, 2, 2, 128)]
    arms = tuple(a for a in arms if a in NUMERICS)
    args.calls, args.blocks = 2, 2
    globals()["ERROR_SHAPE"] = error_shape = (1, 128, 2, 2, 128)
  device = jax.devices()[0].device_kind
  results = {shape: {arm: timings(arm, implementation, shape, args.calls, args.blocks)
                     for arm in arms} for shape in shapes}
  errs = {arm: errors(arm, implementation, error_shape) for arm in arms if arm in NUMERICS
          or arm in CUDNN}
  text = markdown(device, results, errs, args.calls, args.blocks)
  path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                  f"fp8_{bench.device_slug(device)}.md")
  if not args.smoke or args.out:
    with open(path, "w") as f:
      f.write(text)
    plot(path, os.path.splitext(path)[0] + ".png")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
