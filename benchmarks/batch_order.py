"""The Hopper kernels' grid order with a bias or mask every batch row shares: batch fastest
(`TuningConfig.batch_inner`, the default) against (batch, heads, rows), forward and fwd+bwd, one
process, 5 interleaved reps; also checks that both orders give bitwise equal gradients.

    PYTHONPATH=. python benchmarks/batch_order.py        # on a Hopper GPU; prints a Markdown table
"""
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
import pallas_kernels.mosaic_gpu as mosaic  # noqa: E402
from benchmarks import attention as bench  # noqa: E402
from benchmarks.features import _alibi, _block_sparse_mask, _inputs  # noqa: E402
from stable_attn.api import Options, canonicalize  # noqa: E402

IMPL = "pallas_mosaic_gpu"
CASES = [  # (label, shape B T N H, call options, what every batch row shares)
    ("B4 T4096 N16 H128 causal, ALiBi [1,N,T,T]", (4, 4096, 16, 128), dict(is_causal=True), "bias"),
    ("B16 T1024 N12 H64 causal, ALiBi [1,N,T,T]", (16, 1024, 12, 64), dict(is_causal=True), "bias"),
    ("B4 T4096 N16 H128, block-sparse mask 25% [1,1,T,T]", (4, 4096, 16, 128), {}, "mask"),
]
MODES = ("fwd", "fwd+bwd")


def programs(shape, options, shared):
  """{(batch_inner, mode): (jitted fn, args)} for one case, the bias differentiated with q, k, v."""
  q, k, v, do = _inputs(shape)
  bias = _alibi(shape) if shared == "bias" else None
  mask = _block_sparse_mask(shape, 0.25, 128) if shared == "mask" else None
  spec, ops, _ = canonicalize(q, k, v, bias, mask, Options(implementation=IMPL, **options))
  table = mosaic.default_config(spec, ops)
  out = {}
  for inner in (False, True):
    def attend(q, k, v, b, config=table.replace(batch_inner=inner)):
      return stable_attn.dot_product_attention(q, k, v, b, mask, implementation=IMPL,
                                               config=config, **options)
    def grads(q, k, v, b, do, attend=attend):
      if shared == "bias":
        return jax.vjp(attend, q, k, v, b)[1](do)
      return jax.vjp(lambda q, k, v: attend(q, k, v, b), q, k, v)[1](do)
    out[inner, "fwd"] = (jax.jit(attend), (q, k, v, bias))
    out[inner, "fwd+bwd"] = (jax.jit(grads), (q, k, v, bias, do))
  return out


def main():
  rows = []
  for label, shape, options, shared in CASES:
    fns = programs(shape, options, shared)
    run = lambda inner: jax.tree.leaves(fns[inner, "fwd+bwd"][0](*fns[inner, "fwd+bwd"][1]))
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(run(False), run(True)))
    times = {key: [] for key in fns}
    for rep in range(5):   # interleaved, the order alternating
      for mode in MODES:
        for inner in ((False, True) if rep % 2 == 0 else (True, False)):
          fn, args = fns[inner, mode]
          times[inner, mode].append(1e3 * bench.time_calls(fn, args, 20, 3))
    for mode in MODES:
      outer, inner = (statistics.median(times[i, mode]) for i in (False, True))
      rows.append(f"| {label} | {mode} | {outer:.3f} | {inner:.3f} | {outer / inner:.3f} "
                  f"| {same} |")
      print(rows[-1], flush=True)
  print(f"\n# Grid order with a shared bias or mask, {jax.devices()[0].device_kind}, JAX "
        f"{jax.__version__}: 5 interleaved reps, each the median of 3 blocks of 20 calls\n")
  print("| case | mode | (batch, heads, rows) ms | batch fastest ms | speed-up | bitwise equal |")
  print("|---|---|---:|---:|---:|---|")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
