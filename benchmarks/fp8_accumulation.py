"""The compiled FP8 forward's O on random causal attention, its P V accumulated along the row or
promoted as the table's config does (TuningConfig.fp8_pv_promote; issue 49, docs/fp8.md); with
--backward, the FP8 backward's dQ, dK and dV instead.

    PYTHONPATH=. python benchmarks/fp8_accumulation.py [--seq 2048] [--head-dim 64] [--backward]
        [--out FILE]

For each row of ROWS (q's scale: 3 makes rows peaked; v's mean: nonzero makes every product of a
column one sign, so truncated low bits all err one way), one draw of q, k, v (standard normal,
bf16, seeded) and "fp8_fast" "off": the mean signed error of O (outward > 0) in bf16 ulps at
O, over all rows and over the rows with T/2 keys or more, of
  - the kernel with one accumulator along the row, and with its P V promoted (a fresh
    accumulator per TuningConfig.fp8_pv_promote keys), against the reference in the same
    numerics on the CPU (exact fp32 accumulation: the difference is the tensor cores'
    accumulation, and the key blocks' P rounding, 128 keys in the kernel and 64 in the
    reference);
  - the same two and the reference against float64 attention of the quantized inputs.

--backward: for each row of BACKWARD_ROWS (q's scale, dO's mean: nonzero makes each column of
dV = P^T dO one sign), the FP8 backward (TuningConfig.fp8_backward: e4m3 products; dV promoted
per query block, or along the whole column: fp8_dv_promote) and the bf16 backward of the same
forward ("fp8_fast" "off"), each against stable_attn.diagnostics.fp8_backward's float64
emulation of its own arithmetic (exact accumulation): the relative Frobenius error, and the mean
error in bf16 ulps at the tensor's RMS, signed toward +inf and outward (sign of the emulation),
over all rows and over the half with the longest sums (dQ's late queries, dK's and dV's early
keys).

--backward --gpt2 RUN [--layers 1,6,12] [--lean-only]: the same backwards on what a GPT-2 run's
attention sees instead of random draws: from RUN's latest checkpoint (python -m train ...
--grad-accum 1), one training step's q, k, v and dO (the gradient arriving at the attention
output) of each layer, batch row 0; beside them each layer's lean of dO: |mean over positions| /
RMS per column (head, feature), the median over columns (random draws: 0.71 with dO's mean 1,
~T^-1/2 with mean 0); --lean-only: that lean alone, per layer, on any host.
Needs a Hopper GPU (the kernel); the reference and float64 run on the host's CPU.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
from stable_attn import fp8, numerics  # noqa: E402
from stable_attn.api import Options, canonicalize  # noqa: E402
from stable_attn.diagnostics import fp8_backward as emulation  # noqa: E402
from stable_attn.diagnostics.probe import ulp  # noqa: E402
from stable_attn.reference import exact_attention  # noqa: E402
from pallas_kernels import mosaic_gpu as mosaic  # noqa: E402

ROWS = ((1.0, 0.0), (3.0, 0.0), (1.0, 1.0), (3.0, 1.0))   # (q scale, v mean)
NUMERICS = "fp8_fast"
BACKWARD_ROWS = ((1.0, 0.0), (1.0, 1.0), (3.0, 0.0), (3.0, 1.0))   # (q scale, dO mean)
# backward -> (its config's changes, its arithmetic as the emulation names it)
BACKWARDS = {"FP8": (dict(fp8_backward=True), emulation.KERNELS),
             "FP8, dV along the column": (dict(fp8_backward=True, fp8_dv_promote=False),
                                          emulation.KERNELS),
             "bf16": (dict(fp8_backward=False), emulation.VARIANTS[0])}


def draw(seq: int, head_dim: int, q_scale: float, v_mean: float, seed: int):
  """q, k, v [1, seq, 2, head_dim] bf16: standard normal, q times q_scale, v plus v_mean."""
  rng = np.random.default_rng(seed)
  x = lambda scale=1.0, mean=0.0: jnp.asarray(
      rng.standard_normal((1, seq, 2, head_dim)) * scale + mean, jnp.bfloat16)
  return x(q_scale), x(), x(mean=v_mean)


def signed_ulps(o, want) -> tuple[float, float]:
  """(O - want) * sign(want) in bf16 ulps at want, mean over all rows and over the late half
  (entries where want is 0 left out)."""
  o, want = np.asarray(jnp.asarray(o, jnp.float32), np.float64), np.asarray(want, np.float64)
  safe = np.where(want != 0, want, 1.0)
  err = np.where(want != 0, (o - want) * np.sign(want) / ulp(safe, jnp.bfloat16), np.nan)
  return float(np.nanmean(err)), float(np.nanmean(err[:, err.shape[1] // 2:]))


def measure(seq: int, head_dim: int, q_scale: float, v_mean: float, seed: int) -> dict:
  """{arm: (all rows, late rows) against the reference, against float64} for one draw."""
  q, k, v = draw(seq, head_dim, q_scale, v_mean, seed)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    reference = stable_attn.dot_product_attention(
        *(jax.device_put(x, cpu) for x in (q, k, v)), is_causal=True,
        implementation="reference", numerics=NUMERICS)
  truth = exact_attention(*fp8.quantize_inputs(q, k, v, numerics.resolve(NUMERICS).qkv)[:3],
                          is_causal=True)
  spec, ops, _ = canonicalize(q, k, v, None, None, Options(is_causal=True, numerics=NUMERICS))
  config = mosaic.default_config(spec, ops)
  out = {"reference (CPU)": (None, signed_ulps(reference, truth))}
  group = config.fp8_pv_promote
  arms = (("kernel, along the row", 0), (f"kernel, promoted per {group} keys", group))
  for name, promote in arms:
    o = stable_attn.dot_product_attention(
        q, k, v, is_causal=True, implementation="pallas_mosaic_gpu", numerics=NUMERICS,
        config=config.replace(fp8_pv_promote=promote))
    out[name] = (signed_ulps(o, reference), signed_ulps(o, truth))
  return out


def rms_ulps(g, want, long_rows: slice) -> tuple[float, float, float, float]:
  """(relative Frobenius error, mean error toward +inf, mean outward error over all rows, the
  same over `long_rows` of axis 1), errors in bf16 ulps at want's RMS; g, want [B, T, N, H]."""
  g, want = np.asarray(jnp.asarray(g, jnp.float32), np.float64), np.asarray(want, np.float64)
  err = g - want
  unit = float(ulp(np.sqrt(np.mean(want ** 2)), jnp.bfloat16))
  outward = err * np.sign(want) / unit
  return (float(np.linalg.norm(err) / np.linalg.norm(want)), float(np.mean(err)) / unit,
          float(np.mean(outward)), float(np.mean(outward[:, long_rows])))


def measure_backward(seq: int, head_dim: int, q_scale: float, do_mean: float, seed: int) -> dict:
  """{(backward, tensor): rms_ulps against the emulation of that backward} for one draw."""
  q, k, v = draw(seq, head_dim, q_scale, 0.0, seed)
  return backward_errors(q, k, v, draw(seq, head_dim, 1.0, do_mean, seed + 1000)[2])


def backward_errors(q, k, v, do) -> dict:
  """{(backward, tensor): rms_ulps against the emulation of that backward}; q, k, v, do
  [B, T, N, H] bf16, causal."""
  seq = q.shape[1]
  spec, ops, _ = canonicalize(q, k, v, None, None,
                              Options(is_causal=True, numerics=NUMERICS, max_adjust="off"))
  config = mosaic.default_config(spec, ops)
  as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  quantized = [as64(x) for x in fp8.quantize_inputs(q, k, v, numerics.resolve(NUMERICS).qkv)[:3]]
  causal = np.where(np.tril(np.ones((seq, seq), bool)), 0.0, -np.inf)[None, None]
  half = slice(seq // 2, None), slice(None, seq // 2)   # dQ's late queries, dK/dV's early keys
  out, wanted = {}, {}
  for name, (changes, variant) in BACKWARDS.items():
    call = lambda q, k, v: stable_attn.dot_product_attention(
        q, k, v, is_causal=True, implementation="pallas_mosaic_gpu", numerics=NUMERICS,
        max_adjust="off", config=config.replace(**changes))
    got = jax.vjp(call, q, k, v)[1](do)
    if variant not in wanted:   # the two FP8 backwards share their arithmetic's emulation
      wanted[variant] = emulation.gradients(*quantized, causal, as64(do), variant)
    for tensor, g in zip(emulation.TENSORS, got):
      out[name, tensor] = rms_ulps(g, wanted[variant][tensor], half[tensor != "dQ"])
  return out


def column_leans(do) -> np.ndarray:
  """|mean over positions| / RMS of each column (batch row, head, feature) of do [B, T, N, H]
  -> [B, N, H]; an all-zero column leans 0."""
  d = np.asarray(jnp.asarray(do, jnp.float32), np.float64)
  rms = np.sqrt(np.mean(d ** 2, axis=1))
  return np.abs(d.mean(axis=1)) / np.where(rms > 0, rms, 1.0)


def lean(do) -> float:
  """The median of column_leans: how far dO's columns lean one way (0.71 for standard normal
  plus 1, ~T^-1/2 for mean 0)."""
  return float(np.median(column_leans(do)))


def backward_table(seq: int, head_dim: int, seed: int) -> str:
  lines = [f"B1 T{seq} N2 H{head_dim} causal, {NUMERICS} \"off\", each backward against the "
           "float64 emulation of its own arithmetic; errors in bf16 ulps at the tensor's RMS; "
           f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, seed {seed}", "",
           "| q scale | dO mean | backward | tensor | rel. error | mean error | mean outward "
           "| mean outward, longest half |", "|---:|---:|---|---|---:|---:|---:|---:|"]
  for i, (q_scale, do_mean) in enumerate(BACKWARD_ROWS):
    for (name, tensor), (rel, mean, outward, long) in measure_backward(
        seq, head_dim, q_scale, do_mean, seed + i).items():
      lines.append(f"| {q_scale:g} | {do_mean:g} | {name} | {tensor} | {rel:.2e} | {mean:+.3f} "
                   f"| {outward:+.3f} | {long:+.3f} |")
  return "\n".join(lines) + "\n"


_START = time.monotonic()


def progress(what: str) -> None:
  """One line on stderr with the seconds since start: the --gpt2 stages take minutes, and a
  time limit that cuts one should say which."""
  print(f"[{time.monotonic() - _START:6.1f} s] {what}", file=sys.stderr, flush=True)


def gpt2_captures(run: str, data: str | None = None):
  """-> (description, [(q, k, v, dO)] per layer, each [1, T, N, H] bf16: batch row 0): one
  training step of RUN's latest checkpoint with its own attention (reproduction.gradients'
  capture; data: as python -m train's --data, default ./data/<the run's corpus>)."""
  from reproduction import gradients
  progress(f"restoring {run}'s latest checkpoint")
  cfg, start, captures = gradients.captured_steps(pathlib.Path(run), None, data)
  progress(f"step {start}: compiling and running the capture step")
  loss, captured, d_out = next(captures)
  progress("captured")
  layers = [tuple(a[:1] for a in (c["q"], c["k"], c["v"], do)) for c, do in zip(captured, d_out)]
  m = cfg.model
  return (f"GPT-2 run {run} at step {start} (trained with {m.numerics}/{m.max_adjust}"
          f"{', FP8 backward' if m.fp8_backward else ''}, loss {loss:.3f}), "
          f"T{m.block_size} N{m.n_head} H{m.head_dim}, batch row 0"), layers


def gpt2_table(run: str, data: str | None = None, layers: list[int] | None = None) -> str:
  """layers: 1-based, default all (at T1024 N12 each layer's float64 emulations take tens of
  seconds: all twelve did not finish in 200 s on an H200's host)."""
  what, captured = gpt2_captures(run, data)
  layers = layers or list(range(1, len(captured) + 1))
  if not all(1 <= i <= len(captured) for i in layers):
    raise ValueError(f"--layers must lie in 1..{len(captured)}, got {layers}")
  lines = [f"{what}; {NUMERICS} \"off\" backwards, each against the float64 emulation of its "
           f"own arithmetic; bf16 ulps at the tensor's RMS; device: {jax.devices()[0].device_kind},"
           f" jax {jax.__version__}", "",
           "| layer | dO lean | backward | tensor | rel. error | mean error | mean outward "
           "| mean outward, longest half |", "|---:|---:|---|---|---:|---:|---:|---:|"]
  for i in layers:
    q, k, v, do = captured[i - 1]
    progress(f"layer {i}: the kernels' backwards and their float64 emulations")
    for (name, tensor), (rel, mean, outward, long) in backward_errors(q, k, v, do).items():
      lines.append(f"| {i} | {lean(do):.3f} | {name} | {tensor} | {rel:.2e} | {mean:+.3f} "
                   f"| {outward:+.3f} | {long:+.3f} |")
    print("\n".join(lines[-len(BACKWARDS) * len(emulation.TENSORS):]), flush=True)  # progress
  return "\n".join(lines) + "\n"


def lean_table(run: str, data: str | None = None) -> str:
  """Each layer's lean of dO alone (no kernel: runs on any host)."""
  what, captured = gpt2_captures(run, data)
  T = captured[0][3].shape[1]
  lines = [f"{what}; dO's lean per column (head, feature): |mean over positions| / RMS "
           f"(mean-0 noise: ~T^-1/2 = {T ** -0.5:.3f})", "",
           "| layer | median | 90th percentile | largest |", "|---:|---:|---:|---:|"]
  for i, (*_, do) in enumerate(captured):
    r = column_leans(do)
    lines.append(f"| {i + 1} | {lean(do):.3f} | {np.quantile(r, 0.9):.3f} | {r.max():.3f} |")
  return "\n".join(lines) + "\n"


def table(seq: int, head_dim: int, seed: int) -> str:
  fmt = lambda pair: "-" if pair is None else f"{pair[0]:+.3f} / {pair[1]:+.3f}"
  lines = [f"B1 T{seq} N2 H{head_dim} causal, {NUMERICS} \"off\", bf16 ulps of O (outward > 0), "
           f"all rows / rows with {seq // 2} keys or more; device: {jax.devices()[0].device_kind},"
           f" jax {jax.__version__}, seed {seed}", "",
           "| q scale | v mean | arm | against the reference | against float64 |",
           "|---:|---:|---|---:|---:|"]
  for i, (q_scale, v_mean) in enumerate(ROWS):
    for arm, (ref, f64) in measure(seq, head_dim, q_scale, v_mean, seed + i).items():
      lines.append(f"| {q_scale:g} | {v_mean:g} | {arm} | {fmt(ref)} | {fmt(f64)} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--backward", action="store_true",
                      help="measure the FP8 and bf16 backwards' dQ, dK, dV instead of O")
  parser.add_argument("--out", help="also write the table (Markdown) to this file")
  run = parser.add_argument_group("a GPT-2 run's attention instead of random draws")
  run.add_argument("--gpt2", metavar="RUN", help="with --backward: RUN's latest checkpoint")
  run.add_argument("--lean-only", action="store_true",
                   help="only dO's lean per layer (no kernel; any host)")
  run.add_argument("--layers", help="comma list of layers (1-based; default all)")
  run.add_argument("--data", help="the run's token data (default ./data/<its corpus>)")
  args = parser.parse_args(argv)
  if args.gpt2 and not args.backward:
    parser.error("--gpt2 measures the backwards: add --backward")
  given = [f for f, v in (("--lean-only", args.lean_only), ("--layers", args.layers),
                          ("--data", args.data)) if v]
  if given and not args.gpt2:
    parser.error(f"{', '.join(given)} go with --gpt2 RUN")
  try:
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
  except ValueError:
    parser.error(f"--layers takes a comma list of layer numbers, got {args.layers!r}")
  if args.seq < 256 or args.seq % 128:
    parser.error(f"--seq must be a multiple of 128 of at least 256, got {args.seq}")
  if args.gpt2 and args.lean_only:
    text = lean_table(args.gpt2, args.data)
    if args.out:
      pathlib.Path(args.out).write_text(text)
    print(text)
    return 0
  if not mosaic.is_available():
    parser.error("the FP8 forward's kernel needs a Hopper (sm_90) GPU")
  if args.gpt2:
    text = gpt2_table(args.gpt2, args.data, layers)
  else:
    text = (backward_table if args.backward else table)(args.seq, args.head_dim, args.seed)
  if args.out:
    pathlib.Path(args.out).write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
