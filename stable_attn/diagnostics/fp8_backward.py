"""The arithmetic of an FP8 attention backward, measured on the CPU before a kernel (issue 49).

    python -m stable_attn.diagnostics.fp8_backward [--regimes random,one-hot] [--seed 0]
        [--out benchmarks/results/fp8_backward_cpu.md]

For q, k, v that are e4m3 values already (stable_attn.fp8.quantize: the FP8 forward's inputs),
the backward recomputes P = exp(S - LSE) and takes five products:

    dP = dO V^T,   dV = P^T dO,   dS = P * (dP - delta),   dQ = dS K scale,   dK = dS^T Q scale

with delta = rowsum(dO * O). An FP8 tensor-core product takes two 8-bit operands and accumulates
in fp32, where products of FP8 values are exact: only the casts of its operands round. A
`Variant` names the format each cast operand takes: P (for dV, with FlashAttention-3's fixed 2^8
pre-cast scale, or its top keys in bf16 as the forward's "fp8" preset keeps them), dO (for dV and
dP) and dS (for dQ and dK), each FP8 one under a power-of-two scale per (batch row, head) from its
largest |value| -- what a delayed-scaling recipe approximates from earlier steps, here exact:
this measures the formats, not a scale recipe. bf16 is today's backward (V, K and Q, e4m3
values, are exact in bf16). Everything else is float64: dS takes P unrounded, as a kernel's fp32
registers hold it, and delta the exact O, so the errors are the backward's own.

Errors of dQ, dK and dV against float64 gradients of the same quantized inputs, per regime of
stable_attn.diagnostics.accuracy (the bias there only moves the scores): the relative Frobenius
error and the largest |error| over the truth's RMS.

dS's scale (`Variant.ds_scale`). "exact" scales dS by its largest |value| per (batch row, head),
which no kernel knows before it has computed all of dS. Two scales a kernel can compute:
- "bound": before the loop, from norms. |dS_ij| = P_ij |dP_ij - delta_i| <= |dO_i| (|V_j| + Vmax)
  with Vmax = max_j |V_j| (delta_i is a P-weighted mean of the row's dP). The dQ kernel, which
  owns query rows, scales row i of dS by a power of two under 448 / (2 |dO_i| Vmax) and divides
  dQ's row i by it at the end; the dK/dV kernel, which owns key rows, scales column j under
  448 / (dOmax (|V_j| + Vmax)) (dOmax = max_i |dO_i|) and divides dK's row j. Each gradient
  then has its own rounding of dS. |dO_i| and |V_j| are of the cast dO and the e4m3 V. Unsafe on
  peaked rows: there dS falls many binades below the bound (the rest of a row's P ~ e^-gap), into
  e4m3's subnormals or to 0 (tests/test_fp8_numerics.py).
- "online": each kernel keeps the running largest |dS| of each of its rows over the blocks it
  has seen (key blocks of ONLINE_BLOCK for dQ's rows, query blocks of ONLINE_BLOCK for dK's),
  and scales each block under it; where it grows, the fp32 accumulator is rescaled by the ratio
  (a power of two: exact), as the online softmax rescales O.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from stable_attn import fp8
from stable_attn.diagnostics import accuracy
from stable_attn.reference import exact_attention_vjp

# format -> (dtype, largest finite value); "f64" is no rounding
FORMATS = {"f64": (None, None), "bf16": (ml_dtypes.bfloat16, None),
           "e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
P_SCALE = 256.0   # FlashAttention-3's pre-cast scale of P, as the forward's
TOP_BLOCK = 128   # the key block whose top key the "fp8" preset keeps in bf16 (the FP8 forward's)
TENSORS = ("dQ", "dK", "dV")
DS_SCALES = ("exact", "bound", "online")
ONLINE_BLOCK = 64   # the blocks over which "online" keeps its running max (a kernel's tile)


@dataclasses.dataclass(frozen=True)
class Variant:
  """The formats of the backward's cast operands (keys of FORMATS). p_top: P's top key of each
  TOP_BLOCK keys of a row in bf16, the rest in `p` (the "fp8" preset's rule). delta_of_cast:
  delta = rowsum(dO * O) of the cast dO (the dO of dP), else of dO as given. ds_scale: how an FP8
  dS is scaled (DS_SCALES; the module doc)."""
  name: str
  p: str = "bf16"
  do: str = "bf16"
  ds: str = "bf16"
  p_top: bool = False
  delta_of_cast: bool = False
  ds_scale: str = "exact"

  def __post_init__(self):
    if self.ds_scale not in DS_SCALES:
      raise ValueError(f"ds_scale must be one of {DS_SCALES}, got {self.ds_scale!r}")


VARIANTS = (
    Variant("bf16 (today's backward)"),
    Variant("dS e4m3", ds="e4m3"),
    Variant("dS e5m2", ds="e5m2"),
    Variant("P, dO e4m3", p="e4m3", do="e4m3"),
    Variant("P (top bf16), dO e4m3", p="e4m3", do="e4m3", p_top=True),
    Variant("P e4m3, dO e5m2", p="e4m3", do="e5m2"),
    Variant("P, dO, dS e4m3", p="e4m3", do="e4m3", ds="e4m3"),
    Variant("P (top bf16), dO, dS e4m3", p="e4m3", do="e4m3", ds="e4m3", p_top=True),
    Variant("P e4m3, dO, dS e5m2", p="e4m3", do="e5m2", ds="e5m2"),
    Variant("P (top bf16) e4m3, dO, dS e5m2", p="e4m3", do="e5m2", ds="e5m2", p_top=True),
    # delta of the dO that dP is made of: dS = P (dP - rowsum(P dP)) exactly, rows summing to 0
    Variant("P, dO e4m3, delta of cast dO", p="e4m3", do="e4m3", delta_of_cast=True),
    Variant("P (top bf16), dO, dS e4m3, delta of cast dO", p="e4m3", do="e4m3", ds="e4m3",
            p_top=True, delta_of_cast=True),
    Variant("P (top bf16) e4m3, dO, dS e5m2, delta of cast dO", p="e4m3", do="e5m2", ds="e5m2",
            p_top=True, delta_of_cast=True),
    # dS under a scale the kernels can compute (ds_scale), the rest as two rows above
    Variant("P (top bf16), dO, dS e4m3, delta of cast dO, dS scale bound", p="e4m3", do="e4m3",
            ds="e4m3", p_top=True, delta_of_cast=True, ds_scale="bound"),
    Variant("P (top bf16), dO, dS e4m3, delta of cast dO, dS scale online", p="e4m3", do="e4m3",
            ds="e4m3", p_top=True, delta_of_cast=True, ds_scale="online"),
)

# What the Hopper FP8 backward's kernels compute (pallas_kernels/mosaic_gpu/fp8_backward.py), up
# to fp32 sums: the online-scaled variant above with every P in e4m3 (no bf16 top key)
KERNELS = Variant("the FP8 kernels", p="e4m3", do="e4m3", ds="e4m3", delta_of_cast=True,
                  ds_scale="online")


def cast(x: np.ndarray, fmt: str, axes: tuple) -> np.ndarray:
  """float64 x rounded to `fmt`, FP8 under the largest power-of-two scale per slice (the axes
  not in `axes` index the slices) that keeps its largest |value| finite; returned unscaled."""
  dtype, largest = FORMATS[fmt]
  if dtype is None:
    return x
  if largest is None:   # bf16: fp32's range, no scale
    return x.astype(dtype).astype(np.float64)
  amax = np.max(np.abs(x), axis=axes, keepdims=True)
  scale = np.where(amax > 0, 2.0 ** np.floor(np.log2(largest / np.where(amax > 0, amax, 1))), 1)
  return (x * scale).astype(dtype).astype(np.float64) / scale


def power_of_two_under(largest: float, amax: np.ndarray) -> np.ndarray:
  """The largest power of two s with amax * s <= largest (1 where amax is 0)."""
  safe = np.where(amax > 0, amax, 1.0)
  return np.where(amax > 0, 2.0 ** np.floor(np.log2(largest / safe)), 1.0)


def cast_under(x: np.ndarray, fmt: str, scale: np.ndarray) -> np.ndarray:
  """x rounded to the FP8 `fmt` under `scale` (broadcast to x; no |x * scale| past the format's
  largest value), returned unscaled."""
  return (x * scale).astype(FORMATS[fmt][0]).astype(np.float64) / scale


def running_max(a: np.ndarray, axis: int, block: int) -> np.ndarray:
  """|a|'s running largest value along `axis` over blocks of `block`, broadcast back to a: each
  block's entries get the largest |value| of that block and every earlier one."""
  a = np.moveaxis(np.abs(a), axis, -1)
  blocks = a.reshape(*a.shape[:-1], -1, block).max(-1)
  running = np.maximum.accumulate(blocks, axis=-1)
  return np.moveaxis(np.repeat(running, block, axis=-1), -1, axis)


def ds_casts(ds, do_c, v, variant: Variant) -> tuple[np.ndarray, np.ndarray]:
  """(dS as dQ's product reads it, dS as dK's does), ds [B, N, T, S], under variant.ds_scale (the
  module doc); do_c [B, T, N, H] the cast dO, v [B, S, N, H]."""
  dtype, largest = FORMATS[variant.ds]
  if dtype is None or largest is None or variant.ds_scale == "exact":
    one = cast(ds, variant.ds, axes=(2, 3))
    return one, one
  if variant.ds_scale == "bound":
    do_norm = np.linalg.norm(do_c, axis=-1).transpose(0, 2, 1)[..., None]   # [B, N, T, 1]
    v_norm = np.linalg.norm(v, axis=-1).transpose(0, 2, 1)[:, :, None, :]   # [B, N, 1, S]
    v_max = v_norm.max(axis=3, keepdims=True)
    rows = power_of_two_under(largest, 2 * do_norm * v_max)
    cols = power_of_two_under(largest, do_norm.max(axis=2, keepdims=True) * (v_norm + v_max))
  else:   # "online": each row's (column's) running max over the kernel's blocks
    rows = power_of_two_under(largest, running_max(ds, 3, ONLINE_BLOCK))
    cols = power_of_two_under(largest, running_max(ds, 2, ONLINE_BLOCK))
  return cast_under(ds, variant.ds, rows), cast_under(ds, variant.ds, cols)


def cast_p(p: np.ndarray, fmt: str, top: bool) -> np.ndarray:
  """P [B, N, T, S] times P_SCALE in `fmt` (unscaled back), with each row's top key of every
  TOP_BLOCK keys in bf16 when `top`."""
  dtype, _ = FORMATS[fmt]
  scaled = p * P_SCALE
  low = scaled if dtype is None else scaled.astype(dtype).astype(np.float64)
  if top:
    B, N, T, S = p.shape
    blocks = scaled.reshape(B, N, T, S // TOP_BLOCK, TOP_BLOCK)
    is_top = (blocks >= blocks.max(-1, keepdims=True)).reshape(p.shape)
    low = np.where(is_top, scaled.astype(ml_dtypes.bfloat16).astype(np.float64), low)
  return low / P_SCALE


def gradients(q, k, v, bias, do, variant: Variant, exact=None) -> dict:
  """float64 (dQ, dK, dV) of attention of q, k, v [B, T|S, N, H] (N kv heads: no GQA) with
  `bias`, for the cotangent do, in `variant`'s arithmetic (the module doc); all float64 arrays.
  exact: their exact_attention_vjp, if already computed (its O and LSE are used)."""
  exact = exact_attention_vjp(q, k, v, do, bias) if exact is None else exact
  scale = 1.0 / np.sqrt(q.shape[-1])
  p = np.exp(np.einsum("btnh,bsnh->bnts", q, k) * scale + bias - exact.lse[..., None])
  do_c = cast(do, variant.do, axes=(1, 3))   # one scale per batch row and head
  delta = np.einsum("btnh,btnh->bnt", do_c if variant.delta_of_cast else do, exact.out)[..., None]
  dv = np.einsum("bnts,btnh->bsnh", cast_p(p, variant.p, variant.p_top), do_c)
  ds = p * (np.einsum("btnh,bsnh->bnts", do_c, v) - delta)
  ds_q, ds_k = ds_casts(ds, do_c, v, variant)
  return dict(dQ=np.einsum("bnts,bsnh->btnh", ds_q, k) * scale,
              dK=np.einsum("bnts,btnh->bsnh", ds_k, q) * scale, dV=dv)


def errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
  """(relative Frobenius error, largest |error| / RMS of want)."""
  rms = np.sqrt(np.mean(want ** 2))
  return (float(np.linalg.norm(got - want) / np.linalg.norm(want)),
          float(np.max(np.abs(got - want)) / rms))


def measure(regimes=accuracy.REGIMES, variants=VARIANTS, *, seed: int = 0, shapes=None) -> dict:
  """{(regime, variant name): {tensor: errors(...)}} on the regime's inputs (bf16), q, k and v
  quantized to e4m3 under per-head scales (stable_attn.fp8.quantize)."""
  results = {}
  for regime in regimes:
    q, k, v, bias, do = accuracy.inputs(regime, (shapes or {}).get(regime), seed=seed)
    q, k, v = (fp8.quantize(x) for x in (q, k, v))
    args = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, bias, do)]
    truth = exact_attention_vjp(*args[:3], args[4], args[3])
    want = dict(dQ=truth.dq, dK=truth.dk, dV=truth.dv)
    for variant in variants:
      got = gradients(*args, variant, exact=truth)
      results[regime, variant.name] = {t: errors(got[t], want[t]) for t in TENSORS}
  return results


def markdown(results: dict, seed: int) -> str:
  lines = ["# An FP8 attention backward's arithmetic, emulated on the CPU", "",
           f"`python -m stable_attn.diagnostics.fp8_backward --seed {seed}` (float64 but for "
           "the casts; q, k, v e4m3 under per-head scales; FP8 dO and dS under exact per-head "
           "power-of-two scales unless the variant names dS's scale (the module doc); P times "
           "2^8). Errors against float64 gradients of the same inputs: relative Frobenius / "
           "largest |error| over the truth's RMS.", "",
           "| regime | variant | dQ | dK | dV |", "|---|---|---|---|---|"]
  for (regime, name), errs in results.items():
    cells = " | ".join(f"{errs[t][0]:.2e} / {errs[t][1]:.3f}" for t in TENSORS)
    lines.append(f"| {regime} | {name} | {cells} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m stable_attn.diagnostics.fp8_backward",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--regimes", default=",".join(accuracy.REGIMES))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="also write the table (Markdown) to this file")
  args = parser.parse_args(argv)
  regimes = [r for r in args.regimes.split(",") if r]
  if set(regimes) - set(accuracy.REGIMES):
    parser.error(f"--regimes: choose from {accuracy.REGIMES}, got {regimes}")
  text = markdown(measure(regimes, seed=args.seed), args.seed)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
