"""Where compile time goes: each attention program and the GPT-2 training step compiled cold, and
the training step again from JAX's persistent compilation cache (issue 23, item 4).

    PYTHONPATH=. python benchmarks/compile_time.py                  # on the GPU: both parts
    PYTHONPATH=. python benchmarks/compile_time.py --parts kernels  # (a) only
    PYTHONPATH=. python benchmarks/compile_time.py --parts train --train-arms ours,cudnn   # (b)
    PYTHONPATH=. python benchmarks/compile_time.py --tiny           # CPU smoke: tiny shapes

Every measurement runs in a new Python process (this script with --worker), so that nothing an
earlier one compiled is reused: neither JAX's caches nor jaxlib's per-process cache of compiled
Mosaic GPU kernels (keyed by the kernel's hash, so one process compiles a kernel once however many
calls share it). --in-process measures the kernels in this process after jax.clear_caches()
instead: faster, but a Mosaic GPU kernel compiled by an earlier program is not compiled again.

(a) Attention at the GPT-2 shape (B16 T1024 N12 H64 causal, bf16; --shape), for each of
--implementations, JAX's persistent cache off:
  fwd          jit(attention)
  bwd          jit of the VJP function alone (the forward's residuals are its inputs)
  fwd+bwd      jit(grad(sum(attention)))
  bwd, <kernel> kernel only / no kernel
               pallas_mosaic_gpu's backward with the other kernels' calls replaced by zeros of
               their outputs' shapes (traced for the shapes, never lowered): what each of the
               dK/dV and dQ kernels costs, and what the XLA around them costs
  fwd+bwd, T=<n>   ours at a length that is no block multiple (--padded-t; padded in the call)
(b) The train step of benchmarks/train_speed.py's set-up (GPT-2 124M at batch 16 x 1024 by
default; --train-arms, --train-config), each arm in two new processes sharing a new, empty cache
directory: "cold" compiles and writes the cache, "warm" is a second launch that reads it; with
--train-layers L (default 1) also cold with L layers, so (cold(n_layer) - cold(L)) / (n_layer - L)
is what one more layer costs.

Columns: trace (Python to jaxpr, Pallas kernel bodies included), lower (jaxpr to StableHLO; Pallas
to Mosaic GPU / Triton IR), compile (XLA; jaxlib compiles each distinct Mosaic GPU kernel here,
from the IR in the program), first call (the first call's time minus the second's: what is left
for the first run), total (the four), process (the whole worker process, set-up included, as its
launcher sees it), kernels (custom calls in the lowered program by target, with the number of
distinct kernels). Prints a markdown table last; --out writes it. --time-limit (default 270 s)
bounds the whole run: what is still running then is stopped, what has not started is reported.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runnable as a script from anywhere in the checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import stable_attn  # noqa: E402
from benchmarks import peers  # noqa: E402
from train import jax_cache  # noqa: E402

GPT2_SHAPE = (16, 1024, 12, 64)   # B, T, N, H; causal, bf16
TINY_SHAPE = (1, 128, 2, 64)
PEERS = ("cudnn", "xla", "tokamax")   # jax.nn's cuDNN and XLA attention, tokamax's Mosaic GPU
# --tiny's model for the train step: small enough for a CPU test.
TINY_MODEL = dict(n_layer=1, n_head=2, n_embd=32, vocab_size=256)
# A backend's backward kernels that can be left out one at a time: module, {label: function}.
# The functions are replaced (for one measurement) by zeros of their outputs' shapes.
SEPARABLE = {"pallas_mosaic_gpu": ("pallas_kernels.mosaic_gpu.backward",
                                   {"dK/dV": "_dkv_call", "dQ": "_dq_call"})}
TIME_LIMIT_S = 270   # default --time-limit: the whole script, well inside 5 minutes
RESULT = "RESULT "   # a worker's last line of stdout: RESULT <json>


# --------------------------------------------------------------------------- what is measured


def attention_fn(impl: str, max_adjust: str):
  """f(q, k, v) -> O, causal: ours (any stable_attn implementation, 'auto' = implementation=None)
  or a peer ('cudnn' and 'xla' of jax.nn, 'tokamax')."""
  if impl in ("cudnn", "xla"):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation=impl)
  if impl == "tokamax":
    tokamax = peers.tokamax_attention()
    return lambda q, k, v: tokamax(q, k, v, is_causal=True)
  implementation = None if impl == "auto" else impl
  return lambda q, k, v: stable_attn.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation, max_adjust=max_adjust)


def ours(impl: str) -> bool:
  """One of ours ('xla' is jax.nn's, as in benchmarks/attention.py)."""
  return impl not in PEERS and (impl == "auto" or impl in stable_attn.IMPLEMENTATIONS)


def why_not(impl: str, shape) -> str | None:
  """None if `impl` runs the attention programs here, else why not (nothing is compiled)."""
  if impl == "cudnn" and jax.default_backend() != "gpu":
    return "cuDNN needs a GPU"
  if impl == "tokamax" and peers.tokamax_attention() is None:
    return peers.TOKAMAX_MISSING
  if not (ours(impl) or impl in PEERS):
    return "unknown implementation"
  B, T, N, H = shape
  spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  try:
    jax.eval_shape(attention_fn(impl, "safe"), spec, spec, spec)
  except Exception as e:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return None


def separable_kernels(impl: str) -> tuple[dict, str | None]:
  """({label: function name} of impl's backward kernels that can be left out, why not or None)."""
  if impl not in SEPARABLE:
    return {}, None
  module_name, kernels = SEPARABLE[impl]
  module = importlib.import_module(module_name)
  missing = [name for name in kernels.values() if not callable(getattr(module, name, None))]
  if missing:
    return {}, (f"{module_name} has no {', '.join(missing)}: its backward kernels are not "
                "separable here; fwd, bwd and fwd+bwd only")
  return kernels, None


@contextlib.contextmanager
def kernels_left_out(impl: str, left_out):
  """The named backward kernels of impl replaced by zeros of their outputs' shapes (their bodies
  are traced for the shapes, never lowered or compiled)."""
  module = importlib.import_module(SEPARABLE[impl][0]) if left_out else None
  names = [SEPARABLE[impl][1][label] for label in left_out]
  originals = {name: getattr(module, name) for name in names}

  def zeros_of(fn):
    def call(*args, **kwargs):
      shapes = jax.eval_shape(lambda: fn(*args, **kwargs))
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return call

  try:
    for name, fn in originals.items():
      setattr(module, name, zeros_of(fn))
    yield
  finally:
    for name, fn in originals.items():
      setattr(module, name, fn)


def attention_program(task: dict):
  """(jitted function, its arguments) of one attention task."""
  B, T, N, H = task["shape"]
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, (B, T, N, H), jnp.float32).astype(jnp.bfloat16)
                 for key in keys)
  attention = attention_fn(task["impl"], task["max_adjust"])
  if task["program"] == "fwd":
    return jax.jit(attention), (q, k, v)
  if task["program"] == "fwd+bwd":
    loss = lambda q, k, v: attention(q, k, v).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v)
  _, vjp = jax.vjp(attention, q, k, v)   # the forward runs here, outside the measurement
  return jax.jit(lambda vjp, do: vjp(do)), (vjp, do)


def time_stages(jitted, args, run=None) -> dict:
  """Seconds of trace, lower, compile and of the first call beyond the second; `run(compiled)`
  makes one call (default: compiled(*args)); 'kernels' counts the lowered program's custom calls."""
  run = run or (lambda compiled: compiled(*args))
  t0 = time.perf_counter()
  traced = jitted.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3 = time.perf_counter()
  jax.block_until_ready(run(compiled))
  t4 = time.perf_counter()
  jax.block_until_ready(run(compiled))
  t5 = time.perf_counter()
  return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
          "first_call_s": (t4 - t3) - (t5 - t4), "call_s": t5 - t4,
          "kernels": custom_calls(lowered.as_text())}


def custom_calls(text: str) -> str:
  """'target n (d distinct)' for each custom call target of a lowered program but sharding
  annotations; distinct by kernel_hash (Mosaic GPU) or by the call's attributes."""
  seen: dict[str, set] = {}
  count: dict[str, int] = {}
  for line in text.splitlines():
    m = re.search(r"custom_call @([\w$.]+)\(", line)
    if m is None or m.group(1) in ("Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"):
      continue
    target = m.group(1)
    h = re.search(r'kernel_hash = "((?:[^"\\]|\\.)*)"', line)
    key = h.group(1) if h else re.sub(r"%[\w#:.]+", "", line[m.end():])
    seen.setdefault(target, set()).add(hash(key))
    count[target] = count.get(target, 0) + 1
  return ", ".join(f"{t} {n} ({len(seen[t])} distinct)" for t, n in count.items()) or "-"


def measure_attention(task: dict) -> dict:
  with kernels_left_out(task["impl"], task.get("left_out", ())):
    jitted, args = attention_program(task)
    return time_stages(jitted, args)


def measure_train(task: dict) -> dict:
  """The train step of benchmarks/train_speed.py's set-up: traced, lowered, compiled, run twice."""
  from benchmarks import train_speed
  from train.config import get_config
  from train.sharding import make_mesh
  base = get_config(task["config"]).replace(model=task.get("model") or {})
  if task.get("layers"):
    base = base.replace(model=dict(n_layer=task["layers"]))
  cfg = train_speed.arm_config(base, task["arm"], batch_size=task.get("batch_size"),
                               seq=task.get("seq"))
  t0 = time.perf_counter()
  training, x, y = train_speed.set_up(cfg, make_mesh(), train_speed.tokens_for(cfg))
  setup_s = time.perf_counter() - t0
  state = [training.params, training.opt_state]

  def step(compiled):   # params and optimizer state are donated: each call takes the last ones
    state[0], state[1], metrics = compiled(state[0], state[1], x, y)
    return metrics

  result = time_stages(training.train_step, (state[0], state[1], x, y), step)
  result["setup_s"] = setup_s
  result["n_layer"] = cfg.model.n_layer
  return result


def worker(task: dict) -> dict:
  """One measurement in this process, JAX's persistent cache in task['cache'] (None: off)."""
  if task.get("cache"):
    jax_cache.configure(task["cache"])
  else:
    jax.config.update("jax_enable_compilation_cache", False)
  return measure_train(task) if task["kind"] == "train" else measure_attention(task)


# --------------------------------------------------------------------------- running them


def label(task: dict) -> str:
  if task["kind"] == "train":
    layers = f", {task['layers']} layer{'s' * (task['layers'] != 1)}" if task.get("layers") else ""
    return f"train step, {task['arm']}{layers}, {task['state']}"
  B, T, N, H = task["shape"]
  name = task["program"]
  if "only" in task:
    name += f", {task['only']} kernel only" if task["only"] != "none" else ", no kernel"
  if task.get("padded"):
    name += f", T={T}"
  return name


def run_isolated(task: dict, timeout: float) -> dict:
  """worker(task) in a new Python process (killed after `timeout` seconds); its wall time as
  'process_s'."""
  t0 = time.perf_counter()
  try:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(task)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  except subprocess.TimeoutExpired:
    return {"error": f"stopped after {timeout:.0f} s (--time-limit)"}
  wall = time.perf_counter() - t0
  lines = proc.stdout.strip().splitlines()
  if proc.returncode != 0 or not lines or not lines[-1].startswith(RESULT):
    err = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return {"error": f"exit code {proc.returncode}: {err[-1][:300] if err else 'no output'}"}
  return {**json.loads(lines[-1][len(RESULT):]), "process_s": wall}


def run_in_process(task: dict) -> dict:
  """measure_attention(task) here, after jax.clear_caches() and with JAX's persistent cache off
  (restored after)."""
  jax.clear_caches()
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  t0 = time.perf_counter()
  try:
    return {**measure_attention(task), "process_s": time.perf_counter() - t0}
  except Exception as e:  # reported in the row; the other measurements go on
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)


def attention_tasks(impls, shape, max_adjust, padded_t, notes):
  tasks = []
  for impl in impls:
    reason = why_not(impl, shape)
    if reason is not None:
      notes.append(f"{impl}: not run, {reason}")
      continue
    base = dict(kind="attention", impl=impl, shape=list(shape), max_adjust=max_adjust)
    tasks += [dict(base, program=p) for p in ("fwd", "bwd", "fwd+bwd")]
    kernels, why = separable_kernels(impl)
    if why:
      notes.append(f"{impl}: {why}")
    for only in [*kernels, "none"] if kernels else []:
      tasks.append(dict(base, program="bwd", only=only,
                        left_out=[k for k in kernels if k != only]))
    if ours(impl) and padded_t:
      tasks.append(dict(base, program="fwd+bwd", padded=True,
                        shape=[shape[0], padded_t, shape[2], shape[3]]))
  return tasks


def train_tasks(arms, config, model, other_layers, batch_size, seq, cache_root):
  """Per arm, cold and warm in a new cache directory of its own; then, per arm, cold without a
  cache for each of other_layers. model: ModelConfig fields changed from the config's."""
  base = dict(kind="train", config=config, model=model, batch_size=batch_size, seq=seq)
  tasks = []
  for arm in arms:
    cache = str(Path(cache_root) / arm)
    tasks += [dict(base, arm=arm, state=state, cache=cache) for state in ("cold", "warm")]
  return tasks + [dict(base, arm=arm, state="cold", layers=n, cache=None)
                  for arm in arms for n in other_layers]


def fmt(value) -> str:
  return "-" if value is None else f"{value:.2f}"


def markdown(rows, header: str, notes) -> str:
  lines = [header, ""] + [f"- {n}" for n in notes] + ([""] if notes else [])
  lines += ["| implementation | program | trace s | lower s | compile s | first call s | total s "
            "| process s | kernels (custom calls) | note |", "|---" * 10 + "|"]
  for task, r in rows:
    total = None
    if "compile_s" in r:
      total = r["trace_s"] + r["lower_s"] + r["compile_s"] + max(r["first_call_s"], 0.0)
    impl = task.get("impl") or task.get("arm")
    lines.append(f"| {impl} | {label(task)} | {fmt(r.get('trace_s'))} | {fmt(r.get('lower_s'))} | "
                 f"{fmt(r.get('compile_s'))} | {fmt(r.get('first_call_s'))} | {fmt(total)} | "
                 f"{fmt(r.get('process_s'))} | {r.get('kernels', '-')} | {r.get('error', '')} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--parts", default="kernels,train", help="kernels, train or both")
  p.add_argument("--implementations", default="pallas_mosaic_gpu,cudnn,xla",
                 help="attention implementations for (a): ours ('auto' = implementation=None) "
                      "and the peers cudnn, xla, tokamax; those that do not run here are skipped "
                      "with the reason")
  p.add_argument("--shape", default=None, help="B,T,N,H of (a) (default 16,1024,12,64: GPT-2)")
  p.add_argument("--max-adjust", default="safe")
  p.add_argument("--padded-t", type=int, default=None,
                 help="T of the padding variant (default T - 24; 0: none)")
  p.add_argument("--train-arms", default="ours",
                 help="arms of benchmarks/train_speed.py for (b): ours, ours_off, cudnn, xla, ...")
  p.add_argument("--train-config", default="gpt2")
  p.add_argument("--train-layers", default="1",
                 help="n_layer values measured cold besides the config's own ('' for none)")
  p.add_argument("--batch-size", type=int, default=None, help="per device (train_speed's default)")
  p.add_argument("--seq", type=int, default=None)
  p.add_argument("--tiny", action="store_true",
                 help="CPU smoke: attention at B1 T128 N2 H64, the tiny config with 1 layer at "
                      "batch 2 x 32 tokens")
  p.add_argument("--in-process", action="store_true",
                 help="(a) in this process after jax.clear_caches() instead of a new process each")
  p.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                 help="seconds for the whole script: a measurement still running then is stopped "
                      "and those not started are reported as not run (default %(default)s)")
  p.add_argument("--out", default=None, help="also write the table to this file")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    print(RESULT + json.dumps(worker(json.loads(args.worker))), flush=True)
    return 0

  parts = {s.strip() for s in args.parts.split(",") if s.strip()}
  if not parts or parts - {"kernels", "train"}:
    p.error(f"--parts: {args.parts!r}: kernels, train or both")
  shape = tuple(int(x) for x in args.shape.split(",")) if args.shape else (
      TINY_SHAPE if args.tiny else GPT2_SHAPE)
  padded_t = shape[1] - 24 if args.padded_t is None else args.padded_t
  config, model, other_layers = args.train_config, None, [
      int(n) for n in args.train_layers.split(",") if n]
  batch_size, seq = args.batch_size, args.seq
  if args.tiny:
    config, model, other_layers = "tiny", TINY_MODEL, []
    batch_size, seq = batch_size or 2, seq or 32
  device = jax.devices()[0].device_kind
  where = "in one process after jax.clear_caches()" if args.in_process else "a new process each"
  header = (f"# Compile time on {device}, JAX {jax.__version__}\n\n"
            f"Attention: B{shape[0]} T{shape[1]} N{shape[2]} H{shape[3]} causal bf16, max_adjust "
            f"{args.max_adjust}, persistent cache off, {where}. Train step: config {config}"
            f"{f' with {model}' if model else ''}, train_speed.py's set-up; cold = empty "
            f"persistent cache, warm = a second process reading it; the layer variants cold "
            f"without a cache. Seconds; first call = first call - second call.")
  notes, rows = [], []
  tasks = []
  if "kernels" in parts:
    impls = [s.strip() for s in args.implementations.split(",") if s.strip()]
    tasks += attention_tasks(impls, shape, args.max_adjust, padded_t, notes)
  with tempfile.TemporaryDirectory(prefix="compile_time_cache_") as cache_root:
    if "train" in parts:
      arms = [s.strip() for s in args.train_arms.split(",") if s.strip()]
      tasks += train_tasks(arms, config, model, other_layers, batch_size, seq, cache_root)
    deadline = time.perf_counter() + args.time_limit
    for task in tasks:
      left = deadline - time.perf_counter()
      if left <= 1:
        result = {"error": "not run: --time-limit reached"}
      elif args.in_process and task["kind"] == "attention":
        result = run_in_process(task)
      else:
        result = run_isolated(task, left)
      rows.append((task, result))
      print(f"[{task.get('impl') or task.get('arm')}] {label(task)}: "
            + (result.get("error") or f"trace {result['trace_s']:.2f} s, lower "
               f"{result['lower_s']:.2f} s, compile {result['compile_s']:.2f} s, first call "
               f"{result['first_call_s']:.2f} s; {result['kernels']}"), flush=True)
  table = markdown(rows, header, notes)
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table)
    print(f"\nwrote {args.out}")
  print("\n" + table)
  return 0 if all("error" not in r for _, r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
