"""python -m stable_attn.diagnostics: print (and optionally save) the bias-probe tables."""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

from stable_attn.diagnostics.probe import (PEERS, PLACEMENTS, REGIMES, SPLIT_AT, TAIL,
                                          measure_gradients, sweep)

_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _adjusts(text: str):
  """"off,paper:2,paper:7,safe" -> [("off", 2.0), ("paper", 2.0), ("paper", 7.0), ("safe", 2.0)]"""
  out = []
  for item in text.split(","):
    mode, _, beta = item.partition(":")
    out.append((mode, float(beta) if beta else 2.0))
  return out


def _by_row(results) -> dict:
  """(implementation, numerics, max_adjust, regime) -> {placement: result}."""
  rows = {}
  for r in results:
    adjust = r.max_adjust if r.max_adjust != "paper" else f"paper (beta {r.beta:g})"
    rows.setdefault((r.implementation, r.numerics, adjust, r.regime), {})[r.placement] = r
  return rows


def _table(rows: dict, cell, last: str, last_cell) -> str:
  head = ("| implementation | numerics | max_adjust | regime | "
          + " | ".join(f"ties {p}" if p != "none" else "no ties" for p in PLACEMENTS)
          + f" | {last} |\n|" + "---|" * (5 + len(PLACEMENTS)) + "\n")
  lines = ["| " + " | ".join(list(key) + [cell(cells[p]) if p in cells else "" for p in PLACEMENTS]
                             + [last_cell(cells)]) + " |" for key, cells in rows.items()]
  return head + "\n".join(lines) + "\n"


def bias_table(results) -> str:
  """Markdown: one row per implementation x numerics x max_adjust x regime, one column per tie
  placement (mean signed error in output ulps, outward > 0), plus NaN counts."""
  return _table(_by_row(results), lambda r: f"{r.bias_ulp:+.3f}", "NaN",
                lambda cells: str(sum(c.nan_count for c in cells.values())))


def lse_table(results) -> str:
  """Markdown, our implementations only: mean LSE - LSE_true (the row sum's relative error) and,
  in parentheses, the fraction of rows whose LSE is below the truth."""
  ours = [r for r in results if r.implementation not in PEERS]
  return _table(_by_row(ours), lambda r: f"{r.lse_bias:+.1e} ({r.lse_low_frac:.2f})", "NaN",
                lambda cells: str(sum(c.nan_count for c in cells.values())))


def gradient_table(results) -> str:
  head = ("| implementation | numerics | max_adjust | regime | delta bias (rel.) | "
          "batches with delta error > 0 | dQ RMS error | dQ error cosine across batches | NaN |\n"
          "|---|---|---|---|---|---|---|---|---|\n")
  lines = [f"| {r.implementation} | {r.numerics} | {r.max_adjust} | {r.regime} | "
           f"{r.delta_rel_bias:+.2e} | {r.delta_sign:.2f} | {r.dq_rms_err:.2e} | "
           f"{r.dq_cosine:+.2f} | {r.nan_count} |" for r in results]
  return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m stable_attn.diagnostics",
                                   description=__doc__)
  parser.add_argument("--implementations", default="reference,xla,jax.nn",
                      help="comma list of stable_attn implementations, plus peers for comparison: "
                           "'jax.nn' (jax.nn.dot_product_attention, XLA) and 'cudnn' (the same, cuDNN)")
  parser.add_argument("--numerics", default="fast,paper")
  parser.add_argument("--max-adjust", default="off,paper:2,paper:7,safe",
                      help="comma list of modes, 'paper:BETA' for the paper's rule with BETA")
  parser.add_argument("--regimes", default=",".join(REGIMES))
  parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--rows", type=int, default=256, help="query rows per batch element")
  parser.add_argument("--keys", type=int, default=1024)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--gradients", action="store_true",
                      help="also print the delta / dQ error table (positive maxima, adjacent ties)")
  parser.add_argument("--interpret", action="store_true", help="Pallas kernels in interpret mode")
  parser.add_argument("--logits-soft-cap", type=float, default=None,
                      help="soft-cap the logits (our implementations only; truth capped the same)")
  parser.add_argument("--sink", type=float, default=None,
                      help="give the head this attention-sink logit (our implementations only; "
                           "the truth includes it)")
  parser.add_argument("--tail", default=",".join(f"{x:g}" for x in TAIL),
                      help="LO,HI: how far below the row max the other keys score (default "
                           "%(default)s; 9,12 gives a long tail that a bf16 row sum drops)")
  parser.add_argument("--row-spread", type=float, default=0.0, metavar="R",
                      help="give each row its own tail: its distances times a factor in [1, 1+R] "
                           "(default 0: every row the same tail, whose rounding then errs alike "
                           "in every row)")
  parser.add_argument("--context", metavar="N:STRATEGY",
                      help="run ours context parallel: queries and keys split over N devices, "
                           "STRATEGY allgather or ring (on a CPU, give XLA_FLAGS="
                           "--xla_force_host_platform_device_count=N; GPU kernels only)")
  parser.add_argument("--out", help="also write the tables (Markdown) to this file")
  args = parser.parse_args(argv)
  context = None
  if args.context:
    n, _, strategy = args.context.partition(":")
    if not n.isdigit() or int(n) < 1 or strategy not in ("allgather", "ring"):
      parser.error(f"--context takes N:allgather or N:ring, got {args.context!r}")
    if int(n) > jax.device_count():
      parser.error(f"--context {args.context}: {n} devices asked, {jax.device_count()} present")
    context = (int(n), strategy)

  impls = [s for s in args.implementations.split(",") if s]
  numerics = [s for s in args.numerics.split(",") if s]
  adjusts = _adjusts(args.max_adjust)
  regimes = [s for s in args.regimes.split(",") if s]
  for regime in regimes:
    if regime not in REGIMES:
      parser.error(f"--regimes: unknown regime {regime!r}; choose from {REGIMES}")
  try:
    lo, hi = (float(x) for x in args.tail.split(","))
  except ValueError:
    parser.error(f"--tail takes LO,HI (two numbers), got {args.tail!r}")
  if not 0 < lo <= hi:
    parser.error(f"--tail: need 0 < LO <= HI, got {args.tail!r}")
  if args.keys <= SPLIT_AT:
    parser.error(f"--keys: need more than {SPLIT_AT} (the split placement's tie), got {args.keys}")
  if not 0 <= args.row_spread <= 1:
    parser.error(f"--row-spread: need 0 <= R <= 1, got {args.row_spread!r}")
  n_ours = sum(i not in PEERS for i in impls)
  total = (n_ours * len(numerics) * len(adjusts) + (len(impls) - n_ours)) * len(regimes) * len(
      PLACEMENTS)
  start = time.time()
  with tqdm(total=total, desc="bias probe", file=sys.stderr) as bar:
    results = sweep(impls, numerics, adjusts, regimes=regimes, progress=bar,
                    dtype=_DTYPES[args.dtype], batch=args.batch, rows=args.rows, keys=args.keys,
                    seed=args.seed, interpret=args.interpret, logits_soft_cap=args.logits_soft_cap,
                    sink=args.sink, tail=(lo, hi), row_spread=args.row_spread,
                    **({"context": context} if context else {}))
  device = jax.devices()[0].device_kind
  title = (f"Tie-stress bias probe: mean signed error of O in {args.dtype} ulps (outward > 0), "
           f"{args.batch}x{args.rows} rows, {args.keys} keys, head dim 64, "
           f"{'' if args.logits_soft_cap is None else f'logits soft cap {args.logits_soft_cap:g}, '}"
           f"{'' if args.sink is None else f'attention sink {args.sink:g}, '}"
           f"{'' if context is None else 'context parallel over %d devices, %s, ' % context}"
           f"other keys {lo:g}-{hi:g} below the max"
           f"{'' if not args.row_spread else f' times [1, {1 + args.row_spread:g}] per row'}, "
           f"device: {device}, "
           f"jax {jax.__version__}, {time.time() - start:.0f} s\n\n")
  text = title + bias_table(results)
  if any(r.implementation not in PEERS for r in results):
    text += ("\nRow sum: mean LSE - LSE_true (natural log: the relative error of the denominator "
             "l), in parentheses the fraction of rows below the truth\n\n" + lse_table(results))
  if args.gradients:
    grads = [measure_gradients(impl, nx, mode, beta=beta, dtype=_DTYPES[args.dtype],
                               seed=args.seed, interpret=args.interpret)
             for impl in impls if impl not in PEERS for nx in numerics for mode, beta in adjusts
             if not (mode == "paper" and beta != 2.0)]
    text += ("\nGradient probe (positive maxima, adjacent ties, dO < 0 on the negative V columns): "
             "delta = rowsum(dO * O) from the output O vs float64\n\n" + gradient_table(grads))
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
