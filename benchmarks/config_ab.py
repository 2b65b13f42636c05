"""Same-process A/B of TuningConfig changes against a call's default config (pallas_mosaic_gpu).

    PYTHONPATH=. python benchmarks/config_ab.py --shapes h64full,gqa \
        --arm bwdp:fwd_producer=False,fwd_persistent=False --arm noproducer:producer=False
    PYTHONPATH=. python benchmarks/config_ab.py --shapes h128 --arm x:dkv=64x64x3 --dry-run

Each arm is the call's default config (`mosaic.default_config`: this JAX's table, what
dot_product_attention runs for that call) with the arm's fields replaced. Values are Python
literals; Tiles are written 64x128x2 (block_q x block_kv x stages); a bare word is a string. The
arms start from the default of each call, not from a table row, so an arm measures the change
the table would make (an A/B that built its arms from the causal table's row once measured a
config the table then did not give full calls: docs/ptxas_setmaxnreg.md).

Forward and forward+backward (bf16, "safe", random normal inputs; "packed": one row of 8
documents, segment ids, which cuDNN takes as a dense mask; "alibi" and "alibi256": ALiBi's bf16
bias [1, N, T, T], an argument of the timed programs, not differentiated) of cuDNN, the default
and each arm, `--rounds` alternating rounds (the arms' order reversed every other round) of
benchmarks/attention.py's protocol; the median of the rounds. Columns: ms, the ratio to cuDNN and
to the default (> 1: faster), and whether O and the gradients are bitwise the default's (an arm
that computes the same products over the same blocks must give "yes"). Prints the table and
writes benchmarks/results/config_ab_<device><tag>.md. --dry-run prints each arm's changes from
the default and checks them (no GPU needed).
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stable_attn  # noqa: E402
from benchmarks import attention as bench  # noqa: E402
from benchmarks.features import _alibi  # noqa: E402
from pallas_kernels import mosaic_gpu as mosaic  # noqa: E402
from pallas_kernels.mosaic_gpu import tuning  # noqa: E402
from stable_attn.api import Options, canonicalize  # noqa: E402
from train import jax_cache  # noqa: E402

IMPL = "pallas_mosaic_gpu"
SHAPES = {   # name: (B, T, N, K, H, causal), the Hopper kernel's targets and head dim 256
    "h64": (16, 1024, 12, 12, 64, True), "h128": (4, 4096, 16, 16, 128, True),
    "h64full": (8, 2048, 16, 16, 64, False), "gqa": (2, 8192, 32, 8, 128, True),
    "16k": (1, 16384, 16, 16, 128, True), "h256": (2, 4096, 8, 8, 256, True),
    "packed": (1, 8192, 16, 16, 128, True),   # 8 documents of 1024 (benchmarks/features.py's)
    "alibi": (4, 4096, 16, 16, 128, True), "alibi256": (2, 4096, 8, 8, 256, True),
}
DOCUMENTS = {"packed": 8}   # shapes whose row packs documents (segment ids)
ALIBI = ("alibi", "alibi256")   # shapes with ALiBi's bf16 bias [1, N, T, T] (features.py's)
_TILES = re.compile(r"^(\d+)x(\d+)x(\d+)$")


def parse_arm(text: str) -> tuple[str, dict]:
  """'NAME:FIELD=VALUE[,FIELD=VALUE...]' -> (NAME, {FIELD: value}); ValueError naming what is
  wrong."""
  name, sep, body = text.partition(":")
  if not sep or not name or name in ("cudnn", "default"):
    raise ValueError(f"--arm {text!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE...] with a NAME "
                     "other than cudnn and default")
  changes = {}
  for item in filter(None, re.split(r",(?=\s*\w+=)", body)):   # a tuple value keeps its commas
    field, sep, value = item.partition("=")
    if not sep or field not in tuning.FIELDS:
      raise ValueError(f"--arm {name}: {item!r} is not FIELD=VALUE with a TuningConfig field "
                       f"({', '.join(sorted(tuning.FIELDS))})")
    changes[field] = _value(value)
  if not changes:
    raise ValueError(f"--arm {name}: no FIELD=VALUE given")
  return name, changes


def _value(text: str):
  tiles = _TILES.match(text)
  if tiles:
    return tuning.Tiles(*map(int, tiles.groups()))
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text   # a bare word: a string field's value (persistent_order=grid)


def call_of(name: str):
  """(q, k, v, dO, the bias or None), the call's keywords (segment ids for a packed row) and the
  (spec, ops) that dot_product_attention makes of them."""
  B, T, N, K, H, causal = SHAPES[name]
  q, k, v, do = bench.make_inputs(B, T, N, K, H, jnp.bfloat16)
  kwargs = dict(is_causal=causal)
  if name in DOCUMENTS:   # the keys' ids are the queries' (self-attention)
    ids = jnp.repeat(jnp.arange(DOCUMENTS[name], dtype=jnp.int32), T // DOCUMENTS[name])
    kwargs.update(q_segment_ids=jnp.broadcast_to(ids, (B, T)))
  bias = _alibi((B, T, N, H)) if name in ALIBI else None
  spec, ops, _ = canonicalize(q, k, v, bias, None, Options(implementation=IMPL, **kwargs))
  return (q, k, v, do, bias), kwargs, spec, ops


def arm_configs(spec, ops, arms: dict) -> dict:
  """{"default": the call's default config, NAME: it with the arm's changes} (ValueError from
  TuningConfig where a change does not validate)."""
  default = mosaic.default_config(spec, ops)
  configs = {"default": default}
  for name, changes in arms.items():
    try:
      configs[name] = default.replace(**changes)
    except (TypeError, ValueError) as e:
      raise ValueError(f"--arm {name}: {e}") from e
  return configs


def changes_from(default, config) -> str:
  """The fields of `config` that differ from `default`, as FIELD=VALUE."""
  return ", ".join(f"{f}={getattr(config, f)}" for f in sorted(tuning.FIELDS)
                   if getattr(config, f) != getattr(default, f)) or "(none)"


def run_arms(fns: dict, args, rounds: int, calls: int, blocks: int) -> dict:
  """fns: name -> (forward fn, fwd+bwd fn), each taking `args` -> name -> (fwd ms, fwd+bwd ms),
  the median of `rounds` alternating rounds (benchmarks/attention.py's time_calls each)."""
  flat = {(name, which): (fn, args) for name, pair in fns.items() for which, fn in enumerate(pair)}
  seconds = bench.alternating_rounds(flat, rounds, calls, blocks)
  return {name: tuple(1e3 * seconds[name, which] for which in range(len(pair)))
          for name, pair in fns.items()}


def bitwise(outputs: dict, base: str = "default") -> dict:
  """name -> whether its outputs (a list of arrays) are bitwise `base`'s."""
  return {name: all(np.array_equal(np.asarray(x), np.asarray(y))
                    for x, y in zip(out, outputs[base], strict=True))
          for name, out in outputs.items()}


def _fns(kwargs: dict, configs: dict) -> dict:
  """name -> (forward, fwd+bwd), each taking call_of's (q, k, v, dO, bias); the bias (or None)
  is an argument of the timed programs, not differentiated."""
  def ours(config):
    return lambda q, k, v, bias: stable_attn.dot_product_attention(
        q, k, v, bias, implementation=IMPL, max_adjust="safe", config=config, **kwargs)
  ids = kwargs.get("q_segment_ids")   # cuDNN takes a packed row's documents as a dense mask
  mask = None if ids is None else bench.dense_mask(ids)
  attends = {"cudnn": lambda q, k, v, bias: jax.nn.dot_product_attention(
      q, k, v, bias, mask, is_causal=kwargs["is_causal"], implementation="cudnn")}
  attends.update({name: ours(config) for name, config in configs.items()})

  def both(attend):
    def fb(q, k, v, do, bias):
      o, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, bias), q, k, v)
      return (o, *vjp(do))
    return jax.jit(lambda q, k, v, do, bias: attend(q, k, v, bias)), jax.jit(fb)
  return {name: both(attend) for name, attend in attends.items()}


def ab_shape(name: str, arms: dict, rounds: int, calls: int, blocks: int) -> list[str]:
  """The table rows of one shape: cuDNN, the default and each arm (an arm that fails to compile
  or run gets a row saying so)."""
  args, kwargs, spec, ops = call_of(name)
  configs = arm_configs(spec, ops, arms)
  fns, failed = {}, {}
  for arm, pair in _fns(kwargs, configs).items():
    try:
      jax.block_until_ready(pair[1](*args))
      fns[arm] = pair
    except Exception as e:  # noqa: BLE001 -- reported in the table, the other arms go on
      failed[arm] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
  outputs = {arm: list(pair[1](*args)) for arm, pair in fns.items()}
  same = bitwise({a: o for a, o in outputs.items() if a != "cudnn"}) if "default" in fns else {}
  ms = run_arms(fns, args, rounds, calls, blocks)
  rows = []
  for arm in ["cudnn", *configs]:
    if arm in failed:
      rows.append(f"| {name} | {arm} | failed: {failed[arm]} | | | | | | |")
      continue
    fwd, fb = ms[arm]
    ratio = lambda base, i: f"{ms[base][i] / ms[arm][i]:.3f}" if base in ms else ""
    label = "" if arm in ("cudnn", "default") else changes_from(configs["default"], configs[arm])
    rows.append(f"| {name} | {arm} | {fwd:.3f} | {fb:.3f} | {ratio('cudnn', 0)} | "
                f"{ratio('cudnn', 1)} | {ratio('default', 1)} | "
                f"{'' if arm == 'cudnn' else ('yes' if same.get(arm) else 'no')} | {label} |")
  return rows


HEADER = ("| shape | arm | fwd ms | fwd+bwd ms | fwd x cuDNN | fwd+bwd x cuDNN | fwd+bwd x default "
          "| bitwise the default's | changes |\n|---|---|---:|---:|---:|---:|---:|---|---|")


def _quoted(arm: str) -> str:
  """An arm as a shell takes it back (tuple values hold quotes and parentheses)."""
  return arm if re.fullmatch(r"[\w:=.,+-]+", arm) else f'"{arm}"'


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="h128", help=f"comma-separated, of {', '.join(SHAPES)}")
  p.add_argument("--arm", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                 help="a TuningConfig change from each call's default (repeatable)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--blocks", type=int, default=3)
  p.add_argument("--dry-run", action="store_true",
                 help="print each arm's changes from each call's default; time nothing")
  p.add_argument("--out-dir", default=bench.RESULTS)
  p.add_argument("--tag", default="", help="suffix of the result file name")
  jax_cache.add_flags(p)
  args = p.parse_args(argv)
  shapes = [s for s in args.shapes.split(",") if s]
  unknown = sorted(set(shapes) - set(SHAPES))
  if unknown or not shapes:
    p.error(f"--shapes: unknown {', '.join(unknown) or '(none given)'}; the shapes are "
            f"{', '.join(SHAPES)}")
  try:
    arms = dict(parse_arm(a) for a in args.arm)
    if args.dry_run:
      for name in shapes:
        _, _, spec, ops = call_of(name)
        configs = arm_configs(spec, ops, arms)
        print(f"{name} {bench.shape_name(SHAPES[name])}: default {configs['default']}")
        for arm, config in list(configs.items())[1:]:
          print(f"  {arm}: {changes_from(configs['default'], config)}")
      return
  except ValueError as e:
    p.error(str(e))
  jax_cache.configure_or_exit(p, args)
  device = jax.devices()[0].device_kind
  lines = [f"# TuningConfig A/B on {device}", "",
           f"JAX {jax.__version__}; `python benchmarks/config_ab.py --shapes {args.shapes} "
           + " ".join(f"--arm {_quoted(a)}" for a in args.arm) + "`; bf16, \"safe\"; median of "
           f"{args.rounds} alternating rounds of {args.blocks} blocks of {args.calls} calls.", "",
           *(f"- {n}: {bench.shape_name(SHAPES[n])}"
             + (f", {DOCUMENTS[n]} documents (segment ids; cuDNN: a dense mask)"
                if n in DOCUMENTS else "")
             + (", ALiBi bias [1, N, T, T] bf16 (not differentiated)" if n in ALIBI else "")
             for n in shapes), "", HEADER]
  print("\n".join(lines), flush=True)
  for name in shapes:
    for row in ab_shape(name, arms, args.rounds, args.calls, args.blocks):
      print(row, flush=True)
      lines.append(row)
  path = os.path.join(args.out_dir, f"config_ab_{bench.device_slug(device)}{args.tag}.md")
  os.makedirs(args.out_dir, exist_ok=True)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
