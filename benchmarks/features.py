"""What packed sequences, the logit soft cap and attention sinks cost, forward+backward, in one process.

    PYTHONPATH=. python benchmarks/features.py              # on a GPU: the Hopper kernel, pallas_gpu,
                                                            # cuDNN and tokamax (when importable)
    PYTHONPATH=. python benchmarks/features.py --smoke      # tiny shapes, interpret mode, CPU

Packed: one row of T = 8192 tokens (N16 H128, causal, segment ids) holding 8 documents of 1024, 64
of 128, or one of 8192, against the same documents unpacked (a batch of rows, no segment ids; for
one document: the same row without segment ids). The segment block ranges (stable_attn.blocks)
should make a packed row cost about what its documents cost alone. Soft cap: B4 T4096 N16 H128 and
B16 T1024 N12 H64 causal with logits_soft_cap=50 against no cap, forward+backward and forward; sinks
(one per head) at B4 T4096 N16 H128 against none. The peers run what they take: tokamax (its
Mosaic GPU kernel) the soft cap and plain attention, jax.nn's cuDNN attention plain attention and
packed rows as a dense mask; each of ours gets "peer ms / ours" per call.
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
from benchmarks import peers  # noqa: E402
from stable_attn import backends  # noqa: E402
from stable_attn.api import Options, canonicalize  # noqa: E402
from train import jax_cache  # noqa: E402


def _dense_mask(ids):
  """Segment ids [B, T] as the equivalent boolean mask [B, 1, T, T]: what a peer without segment
  ids needs for a packed row."""
  return (ids[:, :, None] == ids[:, None, :])[:, None]


def _callable(implementation, interpret, **kwargs):
  """f(q, k, v) -> O for one of ours or a peer (None if that peer does not take the call)."""
  if implementation == "tokamax":
    peer = peers.tokamax_attention()
    if set(kwargs) - {"is_causal", "logits_soft_cap"}:
      return None   # no segment ids or sinks in tokamax's GPU kernels
    return lambda q, k, v: peer(q, k, v, **kwargs)
  if implementation == "cudnn":   # jax.nn's cuDNN attention: packed rows as a dense mask
    if set(kwargs) - {"is_causal", "q_segment_ids"}:
      return None
    mask = None if "q_segment_ids" not in kwargs else _dense_mask(kwargs["q_segment_ids"])
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=kwargs.get("is_causal", False), implementation="cudnn")
  return lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, implementation=implementation, interpret=interpret, **kwargs)


def _inputs(shape, seed=0):
  B, T, N, H = shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  return tuple(jax.random.normal(key, (B, T, N, H), jnp.float32).astype(jnp.bfloat16)
               for key in keys)


def _why_not(impl, interpret, q, k, v, **kwargs):
  """None if `impl` runs this call here, else why not."""
  if impl == "tokamax":
    if peers.tokamax_attention() is None:
      return peers.TOKAMAX_MISSING
    if _callable(impl, interpret, **kwargs) is None:
      return "tokamax takes no segment ids or sinks on GPU"
    return None
  if impl == "cudnn":
    if jax.default_backend() != "gpu":
      return "cuDNN needs a GPU"
    if _callable(impl, interpret, **kwargs) is None:
      return "jax.nn's cuDNN attention takes no soft cap or sinks"
    return None
  spec, ops, _ = canonicalize(q, k, v, options=Options(interpret=interpret, **kwargs))
  backend = backends.load(impl)
  reason = backend.covers(spec, ops)
  if reason is None and not (interpret or backend.is_available()):
    reason = f"not available on the {jax.default_backend()!r} backend"
  return reason


def _label(shape) -> str:
  B, T, N, H = shape
  return f"B{B} T{T} N{N} H{H} causal"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  p.add_argument("--implementations", default="pallas_mosaic_gpu,pallas_gpu,cudnn,tokamax",
                 help="ours, and the peers 'cudnn' (jax.nn; packed rows as a dense mask) and "
                      "'tokamax' (where importable)")
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--blocks", type=int, default=5)
  p.add_argument("--out-dir", default=bench.RESULTS)
  jax_cache.add_flags(p)
  args = p.parse_args(argv)
  jax_cache.configure_or_exit(p, args)
  N, H = (2, 32) if args.smoke else (16, 128)
  packings = ([(4, 32), (1, 128)] if args.smoke else [(8, 1024), (64, 128), (1, 8192)])
  cap_shapes = [(1, 64, 2, 32)] if args.smoke else [(4, 4096, 16, 128), (16, 1024, 12, 64)]
  calls, blocks = (1, 1) if args.smoke else (args.calls, args.blocks)
  interpret = args.smoke
  device = jax.devices()[0].device_kind
  rows, ms = [], {}
  for impl in args.implementations.split(","):
    def timed(name, shape, forward_only=False, **kwargs):
      q, k, v, do = _inputs(shape)
      name = f"{name}, forward" if forward_only else name
      reason = _why_not(impl, interpret, q, k, v, **kwargs)
      if reason is not None:
        rows.append((impl, name, float("nan"), f"not run: {reason}"))
        return float("nan")
      attention = _callable(impl, interpret, **kwargs)
      fn = jax.jit(attention if forward_only else
                   lambda q, k, v, do: jax.vjp(attention, q, k, v)[1](do))
      try:
        t = 1e3 * bench.time_calls(fn, (q, k, v) if forward_only else (q, k, v, do), calls,
                                   blocks)
      except Exception as e:  # a row that says so, and the other arms go on
        rows.append((impl, name, float("nan"), f"FAILED {type(e).__name__}: {str(e)[:300]}"))
        return float("nan")
      rows.append((impl, name, t, ""))
      ms[impl, name] = t
      return t

    for docs, doc_len in packings:
      ids = jnp.asarray(np.repeat(np.arange(docs), doc_len)[None], jnp.int32)
      packed = timed(f"packed: 1 x {docs * doc_len}, {docs} documents of {doc_len}",
                     (1, docs * doc_len, N, H), is_causal=True, q_segment_ids=ids)
      alone = timed(f"unpacked: {docs} x {doc_len}, no segment ids", (docs, doc_len, N, H),
                    is_causal=True)
      rows.append((impl, f"packed / unpacked, {docs} x {doc_len}", packed / alone, "ratio"))
    for shape in cap_shapes:
      for forward_only in (False, True):
        capped = timed(f"{_label(shape)}, soft cap 50", shape, forward_only, is_causal=True,
                       logits_soft_cap=50.0)
        plain = timed(f"{_label(shape)}, no cap", shape, forward_only, is_causal=True)
        rows.append((impl, f"soft cap / no cap, {_label(shape)}{', forward' * forward_only}",
                     capped / plain, "ratio"))
    shape = cap_shapes[0]
    sunk = timed(f"{_label(shape)}, sinks", shape, is_causal=True,
                 sinks=jnp.zeros(shape[2], jnp.float32))
    rows.append((impl, f"sinks / none, {_label(shape)}", sunk / ms.get((impl, f"{_label(shape)}, "
                                                                        "no cap"), np.nan),
                 "ratio"))
  # Ours against each peer on the same call: the peer's time / ours.
  for peer_name in ("cudnn", "tokamax"):
    for (impl, name), t in list(ms.items()):
      peer = ms.get((peer_name, name))
      if impl not in ("cudnn", "tokamax") and peer is not None:
        rows.append((impl, f"speed-up over {peer_name}: {name}", peer / t,
                     f"{peer_name} ms / ours"))

  lines = [f"# Packed sequences, soft cap and sinks, fwd+bwd, {device}", "",
           f"JAX {jax.__version__}, bf16, median of {blocks} blocks of {calls} calls"
           f"{' (smoke run: interpret mode, tiny shapes)' if args.smoke else ''}.", "",
           "| implementation | case | ms (fwd+bwd unless forward; or ratio) | note |",
           "|---|---|---|---|"]
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
