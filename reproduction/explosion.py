"""The loss-explosion experiment: identical training runs that differ only in the attention arithmetic.

    python -m reproduction.explosion run --out out/explosion --lrs 1e-3,3e-3 --time-limit 1080
    python -m reproduction.explosion report --out out/explosion --figure docs/figures/explosion.png

`run` starts one `python -m train --config repro` process per (learning rate, arm), all with the same
seed and therefore the same initial weights and batch order, spread over the visible GPUs (several
per GPU when there are more runs than GPUs; one after another on a machine without GPUs). Every run
stops at the time limit with a checkpoint (`--time-limit`; the same command resumes it) or when its
loss becomes non-finite or spikes (the train loop's spike stop, which keeps the last good checkpoint).
With `--trunk ARM@STEP`, `run` first trains ARM alone to STEP (one trunk per learning rate, under
OUT/trunk, on the same schedule as the full runs) and starts every arm from the trunk's checkpoint at
STEP: same weights, optimizer state and batch position, so the arms differ only after STEP and the
steps before it are paid once. `--end-by` gives the arms a wall-clock deadline instead of a fixed
`--time-limit` (the trunk's length is not known in advance).
`report` reads the runs' metrics.jsonl and writes the figure (loss and the largest W_Q spectral norm
over layers, against steps, per arm) and a Markdown table of outcomes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

# The explosion experiment's arms; the first is the paper's failing arithmetic. An arm is any
# "NUMERICS/MAX_ADJUST": a numerics preset or a preset with rounding points moved
# ("paper+score=float32/safe", stable_attn.numerics.resolve) and a max_adjust mode.
ARMS = ("paper/off", "paper/paper", "paper/safe", "fast/off")


def arm_settings(arm: str) -> tuple[str, str]:
    """"NUMERICS/MAX_ADJUST" -> (numerics, max_adjust); ValueError naming the arm if either is unknown."""
    from stable_attn import MAX_ADJUST_MODES
    from stable_attn.numerics import resolve
    numerics, sep, max_adjust = arm.rpartition("/")
    if not sep or max_adjust not in MAX_ADJUST_MODES:
        raise ValueError(f"arm {arm!r}: expected NUMERICS/MAX_ADJUST with MAX_ADJUST one of "
                         f"{', '.join(MAX_ADJUST_MODES)}")
    try:
        resolve(numerics)
    except ValueError as e:
        raise ValueError(f"arm {arm!r}: {e}") from None
    return numerics, max_adjust


COLORS = {"paper/off": "tab:red", "paper/paper": "tab:blue", "paper/safe": "tab:green",
          "fast/off": "tab:orange", "fast/safe": "tab:olive",
          # FP8 attention (FlashAttention-3's arithmetic: docs/fp8.md, step 4)
          "fast+qkv=e4m3+p=e4m3+p_scale=256/off": "tab:purple",
          "fast+qkv=e4m3+p=e4m3+p_scale=256/safe": "tab:brown",
          # the "fp8" preset: each key block's top key in bf16 (docs/fp8.md, step 4)
          "fp8/off": "tab:pink", "fp8/safe": "tab:cyan",
          # the "fp8_fast" preset: FlashAttention-3's arithmetic, "safe"'s dither on O (docs/fp8.md)
          "fp8_fast/off": "tab:gray", "fp8_fast/safe": "black"}
_SPARE_COLORS = ("gold", "navy", "teal", "darkred", "lime", "magenta")


def arm_color(arm: str) -> str:
    """The arm's color in every figure: COLORS', else one of _SPARE_COLORS picked by the arm's name
    (the same in every figure and for every seed, unlike matplotlib's cycle)."""
    return COLORS.get(arm) or _SPARE_COLORS[zlib.crc32(arm.encode()) % len(_SPARE_COLORS)]
START_UP_S = 30.0  # a train process's seconds before its time limit starts counting, and after
BRANCH_FILE = "branch.json"  # in a run started from a trunk: {"trunk": its directory, "step": STEP}
EXIT_STOPPED = 3  # `python -m train` exit status when the loss went non-finite or spiked
SPIKE_FACTOR = 1.5  # a logged loss above this many times its running mean is a spike
RISING_FACTOR = 1.2  # a final loss this far above the run's lowest is reported as rising


@dataclasses.dataclass(frozen=True)
class Run:
    lr: float
    arm: str
    out_dir: Path
    gpu: str | None  # CUDA_VISIBLE_DEVICES for this run; None on a machine without GPUs

    @property
    def label(self) -> str:
        return f"lr {self.lr:g} {self.arm}"


def run_dir(out: Path, lr: float, arm: str) -> Path:
    return Path(out) / f"lr{lr:g}" / arm.replace("/", "-")


def plan(out: Path, lrs: list[float], arms: list[str], gpus: list[str]) -> list[Run]:
    """One run per (lr, arm), assigned round-robin to the GPUs."""
    for arm in arms:
        arm_settings(arm)
    if not lrs or any(not lr > 0 for lr in lrs):
        raise ValueError(f"lrs must be positive numbers, got {lrs}")
    runs = []
    for i, (lr, arm) in enumerate((lr, arm) for lr in lrs for arm in arms):
        runs.append(Run(lr, arm, run_dir(out, lr, arm), gpus[i % len(gpus)] if gpus else None))
    return runs


def train_command(run: Run, *, config: str, time_limit: float | None, extra: list[str]) -> list[str]:
    numerics, max_adjust = arm_settings(run.arm)
    cmd = [sys.executable, "-m", "train", "--config", config, "--numerics", numerics,
           "--max-adjust", max_adjust, "--lr", repr(run.lr), "--out-dir", str(run.out_dir),
           "--no-progress", "--no-tensorboard"]
    if time_limit is not None:
        cmd += ["--time-limit", repr(time_limit)]
    return cmd + list(extra)


def visible_gpus() -> list[str]:
    """GPU indices from CUDA_VISIBLE_DEVICES, else from `nvidia-smi -L`; [] without GPUs."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def last_record(out_dir: Path) -> dict | None:
    """The newest whole record of a run's metrics.jsonl (a line being written is left out)."""
    from train.metrics import read_metrics
    records = read_metrics(Path(out_dir))
    return records[-1] if records else None


def _progress_line(runs: list[Run], t0: float) -> str:
    cells = []
    for run in runs:
        rec = last_record(run.out_dir)
        if rec is None:
            cells.append(f"{run.label}: starting")
        elif rec.get("stopped"):
            cells.append(f"{run.label}: STOPPED at {rec['step']}")
        else:
            cells.append(f"{run.label}: step {rec['step']} loss {rec['loss']:.3f}")
    return f"[{time.time() - t0:6.0f}s] " + " | ".join(cells)


def launch(runs: list[Run], *, config: str, time_limit: float | None, extra: list[str],
           report_every: float = 60.0, end_by: float | None = None) -> dict[Run, int]:
    """Start the runs (all at once on GPUs, one by one without), wait, return their exit statuses.
    `end_by` (time.time() seconds) caps each run's time limit so that it has stopped by then."""
    per_gpu = {}
    for run in runs:
        per_gpu[run.gpu] = per_gpu.get(run.gpu, 0) + 1
    t0 = time.time()
    statuses: dict[Run, int] = {}
    waves = [runs] if runs and runs[0].gpu is not None else [[r] for r in runs]
    for wave in waves:
        procs = {}
        limit = time_limit
        if end_by is not None:
            # The train loop's clock starts after imports and data loading (START_UP_S), and its
            # last checkpoint takes a few seconds more.
            left = end_by - time.time() - START_UP_S
            if left <= 0:
                raise ValueError(f"--end-by leaves {left + START_UP_S:.0f}s at launch, less than the "
                                 f"{START_UP_S:g}s a run takes to start")
            limit = left if limit is None else min(limit, left)
        for run in wave:
            run.out_dir.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ)
            if run.gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = run.gpu
                # Several runs share a GPU: each takes its slice of memory up front.
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.85 / per_gpu[run.gpu]:.2f}"
            cmd = train_command(run, config=config, time_limit=limit, extra=extra)
            log = open(run.out_dir / "stdout.log", "a")
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            procs[run] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
            print(f"started {run.label} on GPU {run.gpu}: {run.out_dir}", flush=True)
        next_report = time.time() + report_every
        while any(p.poll() is None for p, _ in procs.values()):
            time.sleep(1.0)
            if time.time() >= next_report:
                print(_progress_line(runs, t0), flush=True)
                next_report += report_every
        for run, (proc, log) in procs.items():
            log.close()
            statuses[run] = proc.returncode
    print(_progress_line(runs, t0), flush=True)
    return statuses


def trunk_extra(config: str, extra: list[str], step: int) -> list[str]:
    """Train arguments that stop a trunk at `step` on the schedule of the full runs: --max-steps
    alone would also move the cosine's end, so --lr-decay-steps pins it where the arms have it."""
    from train.cli import build_config, build_parser
    cfg = build_config(build_parser().parse_args(["--config", config, *extra]))
    if step >= cfg.max_steps:
        raise ValueError(f"--trunk step {step} must be below the runs' max_steps {cfg.max_steps}")
    return [*extra, "--max-steps", str(step), "--lr-decay-steps", str(cfg.decay_steps)]


def branch(run: Run, trunk_dir: Path, step: int) -> bool:
    """Seed `run` with the trunk's checkpoint at `step` and its metrics before `step`, unless the run
    already has checkpoints of its own (then it resumes them). Returns whether it branched."""
    ckpts = run.out_dir / "checkpoints"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        return False
    source = trunk_dir / "checkpoints" / str(step)
    if not source.is_dir():
        raise ValueError(f"the trunk {trunk_dir} has no checkpoint at step {step}; see "
                         f"{trunk_dir / 'stdout.log'}")
    run.out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, ckpts / str(step))
    from train.metrics import read_metrics
    kept = [r for r in read_metrics(trunk_dir) if r.get("step", -1) < step]
    (run.out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    (run.out_dir / BRANCH_FILE).write_text(json.dumps({"trunk": str(trunk_dir), "step": step}))
    return True


def parse_trunk(text: str) -> tuple[str, int]:
    """"ARM@STEP" -> (arm, step) (argparse type)."""
    arm, sep, step = text.rpartition("@")
    if not sep or not step.isdigit() or int(step) <= 0:
        raise argparse.ArgumentTypeError(f"--trunk takes ARM@STEP with STEP a positive integer, got {text!r}")
    try:
        arm_settings(arm)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return arm, int(step)


def _failed(statuses: dict[Run, int]) -> list[Run]:
    failed = [r for r, s in statuses.items() if s not in (0, EXIT_STOPPED)]
    for r in failed:
        print(f"ERROR: {r.label} exited with status {statuses[r]}; see {r.out_dir / 'stdout.log'}",
              file=sys.stderr)
    return failed


# --------------------------------------------------------------------------------- report


def read_run(out_dir: Path) -> dict:
    """Steps/losses, monitor records and the outcome of one run directory."""
    from train.metrics import read_metrics
    records = read_metrics(Path(out_dir))
    train = [r for r in records if r.get("loss") is not None and "stopped" not in r
             and "loss_avg" in r]
    monitors = [r for r in records if "spec_wq" in r]
    stop = next((r for r in records if r.get("stopped")), None)
    summary_path = Path(out_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"steps": [r["step"] for r in train], "loss": [r["loss_avg"] for r in train],
            "monitor_steps": [r["step"] for r in monitors],
            "spec_wq": [r["spec_wq"] for r in monitors], "tie_frac": [r["tie_frac"] for r in monitors],
            "max_logit": [r["max_logit"] for r in monitors], "stop": stop, "summary": summary}


def first_spike(steps: list[int], losses: list[float], *, after: int = 500) -> int | None:
    """First step (from `after` on) whose loss exceeds SPIKE_FACTOR x the running mean (EMA 0.9 over
    the logged losses, as the train loop's spike stop but over records); None if there is none."""
    ema = None
    for step, loss in zip(steps, losses):
        if ema is not None and step >= after and loss > SPIKE_FACTOR * ema:
            return step
        ema = loss if ema is None else 0.9 * ema + 0.1 * loss
    return None


def sustained_rise(steps: list[int], losses: list[float]) -> int | None:
    """First step from which every later logged loss stays above SPIKE_FACTOR x the lowest loss
    before it (a slow divergence, which no single spike reveals); None if there is none."""
    low, lows = float("inf"), []
    for loss in losses:
        lows.append(low)
        low = min(low, loss)
    tail_min = float("inf")
    first = None
    for i in range(len(losses) - 1, -1, -1):
        tail_min = min(tail_min, losses[i])
        if tail_min > SPIKE_FACTOR * lows[i]:
            first = steps[i]
    return first


def first_instability(run: dict) -> int | None:
    """The earliest step at which `run` (from read_run) diverged, rose for good or spiked; None if never."""
    candidates = [sustained_rise(run["steps"], run["loss"]), first_spike(run["steps"], run["loss"]),
                  run["stop"]["step"] if run["stop"] is not None else None]
    found = [step for step in candidates if step is not None]
    return min(found) if found else None


def outcome(run: dict) -> str:
    """"diverged" (non-finite loss, or a sustained rise), "loss spike ... (recovered / did not
    recover)" or "stable"."""
    if run["stop"] is not None:
        return f"diverged at step {run['stop']['step']} (non-finite loss)"
    if not run["steps"]:
        return "no steps recorded"
    rise = sustained_rise(run["steps"], run["loss"])
    if rise is not None:
        low = min(run["loss"])
        return (f"diverged: loss above {SPIKE_FACTOR:g}x its minimum {low:.2f} from step {rise} on, "
                f"{run['loss'][-1]:.2f} at step {run['steps'][-1]}")
    spike = first_spike(run["steps"], run["loss"])
    if spike is None:
        low = min(run["loss"])
        if run["loss"][-1] > RISING_FACTOR * low:
            at = run["steps"][run["loss"].index(low)]
            return (f"rising: lowest loss {low:.2f} at step {at}, {run['loss'][-1]:.2f} at step "
                    f"{run['steps'][-1]}")
        return f"stable to step {run['steps'][-1]}"
    before = min(loss for step, loss in zip(run["steps"], run["loss"]) if step < spike)
    recovered = run["loss"][-1] < SPIKE_FACTOR * before
    return (f"loss spike at step {spike}, {'recovered' if recovered else 'did not recover'} by step "
            f"{run['steps'][-1]}")


def table(out: Path, lrs: list[float], arms: list[str]) -> str:
    lines = ["| lr | arm (numerics/max_adjust) | outcome | final loss | max W_Q norm: first -> last "
             "(layer) | tie rate, mean over layers: first -> last |",
             "|---|---|---|---|---|---|"]
    for lr in lrs:
        for arm in arms:
            r = read_run(run_dir(out, lr, arm))
            final = f"{r['loss'][-1]:.3f}" if r["loss"] else "-"
            if r["spec_wq"]:
                first, last = r["spec_wq"][0], r["spec_wq"][-1]
                layer = max(range(len(last)), key=last.__getitem__)
                norm = f"{max(first):.1f} -> {max(last):.1f} (layer {layer + 1})"
                ties = (f"{sum(r['tie_frac'][0]) / len(first):.3f} -> "
                        f"{sum(r['tie_frac'][-1]) / len(last):.3f}")
            else:
                norm = ties = "-"
            lines.append(f"| {lr:g} | {arm} | {outcome(r)} | {final} | {norm} | {ties} |")
    return "\n".join(lines) + "\n"


def figure(out: Path, lrs: list[float], arms: list[str], path: Path) -> Path:
    """Rows: training loss, largest W_Q spectral norm over layers; one column per learning rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(lrs), figsize=(5.5 * len(lrs), 7), squeeze=False, sharex="col")
    for col, lr in enumerate(lrs):
        ax_loss, ax_norm = axes[0, col], axes[1, col]
        for arm in arms:
            r = read_run(run_dir(out, lr, arm))
            color = arm_color(arm)
            ax_loss.plot(r["steps"], r["loss"], color=color, lw=1, label=f"{arm}: {outcome(r)}")
            ax_norm.plot(r["monitor_steps"], [max(v) for v in r["spec_wq"]], color=color, lw=1.2)
            if r["stop"] is not None and r["steps"]:
                ax_loss.plot(r["steps"][-1], r["loss"][-1], "x", color=color, ms=10, mew=2)
        ax_loss.set_title(f"peak lr {lr:g}")
        label_axes(ax_loss, ax_norm, "largest W_Q spectral norm over layers", legend_loc="lower left")
    fig.suptitle("GPT-2 124M (no biases), bf16, 32x1024 tokens/step: arms differ only in attention "
                 "numerics / max_adjust", fontsize=10)
    return save_figure(fig, path)


def label_axes(ax_loss, ax_norm, norm_label: str, *, legend_loc: str) -> None:
    """The loss panel above the W_Q-norm panel, as every reproduction figure draws them."""
    ax_loss.set_ylabel("training loss (mean of 10 steps)")
    ax_loss.legend(fontsize=6.5, loc=legend_loc)
    ax_norm.set_ylabel(norm_label)
    ax_norm.set_xlabel("step")
    for ax in (ax_loss, ax_norm):
        ax.grid(alpha=0.3)


def save_figure(fig, path: Path, *, bottom: float = 0.0) -> Path:
    """Lay out (leaving the figure's lowest `bottom` fraction to a legend), write (creating the
    directory) and close a matplotlib figure."""
    import matplotlib.pyplot as plt
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------- CLI


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def parse_arms(text: str) -> list[str]:
    """"a/b,c/d" -> the arms, each checked by arm_settings (argparse type)."""
    arms = [a for a in text.split(",") if a]
    try:
        for arm in arms:
            arm_settings(arm)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return arms


def _run_trunks(out: Path, args, runs: list[Run], gpus: list[str], extra: list[str]) -> bool:
    """Train the trunks that have no checkpoint at the branch step yet, then branch every run;
    returns True when a trunk failed (nothing is branched then)."""
    arm, step = args.trunk
    trunks = {t.lr: t for t in plan(out / "trunk", args.lrs, [arm], gpus)}
    todo = [t for t in trunks.values() if not (t.out_dir / "checkpoints" / str(step)).is_dir()]
    if todo:
        print(f"trunk: {arm} to step {step} for lr {', '.join(f'{t.lr:g}' for t in todo)}", flush=True)
        statuses = launch(todo, config=args.config, time_limit=None, report_every=args.report_every,
                          extra=trunk_extra(args.config, extra, step))
        if _failed(statuses):
            return True
    for run in runs:
        if branch(run, trunks[run.lr].out_dir, step):
            print(f"{run.label}: branched from {trunks[run.lr].out_dir} at step {step}", flush=True)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproduction.explosion", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "report"):
        p = sub.add_parser(name)
        p.add_argument("--out", default="out/explosion", help="one sub-directory per run")
        p.add_argument("--lrs", type=_floats, default=[1e-3, 3e-3], help="peak learning rates")
        p.add_argument("--arms", type=parse_arms, default=list(ARMS),
                       help=f"comma list of NUMERICS/MAX_ADJUST (default {','.join(ARMS)})")
        p.add_argument("--figure", help="write the figure here (default OUT/explosion.png)")
        p.add_argument("--table", help="write the Markdown table here (default OUT/explosion.md)")
    run_p = sub.choices["run"]
    run_p.add_argument("--config", default="repro", help="train config of every run")
    run_p.add_argument("--time-limit", type=float, help="seconds per run (then checkpoint; rerun resumes)")
    run_p.add_argument("--gpus", help="comma list of GPU indices (default: all visible; none = CPU)")
    run_p.add_argument("--report-every", type=float, default=60.0, help="seconds between progress lines")
    run_p.add_argument("--trunk", type=parse_trunk, metavar="ARM@STEP",
                       help="train ARM alone to STEP first, then start every arm from its checkpoint there")
    run_p.add_argument("--end-by", type=float, metavar="EPOCH_SECONDS",
                       help="wall-clock time (seconds since the epoch) by which the arms have stopped, "
                            "each with a checkpoint")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    out = Path(args.out)
    status = 0
    if args.command == "run":
        gpus = visible_gpus() if args.gpus is None else [g for g in args.gpus.split(",") if g]
        try:
            runs = plan(out, args.lrs, args.arms, gpus)
        except ValueError as e:
            parser.error(str(e))
        try:
            if args.trunk is not None and _run_trunks(out, args, runs, gpus, extra):
                return 1
            statuses = launch(runs, config=args.config, time_limit=args.time_limit, extra=extra,
                              report_every=args.report_every, end_by=args.end_by)
        except ValueError as e:
            print(f"ERROR: {e}", file=sys.stderr)
            return 1
        status = 1 if _failed(statuses) else 0
    text = table(out, args.lrs, args.arms)
    table_path = Path(args.table or out / "explosion.md")
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(text)
    fig = figure(out, args.lrs, args.arms, Path(args.figure or out / "explosion.png"))
    print(text + f"\nfigure: {fig}\ntable: {table_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
