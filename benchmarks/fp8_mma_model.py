"""The bias probe with the reference's P V accumulated as a model of Hopper's FP8 tensor cores
(issue 49; docs/fp8.md, "Hopper's FP8 accumulation, modelled").

    PYTHONPATH=. python benchmarks/fp8_mma_model.py --numerics fp8_fast --max-adjust off,safe \\
        [--bits 13] [--promote KEYS] [--block-k KEYS] [--top-exact | --center-v] [--tail 4,8] \\
        [--against GPU.md] \\
        [any other probe option]

The model: one FP8 wgmma adds the products of 32 keys (its K) to the accumulator in fixed
point, aligned to the largest of their exponents and the accumulator's, keeping `bits` bits
below it and truncating toward zero. 13 bits reproduced two measurements on an H200: the row sum
of the rounded P taken as a product with ones came out low by what the model gives (2026-12-04,
benchmarks/results/fp8_row_sum_product_nvidia_h200.md), and the compiled FP8 forward's bias probe
(far tail, fp8_fast and FlashAttention-3's arithmetic), cell for cell to 0.001 ulp where the
exact-sum reference is up to 0.008 away (benchmarks/results/fp8_mma_model_cpu.md).
--promote KEYS (a multiple of 32 dividing --block-k) models a kernel that accumulates every
KEYS keys into a fresh accumulator and adds that to O in fp32 (DeepSeek-V3's "promotion"); 0, the
default, is one accumulator along the row, as FlashAttention-3's kernel runs and ours did until
2026-12-04 (TuningConfig.fp8_pv_promote=0). --block-k KEYS: the reference's key block (64 by
default; 128 is the Hopper FP8 forward's, whose P V the kernel now promotes per block: --block-k
128 --promote 128 models it). --top-exact: each key block's largest P per row (every key at
it) is taken out of the modelled product and its P v added in fp32 (a design modelled, not
built). --center-v: each key block's V enters the modelled product less its mean over the
block's keys (per column), and the row sum of the block's P times that mean is added in fp32
(centring per block: modelled, not built; over the whole sequence it is built as numerics
center_v, e.g. --numerics fp8_fast+center_v=true: docs/fp8.md, "V centred"). Only the
reference's FP8 P V changes (l stays the exact sum of the rounded P, as the kernel's); every
other probe option passes through. --against FILE compares
the model's bias table, cell by cell, with a probe's output written elsewhere (the compiled
kernel's: `python -m stable_attn.diagnostics --implementations pallas_mosaic_gpu ... --out FILE`
on a GPU, with the same options), and prints the largest difference.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from stable_attn import reference, tile  # noqa: E402
from stable_attn.diagnostics import __main__ as probe_cli  # noqa: E402

GROUP = 32   # keys per FP8 wgmma instruction (its K for 8-bit operands)


def _unit(x, bits: int):
  """2^(floor(log2 x) - bits) for x > 0 (the model's last kept bit), elementwise."""
  _, e = jnp.frexp(x)   # x = m 2^e, m in [0.5, 1)
  # x = 0: every term is 0, any unit keeps them so (2^-140 would flush to 0 and give 0 / 0)
  return jnp.where(x > 0, jnp.ldexp(jnp.ones_like(x), e - 1 - bits), jnp.float32(1.0))


def truncating_accumulate(c, p, v, *, bits: int = 13, promote: int = 0, top_exact: bool = False):
  """c [rows, H] fp32 plus p [rows, keys] times v [keys, H] (fp32 holding FP8 values, so every
  product is exact), the keys in groups of GROUP: each group's products and the accumulator
  truncated toward zero to `_unit` of the largest magnitude among them, then added (exactly: all
  are multiples of that unit). promote: every `promote` keys (a multiple of GROUP) the
  accumulator starts again from 0 and what it held joins c in fp32, as at the start of each
  call (a call is a kernel's product of one key block; promote must divide its keys).
  top_exact: each row's largest p of the call (every key at it) stays out of the truncated
  product, its terms added in fp32 after (a kernel would need a second product or a gather of
  V's rows for it)."""
  if promote % GROUP or (promote and p.shape[1] % promote):
    raise ValueError(f"promote must be a multiple of {GROUP} keys dividing the block's "
                     f"{p.shape[1]}, got {promote}")
  if top_exact:
    top = jnp.max(p, axis=1, keepdims=True)
    is_top = (p == top) & (top > 0)
    return (truncating_accumulate(c, jnp.where(is_top, 0.0, p), v, bits=bits, promote=promote)
            + jnp.where(is_top, p, 0.0) @ v)
  total, acc = (c, jnp.zeros_like(c)) if promote else (None, c)
  for g in range(0, p.shape[1], GROUP):
    if promote and g and g % promote == 0:
      total, acc = total + acc, jnp.zeros_like(acc)
    t = p[:, g:g + GROUP, None] * v[None, g:g + GROUP, :]   # [rows, GROUP, H]
    u = _unit(jnp.maximum(jnp.abs(acc), jnp.max(jnp.abs(t), axis=1)), bits)
    acc = jnp.trunc(acc / u) * u + jnp.sum(jnp.trunc(t / u[:, None]) * u[:, None], axis=1)
  return acc if total is None else total + acc


@contextlib.contextmanager
def modelled_pv(bits: int = 13, promote: int = 0, block_k: int | None = None,
                top_exact: bool = False, center_v: bool = False):
  """Within: stable_attn.reference's FP8 P V (P in an 8-bit dtype) accumulates as
  `truncating_accumulate` models it, one call per key block, the block's rescaled accumulator
  taking part (the reference computes P V and adds it through tile.pv_product and
  tile.accumulate; both are swapped here and restored after), its key blocks `block_k` keys
  (None: reference.DEFAULT_BLOCK_K, which is set here and restored after); top_exact as
  `truncating_accumulate`'s. center_v: the block's V less its mean over the block's keys goes
  through the model, and sum_j P_j times that mean is added in fp32 (in exact arithmetic the same
  P V: it takes the signs' imbalance out of the truncation). Other numerics are untouched. Not
  thread-safe, and jit's caches are cleared on entry and exit."""
  pv_product, accumulate, default_block_k = (tile.pv_product, tile.accumulate,
                                             reference.DEFAULT_BLOCK_K)

  def products(p, v, dt):
    if jnp.dtype(dt.p).itemsize != 1:
      return pv_product(p, v, dt)
    p, v = p.astype(jnp.float32), v.astype(jnp.float32)
    mean = jnp.mean(v, axis=0) if center_v else jnp.zeros(v.shape[1:], jnp.float32)
    return _Products(p, v - mean, mean)

  def added(acc, alpha, pv, *, dt, round_fn=tile.round_convert, q_axis=0):
    if not isinstance(pv, _Products):
      return accumulate(acc, alpha, pv, dt=dt, round_fn=round_fn, q_axis=q_axis)
    scaled = tile.scale_acc(acc, alpha, dt=dt, round_fn=round_fn, q_axis=q_axis)
    # in P_bar * p_scale units, as the kernel's accumulator (a power of two: the same truncation)
    total = truncating_accumulate(scaled * dt.p_scale, pv.p, pv.v, bits=bits, promote=promote,
                                  top_exact=top_exact)
    return (total + jnp.sum(pv.p, axis=1, keepdims=True) * pv.mean) * (1.0 / dt.p_scale)

  # jit caches the reference's traces: dropped on the way in and out, so that neither side of
  # the swap reuses the other's
  jax.clear_caches()
  tile.pv_product, tile.accumulate = products, added
  reference.DEFAULT_BLOCK_K = block_k or default_block_k
  try:
    yield
  finally:
    tile.pv_product, tile.accumulate = pv_product, accumulate
    reference.DEFAULT_BLOCK_K = default_block_k
    jax.clear_caches()


class _Products(NamedTuple):
  """One key block's FP8 P and V (less `mean`, V's mean over the block's keys, with center_v; 0
  without), handed from `modelled_pv`'s pv_product to its accumulate."""
  p: jax.Array
  v: jax.Array
  mean: jax.Array


def bias_cells(text: str) -> dict:
  """A probe's bias table (its first) -> {(numerics, max_adjust, regime): (4 cells, ulps)}, the
  first implementation's rows where several are listed."""
  cells, impl = {}, None
  for line in text.split("Row sum")[0].splitlines():
    f = [x.strip() for x in line.strip().strip("|").split("|")]
    if len(f) != 9 or not f[4][-1:].isdigit():
      continue
    impl = impl or f[0]
    if f[0] == impl:
      cells[(f[1], f[2], f[3])] = tuple(float(x) for x in f[4:8])
  return cells


def comparison(model: dict, other: dict, label: str) -> str:
  """Markdown: per row of `other` also in `model`, the largest |model - other| of its cells,
  then the largest over all; a ValueError where they share no row."""
  shared = [key for key in other if key in model]
  if not shared:
    raise ValueError(f"{label}: no (numerics, max_adjust, regime) row in common with the model")
  lines = [f"\nModel against {label}: largest |model - measured| per row, ulps\n",
           "| numerics | max_adjust | regime | measured | model | largest difference |",
           "|---|---|---|---|---|---:|"]
  worst = 0.0
  for key in shared:
    d = max(abs(a - b) for a, b in zip(model[key], other[key]))
    worst = max(worst, d)
    show = lambda cells: " ".join(f"{x:+.3f}" for x in cells)
    lines.append(f"| {' | '.join(key)} | {show(other[key])} | {show(model[key])} | {d:.3f} |")
  lines.append(f"\nLargest difference over {len(shared)} rows: {worst:.3f} ulp")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
  parser.add_argument("--bits", type=int, default=13)
  parser.add_argument("--promote", type=int, default=0, metavar="KEYS")
  parser.add_argument("--block-k", type=int, default=reference.DEFAULT_BLOCK_K, metavar="KEYS")
  parser.add_argument("--top-exact", action="store_true",
                      help="each key block's largest P per row added in fp32, outside the model")
  parser.add_argument("--center-v", action="store_true",
                      help="each key block's V less its mean through the model, the mean's term "
                           "added in fp32")
  parser.add_argument("--against", metavar="FILE")
  args, rest = parser.parse_known_args(argv)
  if "-h" in rest or "--help" in rest:   # this script's options, then the probe's
    print(__doc__)
    return probe_cli.main(["--help"])
  if "--implementations" not in " ".join(rest):
    rest = ["--implementations", "reference", *rest]
  if args.top_exact and args.center_v:
    parser.error("--top-exact and --center-v are two designs: model one at a time")
  if args.block_k < GROUP or args.block_k % GROUP:
    parser.error(f"--block-k takes a positive multiple of {GROUP} keys, got {args.block_k}")
  if args.promote < 0 or args.promote % GROUP or args.block_k % max(args.promote, 1):
    # the reference adds P V per key block: a longer promotion would need its accumulator to
    # outlive the block
    parser.error(f"--promote takes a multiple of {GROUP} keys dividing the reference's key "
                 f"blocks of {args.block_k} (--block-k), got {args.promote}")
  print(f"P V accumulated as Hopper's FP8 wgmma, modelled: {args.bits} bits below the largest "
        f"exponent per {GROUP} keys, truncated"
        + (f"; a fresh accumulator every {args.promote} keys" if args.promote else "")
        + ("; each block's largest P per row added in fp32 outside it" if args.top_exact else "")
        + ("; each block's V centred (its mean's term added in fp32)" if args.center_v else "")
        + f"; the reference's key blocks of {args.block_k}\n")
  against = None
  if args.against:
    with open(args.against) as f:
      against = bias_cells(f.read())
  with (modelled_pv(args.bits, args.promote, args.block_k, args.top_exact, args.center_v),
        contextlib.redirect_stdout(io.StringIO()) as out):
    code = probe_cli.main(rest)
  text = out.getvalue()
  print(text)
  if against is not None:
    print(comparison(bias_cells(text), against, args.against))
  return code


if __name__ == "__main__":
  sys.exit(main())
