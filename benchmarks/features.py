"""What packed sequences, the logit soft cap and attention sinks cost, forward+backward, in one process.

    PYTHONPATH=. python benchmarks/features.py              # on a GPU: pallas_gpu (and the Hopper
                                                            # kernel where it covers the call)
    PYTHONPATH=. python benchmarks/features.py --smoke      # tiny shapes, interpret mode, CPU

Packed: one row of T = 8192 tokens (N16 H128, causal, segment ids) holding 8 documents of 1024, 64
of 128, or one of 8192, against the same documents unpacked (a batch of rows, no segment ids; for
one document: the same row without segment ids). The segment block ranges (stable_attn.blocks)
should make a packed row cost about what its documents cost alone. Soft cap and sinks: B4 T4096
N16 H128 causal with logits_soft_cap=50, and with sinks (one per head), against neither.
Protocol of benchmarks/attention.py (loops of back-to-back calls, median of blocks). Writes
benchmarks/results/features_<device>.md and prints it.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
from benchmarks import attention as bench  # noqa: E402
from stable_attn import backends  # noqa: E402
from stable_attn.api import Options, canonicalize  # noqa: E402


def _fwd_bwd(implementation, interpret, **kwargs):
  def attention(q, k, v):
    return stable_attn.dot_product_attention(q, k, v, implementation=implementation,
                                             interpret=interpret, **kwargs)
  return jax.jit(lambda q, k, v, do: jax.vjp(attention, q, k, v)[1](do))


def _inputs(shape, seed=0):
  B, T, N, H = shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  return tuple(jax.random.normal(key, (B, T, N, H), jnp.float32).astype(jnp.bfloat16)
               for key in keys)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  p.add_argument("--implementations", default="pallas_mosaic_gpu,pallas_gpu")
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--blocks", type=int, default=5)
  p.add_argument("--out-dir", default=bench.RESULTS)
  args = p.parse_args(argv)
  N, H = (2, 32) if args.smoke else (16, 128)
  packings = ([(4, 32), (1, 128)] if args.smoke else [(8, 1024), (64, 128), (1, 8192)])
  cap_shape = (1, 64, 2, 32) if args.smoke else (4, 4096, 16, 128)
  calls, blocks = (1, 1) if args.smoke else (args.calls, args.blocks)
  interpret = args.smoke
  device = jax.devices()[0].device_kind
  rows = []
  for impl in args.implementations.split(","):
    def timed(name, shape, **kwargs):
      q, k, v, do = _inputs(shape)
      spec, ops, _ = canonicalize(q, k, v, options=Options(interpret=interpret, **kwargs))
      backend = backends.load(impl)
      reason = backend.covers(spec, ops)
      if reason is None and not (interpret or backend.is_available()):
        reason = f"not available on the {jax.default_backend()!r} backend"
      if reason is not None:
        rows.append((impl, name, float("nan"), f"not run: {reason}"))
        return float("nan")
      fn = _fwd_bwd(impl, interpret, **kwargs)
      ms = 1e3 * bench.time_calls(fn, (q, k, v, do), calls, blocks)
      rows.append((impl, name, ms, ""))
      return ms

    for docs, doc_len in packings:
      ids = jnp.asarray(np.repeat(np.arange(docs), doc_len)[None], jnp.int32)
      packed = timed(f"packed: 1 x {docs * doc_len}, {docs} documents of {doc_len}",
                     (1, docs * doc_len, N, H), is_causal=True, q_segment_ids=ids)
      alone = timed(f"unpacked: {docs} x {doc_len}, no segment ids", (docs, doc_len, N, H),
                    is_causal=True)
      rows.append((impl, f"packed / unpacked, {docs} x {doc_len}", packed / alone, "ratio"))
    capped = timed(f"B{cap_shape[0]} T{cap_shape[1]} N{cap_shape[2]} H{cap_shape[3]} causal, "
                   "soft cap 50", cap_shape, is_causal=True, logits_soft_cap=50.0)
    plain = timed(f"B{cap_shape[0]} T{cap_shape[1]} N{cap_shape[2]} H{cap_shape[3]} causal, "
                  "no cap", cap_shape, is_causal=True)
    sunk = timed(f"B{cap_shape[0]} T{cap_shape[1]} N{cap_shape[2]} H{cap_shape[3]} causal, "
                 "sinks", cap_shape, is_causal=True, sinks=jnp.zeros(cap_shape[2], jnp.float32))
    rows.append((impl, "soft cap / no cap", capped / plain, "ratio"))
    rows.append((impl, "sinks / none", sunk / plain, "ratio"))

  lines = [f"# Packed sequences, soft cap and sinks, fwd+bwd, {device}", "",
           f"JAX {jax.__version__}, bf16, median of {blocks} blocks of {calls} calls"
           f"{' (smoke run: interpret mode, tiny shapes)' if args.smoke else ''}.", "",
           "| implementation | case | fwd+bwd ms (or ratio) | note |", "|---|---|---|---|"]
  lines += [f"| {i} | {name} | {value:.3f} | {note} |" for i, name, value, note in rows]
  text = "\n".join(lines) + "\n"
  slug = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_").lower()
  if not args.smoke:
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"features_{slug}.md"), "w") as f:
      f.write(text)
  print(text)


if __name__ == "__main__":
  main()
