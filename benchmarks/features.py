"""What packed sequences, the soft cap, sinks, bias and masks cost, fwd+bwd, in one process.

    PYTHONPATH=. python benchmarks/features.py          # on a GPU: the Hopper kernel, pallas_gpu,
                                                        # cuDNN and tokamax (when importable)
    PYTHONPATH=. python benchmarks/features.py --smoke  # tiny shapes, interpret mode, CPU

Packed: one row of T = 8192 tokens (N16 H128, causal, segment ids) holding 8 documents of 1024, 64
of 128, or one of 8192, against the same documents unpacked (a batch of rows, no segment ids; for
one document: the same row without segment ids). The segment block ranges (stable_attn.blocks)
should make a packed row cost about what its documents cost alone. Soft cap: B4 T4096 N16 H128 and
B16 T1024 N12 H64 causal with logits_soft_cap=50 against no cap, forward+backward and forward; sinks
(one per head) at B4 T4096 N16 H128 against none. Bias: an ALiBi bias [1, N, T, T] (its gradient
included; and the forward alone) at both soft-cap shapes; wide_bias: the biases whose tiles fit
only beside 32-key blocks, ALiBi in bf16 at B2 T4096 N8 H256 and in fp32 at B4 T4096 N16 H128,
causal, each against no bias. Masks at B4 T4096 N16 H128, not causal: random (80% True,
[B, 1, T, T]), block-sparse (25% of the 128 x 128 blocks and the diagonal, [1, 1, T, T]; the
kernels' block ranges and flags skip the rest) and all True. The peers run what they take: tokamax
(its Mosaic GPU kernel) the soft cap, bias, masks and plain attention, jax.nn's cuDNN attention
plain attention, bias, masks and packed rows as a dense mask; each of ours gets "peer ms / ours"
per call.
Protocol of benchmarks/attention.py (loops of back-to-back calls, median of blocks; the table
opens with a dense bf16 matmul's TFLOP/s in the same run, the ceiling its times are read against).
Writes benchmarks/results/features_<device>.md (features_<device>_<features>.md for a subset,
--features) and a figure beside it (.png: what each feature costs, and our speed over each peer), and prints
the table. `--plot-from TABLE.md` redraws the figure of a written table (no GPU needed).
"""
from __future__ import annotations

import argparse
import os
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


FEATURES = ("packed", "soft_cap", "sinks", "bias", "mask", "wide_bias")


def _callable(implementation, interpret, **kwargs):
  """f(q, k, v) -> O for one of ours or a peer (None if that peer does not take the call)."""
  if implementation == "tokamax":
    peer = peers.tokamax_attention()
    if set(kwargs) - {"is_causal", "logits_soft_cap", "bias", "mask"}:
      return None   # no segment ids or sinks in tokamax's GPU kernels
    return lambda q, k, v: peer(q, k, v, **kwargs)
  if implementation == "cudnn":   # jax.nn's cuDNN attention: packed rows as a dense mask
    if set(kwargs) - {"is_causal", "q_segment_ids", "bias", "mask"}:
      return None
    mask = kwargs.get("mask")
    if "q_segment_ids" in kwargs:
      mask = bench.dense_mask(kwargs["q_segment_ids"])
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, kwargs.get("bias"), mask, is_causal=kwargs.get("is_causal", False),
        implementation="cudnn")
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
  bias, mask = kwargs.pop("bias", None), kwargs.pop("mask", None)
  spec, ops, _ = canonicalize(q, k, v, bias, mask, Options(interpret=interpret, **kwargs))
  backend = backends.load(impl)
  reason = backend.covers(spec, ops)
  if reason is None and not (interpret or backend.is_available()):
    reason = f"not available on the {jax.default_backend()!r} backend"
  return reason


def _alibi(shape, dtype=jnp.bfloat16):
  """ALiBi's bias [1, N, T, T]: -slope_n * |t - s|, slopes 2^(-8 n / N)."""
  _, T, N, _ = shape
  pos = jnp.arange(T)
  slopes = 2.0 ** (-8.0 * (jnp.arange(N) + 1) / N)
  return (-slopes[:, None, None] * jnp.abs(pos[:, None] - pos[None, :]))[None].astype(dtype)


def _random_mask(shape, keep=0.8):
  B, T, _, _ = shape
  return jax.random.uniform(jax.random.PRNGKey(1), (B, 1, T, T)) < keep


def _block_sparse_mask(shape, keep: float, block: int):
  """[1, 1, T, T]: a random `keep` share of the block x block blocks and the diagonal ones True."""
  nb = shape[1] // block
  blocks = jax.random.uniform(jax.random.PRNGKey(2), (nb, nb)) < keep
  blocks = blocks | jnp.eye(nb, dtype=bool)
  return jnp.repeat(jnp.repeat(blocks, block, 0), block, 1)[None, None]


def _label(shape) -> str:
  B, T, N, H = shape
  return f"B{B} T{T} N{N} H{H} causal"


def read_table(path) -> list[tuple]:
  """The (implementation, case, value, note) rows of a table this script wrote."""
  rows = []
  with open(path) as f:
    for line in f:
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if len(cells) == 4 and cells[0] not in ("implementation", "---"):
        rows.append((cells[0], cells[1], float(cells[2]), cells[3]))
  return rows


def plot(rows, title: str, path: str):
  """Left: each feature's cost relative to the same call without it (ratio rows); right: our
  kernels' speed over each peer on the same call (peer ms / ours); log scales."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(17, 7), constrained_layout=True)
  panels = ((axes[0], lambda note: note == "ratio", "cost of the feature (time / without it)"),
            (axes[1], lambda note: note.endswith("ms / ours"), "speed-up over the peer (x)"))
  series_of = lambda r: r[0] if r[3] == "ratio" else f"{r[0]} vs {r[3].split()[0]}"
  case_of = lambda r: r[1].split(": ", 1)[-1] if r[1].startswith("speed-up over") else r[1]
  for ax, keep, label in panels:
    picked = [r for r in rows if keep(r[3]) and np.isfinite(r[2])]
    series = list(dict.fromkeys(map(series_of, picked)))
    cases = list(dict.fromkeys(map(case_of, picked)))
    height = 0.8 / max(1, len(series))
    for i, name in enumerate(series):
      values = {case_of(r): r[2] for r in picked if series_of(r) == name}
      ax.barh(np.arange(len(cases)) + i * height, [values.get(c, np.nan) for c in cases],
              height, label=name)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(np.arange(len(cases)) + 0.4 - height / 2)
    ax.set_yticklabels(cases, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(label)
    ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
  p.add_argument("--implementations", default="pallas_mosaic_gpu,pallas_gpu,cudnn,tokamax",
                 help="ours, and the peers 'cudnn' (jax.nn; packed rows as a dense mask) and "
                      "'tokamax' (where importable)")
  p.add_argument("--features", default=",".join(FEATURES),
                 help=f"which of {', '.join(FEATURES)} to measure (comma-separated)")
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--blocks", type=int, default=5)
  p.add_argument("--out-dir", default=bench.RESULTS)
  p.add_argument("--plot-from", metavar="TABLE.md",
                 help="only redraw the figure of a table this script wrote (beside it, .png)")
  jax_cache.add_flags(p)
  args = p.parse_args(argv)
  if args.plot_from:
    if not os.path.isfile(args.plot_from):
      p.error(f"--plot-from: no such file {args.plot_from!r}")
    with open(args.plot_from) as f:
      title = f.readline().lstrip("# ").strip()
    plot(read_table(args.plot_from), title, os.path.splitext(args.plot_from)[0] + ".png")
    return
  features = args.features.split(",")
  if set(features) - set(FEATURES):
    p.error(f"--features: unknown {sorted(set(features) - set(FEATURES))}; choose from {FEATURES}")
  jax_cache.configure_or_exit(p, args)
  N, H = (2, 32) if args.smoke else (16, 128)
  packings = ([(4, 32), (1, 128)] if args.smoke else [(8, 1024), (64, 128), (1, 8192)])
  cap_shapes = [(1, 64, 2, 32)] if args.smoke else [(4, 4096, 16, 128), (16, 1024, 12, 64)]
  calls, blocks = (1, 1) if args.smoke else (args.calls, args.blocks)
  interpret = args.smoke
  device = jax.devices()[0].device_kind
  rows, ms = [], {}
  for impl in args.implementations.split(","):
    def timed(name, shape, forward_only=False, bias=None, mask=None, **kwargs):
      """ms per call; bias and mask are arguments of the timed program (the bias differentiated
      with q, k and v), never constants folded into it."""
      q, k, v, do = _inputs(shape)
      name = f"{name}, forward" if forward_only else name
      reason = _why_not(impl, interpret, q, k, v, bias=bias, mask=mask, **kwargs)
      if reason is not None:
        rows.append((impl, name, float("nan"), f"not run: {reason}"))
        return float("nan")

      def attention(q, k, v, bias, mask):
        given = {n: a for n, a in (("bias", bias), ("mask", mask)) if a is not None}
        return _callable(impl, interpret, **kwargs, **given)(q, k, v)

      fn = jax.jit(attention if forward_only else lambda q, k, v, bias, mask, do: jax.vjp(
          lambda q, k, v, b: attention(q, k, v, b, mask), q, k, v, bias)[1](do))
      try:
        args = (q, k, v, bias, mask) + (() if forward_only else (do,))
        t = 1e3 * bench.time_calls(fn, args, calls, blocks)
      except Exception as e:  # a row that says so, and the other arms go on
        rows.append((impl, name, float("nan"), f"FAILED {type(e).__name__}: {str(e)[:300]}"))
        return float("nan")
      rows.append((impl, name, t, ""))
      ms[impl, name] = t
      return t

    for docs, doc_len in packings if "packed" in features else ():
      ids = jnp.asarray(np.repeat(np.arange(docs), doc_len)[None], jnp.int32)
      packed = timed(f"packed: 1 x {docs * doc_len}, {docs} documents of {doc_len}",
                     (1, docs * doc_len, N, H), is_causal=True, q_segment_ids=ids)
      alone = timed(f"unpacked: {docs} x {doc_len}, no segment ids", (docs, doc_len, N, H),
                    is_causal=True)
      rows.append((impl, f"packed / unpacked, {docs} x {doc_len}", packed / alone, "ratio"))
    for shape in cap_shapes if "soft_cap" in features else ():
      for forward_only in (False, True):
        capped = timed(f"{_label(shape)}, soft cap 50", shape, forward_only, is_causal=True,
                       logits_soft_cap=50.0)
        plain = timed(f"{_label(shape)}, no cap", shape, forward_only, is_causal=True)
        rows.append((impl, f"soft cap / no cap, {_label(shape)}{', forward' * forward_only}",
                     capped / plain, "ratio"))
    shape = cap_shapes[0]
    if "sinks" in features:
      plain = ms.get((impl, f"{_label(shape)}, no cap")) or timed(f"{_label(shape)}, no cap",
                                                                  shape, is_causal=True)
      sunk = timed(f"{_label(shape)}, sinks", shape, is_causal=True,
                   sinks=jnp.zeros(shape[2], jnp.float32))
      rows.append((impl, f"sinks / none, {_label(shape)}", sunk / plain, "ratio"))
    for shape in cap_shapes if "bias" in features else ():
      for forward_only in (False, True):
        timed(f"{_label(shape)}, ALiBi bias [1, N, T, T]", shape, forward_only, is_causal=True,
              bias=_alibi(shape))
    wide = [((1, 64, 2, 256), jnp.bfloat16), ((1, 64, 2, 128), jnp.float32)] if args.smoke else \
        [((2, 4096, 8, 256), jnp.bfloat16), ((4, 4096, 16, 128), jnp.float32)]
    for shape, dtype in wide if "wide_bias" in features else ():
      biased = timed(f"{_label(shape)}, ALiBi bias [1, N, T, T] {jnp.dtype(dtype).name}", shape,
                     is_causal=True, bias=_alibi(shape, dtype))
      plain = ms.get((impl, f"{_label(shape)}, no cap")) or timed(f"{_label(shape)}, no cap",
                                                                  shape, is_causal=True)
      rows.append((impl, f"{jnp.dtype(dtype).name} bias / none, {_label(shape)}", biased / plain,
                   "ratio"))
    if "mask" not in features:
      continue
    shape = cap_shapes[0]
    label = _label(shape).replace(" causal", "")
    dense = timed(f"{label}, mask all True", shape, mask=jnp.ones((1, 1) + shape[1:2] * 2, bool))
    timed(f"{label}, mask random 80% [B, 1, T, T]", shape, mask=_random_mask(shape))
    sparse = timed(f"{label}, mask block-sparse 25% [1, 1, T, T]", shape,
                   mask=_block_sparse_mask(shape, 0.25, 64 if args.smoke else 128))
    rows.append((impl, f"block-sparse 25% / all True, {label}", sparse / dense, "ratio"))
  # Ours against each peer on the same call: the peer's time / ours.
  for peer_name in ("cudnn", "tokamax"):
    for (impl, name), t in list(ms.items()):
      peer = ms.get((peer_name, name))
      if impl not in ("cudnn", "tokamax") and peer is not None:
        rows.append((impl, f"speed-up over {peer_name}: {name}", peer / t,
                     f"{peer_name} ms / ours"))

  # The tensor cores' ceiling in this run, what each time is read against (attention.py's).
  ceiling, n = bench.matmul_ceiling(jnp.bfloat16, calls, blocks, n=256 if args.smoke else 8192)
  lines = [f"# Packed sequences, soft cap, sinks, bias and masks, fwd+bwd, {device}", "",
           f"JAX {jax.__version__}, bf16, median of {blocks} blocks of {calls} calls"
           f"{' (smoke run: interpret mode, tiny shapes)' if args.smoke else ''}.", "",
           f"Matmul ceiling in this run: a dense bfloat16 {n} x {n} x {n} matmul (XLA) at "
           f"{ceiling:.0f} TFLOP/s.", "",
           "| implementation | case | ms (fwd+bwd unless forward; or ratio) | note |",
           "|---|---|---|---|"]
  lines += [f"| {i} | {name} | {value:.3f} | {note} |" for i, name, value, note in rows]
  text = "\n".join(lines) + "\n"
  slug = bench.device_slug(device)
  if not args.smoke:
    os.makedirs(args.out_dir, exist_ok=True)
    subset = "" if set(features) == set(FEATURES) else "_" + "_".join(features)
    path = os.path.join(args.out_dir, f"features_{slug}{subset}")
    with open(path + ".md", "w") as f:
      f.write(text)
    try:
      plot(rows, lines[0].lstrip("# "), path + ".png")
    except ImportError as e:  # the GPU machine may lack matplotlib: the table stands alone
      print(f"no figure: {e}")
  print(text)


if __name__ == "__main__":
  main()
