"""The Hopper forward with a bias (no mask): the table's tiles against the other candidates, and
tokamax's forward, one process, 5 interleaved reps (docs/hopper_kernel.md, "The forward with a
bias").

    PYTHONPATH=. python benchmarks/bias_forward.py     # on a Hopper GPU; prints a Markdown table

Candidates per head dim: two ping-ponging warpgroups over the tiles that fit beside the bias
(`tuning._BESIDE` at 128; (64, 128, 2) at 64), also persistent in either tile order
(`TuningConfig.persistent_order`), and three warpgroups (at 64 persistent: over 64-key blocks,
`tuning._BIAS_FWD`, and without a bias the table's (64, 128, 2)); at 128 the bias in K's slots
(over 64-key blocks: the table's choice before `TuningConfig.fwd_bias_apart`) or apart from K
(`tuning._BIAS_APART`). Each row's speed is against the table's choice; the output's largest
difference from it shows the candidates compute the same attention. The last case has no bias:
the table's persistent forward in both orders.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
import pallas_kernels.mosaic_gpu as mosaic  # noqa: E402
from benchmarks import attention as bench  # noqa: E402
from benchmarks import peers  # noqa: E402
from benchmarks.features import _alibi, _inputs  # noqa: E402
from pallas_kernels.mosaic_gpu import tuning  # noqa: E402
from stable_attn.api import Options, canonicalize  # noqa: E402

IMPL = "pallas_mosaic_gpu"
T = tuning.Tiles
P = dict(fwd_persistent=True)
WITH_K = dict(fwd_bias_apart=False)
CANDIDATES = {
    64: {"2 warpgroups (64, 128, 2)": dict(fwd=T(64, 128, 2), fwd_wgs=2, fwd_persistent=False),
         "3 persistent (64, 64, 3)": dict(fwd=T(64, 64, 3), fwd_wgs=3, **P,
                                          persistent_order="heaviest"),
         "3 persistent (64, 128, 2), heaviest first": dict(fwd=T(64, 128, 2), fwd_wgs=3, **P,
                                                           persistent_order="heaviest"),
         "2 persistent (64, 128, 2), heaviest first": dict(fwd=T(64, 128, 2), fwd_wgs=2, **P,
                                                           persistent_order="heaviest"),
         "2 persistent (64, 128, 2), grid order": dict(fwd=T(64, 128, 2), fwd_wgs=2, **P,
                                                       persistent_order="grid")},
    128: {"2 warpgroups (64, 64, 2), bias with K": dict(fwd=T(64, 64, 2), fwd_wgs=2, **WITH_K,
                                                        fwd_persistent=False),
          "2 warpgroups (64, 64, 2), bias apart": dict(fwd=T(64, 64, 2), fwd_wgs=2,
                                                       fwd_bias_apart=True, fwd_persistent=False),
          "3 warpgroups (64, 64, 2), bias with K": dict(fwd=T(64, 64, 2), fwd_wgs=3, **WITH_K,
                                                        fwd_persistent=False),
          "2 persistent (64, 64, 2), grid order, bias with K": dict(
              fwd=T(64, 64, 2), fwd_wgs=2, **WITH_K, **P, persistent_order="grid")},
}
# (label, shape B T N H [K], call options, bias: 1 ALiBi [1, N, T, T] every row shares, 0 one per
# row [B, N, T, T], None no bias)
CASES = [
    ("B16 T1024 N12 H64 causal, ALiBi [1,N,T,T]", (16, 1024, 12, 64), dict(is_causal=True), 1),
    ("B8 T2048 N16 H64 causal, bias [B,N,T,T]", (8, 2048, 16, 64), dict(is_causal=True), 0),
    ("B4 T4096 N16 H64 window 512, ALiBi [1,N,T,T]", (4, 4096, 16, 64),
     dict(local_window_size=(512, 0)), 1),
    ("B8 T2048 N16 H64 full, bias [B,N,T,T]", (8, 2048, 16, 64), {}, 0),
    ("B8 T2048 N16 H64 full, ALiBi [1,N,T,T]", (8, 2048, 16, 64), {}, 1),
    ("B4 T4096 N16 H128 causal, ALiBi [1,N,T,T]", (4, 4096, 16, 128), dict(is_causal=True), 1),
    ("B8 T2048 N16 H128 full, bias [B,N,T,T]", (8, 2048, 16, 128), {}, 0),
    ("B2 T8192 N32 K8 H128 causal, ALiBi [1,N,T,T]", (2, 8192, 32, 128, 8),
     dict(is_causal=True), 1),
    ("B8 T2048 N16 H64 full, no bias", (8, 2048, 16, 64), {}, None),
]


def forwards(shape, options, shared):
  """{name: jitted forward} for one case (the table's, its candidates, tokamax's), and the args."""
  q, k, v, _ = _inputs(shape[:4])
  if len(shape) == 5:   # GQA: K kv heads
    k, v = k[:, :, :shape[4]], v[:, :, :shape[4]]
    shape = shape[:4]
  bias = None if shared is None else _alibi(shape)
  if shared == 0:
    bias = jnp.broadcast_to(bias, (shape[0],) + bias.shape[1:]) + 0   # materialised
  spec, ops, _ = canonicalize(q, k, v, bias, None, Options(implementation=IMPL, **options))
  table = mosaic.default_config(spec, ops)
  configs = {"table": table}
  for name, change in CANDIDATES[shape[-1]].items():
    config = table.replace(**change)
    if config != table and config.smem_problem(shape[-1], 2, **mosaic._extras(ops)) is None:
      configs[name] = config
  fns = {name: jax.jit(lambda q, k, v, b, config=config: stable_attn.dot_product_attention(
      q, k, v, b, implementation=IMPL, config=config, **options))
      for name, config in configs.items()}
  tokamax = peers.tokamax_attention()
  if tokamax is not None:
    fns["tokamax"] = jax.jit(lambda q, k, v, b: tokamax(q, k, v, bias=b, **options))
  return fns, (q, k, v, bias), _describe(table)


def _describe(config) -> str:
  fwd = config.fwd
  kind = f" persistent, {config.persistent_order} order," if config.fwd_persistent else ""
  apart = ", bias apart" if config.fwd_bias_apart else ""
  return f"table: {config.fwd_wgs}{kind} ({fwd.block_q}, {fwd.block_kv}, {fwd.stages}){apart}"


def main():
  rows = []
  for label, shape, options, shared in CASES:
    fns, args, table = forwards(shape, options, shared)
    outs = {name: np.asarray(fn(*args), np.float32) for name, fn in fns.items()}
    seconds = bench.alternating_rounds({name: (fn, args) for name, fn in fns.items()}, 5, 20, 3)
    ms = {name: 1e3 * t for name, t in seconds.items()}
    for name in fns:
      diff = float(np.abs(outs[name] - outs["table"]).max())
      versus = f"{ms['tokamax'] / ms[name]:.3f}" if "tokamax" in ms else "-"
      rows.append(f"| {label} | {table if name == 'table' else name} | {ms[name]:.3f} "
                  f"| {ms['table'] / ms[name]:.3f} | {versus} | {diff:.3g} |")
      print(rows[-1], flush=True)
  print(f"\n# The forward with a bias, {jax.devices()[0].device_kind}, JAX {jax.__version__}, "
        f"\"safe\": 5 interleaved reps, each the median of 3 blocks of 20 calls\n")
  print("| case | forward (first: the table's) | ms | speed vs the table | speed vs tokamax "
        "| max abs O diff vs the table |")
  print("|---|---|---:|---:|---:|---:|")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
