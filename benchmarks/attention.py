"""Attention kernel benchmark: our kernels -- pallas_mosaic_gpu ("mosaic_*", Hopper) and pallas_gpu
("ours_*", Triton), each with max_adjust off / paper / safe -- next to cuDNN, XLA, tokamax (its
Mosaic GPU kernel, when importable) and JAX's Mosaic GPU attention example, in one process,
protocol of ../shared/docs/peers.md. JAX's deprecated Pallas Triton `mha` runs only when named
(--only ...,pallas_mha).

    PYTHONPATH=. python benchmarks/attention.py                  # the peers.md shapes
    PYTHONPATH=. python benchmarks/attention.py --shapes targets # the Hopper kernel's target shapes
    PYTHONPATH=. python benchmarks/attention.py --sweep          # tiling variants of pallas_gpu
    ... --compilation-cache DIR / --no-compilation-cache         # JAX's persistent cache (on)

Protocol: random normal inputs (bf16 by default); each figure is the median of 5 blocks of 30
back-to-back calls with one block_until_ready per block, after compilation and warm-up.
TFLOP/s by the FlashAttention convention: forward 4*B*N*T*S*H, halved when causal; backward 2.5x
forward, forward+backward 3.5x forward; "bwd" time is (fwd+bwd) - fwd. Every row carries the
relative Frobenius error of O and of the gradients (dQ, dK, dV: the largest of the three) against
an fp32 XLA reference on the same inputs. Writes benchmarks/results/attention_<device>.md and .png
and prints a short table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
from benchmarks import peers  # noqa: E402
from pallas_kernels.gpu import tuning  # noqa: E402
from pallas_kernels.mosaic_gpu import tuning as mosaic_tuning  # noqa: E402
from train import jax_cache  # noqa: E402

try:  # JAX's Mosaic GPU FlashAttention-3 example: float16 only, no causal backward
  from jax.experimental.pallas.ops.gpu import attention_mgpu as _jax_mgpu_module
except Exception:  # pragma: no cover - depends on the installed JAX
  _jax_mgpu_module = None
# Peers that take other input dtypes (inputs are cast once, outside the timed calls) or have no
# backward for these shapes (forward only).
CAST_TO = {"jax_mgpu": jnp.float16}
FORWARD_ONLY = ("jax_mgpu",)
# Run only when named in --only: JAX's Pallas Triton mha (deprecated in JAX 0.11: its import
# warns) and the Hopper kernel with its fused-dQ backward (TuningConfig.fused_dq, opt-in).
OPT_IN = ("pallas_mha", "mosaic_fused")
# Every arm name --only takes (`implementations`; an arm whose peer does not import is left out).
ARMS = ("cudnn", "xla", "tokamax", "pallas_mha", "jax_mgpu", "mosaic_fused",
        *(f"{prefix}_{mode}" for prefix in ("mosaic", "ours") for mode in ("off", "paper", "safe")))
# The peers whose speed each row is put against (ratio columns), with their column names.
RATIO_PEERS = {"cudnn": "cuDNN", "tokamax": "tokamax", "pallas_mha": "mha"}

# (B, T, N query heads, K kv heads, H, causal): the peers.md table.
SHAPES = [
    (16, 1024, 12, 12, 64, True), (16, 1024, 12, 12, 64, False),
    (8, 2048, 16, 16, 64, True), (8, 2048, 16, 16, 64, False),
    (4, 4096, 16, 16, 128, True), (4, 4096, 16, 16, 128, False),
]
# The Hopper kernel's targets (issue 10): the first two are the targets, the rest are reported.
TARGETS = [(16, 1024, 12, 12, 64, True), (4, 4096, 16, 16, 128, True),
           (8, 2048, 16, 16, 64, False), (2, 8192, 32, 8, 128, True),
           (1, 16384, 16, 16, 128, True)]
# Head dim 256 (Gemma's): causal, and GQA at a longer context.
H256 = [(2, 4096, 8, 8, 256, True), (1, 8192, 8, 4, 256, True)]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
XLA_MAX_SCORES = 2 ** 31   # XLA attention materialises B*N*T*T fp32 scores; skip beyond this


def fwd_flops(B, T, N, K, H, causal):
  f = 4.0 * B * N * T * T * H
  return f / 2 if causal else f


def time_calls(fn, args, calls: int, blocks: int, warmup: int = 3) -> float:
  """Median over `blocks` of (time of `calls` back-to-back calls) / calls, in seconds."""
  out = fn(*args)
  jax.block_until_ready(out)
  for _ in range(warmup):
    out = fn(*args)
  jax.block_until_ready(out)
  per_call = []
  for _ in range(blocks):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - t0) / calls)
  return statistics.median(per_call)


def alternating_rounds(arms: dict, rounds: int, calls: int, blocks: int) -> dict:
  """arms: name -> (fn, args) -> name -> the median over `rounds` of its `time_calls` (seconds),
  every arm timed once a round, their order reversed every other round, so that a drift of the
  machine's speed over the run falls on all arms alike."""
  times = {name: [] for name in arms}
  for r in range(rounds):
    for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
      times[name].append(time_calls(*arms[name], calls, blocks))
  return {name: statistics.median(t) for name, t in times.items()}


def matmul_ceiling(dtype, calls: int, blocks: int, n: int = 8192) -> tuple[float, int]:
  """(TFLOP/s, n) of a dense [n, n] @ [n, n] matmul in `dtype` (XLA, fp32 accumulation): what the
  tensor cores reach in this run, the ceiling each attention figure is read against."""
  a, b = (jax.random.normal(jax.random.PRNGKey(i), (n, n), jnp.float32).astype(dtype)
          for i in range(2))
  return 2.0 * n ** 3 / time_calls(jax.jit(jnp.matmul), (a, b), calls, blocks) / 1e12, n


def implementations(shape, only=None):
  """name -> f(q, k, v) -> O ([B, T, N, H] queries, [B, T, K, H] keys and values): every arm that
  is importable here, or those named in `only` (the OPT_IN ones only when named)."""
  B, T, N, K, H, causal = shape
  scale = 1.0 / np.sqrt(H)
  impls = {}
  impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="cudnn")
  if B * N * T * T <= XLA_MAX_SCORES:
    impls["xla"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla")
  tokamax = peers.tokamax_attention()
  if tokamax is not None:
    impls["tokamax"] = lambda q, k, v: tokamax(q, k, v, is_causal=causal)
  mha = peers.pallas_mha()[0] if only and "pallas_mha" in only else None
  if mha is not None and K == N:
    impls["pallas_mha"] = lambda q, k, v: mha(q, k, v, None, sm_scale=float(scale), causal=causal)
  if _jax_mgpu_module is not None and H in (64, 128) and T % 128 == 0:
    # It has no softmax scale: Q is pre-scaled outside the timed calls (see bench_shape).
    config = _jax_mgpu_module.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                           causal=causal)
    impls["jax_mgpu"] = lambda q, k, v: _jax_mgpu_module.attention(q, k, v, config)
  if H in (64, 128) and only and "mosaic_fused" in only:   # FA3's fused-dQ backward
    fused = mosaic_tuning.fused_dq_config(H)
    impls["mosaic_fused"] = lambda q, k, v: stable_attn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="pallas_mosaic_gpu", max_adjust="safe",
        config=fused)
  for prefix, implementation in (("mosaic", "pallas_mosaic_gpu"), ("ours", "pallas_gpu")):
    for mode in ("off", "paper", "safe"):
      impls[f"{prefix}_{mode}"] = functools.partial(
          lambda q, k, v, mode, implementation: stable_attn.dot_product_attention(
              q, k, v, is_causal=causal, implementation=implementation, max_adjust=mode),
          mode=mode, implementation=implementation)
  if only:
    impls = {k: v for k, v in impls.items() if k in only}
  return impls


def peer_notes(only=None) -> list[str]:
  """A line for each peer that does not run here because it does not import."""
  notes = []
  if peers.tokamax_attention() is None and (not only or "tokamax" in only):
    notes.append(f"tokamax: not run, {peers.TOKAMAX_MISSING}.")
  if only and "pallas_mha" in only and peers.pallas_mha()[1]:
    notes.append(f"JAX Pallas mha: not run, not importable: `{peers.pallas_mha()[1]}`.")
  return notes


def make_inputs(B, T, N, K, H, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  normal = lambda key, heads: jax.random.normal(key, (B, T, heads, H), jnp.float32).astype(dtype)
  return normal(keys[0], N), normal(keys[1], K), normal(keys[2], K), normal(keys[3], N)


def dense_mask(ids):
  """Segment ids [B, T] as the equivalent boolean mask [B, 1, T, T]: what a peer without segment
  ids needs for a packed row."""
  return (ids[:, :, None] == ids[:, None, :])[:, None]


def rel_err(x, ref):
  x = jnp.asarray(x, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


@dataclasses.dataclass
class Row:
  shape: tuple
  impl: str
  fwd_ms: float = float("nan")
  fb_ms: float = float("nan")
  err_o: float = float("nan")
  err_grad: float = float("nan")
  note: str = ""

  def tflops(self, which):
    f = fwd_flops(*self.shape)
    if which == "fwd":
      return f / (self.fwd_ms * 1e-3) / 1e12
    if which == "bwd":
      return 2.5 * f / ((self.fb_ms - self.fwd_ms) * 1e-3) / 1e12
    return 3.5 * f / (self.fb_ms * 1e-3) / 1e12


def bench_shape(shape, dtype, calls, blocks, only=None, check=True):
  B, T, N, K, H, causal = shape
  q, k, v, do = make_inputs(*shape[:5], dtype)
  ref_o = ref_grads = None
  check = check and B * N * T * T <= XLA_MAX_SCORES   # the fp32 reference must fit in memory
  if check:
    f32 = lambda x: x.astype(jnp.float32)
    ref_fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                          implementation="xla")
    ref_o, ref_vjp = jax.vjp(ref_fn, f32(q), f32(k), f32(v))
    ref_grads = ref_vjp(f32(do))
  rows = []
  for name, fn in implementations(shape, only).items():
    row = Row(shape, name)
    try:
      args = (q, k, v)
      if name in CAST_TO:
        scaled_q = q.astype(jnp.float32) * (1.0 / np.sqrt(H))
        args = tuple(x.astype(CAST_TO[name]) for x in (scaled_q, k, v))
      fwd = jax.jit(fn)
      fb = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))
      if check:
        row.err_o = rel_err(fwd(*args), ref_o)
        if name not in FORWARD_ONLY:
          row.err_grad = max(rel_err(g, r) for g, r in zip(fb(q, k, v, do), ref_grads))
      row.fwd_ms = 1e3 * time_calls(fwd, args, calls, blocks)
      if name not in FORWARD_ONLY:
        row.fb_ms = 1e3 * time_calls(fb, (q, k, v, do), calls, blocks)
    except Exception as e:  # a peer that fails on this JAX/shape is reported, not fatal
      row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
      traceback.print_exc()
    rows.append(row)
    print(f"  {name:12s} fwd {row.fwd_ms:8.3f} ms  fwd+bwd {row.fb_ms:8.3f} ms  "
          f"err O {row.err_o:.1e} grad {row.err_grad:.1e} {row.note}", flush=True)
  del ref_o, ref_grads
  return rows


def device_slug(device: str) -> str:
  """A device kind as result file names carry it: "NVIDIA H200" -> "nvidia_h200"."""
  return re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")


def shape_name(shape):
  B, T, N, K, H, causal = shape
  heads = f"N{N}" if K == N else f"N{N} K{K}"
  return f"B{B} T{T} {heads} H{H} {'causal' if causal else 'full'}"


def ratios(rows, shape, impl, base, which="fb"):
  """Speed of `impl` relative to `base` (>1 = faster), fwd+bwd ("fb") or forward ("fwd")."""
  by = {r.impl: r for r in rows if r.shape == shape}
  if impl not in by or base not in by:
    return float("nan")
  attr = "fb_ms" if which == "fb" else "fwd_ms"
  return getattr(by[base], attr) / getattr(by[impl], attr)


def ratio_peers(rows):
  """The RATIO_PEERS with a row in `rows` (cuDNN always: its columns are the table's anchor)."""
  present = {r.impl for r in rows}
  return {p: name for p, name in RATIO_PEERS.items() if p == "cudnn" or p in present}


def markdown(rows, device, dtype, calls, blocks, notes=(), ceiling=None):
  against = ratio_peers(rows)
  lines = [f"# Attention benchmark on {device}",
           "",
           f"JAX {jax.__version__}, {np.dtype(dtype).name}, random normal inputs; median of {blocks} "
           f"blocks of {calls} back-to-back calls after warm-up (one block_until_ready per block). "
           "TFLOP/s by the FlashAttention convention (forward 4*B*N*T*S*H, halved when causal; "
           "bwd 2.5x, fwd+bwd 3.5x forward; bwd time = fwd+bwd - fwd). Errors: relative "
           "Frobenius error against an fp32 XLA reference (grad = max over dQ, dK, dV). "
           "x cuDNN / x tokamax / x mha: fwd+bwd speed relative to that peer in this run (tokamax: "
           "its Mosaic GPU kernel; mha: JAX's Pallas Triton attention); fwd x ...: the forward "
           "alone.",
           ""]
  if ceiling:
    ceiling, n = ceiling
    notes = [f"Matmul ceiling in this run: a dense {np.dtype(dtype).name} {n} x {n} x {n} matmul "
             f"(XLA) at {ceiling:.0f} TFLOP/s; 'of mm' = fwd+bwd TFLOP/s / that.", *notes]
  lines += list(notes) + ([""] if notes else [])
  ratio_heads = "".join(f" fwd x {name} | x {name} |" for name in against.values())
  mm_head = " of mm |" if ceiling else ""
  lines += ["| shape | impl | fwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
            f"|{mm_head}{ratio_heads} err O | err grad | note |",
            "|---" * (10 + bool(ceiling) + 2 * len(against)) + "|"]
  for r in rows:
    ratio_cells = "".join(f" {ratios(rows, r.shape, r.impl, peer, 'fwd'):.2f} | "
                          f"{ratios(rows, r.shape, r.impl, peer):.2f} |" for peer in against)
    lines.append(
        f"| {shape_name(r.shape)} | {r.impl} | {r.fwd_ms:.3f} | {r.tflops('fwd'):.0f} | "
        f"{r.tflops('bwd'):.0f} | {r.fb_ms:.3f} | {r.tflops('fb'):.0f} |"
        + (f" {r.tflops('fb') / ceiling:.2f} |" if ceiling else "") + f"{ratio_cells} "
        f"{r.err_o:.1e} | {r.err_grad:.1e} | {r.note} |")
  shapes = list(dict.fromkeys(r.shape for r in rows))
  lines += ["", "Cost of the fix (time relative to max_adjust=off of the same kernel):", "",
            "| shape | kernel | fwd paper / off | fwd safe / off | fwd+bwd paper / off "
            "| fwd+bwd safe / off |", "|---|---|---|---|---|---|"]
  for s in shapes:
    by = {r.impl: r for r in rows if r.shape == s}
    for prefix in ("mosaic", "ours"):
      if f"{prefix}_off" in by:
        rel = lambda m, attr: (getattr(by[f"{prefix}_{m}"], attr) / getattr(by[f"{prefix}_off"], attr)
                               if f"{prefix}_{m}" in by else float("nan"))
        lines.append(f"| {shape_name(s)} | {prefix} | {rel('paper', 'fwd_ms'):.3f} | "
                     f"{rel('safe', 'fwd_ms'):.3f} | {rel('paper', 'fb_ms'):.3f} | "
                     f"{rel('safe', 'fb_ms'):.3f} |")
  return "\n".join(lines) + "\n"


def plot(rows, device, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  shapes = list(dict.fromkeys(r.shape for r in rows))
  impls = list(dict.fromkeys(r.impl for r in rows))
  fig, axes = plt.subplots(1, 2, figsize=(14, 5))
  width = 0.8 / max(1, len(impls))
  for ax, which, title in ((axes[0], "fwd", "forward"), (axes[1], "fb", "forward + backward")):
    for i, impl in enumerate(impls):
      vals = []
      for s in shapes:
        r = next((r for r in rows if r.shape == s and r.impl == impl), None)
        vals.append(r.tflops(which) if r is not None else np.nan)
      ax.bar(np.arange(len(shapes)) + i * width, vals, width, label=impl)
    ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2)
    ax.set_xticklabels([shape_name(s).replace(" ", "\n", 2) for s in shapes], fontsize=7)
    ax.set_ylabel("TFLOP/s (FA convention)")
    ax.set_title(f"{title}, {device}")
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# Tiling variants for --sweep: each replaces one kernel's config in the table's config.
K = tuning.KernelConfig
SWEEP = {
    "fwd": [K(128, 64, 4, 3), K(128, 64, 8, 3), K(128, 128, 8, 3), K(64, 64, 4, 3),
            K(128, 32, 4, 4)],
    "dkv": [K(64, 64, 4, 2), K(64, 64, 8, 2), K(64, 64, 4, 3), K(128, 64, 8, 2),
            K(32, 64, 4, 2), K(64, 32, 4, 2), K(64, 128, 8, 2)],
    "dq": [K(128, 64, 8, 2), K(64, 64, 4, 2), K(128, 128, 8, 2), K(64, 128, 4, 2),
           K(128, 32, 4, 3), K(64, 32, 4, 3)],
}


def sweep(shapes, dtype, calls, blocks, kernels=tuple(SWEEP)):
  """Times each variant of each kernel (others from the table): fwd alone for 'fwd', fwd+bwd
  otherwise. Prints one line per variant."""
  lines = []
  for shape in shapes:
    B, T, N, K, H, causal = shape
    q, k, v, do = make_inputs(*shape[:5], dtype)
    base = tuning.table_config(H, dtype)
    for kernel in kernels:
      for kc in SWEEP[kernel]:
        try:
          fn = functools.partial(
              lambda q, k, v, config: stable_attn.dot_product_attention(
                  q, k, v, is_causal=causal, implementation="pallas_gpu", max_adjust="off",
                  config=config), config=base.replace(**{kernel: kc}))
          if kernel == "fwd":
            f = jax.jit(fn)
            args = (q, k, v)
          else:
            f = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))
            args = (q, k, v, do)
          jax.block_until_ready(f(*args))
          ms = 1e3 * time_calls(f, args, calls, blocks)
          flops = fwd_flops(*shape) * (1 if kernel == "fwd" else 3.5)
          tag = " (table)" if getattr(base, kernel) == kc else ""
          line = (f"sweep {shape_name(shape)} {kernel} bq{kc.block_q} bk{kc.block_k} "
                  f"w{kc.num_warps} s{kc.num_stages}: {ms:.3f} ms "
                  f"{flops / ms / 1e9:.0f} TFLOP/s{tag}")
        except Exception as e:
          line = (f"sweep {shape_name(shape)} {kernel} {kc}: FAILED "
                  f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
        print(line, flush=True)
        lines.append(line)
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="all", choices=("all", "targets", "targets2", "h256"),
                 help="all: the peers.md table; targets: the Hopper kernel's shapes; targets2: "
                      "its first two; h256: head dim 256")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--calls", type=int, default=30)
  p.add_argument("--blocks", type=int, default=5)
  p.add_argument("--only", "--implementations", dest="only", default="",
                 help="comma-separated arm names (default: all that import here, without the "
                      f"opt-in {', '.join(OPT_IN)})")
  p.add_argument("--sweep", action="store_true", help="time tiling variants instead")
  p.add_argument("--sweep-kernels", default="fwd,dkv,dq")
  p.add_argument("--no-check", action="store_true", help="skip the fp32 reference errors")
  p.add_argument("--out-dir", default=RESULTS)
  p.add_argument("--tag", default="", help="suffix of the result file names")
  jax_cache.add_flags(p)
  args = p.parse_args(argv)
  cache = jax_cache.configure_or_exit(p, args)
  dtype = jnp.dtype(args.dtype)
  device = jax.devices()[0].device_kind
  shapes = {"all": SHAPES, "targets": TARGETS, "targets2": TARGETS[:2], "h256": H256}[args.shapes]
  only = [s for s in args.only.split(",") if s] or None
  unknown = sorted(set(only or ()) - set(ARMS))
  if unknown:   # a misspelt arm would otherwise leave the table without it, silently
    p.error(f"--only: unknown arm(s) {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
  notes = peer_notes(only)
  print(f"device: {device}; jax {jax.__version__}; compilation cache: {cache or 'off'}",
        *notes, sep="\n", flush=True)
  if args.sweep:
    sweep(shapes, dtype, args.calls, args.blocks, args.sweep_kernels.split(","))
    return
  ceiling = matmul_ceiling(dtype, args.calls, args.blocks,
                           n=8192 if jax.default_backend() == "gpu" else 512)
  print(f"matmul ceiling: {ceiling[0]:.0f} TFLOP/s", flush=True)
  rows = []
  for shape in shapes:
    print(shape_name(shape), flush=True)
    rows += bench_shape(shape, dtype, args.calls, args.blocks, only, check=not args.no_check)
  os.makedirs(args.out_dir, exist_ok=True)
  slug = device_slug(device) + args.tag
  md_path = os.path.join(args.out_dir, f"attention_{slug}.md")
  with open(md_path, "w") as f:
    f.write(markdown(rows, device, dtype, args.calls, args.blocks, notes, ceiling))
  try:
    plot(rows, device, os.path.join(args.out_dir, f"attention_{slug}.png"))
  except ImportError as e:  # the GPU machine may lack matplotlib: the table stands alone
    print(f"no figure: {e}")
  print(f"\nwrote {md_path}\n")
  print(f"{'shape':32s} {'impl':12s} {'fwd TF':>7s} {'f+b TF':>7s} {'fwd/cu':>6s} {'f+b/cu':>6s} "
        f"{'fwd/tk':>6s} {'f+b/tk':>6s} {'errO':>7s} {'errG':>7s}")
  for r in rows:
    print(f"{shape_name(r.shape):32s} {r.impl:12s} {r.tflops('fwd'):7.0f} {r.tflops('fb'):7.0f} "
          + "".join(f"{ratios(rows, r.shape, r.impl, peer, which):6.2f} "
                    for peer in ("cudnn", "tokamax") for which in ("fwd", "fb"))
          + f"{r.err_o:7.1e} {r.err_grad:7.1e}")
  for note in notes:
    print(note)


if __name__ == "__main__":
  main()
