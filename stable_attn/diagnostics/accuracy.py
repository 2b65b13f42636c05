"""What the max adjustment costs in accuracy: errors of O, dQ, dK, dV and dbias against float64.

    python -m stable_attn.diagnostics.accuracy                      # CPU: reference, xla, jax.nn
    python -m stable_attn.diagnostics.accuracy --out results.md     # on a GPU: + the default
                                                                    # kernel and cuDNN

Regimes (bf16 by default; the truth is float64 attention of the same low-precision inputs, values
and gradients from `stable_attn.reference.exact_attention_vjp`):
  random     q, k, v, bias ~ N(0, 1), cotangent ~ N(0, 1): flat rows, no key dominates.
  one-hot    self-attention q = k = v = x ~ N(0, 1) with bias ~ N(0, 1) and cotangent x: the bias-
             gradient tests of jax.nn and tokamax (B16 T128 N4 H64). Each row's diagonal score is
             |x|^2 / 8 ~ 8, so it takes ~90% of the row: near-one-hot rows, with dO along O.
  long-tail  one key per row 9 above a N(0, 1) background of S = 1024 keys (bias), q, k, v and
             cotangent ~ N(0, 1): the key takes ~80% of the row and the rest is spread thin.

Arms: our implementations x max_adjust x numerics, and peers: jax.nn (its XLA attention) always,
cuDNN (jax.nn with implementation="cudnn") only where a GPU is present. max_adjust may also be
"safe-on-grid", a diagnostic arm and not a mode of the library: "safe" with each row's largest
weight w moved onto the P dtype's grid, i.e. without the rounding error of w that makes "safe"
unbiased in the "fast" presets. It computes what "off" computes (up to the constant factor w) and
is as biased as "off" there; what "safe" loses against it is what the dither costs.

What the tables show (README, "What safe costs in accuracy"): the flash backward's delta =
rowsum(dO * O) sees every error of the saved O. "off" saves O rounded to bf16 (delta from fp32 O,
"+fp32o", removes that); "safe" in addition moves each row's O by the rounding error of w, up to
half a cell of P's grid relative to w (2^-9 / w in bf16), coherently over the head dim, so on
near-one-hot rows with dO along O delta carries ~|dO| |O| 2^-9 / w. That error is zero-mean
(the dither's sign alternates over rows), not one-signed.

Figures per tensor: max |err|, mean |err| and bias = mean (x - x_true) * sign(x_true) (outward > 0;
the probe's convention), in the tensor's own units, with the RMS of the truth for scale.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from stable_attn import backends, tile
from stable_attn import numerics as numerics_lib
from stable_attn.api import Options, canonicalize, dot_product_attention
from stable_attn.reference import exact_attention_vjp, tile_dtypes
from stable_attn.tile import MAX_ADJUST_MODES

TENSORS = ("O", "dQ", "dK", "dV", "dbias")
REGIMES = ("random", "one-hot", "long-tail")
# Peers: name -> jax.nn.dot_product_attention's implementation argument.
PEERS = {"jax.nn": "xla", "cudnn": "cudnn"}
# Default shapes (B, T, S, N, H) per regime.
SHAPES = {"random": (4, 256, 256, 4, 64), "one-hot": (16, 128, 128, 4, 64),
          "long-tail": (2, 128, 1024, 4, 64)}
LONG_TAIL_SPIKE = 9.0
# A diagnostic arm, not a mode of the library: "safe" with each row's largest weight w on the P
# dtype's grid (its rounding error, the dither that makes "safe" unbiased, removed; biased again).
SAFE_ON_GRID = "safe-on-grid"


def gpu_present() -> bool:
  return any(d.platform == "gpu" for d in jax.devices())


@dataclasses.dataclass(frozen=True)
class Arm:
  """One way of computing attention: ours (implementation, max_adjust, numerics) or a peer."""
  implementation: str
  max_adjust: str = "-"
  numerics: str = "-"
  interpret: bool = False

  @property
  def label(self) -> str:
    if self.implementation in PEERS:
      return f"{self.implementation} ({PEERS[self.implementation]})"
    name = self.implementation + (" (interpret)" if self.interpret else "")
    return f"{name} / {self.max_adjust} / {self.numerics}"


@dataclasses.dataclass(frozen=True)
class Stat:
  max_abs: float
  mean_abs: float
  bias: float       # mean (x - x_true) * sign(x_true)
  nonfinite: int


@dataclasses.dataclass
class Result:
  regime: str
  arm: Arm
  stats: dict        # tensor -> Stat, or empty when skipped
  skipped: str = ""  # why the arm did not run


def inputs(regime: str, shape=None, *, dtype=jnp.bfloat16, seed: int = 0):
  """-> (q, k, v, bias, d_out) in `dtype` for a regime (see the module doc)."""
  if regime not in REGIMES:
    raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
  B, T, S, N, H = shape or SHAPES[regime]
  rng = np.random.default_rng(seed)
  cast = lambda x: jnp.asarray(x, dtype)
  if regime == "one-hot":
    if T != S:
      raise ValueError(f"the one-hot regime is self-attention: T == S, got T={T}, S={S}")
    x = cast(rng.standard_normal((B, T, N, H)))
    return x, x, x, cast(rng.standard_normal((B, N, T, S))), x
  q, k, v, do = (cast(rng.standard_normal(s)) for s in
                 ((B, T, N, H), (B, S, N, H), (B, S, N, H), (B, T, N, H)))
  bias = rng.standard_normal((B, N, T, S))
  if regime == "long-tail":
    spike = rng.integers(0, S, (B, N, T))
    np.put_along_axis(bias, spike[..., None], LONG_TAIL_SPIKE, axis=-1)
  return q, k, v, cast(bias), do


def on_grid_offsets(offset: jax.Array, p_dtype) -> jax.Array:
  """"safe"'s per-row offsets c moved so that each row's largest weight exp(-c) is its value
  rounded to the P dtype: the same weights as fed to PV, without their rounding error."""
  return tile.p_grid_offset(offset, p_dtype, round_fn=tile.round_exact)


def _function(arm: Arm):
  if arm.implementation in PEERS:
    impl = PEERS[arm.implementation]
    return lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, implementation=impl)
  impl = None if arm.implementation == "auto" else arm.implementation
  if arm.max_adjust == SAFE_ON_GRID:
    def attention(q, k, v, b):
      options = Options(implementation=impl, max_adjust="safe", numerics=arm.numerics,
                        interpret=arm.interpret)
      spec, ops, _ = canonicalize(q, k, v, b, None, options)
      ops = ops._replace(offset=on_grid_offsets(ops.offset, tile_dtypes(spec.numerics,
                                                                         q.dtype).p))
      return backends.run(impl, spec, ops)[0]
    return attention
  return lambda q, k, v, b: dot_product_attention(
      q, k, v, b, implementation=impl, max_adjust=arm.max_adjust, numerics=arm.numerics,
      interpret=arm.interpret)


def values_and_grads(arm: Arm, q, k, v, bias, do) -> dict:
  """tensor name -> float64 array (O and the gradients for the cotangent do)."""
  out, vjp = jax.vjp(jax.jit(_function(arm)), q, k, v, bias)
  grads = vjp(do)
  as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  return dict(zip(TENSORS, (as64(out),) + tuple(as64(g) for g in grads)))


def truth(q, k, v, bias, do) -> dict:
  exact = exact_attention_vjp(q, k, v, do, bias)
  return dict(zip(TENSORS, (exact.out, exact.dq, exact.dk, exact.dv, exact.dbias)))


def statistics(got: np.ndarray, want: np.ndarray) -> Stat:
  finite = np.isfinite(got)
  err = np.where(finite, got - want, 0.0)
  return Stat(float(np.abs(err).max()), float(np.abs(err).mean()),
              float(np.mean(err * np.sign(want))), int(np.size(got) - finite.sum()))


def measure(arms, regimes=REGIMES, *, dtype=jnp.bfloat16, seed=0, shapes=None,
            progress=None) -> tuple[list[Result], dict]:
  """-> (results, {regime: {tensor: RMS of the truth}})."""
  results, scales = [], {}
  for regime in regimes:
    shape = (shapes or {}).get(regime)
    args = inputs(regime, shape, dtype=dtype, seed=seed)
    want = truth(*args)
    scales[regime] = {t: float(np.sqrt(np.mean(want[t] ** 2))) for t in TENSORS}
    for arm in arms:
      skip = _skip_reason(arm)
      if skip:
        results.append(Result(regime, arm, {}, skip))
      else:
        try:
          got = values_and_grads(arm, *args)
        except Exception as e:  # a peer refusing the call (e.g. cuDNN on an unsupported GPU)
          if arm.implementation not in PEERS:
            raise
          results.append(Result(regime, arm, {}, f"{type(e).__name__}: {str(e).splitlines()[0]}"))
        else:
          results.append(Result(regime, arm, {t: statistics(got[t], want[t]) for t in TENSORS}))
      if progress is not None:
        progress(regime, arm)
  return results, scales


def _skip_reason(arm: Arm) -> str:
  if arm.implementation == "cudnn" and not gpu_present():
    return "no GPU"
  return ""


def default_implementations() -> str:
  return "auto,xla,jax.nn,cudnn" if gpu_present() else "reference,xla,jax.nn"


def arms_from(implementations: str, max_adjusts: str, numerics: str, interpret: bool) -> list:
  arms = []
  for impl in (s for s in implementations.split(",") if s):
    if impl in PEERS:
      arms.append(Arm(impl))
      continue
    for nx in (s for s in numerics.split(",") if s):
      if impl == "xla" and nx.endswith("+fp32o"):
        continue   # xla differentiates its forward: no residual O, the same as its base preset
      for mode in (s for s in max_adjusts.split(",") if s):
        arms.append(Arm(impl, mode, nx, interpret and impl.startswith("pallas")))
  return arms


def _cell(stat: Optional[Stat]) -> str:
  if stat is None:
    return ""
  text = f"{stat.max_abs:.3g} ({stat.mean_abs:.2g}) [{stat.bias:+.1e}]"
  return text + (f" {stat.nonfinite} non-finite" if stat.nonfinite else "")


def table(results: list[Result], scales: dict) -> str:
  """Markdown, one table per regime: rows = arms, one column per tensor with
  'max |err| (mean |err|) [bias]'."""
  text = ""
  for regime in dict.fromkeys(r.regime for r in results):
    scale = ", ".join(f"{t} {scales[regime][t]:.3g}" for t in TENSORS)
    text += (f"\n**{regime}** (RMS of the truth: {scale})\n\n| arm | "
             + " | ".join(TENSORS) + " |\n|---|" + "---|" * len(TENSORS) + "\n")
    for r in (r for r in results if r.regime == regime):
      cells = ([f"skipped: {r.skipped}"] + [""] * (len(TENSORS) - 1) if r.skipped
               else [_cell(r.stats.get(t)) for t in TENSORS])
      text += f"| {r.arm.label} | " + " | ".join(cells) + " |\n"
  return text


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m stable_attn.diagnostics.accuracy",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--implementations", default=None,
                      help="comma list of stable_attn implementations ('auto' = the default "
                           "dispatch) and peers 'jax.nn', 'cudnn' (cuDNN runs only where a GPU is "
                           "present). Default: %s on a CPU, %s on a GPU" % (
                               "reference,xla,jax.nn", "auto,xla,jax.nn,cudnn"))
  parser.add_argument("--max-adjust", default="safe,off",
                      help="comma list of off, paper, safe and the diagnostic safe-on-grid "
                           "(default %(default)s)")
  parser.add_argument("--numerics", default="fast,fast+fp32o",
                      help="comma list of presets or spellings stable_attn.numerics.resolve "
                           "takes (default %(default)s)")
  parser.add_argument("--regimes", default=",".join(REGIMES))
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  parser.add_argument("--shape", action="append", default=[], metavar="REGIME=B,T,S,N,H",
                      help="override a regime's shape (repeatable), e.g. one-hot=2,64,64,2,64")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--interpret", action="store_true", help="Pallas kernels in interpret mode")
  parser.add_argument("--out", help="also write the table (Markdown) to this file")
  parser.add_argument("--append", action="store_true",
                      help="append to --out instead of replacing it")
  args = parser.parse_args(argv)

  for mode in (s for s in args.max_adjust.split(",") if s):
    if mode not in MAX_ADJUST_MODES + (SAFE_ON_GRID,):
      parser.error(f"--max-adjust: unknown mode {mode!r}; choose from "
                   f"{MAX_ADJUST_MODES + (SAFE_ON_GRID,)}")
  for nx in (s for s in args.numerics.split(",") if s):
    try:
      numerics_lib.resolve(nx)
    except ValueError as e:
      parser.error(f"--numerics: {e}")

  regimes = [s for s in args.regimes.split(",") if s]
  for regime in regimes:
    if regime not in REGIMES:
      parser.error(f"--regimes: unknown regime {regime!r}; choose from {REGIMES}")
  shapes = {}
  for item in args.shape:
    regime, _, dims = item.partition("=")
    try:
      shapes[regime] = tuple(int(d) for d in dims.split(","))
    except ValueError:
      parser.error(f"--shape takes REGIME=B,T,S,N,H, got {item!r}")
    if regime not in REGIMES or len(shapes[regime]) != 5:
      parser.error(f"--shape takes REGIME=B,T,S,N,H with REGIME in {REGIMES}, got {item!r}")
  arms = arms_from(args.implementations or default_implementations(), args.max_adjust,
                   args.numerics, args.interpret)
  dtype = jnp.dtype(args.dtype)
  start = time.time()
  results, scales = measure(arms, regimes, dtype=dtype, seed=args.seed, shapes=shapes,
                            progress=lambda regime, arm: print(f"  {regime}: {arm.label}",
                                                               file=sys.stderr, flush=True))
  shape_text = "; ".join(f"{r} B,T,S,N,H={','.join(map(str, shapes.get(r, SHAPES[r])))}"
                         for r in regimes)
  text = (f"Accuracy against float64 attention of the same {args.dtype} inputs; cell: max |err| "
          f"(mean |err|) [bias = mean signed error, outward > 0]; cotangent ~ N(0, 1), for one-hot "
          f"the input x (as the peers' tests). {shape_text}; seed {args.seed}; "
          f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{time.time() - start:.0f} s\n" + table(results, scales))
  print(text)
  if args.out:
    with open(args.out, "a" if args.append else "w") as f:
      f.write(("\n" if args.append else "") + text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
