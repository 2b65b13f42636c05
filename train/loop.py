"""The training loop: set-up, steps, evaluation, monitors, checkpoints, logging, the end-of-run outputs."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from train import attention as attn_lib
from train import data as data_lib
from train.checkpoint import Checkpointer
from train.config import TrainConfig
from train.metrics import MetricsLogger, peak_tflops, plot_loss, to_python
from train.model import GPT, count_params, flops_per_token
from train.monitors import make_monitor_fn
from train.optim import lr_schedule, make_optimizer
from train.sample import generate_text, make_sampler
from train.sharding import batch_sharding, host_rows, make_mesh, param_shardings, replicated, to_global
from train.step import make_eval_step, make_train_step

MONITOR_ROWS = 4  # sequences of the first validation batch that the attention monitors look at
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")


class TrainingStopped(RuntimeError):
    """Raised when the loss became NaN/Inf or spiked; the last good checkpoint is kept."""

    def __init__(self, message: str, step: int | None = None, loss: float | None = None):
        super().__init__(message)
        self.step, self.loss = step, loss


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


class _Log:
    """Messages to the terminal (above the progress bar) and to DIR/train.log, from process 0 only."""

    def __init__(self, out_dir: Path, enabled: bool):
        self.path, self.enabled = out_dir / "train.log", enabled

    def __call__(self, msg: str) -> None:
        if not self.enabled:
            return
        tqdm.write(msg)
        with open(self.path, "a") as f:
            f.write(msg + "\n")


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def abstract_model(cfg):
    """The model with abstract (shape-only) parameters."""
    return nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))


def init_params(cfg: TrainConfig, shardings=None):
    """Float32 parameters (an nnx.State), created directly on their shardings by a jitted init."""
    def init():
        return nnx.split(GPT(cfg.model, rngs=nnx.Rngs(cfg.seed)), nnx.Param)[1]
    return jax.jit(init, out_shardings=shardings)()


def train(cfg: TrainConfig, opts: RunOptions) -> dict:
    """Run (or resume) training as configured; returns a summary dict (also written to DIR/summary.json)."""
    with attn_lib.batch_sharded(make_mesh()):
        return _train(cfg, opts)


def _train(cfg: TrainConfig, opts: RunOptions) -> dict:
    out_dir = Path(opts.out_dir)
    main = jax.process_index() == 0
    out_dir.mkdir(parents=True, exist_ok=True)
    log = _Log(out_dir, main)
    mcfg = cfg.model
    n_dev = jax.device_count()
    if cfg.batch_size % n_dev:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the {n_dev} devices")
    if jax.default_backend() == "cpu":
        # CPU XLA cannot reuse donated buffers; the warning says nothing useful there.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

    log(f"train: config {opts.config_name}: {mcfg.n_layer} layers, {mcfg.n_head} heads, width {mcfg.n_embd}, "
        f"context {mcfg.block_size}, vocab {mcfg.vocab_size}, bias {mcfg.bias}, compute {mcfg.dtype}")
    log(f"train: {jax.process_count()} process(es), {n_dev} device(s): {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), jax {jax.__version__}; FSDP {cfg.fsdp}")
    log(f"train: attention {attn_lib.describe(mcfg.attention, mcfg.max_adjust, mcfg.numerics)}")
    log(f"train: {cfg.tokens_per_step:,} tokens/step = {cfg.batch_size} seq x {cfg.grad_accum} accum x "
        f"{mcfg.block_size}; {cfg.max_steps} steps; lr {cfg.lr:g} (warm-up {cfg.warmup_steps}, cosine to "
        f"{cfg.min_lr:g} at {cfg.decay_steps}); AdamW b1 {cfg.b1} b2 {cfg.b2} wd {cfg.weight_decay}; "
        f"clip {cfg.grad_clip}")

    data = data_lib.load_data(opts.data, corpus=cfg.corpus, progress=opts.progress and main, log=log)
    data.check(mcfg.block_size, mcfg.vocab_size)
    log(f"data: {data.source}: {data.train.size:,} train / {data.val.size:,} val tokens")

    # ----------------------------------------------------------------- state on the mesh
    mesh = make_mesh()
    graphdef, abstract_params = nnx.split(abstract_model(mcfg), nnx.Param)
    p_sh = param_shardings(abstract_params, mesh, cfg.fsdp)
    params = init_params(cfg, p_sh)
    tx = make_optimizer(cfg)
    abstract_opt = jax.eval_shape(tx.init, params)
    o_sh = _opt_shardings(tx, abstract_opt, p_sh, mesh)
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
    rep = replicated(mesh)
    b_sh3, b_sh2 = batch_sharding(mesh, 3, 1), batch_sharding(mesh, 2, 0)
    n_params = count_params(params)
    fpt = flops_per_token(mcfg, count_params(params, exclude_positions=True))
    peak, peak_note = peak_tflops(opts.peak_tflops)
    log(f"train: {n_params / 1e6:.2f}M parameters; {fpt / 1e6:.1f} MFLOP/token; MFU peak: {peak_note}")

    train_step = jax.jit(make_train_step(graphdef, tx), in_shardings=(p_sh, o_sh, b_sh3, b_sh3),
                         out_shardings=(p_sh, o_sh, rep), donate_argnums=(0, 1))
    eval_step = jax.jit(make_eval_step(graphdef), in_shardings=(p_sh, b_sh2, b_sh2), out_shardings=rep)
    monitor = jax.jit(make_monitor_fn(graphdef, mcfg), out_shardings=rep)
    sampler = make_sampler(graphdef, mcfg.block_size)
    schedule = lr_schedule(cfg)
    rows = host_rows(cfg.batch_size)

    def batch(step):
        x, y = data_lib.train_batch(data, step, seed=cfg.seed, batch_size=cfg.batch_size,
                                    grad_accum=cfg.grad_accum, block_size=mcfg.block_size, rows=rows)
        shape = (cfg.grad_accum, cfg.batch_size, mcfg.block_size)
        return to_global(x, b_sh3, shape), to_global(y, b_sh3, shape)

    def evaluate(params):
        total = 0.0
        for i in range(cfg.eval_batches):
            x, y = data_lib.val_batch(data, i, seed=cfg.seed, batch_size=cfg.batch_size,
                                      block_size=mcfg.block_size, rows=rows)
            shape = (cfg.batch_size, mcfg.block_size)
            total += float(eval_step(params, to_global(x, b_sh2, shape), to_global(y, b_sh2, shape)))
        return total / cfg.eval_batches

    n_mon = min(MONITOR_ROWS, cfg.batch_size)
    mon_x = data_lib.val_batch(data, 0, seed=cfg.seed, batch_size=cfg.batch_size, block_size=mcfg.block_size)[0][:n_mon]
    mon_x = to_global(mon_x, rep, mon_x.shape)

    # ----------------------------------------------------------------- resume
    ckpt = Checkpointer(out_dir / "checkpoints", keep=cfg.keep_checkpoints)
    metrics = MetricsLogger(out_dir, enabled=main, tensorboard=opts.tensorboard)
    sample_key = jax.random.PRNGKey(cfg.seed)
    start = 0
    resumed_ema = None
    latest = ckpt.latest_step() if opts.resume else None
    if latest is not None:
        params, opt_state, meta = ckpt.restore(latest, params, opt_state)
        _check_compatible(meta, cfg, out_dir)
        sample_key = jnp.asarray(meta["sample_key"], jnp.uint32)
        start = int(meta["data_step"])
        resumed_ema = meta.get("loss_ema")
        log(f"train: resumed from {out_dir / 'checkpoints'} at step {start}")
    elif not opts.resume and ckpt.latest_step() is not None:
        raise ValueError(f"{out_dir / 'checkpoints'} already holds checkpoints and --no-resume was given; "
                         f"choose another --out-dir or delete them")
    metrics.truncate_after(start)

    def save(step):
        meta = {"data_step": step, "seed": cfg.seed, "sample_key": [int(v) for v in np.asarray(sample_key)],
                "loss_ema": state["ema"], "config": dataclasses.asdict(cfg), "config_name": opts.config_name}
        ckpt.save(step, params, opt_state, meta)
        log(f"checkpoint: step {step} -> {ckpt.directory / str(step)}")

    # ----------------------------------------------------------------- the loop
    bar = tqdm(total=cfg.max_steps, initial=start, disable=not (main and opts.progress), desc=opts.config_name,
               dynamic_ncols=True, unit="step")
    pending: list[tuple[int, dict, dict]] = []
    state = {"ema": resumed_ema, "last_good": latest, "t_mark": None, "tokens": 0, "excluded": 0.0,
             "first_loss": None, "last_loss": None, "val_loss": None, "tok_s": [], "mfu": []}
    t_start = time.time()
    stopped = None
    step = completed = start
    if opts.time_limit is not None and opts.time_limit <= 0:
        raise ValueError(f"time_limit must be positive, got {opts.time_limit}")
    deadline = None if opts.time_limit is None else t_start + opts.time_limit
    timed_out = False

    def flush():
        """Fetch pending step metrics, check them, write the records due; raises TrainingStopped."""
        fetched = jax.device_get([m for _, m, _ in pending])
        now = time.perf_counter()
        losses = []
        for (s, _, extra), m in zip(pending, fetched):
            loss, gnorm = float(m["loss"]), float(m["grad_norm"])
            losses.append(loss)
            _check_loss(s, loss, gnorm, cfg, state, state["last_good"], out_dir)
            if state["first_loss"] is None:
                state["first_loss"] = loss
            state["last_loss"] = loss
            if not (_due(s, cfg.log_every) or extra or s == cfg.max_steps - 1):
                continue
            rec = {"step": s, "loss": loss, "loss_avg": float(np.mean(losses)), "grad_norm": gnorm,
                   "lr": float(schedule(s)), "tokens": (s + 1) * cfg.tokens_per_step}
            if state["t_mark"] is not None and state["tokens"]:
                tok_s = state["tokens"] / max(1e-9, now - state["t_mark"] - state["excluded"])
                rec["tokens_per_s"] = tok_s
                rec["mfu"] = tok_s * fpt / (peak * 1e12 * n_dev)
                state["tok_s"].append(tok_s)
                state["mfu"].append(rec["mfu"])
            rec.update(extra)
            rec["time_s"] = time.time() - t_start
            metrics.write(rec)
            post = {"loss": f"{loss:.3f}"}
            if "tokens_per_s" in rec:
                post.update({"tok/s": f"{rec['tokens_per_s']:,.0f}", "MFU": f"{100 * rec['mfu']:.1f}%"})
            if "val_loss" in rec:
                post["val"] = f"{rec['val_loss']:.3f}"
            bar.set_postfix(post, refresh=False)
            losses = []
        pending.clear()
        state["t_mark"], state["tokens"], state["excluded"] = time.perf_counter(), 0, 0.0

    try:
        for step in range(start, cfg.max_steps):
            last = step == cfg.max_steps - 1
            extra = {}
            do_eval = _due(step, cfg.eval_every) or (last and cfg.eval_every > 0)
            do_monitor = _due(step, cfg.monitor_every) or (last and cfg.monitor_every > 0)
            do_sample = step > 0 and _due(step, cfg.sample_every) and cfg.sample_tokens > 0
            if do_eval or do_monitor or do_sample:
                # Dispatch is asynchronous: finish the queued train steps first, so that their time
                # counts as training and only the evaluation itself is left out of tokens/s.
                jax.block_until_ready(params)
            t0 = time.perf_counter()
            if do_eval:
                extra["val_loss"] = state["val_loss"] = evaluate(params)
            if do_monitor:
                extra.update(to_python(monitor(params, mon_x)))
            if do_sample:
                _write_sample(out_dir, step, generate_text(sampler, params, mcfg.block_size,
                              jax.random.fold_in(sample_key, step), prompt=opts.prompt,
                              max_new_tokens=cfg.sample_tokens), main, log)
            state["excluded"] += time.perf_counter() - t0
            x, y = batch(step)
            params, opt_state, m = train_step(params, opt_state, x, y)
            completed = step + 1
            pending.append((step, m, extra))
            state["tokens"] += cfg.tokens_per_step if step > start else 0
            bar.update(1)
            done = step + 1
            # The first flush comes right after the first step (compilation), so throughput is only
            # measured from then on.
            if step == start or _due(step, cfg.log_every) or extra or last or _due(done, cfg.ckpt_every):
                flush()
            timed_out = deadline is not None and time.time() > deadline and not last
            if timed_out and pending:
                flush()
            if _due(done, cfg.ckpt_every) or last or timed_out:
                t0 = time.perf_counter()
                save(done)
                state["last_good"] = done
                state["excluded"] += time.perf_counter() - t0
            if timed_out:
                log(f"train: time limit of {opts.time_limit:g}s reached after step {step}; checkpoint at "
                    f"step {done}; run the same command again to resume")
                break
    except TrainingStopped as e:
        stopped = str(e)
        loss = e.loss if e.loss is not None and math.isfinite(e.loss) else None
        metrics.write({"step": e.step, "loss": loss, "stopped": stopped})
    except KeyboardInterrupt:
        bar.close()
        try:
            flush()
            done = completed
            if done > (state["last_good"] or 0):
                save(done)
            log(f"train: interrupted; checkpoint at step {done}; run the same command again to resume")
        except TrainingStopped as e:
            log(str(e))
        ckpt.close()
        metrics.close()
        raise
    bar.close()

    # ----------------------------------------------------------------- end of run
    summary = {
        "config": opts.config_name, "out_dir": str(out_dir), "device": jax.devices()[0].device_kind,
        "devices": n_dev, "attention": attn_lib.describe(mcfg.attention, mcfg.max_adjust, mcfg.numerics),
        "start_step": start, "end_step": completed if stopped is None else None,
        "first_loss": state["first_loss"], "last_loss": state["last_loss"], "val_loss": state["val_loss"],
        "tokens_per_s": float(np.median(state["tok_s"])) if state["tok_s"] else None,
        "mfu": float(np.median(state["mfu"])) if state["mfu"] else None, "mfu_peak": peak_note,
        "wall_s": time.time() - t_start, "last_checkpoint": state["last_good"], "stopped": stopped,
        "time_limit_reached": timed_out,
    }
    if timed_out:
        pass  # a later run finishes the job; the final sample belongs to that one
    elif stopped is None and main and cfg.sample_tokens > 0:
        text = generate_text(sampler, params, mcfg.block_size, jax.random.fold_in(sample_key, cfg.max_steps),
                             prompt=opts.prompt, max_new_tokens=cfg.sample_tokens)
        _write_sample(out_dir, cfg.max_steps, text, main, log)
        summary["sample"] = text
    elif stopped is None and cfg.sample_tokens > 0:
        generate_text(sampler, params, mcfg.block_size, jax.random.fold_in(sample_key, cfg.max_steps),
                      prompt=opts.prompt, max_new_tokens=cfg.sample_tokens)  # every process joins the jit
    if main:
        plot = plot_loss(out_dir, title=f"{opts.config_name}: {attn_lib.short_name(mcfg.attention, mcfg.max_adjust, mcfg.numerics)}")
        summary["loss_plot"] = str(plot) if plot else None
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if summary["tokens_per_s"]:
            log(f"train: median {summary['tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['mfu']:.1f}% "
                f"({peak_note})")
        if state["first_loss"] is None:
            log(f"train: nothing to do: {out_dir / 'checkpoints'} is already at step {start} >= --max-steps "
                f"{cfg.max_steps}")
        else:
            log(f"train: done in {summary['wall_s']:.0f}s; loss {state['first_loss']:.3f} -> "
                f"{state['last_loss']:.3f}; outputs in {out_dir}")
    ckpt.close()
    metrics.close()
    if stopped is not None:
        log(stopped)
        raise TrainingStopped(stopped)
    return summary


# --------------------------------------------------------------------- helpers


def _opt_shardings(tx, abstract_opt, p_sh, mesh):
    """Optimizer-state shardings: moments follow their parameters, scalars (counts) are replicated."""
    import optax
    rep = replicated(mesh)
    return optax.tree_map_params(tx, lambda _, s: s, abstract_opt, p_sh,
                                 transform_non_params=lambda _: rep,
                                 is_leaf=lambda x: isinstance(x, nnx.Variable))


def _check_loss(step, loss, gnorm, cfg, state, last_good, out_dir):
    where = (f"the last good checkpoint (step {last_good}) is kept in {out_dir / 'checkpoints'}"
             if last_good is not None else "no checkpoint had been written yet")
    if not (math.isfinite(loss) and math.isfinite(gnorm)):
        raise TrainingStopped(f"train: STOPPED at step {step}: loss {loss}, grad norm {gnorm} (not finite); {where}",
                              step, loss)
    if cfg.spike_factor and step >= max(100, cfg.warmup_steps):
        ema = state["ema"]
        if ema is not None and loss > cfg.spike_factor * ema:
            raise TrainingStopped(f"train: STOPPED at step {step}: loss spike {loss:.3f} > {cfg.spike_factor} x "
                                  f"running mean {ema:.3f} (disable with --spike-factor 0); {where}", step, loss)
    state["ema"] = loss if state["ema"] is None else 0.95 * state["ema"] + 0.05 * loss


def _check_compatible(meta: dict, cfg: TrainConfig, out_dir: Path) -> None:
    saved = meta.get("config", {}).get("model", {})
    diff = {k: (saved.get(k), getattr(cfg.model, k)) for k in SHAPE_FIELDS if saved.get(k) != getattr(cfg.model, k)}
    if diff:
        raise ValueError(f"{out_dir / 'checkpoints'} holds a model of another shape {diff}; use another --out-dir")
    if meta.get("seed") != cfg.seed:
        raise ValueError(f"the checkpoint was trained with --seed {meta.get('seed')}, not {cfg.seed}; exact "
                         f"resume needs the same seed")


def _write_sample(out_dir: Path, step: int, text: str, main: bool, log) -> None:
    if not main:
        return
    with open(out_dir / "samples.txt", "a") as f:
        f.write(f"===== step {step} =====\n{text}\n\n")
    log(f"sample at step {step}:\n{text}\n")
