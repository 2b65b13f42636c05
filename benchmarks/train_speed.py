"""GPT-2 training throughput with our attention vs cuDNN vs XLA attention, in one process.

Same model, same initial weights, same synthetic batch, one full optimizer step (forward, backward,
AdamW, clipping) per iteration, data parallel over every local device. Writes a Markdown table and
JSON to benchmarks/results/ naming the device, and prints the table last.

  python benchmarks/train_speed.py                          # GPT-2 124M, seq 1024, on the GPU
  python benchmarks/train_speed.py --config tiny --steps 3  # CPU smoke run
  --compilation-cache DIR / --no-compilation-cache          # JAX's persistent cache (default on)

Arms: ours = stable_attn (implementation chosen by stable_attn: the Pallas kernel on GPU, the
blockwise reference elsewhere; --max-adjust safe), ours_off = the same without the max adjustment,
cudnn = jax.nn.dot_product_attention(implementation="cudnn") (GPU only), xla = jax.nn's XLA
attention; ours_cp / ours_ring / ours_alltoall = ours with each sequence split over
--context-parallel N devices (zigzag order; keys all-gathered / passed round a ring / positions
traded for heads), e.g. `--config gpt2-long --batch-size 1
--arms ours,ours_cp,ours_ring --context-parallel 4`; ours_fp8 / ours_fp8_off = ours / ours_off
with FP8 attention (numerics fast+qkv=e4m3+p=e4m3+p_scale=256: the Hopper kernel's FP8 forward,
issue 49); ours_fp8_preset = ours with numerics "fp8" (its top key in bf16); ours_fp8_fast(_bwd) =
ours with numerics "fp8_fast" (and the FP8 backward). MFU = tokens/s
x (6N + 12 L T d) / (devices x peak), peak = the datasheet's dense bf16 peak of the device kind
(train.metrics.peak_tflops: measured where the kind is not in its table; --peak-tflops sets one).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runnable as a script from anywhere in the checkout

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from train import attention as attn_lib  # noqa: E402
from train import jax_cache  # noqa: E402
from train.config import get_config  # noqa: E402
from train.metrics import mfu, peak_tflops, percent  # noqa: E402
from train.model import abstract_model, count_params, flops_per_token  # noqa: E402
from train.sharding import make_mesh  # noqa: E402
from train.step import make_training  # noqa: E402

FP8_NUMERICS = "fast+qkv=e4m3+p=e4m3+p_scale=256"
ARMS = {
    "ours": dict(attention="auto", max_adjust="safe"),
    "ours_off": dict(attention="auto", max_adjust="off"),
    # q, k, v split out of the fused projection before attention, as jax.nn's arms must.
    "ours_split": dict(attention="auto", max_adjust="safe", qkv_packed=False),
    # packed, with c_attn's bias added after its product (nnx.Linear's way) instead of in it.
    "ours_bias_add": dict(attention="auto", max_adjust="safe", qkv_bias_in_matmul=False),
    # --remat: blocks recomputed in the backward, attention's named residuals (out, lse) kept.
    "ours_remat": dict(attention="auto", max_adjust="safe", remat=True),
    # --context-parallel N: each sequence split over N devices (zigzag), keys all-gathered / ring.
    "ours_cp": dict(attention="auto", max_adjust="safe"),
    "ours_ring": dict(attention="auto", max_adjust="safe"),
    "ours_alltoall": dict(attention="auto", max_adjust="safe"),
    # FP8 attention (issue 49): e4m3 q, k, v and P (FlashAttention-3's arithmetic), the Hopper
    # kernel's FP8 forward and its bf16 backward on the dequantized inputs.
    "ours_fp8": dict(attention="auto", max_adjust="safe", numerics=FP8_NUMERICS),
    "ours_fp8_off": dict(attention="auto", max_adjust="off", numerics=FP8_NUMERICS),
    # the "fp8" preset: each key block's top key in bf16 (a second e4m3 P V product of its
    # residual) and the row sum of the rounded P_bar, with which "safe" trains (docs/fp8.md).
    "ours_fp8_preset": dict(attention="auto", max_adjust="safe", numerics="fp8"),
    # "fp8_fast": FlashAttention-3's FP8 arithmetic with "safe"'s dither on O (docs/fp8.md);
    # _bwd: with the FP8 backward's e4m3 products.
    "ours_fp8_fast": dict(attention="auto", max_adjust="safe", numerics="fp8_fast"),
    "ours_fp8_fast_bwd": dict(attention="auto", max_adjust="safe", numerics="fp8_fast",
                              fp8_backward=True),
    "cudnn": dict(attention="cudnn", max_adjust="off"),
    "xla": dict(attention="jax_xla", max_adjust="off"),
}


CONTEXT_ARMS = {"ours_cp": "allgather", "ours_ring": "ring", "ours_alltoall": "alltoall"}


def arm_config(base, arm: str, *, batch_size: int | None = None, seq: int | None = None,
               numerics: str = "fast", fsdp: bool = False, remat: bool = False,
               context_parallel: int = 1, n_head: int | None = None):
  """The config an arm trains: `base` with the arm's attention, one micro-batch per step and a
  global batch of batch_size sequences per device (default 16 for contexts of 1024 and more, else
  the config's) of seq tokens (default the config's context), n_head heads (default the
  config's; the width stays, so the head dim is n_embd / n_head); the context arms split each
  sequence over context_parallel devices."""
  seq = seq or base.model.block_size
  heads = {"n_head": n_head} if n_head else {}
  per_dev = batch_size or (16 if seq >= 1024 else base.batch_size)
  context = dict(context_parallel=context_parallel, context_strategy=CONTEXT_ARMS[arm]) if (
      arm in CONTEXT_ARMS) else {}
  return base.replace(batch_size=per_dev * jax.device_count(), grad_accum=1, fsdp=fsdp, **context,
                      model={"block_size": seq, **heads,
                             "numerics": numerics if ARMS[arm]["attention"] == "auto" else "fast",
                             "remat": remat, **ARMS[arm]})


def tokens_for(cfg) -> np.ndarray:
  """The synthetic batch: [1, B, T+1] int32 token ids (global), the same for every arm."""
  B, T = cfg.batch_size, cfg.model.block_size
  return np.random.default_rng(0).integers(0, cfg.model.vocab_size, size=(1, B, T + 1),
                                          dtype=np.int32)


def set_up(cfg, mesh, tokens: np.ndarray):
  """The trainer's own set-up (train.step.make_training) and the batch on its sharding ->
  (training, x, y): what is timed is the step the trainer trains with."""
  training = make_training(cfg, mesh)
  x = jax.device_put(tokens[..., :-1], training.batch_sharding)
  y = jax.device_put(tokens[..., 1:], training.batch_sharding)
  return training, x, y


def run_arm(cfg, n_steps: int, warmup: int, mesh, tokens: np.ndarray) -> dict:
  """Compile, warm up, then time n_steps optimizer steps. tokens: [1, B, T+1] int32 (global)."""
  training, x, y = set_up(cfg, mesh, tokens)
  params, opt_state = training.params, training.opt_state
  t0 = time.perf_counter()
  compiled = training.train_step.lower(params, opt_state, x, y).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()  # what XLA plans for one step: buffers live at its peak
  step_gib = None if mem is None else (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                       + mem.output_size_in_bytes
                                       - mem.alias_size_in_bytes) / 2 ** 30
  for _ in range(warmup):
    params, opt_state, _ = compiled(params, opt_state, x, y)
  jax.block_until_ready(params)
  t0 = time.perf_counter()
  for _ in range(n_steps):
    params, opt_state, m = compiled(params, opt_state, x, y)
  loss = float(m["loss"])  # waits for the last step
  elapsed = time.perf_counter() - t0
  B, T = tokens.shape[1], tokens.shape[2] - 1
  return {"tokens_per_s": n_steps * B * T / elapsed, "step_ms": 1e3 * elapsed / n_steps,
          "compile_s": compile_s, "loss": loss, "finite": bool(np.isfinite(loss)),
          "step_memory_gib": step_gib}


def label(mcfg) -> str:
  """Short name of what an arm runs, for the table."""
  name = attn_lib.short_name(mcfg)
  split = not mcfg.qkv_packed and mcfg.attention not in attn_lib.JAX_NN
  return name + (", --remat" if mcfg.remat else "") + (", --no-qkv-packed" if split else "")


def peak_memory_gb() -> float | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return peak / 2 ** 30 if peak else None


def _gib(value) -> str:
  return "-" if value is None else f"{value:.2f}"


def markdown(rows: list[dict], header: dict) -> str:
  lines = [f"# GPT-2 training throughput: {header['device']} x{header['devices']}", "",
           f"config {header['config']} ({header['params_m']:.1f}M params), batch "
           f"{header['batch']} x seq {header['seq']} (global), heads {header['heads']}, "
           f"{header['steps']} timed steps after "
           f"{header['warmup']} warm-up, bf16 compute / fp32 master weights, AdamW + clip. "
           f"jax {header['jax']}. "
           f"MFU peak: {header['peak_note']}. Step memory: XLA's plan for one compiled step "
           f"(arguments + outputs + temporaries - donated).", "",
           "| arm | attention | tokens/s | step ms | MFU | vs cuDNN | compile s "
           "| step memory GiB |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  base = next((r["tokens_per_s"] for r in rows if r["arm"] == "cudnn" and "tokens_per_s" in r),
              None)
  for r in rows:
    if "tokens_per_s" not in r:
      lines.append(f"| {r['arm']} | {r['attention']} | - | - | - | - | "
                   f"{r.get('error', 'skipped')[:60]} | - |")
      continue
    vs = f"{r['tokens_per_s'] / base:.3f}x" if base else "-"
    lines.append(f"| {r['arm']} | {r['attention']} | {r['tokens_per_s']:,.0f} | "
                 f"{r['step_ms']:.1f} | {percent(r['mfu'])} | {vs} | {r['compile_s']:.1f} | "
                 f"{_gib(r.get('step_memory_gib'))} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="gpt2")
  p.add_argument("--batch-size", type=int, default=None,
                 help="sequences per device per step (default 16 for 1024-token configs, else the "
                      "config's)")
  p.add_argument("--seq", type=int, default=None,
                 help="sequence length (default: the config's context)")
  p.add_argument("--n-head", type=int, default=None,
                 help="heads (default: the config's); the width stays, so e.g. 6 gives GPT-2 "
                      "124M heads of 128, where the FP8 kernels pay (docs/fp8.md)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--arms", default="ours,cudnn,xla",
                 help=f"comma-separated, from {', '.join(ARMS)}")
  p.add_argument("--numerics", default="fast")
  p.add_argument("--fsdp", action="store_true")
  p.add_argument("--context-parallel", type=int, default=1, metavar="N",
                 help="the arms ours_cp, ours_ring and ours_alltoall split each sequence over N "
                      "devices (the same tokens per device as the other arms)")
  p.add_argument("--remat", action="store_true",
                 help="every arm recomputes its blocks in the backward (train --remat)")
  p.add_argument("--peak-tflops", type=float, default=None)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  p.add_argument("--tag", default="", help="suffix of the result files' names (e.g. remat)")
  jax_cache.add_flags(p)
  args = p.parse_args(argv)
  jax_cache.configure_or_exit(p, args)

  if args.steps < 1 or args.warmup < 0:
    raise ValueError(f"need --steps >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
  base = get_config(args.config)
  if args.n_head is not None and (args.n_head < 1 or base.model.n_embd % args.n_head):
    raise ValueError(f"--n-head must divide the config's width {base.model.n_embd}, got "
                     f"{args.n_head}")
  arms = [a.strip() for a in args.arms.split(",") if a.strip()]
  for a in arms:
    if a not in ARMS:
      raise ValueError(f"--arms: {a!r} is not one of {', '.join(ARMS)}")
  n_dev = jax.device_count()
  peak, peak_note = peak_tflops(args.peak_tflops)
  device = jax.devices()[0].device_kind
  abstract = nnx.state(abstract_model(base.model), nnx.Param)  # heads do not change the count
  config_of = lambda arm: arm_config(base, arm, batch_size=args.batch_size, seq=args.seq,
                                     numerics=args.numerics, fsdp=args.fsdp, remat=args.remat,
                                     context_parallel=args.context_parallel, n_head=args.n_head)
  shape = config_of("ours")   # every arm trains the same batch shape on the same tokens
  batch, seq, tokens = shape.batch_size, shape.model.block_size, tokens_for(shape)
  rows = []
  for arm in arms:
    cfg = config_of(arm)
    fpt = flops_per_token(cfg.model, count_params(abstract, exclude_positions=True))
    context = (f", context parallel {cfg.context_parallel} ({cfg.context_strategy})"
               if arm in CONTEXT_ARMS else "")
    row = {"arm": arm, "attention": label(cfg.model) + context,
           "attention_detail": attn_lib.describe(cfg.model)}
    if arm == "cudnn" and jax.default_backend() != "gpu":
      row["error"] = "skipped: cuDNN needs a GPU"
      rows.append(row)
      print(f"[{arm}] skipped (no GPU)", flush=True)
      continue
    print(f"[{arm}] {row['attention_detail']} ...", flush=True)
    try:
      row.update(run_arm(cfg, args.steps, args.warmup, make_mesh(cfg.context_parallel), tokens))
      row["mfu"] = mfu(row["tokens_per_s"], fpt, peak, n_dev)
      print(f"[{arm}] {row['tokens_per_s']:,.0f} tokens/s, {row['step_ms']:.1f} ms/step, "
            f"MFU {percent(row['mfu'])}, compile {row['compile_s']:.1f}s", flush=True)
    except Exception as e:  # one failing arm must not lose the others' numbers
      row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
      traceback.print_exc()
    rows.append(row)

  header = {"device": device, "devices": n_dev, "backend": jax.default_backend(),
            "config": args.config, "params_m": count_params(abstract) / 1e6, "batch": batch,
            "seq": seq, "heads": f"{shape.model.n_head} x {shape.model.head_dim}",
            "steps": args.steps, "warmup": args.warmup, "jax": jax.__version__,
            "peak_tflops": peak, "peak_note": peak_note, "peak_memory_gb": peak_memory_gb(),
            "numerics": args.numerics, "fsdp": args.fsdp, "remat": args.remat}
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_") + (f"_x{n_dev}" if n_dev > 1 else "")
  stem = f"train_speed_{args.config}_{slug}" + (f"_{args.tag}" if args.tag else "")
  table = markdown(rows, header)
  (out / f"{stem}.md").write_text(table)
  (out / f"{stem}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
  print(f"\nwrote {out / stem}.md and .json\n")
  print(table)
  return 0 if all("tokens_per_s" in r or r.get("error", "").startswith("skipped")
                  for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
