"""The tie-stress rounding-bias probe (paper.md, "Which arithmetic shows which bias").

Inputs: S keys, head dim 64. In every query row two keys tie exactly for the row max M (regime:
positive, negative, zero, tiny or large M, drawn per row); every other key scores 15-18 below M
(`tail`), so the rest of the row carries ~1e-4 of the mass, tiny but not zero. V columns 0-47 are
negative.
The scores are exact in every precision: q_i = (8 M_i, 8, 0...), k_tie = (1, 0, ...),
k_j = (1, -d_j, 0, ...), scale 1/8, so S_ij = M_i - d_j.

Every row then has the same tail d_j, so a P dtype's rounding of the tail errs alike in every row
and its mean over rows is one draw of d: with an FP8 P's 1/16 grid and a near tail that draw
moves the figure by tenths of an ulp from seed to seed, ties or not. `row_spread` r gives each
row its own tail, q_i = (8 M_i, 8 f_i, 0...) with f_i uniform in [1, 1 + r] (S_ij = M_i - f_i d_j,
still exact in fp32; the ties stay exact), as a model's rows have.

The figure is the mean of (O - O_true) * sign(O_true) over the negative columns, in ulps of the output
dtype at O_true, where O_true is float64 attention of the same low-precision inputs: +0.25 means
every half-way case rounded outward, -0.25 inward, ~0 unbiased.

The probe also reports the row sum's error as LSE - LSE_true (natural log, i.e. the relative error of
the denominator l) for our implementations. With a long tail (tail=(9, 12): ~1-3% of the mass spread
over ~1000 keys, each block's share below half an ulp of a bf16 l) a bf16 running sum drops the tail
in every row: LSE is low by ~2e-2 with or without the max adjustment, and only a wider sum
(Numerics.sum="float32") removes it. That rounding point drove the W_Q growth in the ablation
(docs/reproduction.md, section 5).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from stable_attn import fp8
from stable_attn.api import dot_product_attention
from stable_attn.reference import exact_attention_vjp

REGIMES = ("positive", "negative", "zero", "tiny", "large")
PLACEMENTS = ("adjacent", "random", "split", "none")   # "none": the no-tie control
NEGATIVE_COLUMNS = 48
HEAD_DIM = 64
TAIL = (15.0, 18.0)   # default distance of the non-max keys below the row max
SPLIT_AT = 128   # ties at keys 127 and 128: split across blocks for any block_k in 16..128
# Peers measured beside ours: name -> jax.nn.dot_product_attention implementation. They have no
# numerics presets or max adjustment.
PEERS = {"jax.nn": "xla", "cudnn": "cudnn"}


@dataclasses.dataclass(frozen=True)
class ProbeResult:
  implementation: str
  numerics: str
  max_adjust: str
  beta: float
  regime: str
  placement: str
  bias_ulp: float     # mean signed error in output ulps (outward > 0)
  abs_err_ulp: float  # mean |error| in output ulps
  nan_count: int
  lse_bias: float = float("nan")      # mean LSE - LSE_true (relative error of l); NaN for peers
  lse_low_frac: float = float("nan")  # fraction of rows whose LSE is below the truth


def _row_max(regime: str, rng, rows: int) -> np.ndarray:
  if regime == "positive":
    return rng.uniform(2, 6, rows)
  if regime == "negative":
    return -rng.uniform(2, 6, rows)
  if regime == "zero":
    return np.zeros(rows)
  if regime == "tiny":
    return rng.choice([-1.0, 1.0], rows) * rng.uniform(1e-4, 1.5e-3, rows)
  if regime == "large":
    return rng.uniform(20, 40, rows)
  raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")


def tie_inputs(regime: str, placement: str, *, batch=4, rows=256, keys=1024,
               dtype=jnp.bfloat16, seed=0, tail=TAIL, row_spread=0.0):
  """-> (q [B,T,1,64], k [B,S,1,64], v [B,S,1,64]) in `dtype`, as described in the module doc;
  tail: (lo, hi), how far below the row max the other keys score (uniform); row_spread: each
  row's tail distances times its own factor in [1, 1 + row_spread] (0: one tail for all rows)."""
  lo, hi = tail
  if not 0 < lo <= hi:
    raise ValueError(f"tail must be (lo, hi) with 0 < lo <= hi, got {tail!r}")
  if not 0 <= row_spread <= 1:
    raise ValueError(f"row_spread must be in [0, 1], got {row_spread!r}")
  if placement not in PLACEMENTS:
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
  if placement == "split" and keys <= SPLIT_AT:   # its ties: keys SPLIT_AT - 1 and SPLIT_AT
    raise ValueError(f"keys must be more than {SPLIT_AT} for the split placement, got {keys}")
  rng = np.random.default_rng(seed)
  to_dtype = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
  m = to_dtype(_row_max(regime, rng, batch * rows)).reshape(batch, rows)
  q = np.zeros((batch, rows, 1, HEAD_DIM))
  q[:, :, 0, 0] = 8 * m
  q[:, :, 0, 1] = 8.0
  if row_spread:   # drawn after everything else, so that row_spread=0 keeps every other draw
    spread = np.random.default_rng([seed, 1]).uniform(1, 1 + row_spread, (batch, rows))
    q[:, :, 0, 1] = to_dtype(8.0 * spread)
  k = np.zeros((batch, keys, 1, HEAD_DIM))
  k[:, :, 0, 0] = 1.0
  k[:, :, 0, 1] = -to_dtype(rng.uniform(lo, hi, (batch, keys)))
  for b in range(batch):
    if placement == "adjacent":
      tied = (0, 1)
    elif placement == "split":
      tied = (SPLIT_AT - 1, SPLIT_AT)
    else:  # random positions; the control keeps only the first as the max
      tied = tuple(rng.choice(keys, 2, replace=False))
    k[b, tied[0], 0, 1] = 0.0
    if placement != "none":
      k[b, tied[1], 0, 1] = 0.0
  v = rng.standard_normal((batch, keys, 1, HEAD_DIM))
  v[..., :NEGATIVE_COLUMNS] = -rng.uniform(1.0, 3.0, (batch, keys, 1, NEGATIVE_COLUMNS))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def ulp(x: np.ndarray, dtype) -> np.ndarray:
  """Spacing of `dtype` values at |x| (float64)."""
  mant = jnp.finfo(dtype).nmant
  tiny = float(jnp.finfo(dtype).tiny)
  e = np.floor(np.log2(np.maximum(np.abs(x), tiny)))
  return np.exp2(e - mant)


def signed_ulp_error(out, truth, dtype):
  """(O - O_true) * sign(O_true) / ulp over the negative columns; NaN where O is not finite."""
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)[..., :NEGATIVE_COLUMNS]
  truth = truth[..., :NEGATIVE_COLUMNS]
  return (out - truth) * np.sign(truth) / ulp(truth, dtype)


def measure(implementation: str, numerics: str, max_adjust: str, regime: str, placement: str, *,
            beta: float = 2.0, dtype=jnp.bfloat16, batch=4, rows=256, keys=1024, seed=0,
            interpret: bool = False, logits_soft_cap=None, sink=None, tail=TAIL,
            row_spread: float = 0.0, context: tuple[int, str] | None = None) -> ProbeResult:
  """With logits_soft_cap, the truth is the float64 attention of the capped logits (ties stay
  ties: both tied scores map to the same capped value). With `sink` (a float), the one head gets
  that attention-sink logit, and the truth includes it. With context = (n, strategy), the call
  runs context parallel: queries and keys split over the first n devices (an Explicit mesh),
  `strategy` "allgather" or "ring" (each device then merges n key blocks' O and LSE)."""
  q, k, v = tie_inputs(regime, placement, batch=batch, rows=rows, keys=keys, dtype=dtype,
                       seed=seed, tail=tail, row_spread=row_spread)
  sinks = None if sink is None else np.full((1,), sink, np.float32)
  fn = _attention(implementation, numerics, max_adjust, beta, interpret, logits_soft_cap, sink,
                  None if context is None else context[1])
  if context is None:
    out = fn(q, k, v)
  else:
    mesh = jax.make_mesh((context[0],), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:context[0]])
    with jax.set_mesh(mesh):
      split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
      out = jax.device_get(fn(*(jax.device_put(x, split) for x in (q, k, v))))
  if implementation not in PEERS:   # the truth of FP8 inputs: the exact attention of their values
    q, k, v = fp8.attended(q, k, v, numerics)
  # The float64 VJP's forward gives O and LSE at once (the zero cotangent costs only time).
  exact = exact_attention_vjp(q, k, v, np.zeros(q.shape, np.float32),
                              logits_soft_cap=logits_soft_cap, sinks=sinks)
  lse_bias = lse_low = float("nan")
  if implementation not in PEERS:   # ours return (O, LSE); jax.nn has no LSE
    out, lse = out
    lse_err = np.asarray(lse, np.float64) - exact.lse
    lse_bias, lse_low = float(np.mean(lse_err)), float(np.mean(lse_err < 0))
  err = signed_ulp_error(out, exact.out, dtype)
  finite = np.isfinite(err)
  nan_count = int(np.size(err) - finite.sum())
  bias = float(err[finite].mean()) if finite.any() else float("nan")
  abs_err = float(np.abs(err[finite]).mean()) if finite.any() else float("nan")
  return ProbeResult(implementation, numerics, max_adjust, beta, regime, placement, bias, abs_err,
                     nan_count, lse_bias, lse_low)


_CACHE: dict = {}


def _attention(implementation, numerics, max_adjust, beta, interpret, logits_soft_cap=None,
               sink=None, strategy=None):
  """One jitted function per configuration (shapes repeat across regimes)."""
  key = (implementation, numerics, max_adjust, beta, interpret, logits_soft_cap, sink, strategy)
  if key not in _CACHE:
    if implementation in PEERS:
      if logits_soft_cap is not None or sink is not None:
        raise ValueError(f"the peer {implementation!r} (jax.nn) has no logits soft cap or sinks")
      fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                        implementation=PEERS[implementation])
    else:
      fn = lambda q, k, v: dot_product_attention(
          q, k, v, implementation=implementation, numerics=numerics, max_adjust=max_adjust,
          beta=beta, interpret=interpret, logits_soft_cap=logits_soft_cap,
          sinks=None if sink is None else jnp.full((1,), sink, jnp.float32),
          return_residuals=True, context_strategy=strategy or "allgather")
    _CACHE[key] = jax.jit(fn)
  return _CACHE[key]


def sweep(implementations: Iterable[str], numerics_presets: Iterable[str] = ("fast", "paper"),
          adjusts: Iterable[tuple[str, float]] = (("off", 2.0), ("paper", 2.0), ("paper", 7.0),
                                                  ("safe", 2.0)),
          regimes=REGIMES, placements=PLACEMENTS, progress=None, **kwargs) -> list[ProbeResult]:
  """Every combination; `progress` (e.g. a tqdm) is updated once per measurement."""
  results = []
  for impl in implementations:
    nx_list = ("-",) if impl in PEERS else tuple(numerics_presets)
    adj_list = (("-", 0.0),) if impl in PEERS else tuple(adjusts)
    for nx in nx_list:
      for adjust, beta in adj_list:
        for regime in regimes:
          for placement in placements:
            results.append(measure(impl, nx, adjust, regime, placement, beta=beta, **kwargs))
            if progress is not None:
              progress.update(1)
  return results


# ---------------------------------------------------------------------------------------------
# Gradients: delta error and the alignment of dQ errors across batches
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GradientProbeResult:
  implementation: str
  numerics: str
  max_adjust: str
  regime: str
  delta_rel_bias: float   # mean(delta - delta_true) / mean|delta_true|, delta from the output O
  delta_sign: float       # fraction of batches whose summed delta error is positive
  dq_rms_err: float       # RMS of dQ - dQ_true (absolute: the tied keys are equal, so the true
                          # dQ is ~0 and the error is the delta error times P K)
  dq_cosine: float        # mean pairwise cosine of the per-batch dQ errors (1 = one direction)
  nan_count: int


def measure_gradients(implementation: str, numerics: str, max_adjust: str, regime="positive",
                      placement="adjacent", *, beta=2.0, dtype=jnp.bfloat16, batch=8, rows=128,
                      keys=512, seed=0, interpret=False) -> GradientProbeResult:
  """dO is negative on the negative V columns (the paper's setting: one-signed dO and V)."""
  q, k, v = tie_inputs(regime, placement, batch=batch, rows=rows, keys=keys, dtype=dtype,
                       seed=seed)
  rng = np.random.default_rng(seed + 1)
  do = rng.standard_normal(q.shape)
  do[..., :NEGATIVE_COLUMNS] = -np.abs(do[..., :NEGATIVE_COLUMNS])
  do = jnp.asarray(do, dtype)
  fn = lambda q, k, v: dot_product_attention(q, k, v, implementation=implementation,
                                             numerics=numerics, max_adjust=max_adjust, beta=beta,
                                             interpret=interpret)
  out, vjp = jax.vjp(jax.jit(fn), q, k, v)
  dq = np.asarray(vjp(do)[0].astype(jnp.float32), np.float64)
  exact = exact_attention_vjp(q, k, v, do)
  o_true, dq_true = exact.out, exact.dq
  do64 = np.asarray(do.astype(jnp.float32), np.float64)
  o64 = np.asarray(out.astype(jnp.float32), np.float64)
  delta_err = np.sum(do64 * (o64 - o_true), axis=-1)          # [B, T, 1]
  delta_true = np.sum(do64 * o_true, axis=-1)
  per_batch = delta_err.reshape(batch, -1).sum(axis=1)
  dq_err = (dq - dq_true).reshape(batch, -1)
  unit = dq_err / np.maximum(np.linalg.norm(dq_err, axis=1, keepdims=True), 1e-300)
  cos = unit @ unit.T
  pairs = cos[np.triu_indices(batch, 1)]
  nan_count = int(np.size(dq) - np.isfinite(dq).sum() + np.size(o64) - np.isfinite(o64).sum())
  return GradientProbeResult(
      implementation, numerics, max_adjust, regime,
      float(np.nanmean(delta_err) / np.mean(np.abs(delta_true))),
      float(np.mean(per_batch > 0)),
      float(np.sqrt(np.mean((dq - dq_true) ** 2))),
      float(np.nanmean(pairs)), nan_count)
