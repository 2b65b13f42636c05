"""The training loop (`train`) and what it calls: set-up and resume, evaluation and monitors,
metrics, checkpoints, the end-of-run outputs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import resource
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from stable_attn import context

from . import attention as attn_lib
from . import data as data_lib
from . import jax_cache
from .checkpoint import Checkpointer
from .config import TrainConfig, check_dir
from .metrics import (MetricsLogger, check_peak_tflops, mfu, mfu_warning, peak_tflops, percent,
                      plot_loss, tensorboard_missing, to_python, write_atomically)
# abstract_model and init_params are imported from here by reproduction/gradients.py.
from .model import abstract_model, count_params, flops_per_token  # noqa: F401
from .monitors import make_monitor_fn
from .optim import describe_schedule, lr_schedule
from .sample import generate_text, make_sampler
from .sharding import batch_sharding, host_rows, make_mesh, replicated, to_global
from .step import init_params, make_eval_step, make_training  # noqa: F401

MONITOR_ROWS = 4  # sequences of the first validation batch that the attention monitors look at
MONITOR_TOKENS = 4096  # and their first tokens (the monitors' scores are T x T per row and head)
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")


class TrainingStopped(RuntimeError):
  """Raised when the loss became NaN/Inf or spiked; the last good checkpoint is kept."""

  def __init__(self, message: str, step: int | None = None, loss: float | None = None):
    super().__init__(message)
    self.step, self.loss = step, loss


class OutOfMemory(RuntimeError):
  """A jitted step asked XLA for more memory than the device has; the message is one line saying
  how much, what the device holds and which flags lower it."""


@dataclass
class RunOptions:
  out_dir: Path
  config_name: str = "custom"
  data: str | None = None  # --data PATH; None = ./data/<corpus>, prepared if missing
  resume: bool = True
  peak_tflops: float | None = None
  progress: bool = True
  tensorboard: bool = True
  prompt: str = ""
  time_limit: float | None = None  # seconds; then checkpoint and return (resumable)
  deterministic: bool = False  # --deterministic: the command line has set XLA_FLAGS; logged here


@dataclass
class RunState:
  """What the loop changes besides the arrays (parameters and optimizer state stay local to it)."""

  completed: int = 0  # optimizer steps done, resumed ones included
  loss_ema: float | None = None  # running mean for the spike test; checkpointed for exact resume
  last_good: int | None = None  # step of the newest checkpoint: what a stop leaves behind
  first_loss: float | None = None  # of step 0 (checkpointed: a resumed run reports it too)
  last_loss: float | None = None  # checkpointed too
  val_loss: float | None = None  # the latest evaluation
  pending: list = field(default_factory=list)  # (step, metrics still on device, extras) to flush
  # Losses since the last record (loss_avg), across flushes: a checkpoint flush between two
  # records must not shorten the average.
  losses_since_record: list = field(default_factory=list)
  # Throughput window since the last flush: tokens trained, seconds spent on anything but training.
  t_mark: float | None = None
  tokens: int = 0
  excluded: float = 0.0
  tokens_per_s: list = field(default_factory=list)  # one sample per logged record
  mfu: list = field(default_factory=list)
  mfu_warned: bool = False  # an MFU above 100% was reported (once a run)


class _Log:
  """Messages to the terminal (above the progress bar) and to DIR/train.log, from process 0 only.

  The out dir is created only once the inputs are known good (a bad --data must leave nothing
  behind), so lines logged before `open` are held and written to train.log when it opens.
  """

  def __init__(self, enabled: bool):
    self.path, self.enabled, self.held = None, enabled, []

  def open(self, out_dir: Path) -> None:
    self.path = out_dir / "train.log"
    if self.enabled and self.held:
      _append(self.path, "".join(msg + "\n" for msg in self.held))
    self.held = []

  def __call__(self, msg: str, terminal: bool = True) -> None:
    """`msg` to train.log, and to the terminal unless `terminal` is False (a message the command
    line prints itself, last)."""
    if not self.enabled:
      return
    if terminal:
      tqdm.write(msg)
    if self.path is None:
      self.held.append(msg)
      return
    _append(self.path, msg + "\n")


def _append(path: Path, text: str) -> None:
  """Appends text to a log; a line left unfinished by a killed run is ended first, so that a kill
  at any byte costs at most that line."""
  with open(path, "ab+") as f:  # appends go to the end whatever the read position
    end = f.seek(0, os.SEEK_END)
    if end:
      f.seek(end - 1)
      if f.read(1) != b"\n":
        text = "\n" + text
    f.write(text.encode())


def _due(step: int, every: int) -> bool:
  return every > 0 and step % every == 0


def train(cfg: TrainConfig, opts: RunOptions) -> dict:
  """Run (or resume) training as configured; returns a summary dict (also written to
  DIR/summary.json).

  Per step: the evaluations due, one optimizer step, metrics, checkpoints (cf. nanoGPT's train.py).
  OutOfMemory when a step does not fit the device.
  """
  try:
    return _train(cfg, opts)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise OutOfMemory(_out_of_memory(cfg, e)) from e


def _train(cfg: TrainConfig, opts: RunOptions) -> dict:
  run, params, opt_state, state = _set_up(cfg, opts)
  stopped, timed_out = None, False
  try:
    for step in range(run.start, cfg.max_steps):
      last = step == cfg.max_steps - 1
      extra = _evaluate_due(run, state, params, step, last)
      params, opt_state, m = run.train_step(params, opt_state, *run.train_batch(step))
      state.completed = done = step + 1
      state.pending.append((step, m, extra))
      state.tokens += cfg.tokens_per_step if step > run.start else 0
      run.bar.update(1)
      save_due = _due(done, cfg.ckpt_every) or last
      # The first flush comes right after the first step (compilation), so throughput is only
      # measured from then on.
      if step == run.start or _due(step, cfg.log_every) or extra or save_due:
        _flush(run, state)
      timed_out = run.deadline is not None and time.time() > run.deadline and not last
      if save_due or timed_out:
        _save(run, state, params, opt_state, done)
      if timed_out:
        run.log(f"train: time limit of {opts.time_limit:g}s reached after step {step}; checkpoint "
                f"at step {done}; run the same command again to resume")
        break
  except TrainingStopped as e:
    stopped = str(e)
    loss = e.loss if e.loss is not None and math.isfinite(e.loss) else None
    run.metrics.write({"step": e.step, "loss": loss, "stopped": stopped})
  except KeyboardInterrupt:
    _save_interrupted(run, state, params, opt_state)
    raise
  except BaseException:
    run.bar.close()  # now, not at exit: after the caller's one line, which must come last
    raise
  return _finish(run, state, params, stopped, timed_out)


# --------------------------------------------------------------------- set-up


@dataclass
class _Run:
  """What stays fixed while training: options, data, jitted functions, output writers."""

  cfg: TrainConfig
  opts: RunOptions
  out_dir: Path
  main: bool  # process 0, the only one that writes files; every process joins every jitted call
  log: _Log
  data: data_lib.TokenData
  rows: slice  # this host's rows of each global batch
  train_sharding: jax.sharding.Sharding  # of train batches [accum, B, T]
  eval_sharding: jax.sharding.Sharding  # of validation batches [B, T]
  train_step: Callable  # (params, opt_state, x, y) -> (params, opt_state, metrics)
  eval_step: Callable
  monitor: Callable
  monitor_x: jax.Array  # the monitors' input: MONITOR_ROWS validation sequences
  sampler: Callable
  sample_sharding: jax.sharding.Sharding  # of the parameters the sampler reads: replicated
  schedule: Callable  # step -> learning rate
  flops_per_token: float
  peak: float | None  # TFLOP/s per device, for MFU (None: no MFU)
  peak_note: str
  ckpt: Checkpointer
  metrics: MetricsLogger
  bar: tqdm
  start: int  # first step of this run: 0, or the step of the checkpoint resumed from
  sample_key: jax.Array
  t_start: float = field(default_factory=time.time)

  @property
  def deadline(self) -> float | None:
    return None if self.opts.time_limit is None else self.t_start + self.opts.time_limit

  def train_batch(self, step):
    cfg = self.cfg
    x, y = data_lib.train_batch(self.data, step, seed=cfg.seed, batch_size=cfg.batch_size,
                                grad_accum=cfg.grad_accum, block_size=cfg.model.block_size,
                                rows=self.rows)
    shape = (cfg.grad_accum, cfg.batch_size, cfg.model.block_size)
    x, y = _laid_out(cfg, x, axis=2), _laid_out(cfg, y, axis=2)
    return to_global(x, self.train_sharding, shape), to_global(y, self.train_sharding, shape)

  def evaluate(self, params) -> float:
    """Mean loss over the first eval_batches validation batches (the same ones every time)."""
    cfg, total = self.cfg, 0.0
    shape = (cfg.batch_size, cfg.model.block_size)
    for i in range(cfg.eval_batches):
      x, y = data_lib.val_batch(self.data, i, seed=cfg.seed, batch_size=cfg.batch_size,
                                block_size=cfg.model.block_size, rows=self.rows)
      x, y = _laid_out(cfg, x, axis=1), _laid_out(cfg, y, axis=1)
      x, y = to_global(x, self.eval_sharding, shape), to_global(y, self.eval_sharding, shape)
      total += float(self.eval_step(params, x, y))
    return total / cfg.eval_batches

  def sample(self, params, step: int) -> str:
    """Text drawn with a key that depends only on the step, so a resumed run draws the same.

    The sampler reads whole parameters, as data parallel: on FSDP-split ones XLA 0.11's GPU
    compiler crashed compiling its one-row loop (a segfault on 4 H200s, after the last
    checkpoint). The copy lasts the sample."""
    params = jax.device_put(params, self.sample_sharding)
    return generate_text(self.sampler, params, self.cfg.model.block_size,
                         jax.random.fold_in(self.sample_key, step), prompt=self.opts.prompt,
                         max_new_tokens=self.cfg.sample_tokens)

  def close(self) -> None:
    self.ckpt.close()
    self.metrics.close()


def _laid_out(cfg: TrainConfig, tokens: np.ndarray, axis: int) -> np.ndarray:
  """Host tokens (inputs or targets) in the order the steps take them: the zigzag order over the
  context axis (--context-parallel; stable_attn.context), so every device does equal causal work.
  The loss is a mean over positions, so reordering inputs and targets alike leaves it the same."""
  n = cfg.context_parallel
  return tokens if n == 1 else context.zigzag(tokens, n, axis=axis)


def _set_up(cfg: TrainConfig, opts: RunOptions):
  """Logs the configuration, loads the data, builds the state and the jitted functions on the mesh
  and resumes from the newest checkpoint; returns (run, params, opt_state, state)."""
  # Every input is checked before anything is written: a bad flag or --data leaves no out dir.
  check_options(opts)
  out_dir = Path(opts.out_dir)
  check_dir(out_dir, "--out-dir")
  main = jax.process_index() == 0
  log = _Log(main)
  mcfg, n_dev = cfg.model, jax.device_count()
  attn_lib.check_attention(cfg)
  mesh = make_mesh(cfg.context_parallel)
  groups = mesh.shape["data"]   # data-parallel groups
  if cfg.batch_size % groups:
    per = f" / {cfg.context_parallel} (--context-parallel)" if cfg.context_parallel > 1 else ""
    raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the {n_dev} devices{per}")
  rows = host_rows(cfg.batch_size)
  if jax.default_backend() == "cpu":
    # CPU XLA cannot reuse donated buffers; the warning says nothing useful there.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  _log_config(log, cfg, opts)
  tensorboard = opts.tensorboard and _tensorboard_usable(log)
  data = data_lib.load_data(opts.data, corpus=cfg.corpus, progress=opts.progress and main, log=log)
  data.check(mcfg.block_size, mcfg.vocab_size)
  log(f"data: {data.source}: {data.train.size:,} train / {data.val.size:,} val tokens")
  _make_out_dir(out_dir)
  log.open(out_dir)

  training = make_training(cfg, mesh)
  graphdef, params, opt_state = training.graphdef, training.params, training.opt_state
  p_sh = training.param_shardings
  rep = replicated(mesh)
  b_sh3, b_sh2 = training.batch_sharding, batch_sharding(mesh, 2, 0)
  fpt = flops_per_token(mcfg, count_params(params, exclude_positions=True))
  peak, peak_note = peak_tflops(opts.peak_tflops)
  log(f"train: {count_params(params) / 1e6:.2f}M parameters; {fpt / 1e6:.1f} MFLOP/token; "
      f"MFU peak: {peak_note}")
  eval_step = attn_lib.jit_on_mesh(mesh, make_eval_step(graphdef), strategy=cfg.context_strategy,
                                   in_shardings=(p_sh, b_sh2, b_sh2), out_shardings=rep)
  monitor = attn_lib.jit_on_mesh(mesh, make_monitor_fn(graphdef, mcfg), split_sequence=False,
                                 out_shardings=rep)
  # The monitors hold every row's T x T scores: a long context is looked at through its start.
  mon_x = data_lib.val_batch(data, 0, seed=cfg.seed, batch_size=cfg.batch_size,
                             block_size=mcfg.block_size)[0][:min(MONITOR_ROWS, cfg.batch_size),
                                                            :MONITOR_TOKENS]

  ckpt = Checkpointer(out_dir / "checkpoints", keep=cfg.keep_checkpoints)
  try:
    params, opt_state, state, start, sample_key = _resume(ckpt, params, opt_state, cfg, opts,
                                                          out_dir, log)
  except BaseException:
    # Left open after a failed read, Orbax's threads print tracebacks of their own at exit.
    ckpt.close()
    raise
  # Records of steps from the checkpoint on are about to be redone: MetricsLogger drops them.
  metrics = MetricsLogger(out_dir, start_step=start, enabled=main, tensorboard=tensorboard, log=log)
  bar = tqdm(total=cfg.max_steps, initial=start, disable=not (main and opts.progress),
             desc=opts.config_name, dynamic_ncols=True, unit="step")
  run = _Run(cfg=cfg, opts=opts, out_dir=out_dir, main=main, log=log, data=data, rows=rows,
             train_sharding=b_sh3, eval_sharding=b_sh2,
             train_step=training.train_step, eval_step=eval_step, monitor=monitor,
             monitor_x=to_global(mon_x, rep, mon_x.shape),
             sampler=make_sampler(graphdef, mcfg.block_size), sample_sharding=rep,
             schedule=lr_schedule(cfg),
             flops_per_token=fpt, peak=peak, peak_note=peak_note, ckpt=ckpt, metrics=metrics,
             bar=bar, start=start, sample_key=sample_key)
  return run, params, opt_state, state


def check_options(opts: RunOptions) -> None:
  """ValueError naming the flag of a bad option (a NaN time limit was ignored; a negative peak
  printed a negative MFU)."""
  if opts.time_limit is not None and not (math.isfinite(opts.time_limit) and opts.time_limit > 0):
    raise ValueError(f"--time-limit must be a positive number of seconds, got {opts.time_limit}")
  check_peak_tflops(opts.peak_tflops)


def _out_of_memory(cfg: TrainConfig, e: Exception) -> str:
  """One line for an XLA allocation failure: what was asked, what the device holds, what to
  change."""
  xla = str(e).strip().splitlines()[0].removeprefix("RESOURCE_EXHAUSTED: ").rstrip(".")
  asked = re.search(r"(\d{4,}) bytes", xla)
  if asked:
    xla += f" ({int(asked.group(1)) / 2 ** 30:.1f} GiB)"
  remat = "" if cfg.model.remat else ", or add --remat"
  return (f"out of memory at --block-size {cfg.model.block_size}, --batch-size {cfg.batch_size}: "
          f"{xla}; {_memory_available()}. Lower --block-size or --batch-size (raise --grad-accum "
          f"to keep the tokens per step){remat}")


def _memory_available() -> str:
  """What the first device holds, in words."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return f"the {device.device_kind} holds {stats['bytes_limit'] / 2 ** 30:.1f} GiB"
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  text = f"this host has {memory / 2 ** 30:.1f} GiB"
  limit = resource.getrlimit(resource.RLIMIT_AS)[0]
  if limit != resource.RLIM_INFINITY:
    text += f", of which this process may use {limit / 2 ** 30:.1f} GiB (ulimit -v)"
  return text


def _make_out_dir(out_dir: Path) -> None:
  """Creates --out-dir; ValueError in one line when it cannot be created or written to."""
  try:
    out_dir.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # a file in its path, no permission, a read-only file system
    raise ValueError(f"--out-dir {out_dir} cannot be created: {e.strerror or e}") from e
  if not os.access(out_dir, os.W_OK | os.X_OK):
    raise ValueError(f"--out-dir {out_dir} is not writable")


def _log_config(log: _Log, cfg: TrainConfig, opts: RunOptions) -> None:
  mcfg, backend = cfg.model, jax.default_backend()
  log(f"train: config {opts.config_name}: {mcfg.n_layer} layers, {mcfg.n_head} heads, width "
      f"{mcfg.n_embd}, context {mcfg.block_size}, vocab {mcfg.vocab_size}, bias {mcfg.bias}, "
      f"compute {mcfg.dtype}")
  log(f"train: {jax.process_count()} process(es), {jax.device_count()} device(s): "
      f"{jax.devices()[0].device_kind} ({backend}), jax {jax.__version__}; FSDP {cfg.fsdp}; "
      f"{_parallelism(cfg)}; "
      f"deterministic {opts.deterministic}; {jax_cache.describe()}")
  if opts.deterministic and backend != "gpu":
    here = "CPU XLA is deterministic already" if backend == "cpu" else f"not on {backend}"
    log(f"train: --deterministic applies to GPUs (XLA's deterministic reductions); {here}")
  documents = ("; documents masked at end-of-text tokens (--pack-documents)" if mcfg.pack_documents
               else "")
  log(f"train: attention {attn_lib.describe(mcfg)}{documents}")
  schedule, warning = describe_schedule(cfg)
  log(f"train: {cfg.tokens_per_step:,} tokens/step = {cfg.batch_size} seq x {cfg.grad_accum} "
      f"accum x {mcfg.block_size}; {cfg.max_steps} steps; {schedule}; AdamW b1 {cfg.b1} "
      f"b2 {cfg.b2} wd {cfg.weight_decay}; clip {cfg.grad_clip}")
  if warning:
    log(f"train: warning: {warning}")


def _parallelism(cfg: TrainConfig) -> str:
  n = cfg.context_parallel
  if n == 1:
    return "data parallel"
  heads = cfg.model.n_head   # GPT-2: as many key/value heads
  strategy = context.choose_strategy(cfg.context_strategy, heads, heads, n)
  chosen = f"auto -> {strategy}" if cfg.context_strategy == "auto" else strategy
  return (f"{jax.device_count() // n} data x {n} context parallel (each sequence over {n} devices, "
          f"zigzag order, {chosen})")


def _tensorboard_usable(log: _Log) -> bool:
  """Whether TensorBoard files can be written; where not (tensorboardX is optional for training),
  one line says so, before any expensive work, and the run goes on with metrics.jsonl alone."""
  missing = tensorboard_missing()
  if missing:
    log(f"tensorboard: {missing}; metrics go to metrics.jsonl only (--no-tensorboard silences "
        f"this)")
  return missing is None


def _resume(ckpt: Checkpointer, params, opt_state, cfg: TrainConfig, opts: RunOptions,
            out_dir: Path, log: _Log):
  """The arrays and bookkeeping of the newest checkpoint that reads back (newer, corrupt ones are
  set aside with a line each: Checkpointer.restore_latest), or else the fresh arrays given;
  returns (params, opt_state, state, start step, sample key)."""
  ckpt.remove_partial_saves(warn=log)
  if ckpt.latest_step() is None:
    return params, opt_state, RunState(), 0, jax.random.PRNGKey(cfg.seed)
  if not opts.resume:
    raise ValueError(f"{out_dir / 'checkpoints'} already holds checkpoints and --no-resume was "
                     f"given; choose another --out-dir or delete them")
  # The compatibility check runs before the arrays are read: Orbax would fail on another shape
  # with a far less clear error.
  start, params, opt_state, meta = ckpt.restore_latest(
      params, opt_state, check=lambda meta: _check_compatible(meta, cfg, out_dir), warn=log)
  log(f"train: resumed from {out_dir / 'checkpoints'} at step {start}")
  # Checkpoints written before the losses were kept lack them: the summary then has no first loss,
  # and the first record's loss_avg covers only the steps run here.
  state = RunState(completed=start, loss_ema=meta.get("loss_ema"), last_good=start,
                   first_loss=meta.get("first_loss"), last_loss=meta.get("last_loss"),
                   losses_since_record=list(meta.get("losses_since_record", [])))
  return params, opt_state, state, start, jnp.asarray(meta["sample_key"], jnp.uint32)


def _check_compatible(meta: dict, cfg: TrainConfig, out_dir: Path) -> None:
  saved = meta.get("config", {}).get("model", {})
  diff = {k: (saved.get(k), getattr(cfg.model, k)) for k in SHAPE_FIELDS
          if saved.get(k) != getattr(cfg.model, k)}
  if diff:
    raise ValueError(f"{out_dir / 'checkpoints'} holds a model of another shape {diff}; use "
                     f"another --out-dir")
  if meta.get("seed") != cfg.seed:
    raise ValueError(f"the checkpoint was trained with --seed {meta.get('seed')}, not {cfg.seed}; "
                     f"exact resume needs the same seed")


# ----------------------------------------------------------------- evaluation, metrics, checkpoints


def _evaluate_due(run: _Run, state: RunState, params, step: int, last: bool) -> dict:
  """Validation loss, monitors and a text sample where due before this step; their time is left out
  of the throughput. Returns the values for this step's metrics record."""
  cfg = run.cfg
  do_eval = _due(step, cfg.eval_every) or (last and cfg.eval_every > 0)
  do_monitor = _due(step, cfg.monitor_every) or (last and cfg.monitor_every > 0)
  do_sample = step > 0 and _due(step, cfg.sample_every) and cfg.sample_tokens > 0
  if not (do_eval or do_monitor or do_sample):
    return {}
  # Dispatch is asynchronous: finish the queued train steps first, so that their time counts as
  # training and only the evaluation itself is left out of tokens/s.
  jax.block_until_ready(params)
  t0 = time.perf_counter()
  extra = {}
  if do_eval:
    extra["val_loss"] = state.val_loss = run.evaluate(params)
  if do_monitor:
    extra.update(to_python(run.monitor(params, run.monitor_x)))
  if do_sample:
    _write_sample(run, step, run.sample(params, step))
  state.excluded += time.perf_counter() - t0
  return extra


def _flush(run: _Run, state: RunState) -> None:
  """Fetches the pending steps' metrics, checks every loss (raising TrainingStopped), writes the
  records due and restarts the throughput window."""
  if not state.pending:
    return
  cfg = run.cfg
  fetched = jax.device_get([m for _, m, _ in state.pending])
  now = time.perf_counter()
  tok_s = None
  if state.t_mark is not None and state.tokens:
    tok_s = state.tokens / max(1e-9, now - state.t_mark - state.excluded)
  for (s, _, extra), m in zip(state.pending, fetched):
    loss, gnorm = float(m["loss"]), float(m["grad_norm"])
    state.losses_since_record.append(loss)
    _check_loss(s, loss, gnorm, cfg, state, run.out_dir)
    if s == 0:
      state.first_loss = loss
    state.last_loss = loss
    if _due(s, cfg.log_every) or extra or s == cfg.max_steps - 1:
      _write_record(run, state, s, loss, float(np.mean(state.losses_since_record)), gnorm,
                    extra, tok_s)
      state.losses_since_record = []
  state.pending.clear()
  state.t_mark, state.tokens, state.excluded = time.perf_counter(), 0, 0.0


def _write_record(run: _Run, state: RunState, step: int, loss: float, loss_avg: float, gnorm: float,
                  extra: dict, tok_s: float | None) -> None:
  """One metrics.jsonl record (and TensorBoard scalars); the progress bar shows its gist."""
  rec = {"step": step, "loss": loss, "loss_avg": loss_avg, "grad_norm": gnorm,
         "lr": float(run.schedule(step)), "tokens": (step + 1) * run.cfg.tokens_per_step}
  post = {"loss": f"{loss:.3f}"}
  if tok_s is not None:
    rec["tokens_per_s"] = tok_s
    state.tokens_per_s.append(tok_s)
    post["tok/s"] = f"{tok_s:,.0f}"
    rec["mfu"] = mfu(tok_s, run.flops_per_token, run.peak, jax.device_count())
    if rec["mfu"] is not None:
      state.mfu.append(rec["mfu"])
      post["MFU"] = percent(rec["mfu"])
      warning = mfu_warning(rec["mfu"], run.peak_note)
      if warning and not state.mfu_warned:
        run.log(f"train: warning: MFU {percent(rec['mfu'])} at step {step} is {warning}")
        state.mfu_warned = True
  rec.update(extra)
  rec["time_s"] = time.time() - run.t_start
  run.metrics.write(rec)
  if "val_loss" in rec:
    post["val"] = f"{rec['val_loss']:.3f}"
  run.bar.set_postfix(post, refresh=False)


def _check_loss(step: int, loss: float, gnorm: float, cfg: TrainConfig, state: RunState,
                out_dir: Path) -> None:
  """TrainingStopped on a non-finite loss or grad norm, or a loss spike; else updates the loss
  EMA."""
  where = (f"the last good checkpoint (step {state.last_good}) is kept in {out_dir / 'checkpoints'}"
           if state.last_good is not None else "no checkpoint had been written yet")
  if not (math.isfinite(loss) and math.isfinite(gnorm)):
    raise TrainingStopped(f"train: STOPPED at step {step}: loss {loss}, grad norm {gnorm} (not "
                          f"finite); {where}", step, loss)
  ema = state.loss_ema
  # Warm-up losses fall too fast for a running mean to judge them.
  if (cfg.spike_factor and step >= max(100, cfg.warmup_steps) and ema is not None
      and loss > cfg.spike_factor * ema):
    raise TrainingStopped(f"train: STOPPED at step {step}: loss spike {loss:.3f} > "
                          f"{cfg.spike_factor} x running mean {ema:.3f} (disable with "
                          f"--spike-factor 0); {where}", step, loss)
  state.loss_ema = loss if ema is None else 0.95 * ema + 0.05 * loss


def _save(run: _Run, state: RunState, params, opt_state, step: int) -> None:
  """Checkpoint at `step` (completed steps). The pending losses are checked first, so that no
  checkpoint holds a NaN or a spike; the save itself is left out of the throughput."""
  _flush(run, state)
  t0 = time.perf_counter()
  cfg = run.cfg
  meta = {"data_step": step, "seed": cfg.seed,
          "sample_key": [int(v) for v in np.asarray(run.sample_key)], "loss_ema": state.loss_ema,
          "config": dataclasses.asdict(cfg), "config_name": run.opts.config_name,
          # What the outputs after a resume need: the run's first and latest losses for
          # summary.json, and the losses since the last record for the next record's loss_avg.
          "first_loss": state.first_loss, "last_loss": state.last_loss,
          "losses_since_record": state.losses_since_record}
  run.ckpt.save(step, params, opt_state, meta)
  run.log(f"checkpoint: step {step} -> {run.ckpt.directory / str(step)}")
  state.last_good = step
  state.excluded += time.perf_counter() - t0


def _save_interrupted(run: _Run, state: RunState, params, opt_state) -> None:
  """On Ctrl-C: checkpoint the completed steps (unless a loss among them is bad) and close the
  outputs."""
  run.bar.close()
  try:
    _flush(run, state)
    if state.completed > (state.last_good or 0):
      _save(run, state, params, opt_state, state.completed)
    run.log(f"train: interrupted; checkpoint at step {state.completed}; run the same command "
            f"again to resume")
  except TrainingStopped as e:
    run.log(str(e))
  run.close()


def _write_sample(run: _Run, step: int, text: str) -> None:
  if not run.main:
    return
  _append(run.out_dir / "samples.txt", f"===== step {step} =====\n{text}\n\n")
  run.log(f"sample at step {step}:\n{text}\n")


# --------------------------------------------------------------------- end of run


def _finish(run: _Run, state: RunState, params, stopped: str | None, timed_out: bool) -> dict:
  """The final sample, summary.json, the loss plot and the closing log lines (only a log line for a
  run started again after it finished and wrote its summary); re-raises a stop."""
  cfg, mcfg = run.cfg, run.cfg.model
  run.bar.close()
  summary = {
      "config": run.opts.config_name, "out_dir": str(run.out_dir),
      "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
      "attention": attn_lib.describe(mcfg),
      "start_step": run.start, "end_step": state.completed if stopped is None else None,
      "first_loss": state.first_loss, "last_loss": state.last_loss, "val_loss": state.val_loss,
      "tokens_per_s": float(np.median(state.tokens_per_s)) if state.tokens_per_s else None,
      "mfu": float(np.median(state.mfu)) if state.mfu else None, "mfu_peak": run.peak_note,
      "peak_tflops": run.peak,
      "wall_s": time.time() - run.t_start, "last_checkpoint": state.last_good, "stopped": stopped,
      "time_limit_reached": timed_out,
  }
  if run.start >= cfg.max_steps and (run.out_dir / "summary.json").exists():
    # Started again after it finished: summary.json, the plot and the samples stay those of the
    # run that did the work. (Without its summary.json, that run was cut off after its last
    # checkpoint, and this one writes what it can: the plot from metrics.jsonl and the sample.)
    if run.main:
      run.log(f"train: nothing to do: {run.out_dir / 'checkpoints'} is already at step "
              f"{run.start} >= --max-steps {cfg.max_steps}; summary.json left as it was")
    run.close()
    return summary
  # A run cut short by --time-limit leaves the final sample to the run that finishes the job.
  if stopped is None and not timed_out and cfg.sample_tokens > 0:
    text = run.sample(params, cfg.max_steps)  # on every process: all join the jitted sampler
    _write_sample(run, cfg.max_steps, text)
    if run.main:
      summary["sample"] = text
  if run.main:
    title = f"{run.opts.config_name}: {attn_lib.short_name(mcfg)}"
    plot = plot_loss(run.out_dir, title=title)
    summary["loss_plot"] = str(plot) if plot else None
    write_atomically(run.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    if summary["tokens_per_s"]:
      run.log(f"train: median {summary['tokens_per_s']:,.0f} tokens/s, "
              f"{_utilisation(summary['mfu'], run.peak_note)}")
    # None when the first step stopped the run (or a checkpoint from before they were kept).
    if stopped is None and state.first_loss is not None and state.last_loss is not None:
      run.log(f"train: done in {summary['wall_s']:.0f}s; loss {state.first_loss:.3f} -> "
              f"{state.last_loss:.3f}; outputs in {run.out_dir}")
  run.close()
  if stopped is not None:
    # The terminal gets it from the caller, once and last (the command line prints it).
    run.log(stopped, terminal=False)
    raise TrainingStopped(stopped)
  return summary


def _utilisation(fraction: float | None, peak_note: str) -> str:
  """The median MFU for the closing line, with where its peak came from; one above 100% says in
  the same words that the peak must be wrong."""
  if fraction is None:
    return f"no MFU ({peak_note})"
  return f"MFU {percent(fraction)} ({mfu_warning(fraction, peak_note) or peak_note})"
