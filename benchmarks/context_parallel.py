"""Context parallelism (issue 45): attention over a sequence sharded across the GPUs of one host.

For each length T and each device count n (the first n GPUs, one mesh axis "seq"), q, k and v
[B, T, heads, H] are placed sharded over their sequence dim, and forward+backward (the gradient of
sum(O * w) in q, k, v) runs under jit: ours (pallas_mosaic_gpu, "safe", the library's context
parallel path, in contiguous and zigzag order) next to jax.nn's cuDNN attention, which refuses a
sequence-sharded input, after an all-to-all to heads (ARM_NOTES), every arm in this one process.

    PYTHONPATH=. python benchmarks/context_parallel.py                    # T 32k, 64k; 1, 2, 4 GPUs
    PYTHONPATH=. python benchmarks/context_parallel.py --lengths 131072 --gqa --devices 4

Per GPU TFLOP/s by the FlashAttention convention (fwd+bwd 3.5 x 4*B*N*T*T*H, halved when causal,
divided by n), the efficiency against the same arm on one GPU, memory per GPU (XLA's
memory_analysis of the compiled step: arguments + outputs + temporaries), and the relative
Frobenius error of O and of dQ, dK, dV against the one-GPU call of the same arm. Timing: the
median of --blocks blocks of --calls calls. With --profile, a trace of --calls more calls splits
each row's GPU time per device into attention kernels, collectives and the rest. Writes
benchmarks/results/context_parallel_<device>.md, .json and .png and prints the table last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
from stable_attn import context  # noqa: E402
from benchmarks.attention import RESULTS, fwd_flops, time_calls  # noqa: E402

ARMS = ("ours", "ours_zigzag", "cudnn_heads")
ARM_NOTES = {
    "ours": "stable_attn, context parallel (allgather), the sequence in contiguous order",
    "ours_zigzag": "the same with context_layout='zigzag' (equal causal work per GPU)",
    "ours_ring": "zigzag with context_strategy='ring' (K, V passed round the devices; each holds "
                 "two key blocks, not every key)",
    "ours_alltoall": "context_strategy='alltoall' (each device trades its positions for a share "
                     "of the heads: all-to-all in, the one-GPU kernels, all-to-all out), on "
                     "Auto mesh axes (plain jit over NamedShardings)",
    "ours_alltoall_explicit": "the same on Explicit mesh axes, traced and called under "
                              "jax.set_mesh: the trainer's --context-parallel route",
    "ours_heads": "stable_attn after resharding q, k, v from sequence to heads (all-to-all)",
    "cudnn": "jax.nn's cuDNN attention on the sequence-sharded inputs (XLA refuses: 'Sharding on "
             "sequence dim is not allowed')",
    "cudnn_heads": "jax.nn's cuDNN attention after resharding q, k, v from sequence to heads "
                   "(all-to-all; O resharded back): what a user of jax.nn can do",
}


# How each of our arms calls stable_attn (allgather and the contiguous order otherwise).
STRATEGY = {"ours_ring": "ring", "ours_alltoall": "alltoall", "ours_alltoall_explicit": "alltoall"}
ZIGZAG = ("ours_zigzag", "ours_ring")


def attention(arm: str, causal: bool, mesh, implementation="pallas_mosaic_gpu",
              interpret=False):
  """f(q, k, v) -> O over sequence-sharded q, k, v for one arm."""
  if arm.startswith("cudnn"):
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation="cudnn")
  else:
    fn = lambda q, k, v: stable_attn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=implementation, max_adjust="safe",
        context_layout="zigzag" if arm in ZIGZAG else "contiguous",
        context_strategy=STRATEGY.get(arm, "allgather"), interpret=interpret)
  if not arm.endswith("_heads"):
    return fn
  heads, rows = NamedSharding(mesh, P(None, None, "seq")), NamedSharding(mesh, P(None, "seq"))

  def by_heads(q, k, v):
    q, k, v = (jax.lax.with_sharding_constraint(x, heads) for x in (q, k, v))
    return jax.lax.with_sharding_constraint(fn(q, k, v), rows)
  return by_heads


# What a profiled step's GPU time goes to, by kernel name (the rest, "other", is XLA's copies,
# transposes and fusions around the kernels).
KINDS = (("attention", re.compile(r"stable_attn_|sdpa|cudnn", re.I)),
         ("collectives", re.compile(r"nccl|all-to-all|all_to_all|all-gather|all_gather|"
                                    r"reduce-scatter|collective-permute|sendrecv", re.I)))


def gpu_time(kernel_us: dict, n: int) -> dict:
  """{kind: GPU ms per step and device} from per-kernel-name us per step summed over n devices
  (benchmarks/train_profile.kernel_times). Kernels on different streams may overlap, so the kinds
  can add up to more than the step."""
  out = dict.fromkeys([kind for kind, _ in KINDS] + ["other"], 0.0)
  for name, us in kernel_us.items():
    kind = next((kind for kind, pattern in KINDS if pattern.search(name)), "other")
    out[kind] += us / n / 1e3
  return out


def step(fn, w):
  """(q, k, v) -> (O, (dQ, dK, dV)) of sum(O * w)."""
  def run(q, k, v):
    o, pullback = jax.vjp(fn, q, k, v)
    return o, pullback(w.astype(o.dtype))
  return run


def rel_err(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def measure(arm, shape, n, args, w, calls, blocks, reference=None, profile=False, **kernel):
  """One row: per-GPU TFLOP/s, memory per GPU, errors against `reference` (the one-GPU result);
  with `profile`, the step's GPU time by kind (`gpu_time`) from a trace of `calls` more calls."""
  B, T, N, K, H, causal = shape
  explicit = arm.endswith("_explicit")
  mesh = Mesh(np.asarray(jax.devices()[:n]), ("seq",),
              axis_types=(AxisType.Explicit if explicit else AxisType.Auto,))
  # On Explicit axes the library shard_maps at trace time, so tracing and calls run under the mesh.
  under_mesh = (lambda: jax.set_mesh(mesh)) if explicit else contextlib.nullcontext
  rows = NamedSharding(mesh, P(None, "seq"))
  # The same (natural-order) data in the zigzag order the arm takes; results put back after.
  order, natural = ((lambda x: context.zigzag(x, n), lambda x: context.unzigzag(x, n))
                    if arm in ZIGZAG else (lambda x: x, lambda x: x))
  placed = [jax.device_put(order(a), rows) for a in args]
  w = order(w)
  # O and every gradient leave sharded like q, k, v (a training step needs them so): without
  # out_shardings XLA returned the _heads arms' gradients in the heads layout, 3 trades short.
  fn = jax.jit(step(attention(arm, causal, mesh, **kernel), jax.device_put(w, rows)),
               in_shardings=(rows,) * 3, out_shardings=(rows, (rows,) * 3))
  with under_mesh():
    compiled = fn.lower(*placed).compile()
    seconds = time_calls(compiled, placed, calls, blocks, warmup=1)
    o, grads = jax.device_get(compiled(*placed))
    if profile:
      from benchmarks.train_profile import kernel_times
      kernel_us = kernel_times(lambda: compiled(*placed), calls)
      gpu_ms = gpu_time(kernel_us, n)
  memory = compiled.memory_analysis()
  per_gpu = None
  if memory is not None:
    per_gpu = (memory.argument_size_in_bytes + memory.output_size_in_bytes +
               memory.temp_size_in_bytes - memory.alias_size_in_bytes) / 2 ** 30
  o, grads = natural(o), [natural(g) for g in grads]
  row = dict(arm=arm, T=T, K=K, devices=n, ms=seconds * 1e3,
             tflops_per_gpu=3.5 * fwd_flops(B, T, N, K, H, causal) / seconds / n / 1e12,
             gib_per_gpu=per_gpu)
  if profile:
    row["gpu_ms"] = gpu_ms
    # The longest kernels by name (ms per step and device), in the JSON: where a kind's time goes.
    row["top_kernels"] = {name: round(us / n / 1e3, 3) for name, us in
                          sorted(kernel_us.items(), key=lambda kv: -kv[1])[:12]}
  if reference is not None:
    row["err_o"] = rel_err(o, reference[0])
    row["err_grads"] = max(rel_err(g, r) for g, r in zip(grads, reference[1]))
  del placed
  return row, (o, grads)


def markdown(rows, device: str, notes) -> str:
  lines = [f"# Context parallelism on {device}", "",
           "Forward+backward of causal attention, B1 H128 bf16, q/k/v sharded over their "
           "sequence across n GPUs, every arm in one process. Per-GPU "
           "TFLOP/s by the FlashAttention convention; efficiency against the same arm on one GPU; "
           "memory per GPU from XLA's memory analysis; errors against the one-GPU call.", "",
           "| T | K | GPUs | arm | process | ms | TFLOP/s per GPU | efficiency | GiB per GPU | "
           "err O | err grads |", "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
  # Efficiency against the same arm on one GPU in the same process (rows merged from several
  # runs carry a "process"); ours_heads against ours, the same kernel there.
  key = lambda r, arm=None: (r.get("process"), arm or r["arm"], r["T"], r["K"])
  base = {key(r): r for r in rows if r.get("devices") == 1 and "ms" in r}
  for r in rows:
    if r["arm"] == "ours_heads":
      one = [b for k, b in base.items() if k[1:] == ("ours", r["T"], r["K"])]
      if one:
        base[key(r)] = one[-1]
  fmt = lambda x, f: "-" if x is None else format(x, f)
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['T']} | {r['K']} | {r['devices']} | {r['arm']} | "
                   f"{r.get('process', '')} | failed: {r['error'][:120]} | | | | | |")
      continue
    one = base.get(key(r))
    eff = None if one is None else r["tflops_per_gpu"] / one["tflops_per_gpu"]
    lines.append(f"| {r['T']} | {r['K']} | {r['devices']} | {r['arm']} | "
                 f"{r.get('process', '')} | {r['ms']:.1f} | "
                 f"{r['tflops_per_gpu']:.0f} | {fmt(eff and 100 * eff, '.1f')}% | "
                 f"{fmt(r['gib_per_gpu'], '.2f')} | {fmt(r.get('err_o'), '.1e')} | "
                 f"{fmt(r.get('err_grads'), '.1e')} |")
  lines += profile_table(rows)
  return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def profile_table(rows) -> list:
  """Markdown lines: each profiled row's GPU time per step and device, by kind."""
  rows = [r for r in rows if "gpu_ms" in r]
  if not rows:
    return []
  kinds = list(rows[0]["gpu_ms"])
  lines = ["", "GPU time per step and device from a profiler trace (kernel durations summed by "
           "kind; streams may overlap, so the kinds can add up to more than the step):", "",
           "| T | K | GPUs | arm | process | step ms | " + " | ".join(f"{k} ms" for k in kinds)
           + " |", "|---:|---:|---:|---|---|---:|" + "---:|" * len(kinds)]
  for r in rows:
    lines.append(f"| {r['T']} | {r['K']} | {r['devices']} | {r['arm']} | {r.get('process', '')} | "
                 f"{r['ms']:.1f} | " + " | ".join(f"{r['gpu_ms'][k]:.2f}" for k in kinds) + " |")
  return lines


def plot(rows, device: str, path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
  ax.set_prop_cycle(color=plt.cm.tab20.colors)   # up to 20 lines, none sharing a colour
  # One line per arm, shape and process (rows merged from several runs carry a "process").
  line = lambda r: (r.get("process", ""), r["arm"], r["T"], r["K"])
  for key in sorted({line(r) for r in rows if "ms" in r}):
    pts = sorted((r["devices"], r["tflops_per_gpu"]) for r in rows
                 if "ms" in r and line(r) == key)
    tag = f" ({key[0]})" if key[0] else ""
    ax.plot(*zip(*pts), "o-", label=f"{key[1]} T={key[2] // 1024}k K={key[3]}{tag}")
  ax.set_xlabel("GPUs (sequence sharded)")
  ax.set_ylabel("fwd+bwd TFLOP/s per GPU")
  ax.set_title(f"Context parallel causal attention, {device}")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))   # beside the lines
  fig.tight_layout()
  fig.savefig(path)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--lengths", default="32768,65536")
  p.add_argument("--devices", default="1,2,4")
  p.add_argument("--arms", default=",".join(ARMS))
  p.add_argument("--gqa", action="store_true", help="also K=8 kv heads")
  p.add_argument("--kv-heads", help="the kv head counts, e.g. 8 (default: 16, and 8 with --gqa)")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--implementation", default="pallas_mosaic_gpu",
                 help="ours' backend (pallas_gpu with --interpret: a CPU smoke run of the script)")
  p.add_argument("--interpret", action="store_true")
  p.add_argument("--profile", action="store_true",
                 help="also trace --calls calls of each row: GPU time by kind (attention kernels, "
                      "collectives, other)")
  p.add_argument("--calls", type=int, default=3)
  p.add_argument("--blocks", type=int, default=3)
  p.add_argument("--out", default=RESULTS)
  p.add_argument("--plot-from", metavar="JSON",
                 help="only redraw the figure of rows this script wrote (beside them, .png; no "
                      "GPU needed), titled with --device")
  p.add_argument("--device", help="the figure's device with --plot-from, e.g. '2 x NVIDIA H200'")
  args = p.parse_args(argv)
  if args.plot_from:
    if not os.path.isfile(args.plot_from):
      p.error(f"--plot-from: no such file {args.plot_from!r}")
    with open(args.plot_from) as f:
      rows = json.load(f)
    plot(rows, args.device or "", os.path.splitext(args.plot_from)[0] + ".png")
    return 0
  unknown = [arm for arm in args.arms.split(",") if arm not in ARM_NOTES]
  if unknown:
    p.error(f"--arms: {', '.join(unknown)} not among {', '.join(ARM_NOTES)}")
  counts = [int(n) for n in args.devices.split(",") if int(n) <= jax.device_count()]
  device = jax.devices()[0].device_kind
  rows, notes = [], [f"jax {jax.__version__}, {jax.device_count()} x {device}"]
  notes += [f"{arm}: {ARM_NOTES[arm]}" for arm in args.arms.split(",")]
  kv_heads = ([int(k) for k in args.kv_heads.split(",")] if args.kv_heads
              else (16, 8) if args.gqa else (16,))
  for T in (int(t) for t in args.lengths.split(",")):
    for K in kv_heads:
      N = args.heads
      shape = (1, T, N, min(K, N), 128, True)
      rng = np.random.default_rng(0)
      normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
      qkv = (normal(1, T, N, 128), normal(1, T, min(K, N), 128), normal(1, T, min(K, N), 128))
      w = normal(1, T, N, 128)
      for arm in args.arms.split(","):
        reference = None
        for n in counts:
          try:
            row, result = measure(arm, shape, n, qkv, w, args.calls, args.blocks, reference,
                                  profile=args.profile, implementation=args.implementation,
                                  interpret=args.interpret)
            reference = reference or result
          except Exception as e:   # a failed arm is a row of the table, not the end of the run
            traceback.print_exc()
            row = dict(arm=arm, T=T, K=K, devices=n, error=f"{type(e).__name__}: {e}")
          rows.append(row)
          print(json.dumps(row), flush=True)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "context_parallel_" + device.lower().replace(" ", "_"))
  text = markdown(rows, device, notes)
  with open(stem + ".md", "w") as f:
    f.write(text)
  with open(stem + ".json", "w") as f:
    json.dump(rows, f, indent=1)
  plot(rows, device, stem + ".png")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
