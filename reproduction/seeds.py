"""Do the explosion arms separate for every seed? Loss per arm and seed, and a table of outcomes.

    python -m reproduction.seeds --lr 3e-3 --arms paper/off,paper/safe,fast/off \
        --runs 0=docs/results/reproduction/explosion,1=docs/results/reproduction/seeds/seed1,2=docs/results/reproduction/seeds/seed2 \
        --figure docs/figures/seeds.png

Each --runs entry is SEED=DIR, DIR an `explosion run --out` directory whose runs were trained with
`--seed SEED` (different initial weights and batch order; `python -m train` refuses to resume a
checkpoint of another seed); a seed may be named with several directories, each arm read from the
first that has it. Prints a Markdown table (per arm and seed: outcome, loss at the
milestones, the loss minus the --baseline arm's of the same seed at --compare-step, the lowest loss
up to --compare-step, and the largest attention logit and W_Q spectral norm over layers at
--monitor-step, each with its 1-based layer: the growing layer differs between seeds) and, with
--figure, writes the figure (loss over the whole runs, loss from step 1000 to --compare-step scaled
to the runs within SPIKE_FACTOR (1.5) x the lowest loss there, and the largest logit over layers:
one color per arm, one line style per seed, the legend below). "stable" in the outcome column is
explosion.outcome's: no sustained rise past 1.5x the lowest loss, no spike, no non-finite loss.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from reproduction.ablation import at
from reproduction.explosion import (SPIKE_FACTOR, arm_color, outcome, parse_arms, read_run, run_dir,
                                    save_figure)

# The seed 1 and 2 runs stop at step 2499 (--max-steps 2500): their last logged loss is at 2490 and
# their last periodic monitor at 2450; seed 0 ran on to ~5,800.
MILESTONES = (1000, 2000, 2490, 4000, 5000)
COMPARE_STEP, MONITOR_STEP = 2490, 2450
STYLES = ("-", "--", ":", "-.")


def parse_runs(text: str) -> list[tuple[int, Path]]:
    """"0=dir,1=dir,0=dir2" -> [(seed, directory)] (argparse type); a seed may name several
    directories (arms of one seed trained in different sessions)."""
    runs = []
    for item in text.split(","):
        seed, sep, path = item.partition("=")
        if not sep or not seed.strip().isdigit() or not path:
            raise argparse.ArgumentTypeError(f"--runs takes SEED=DIR[,SEED=DIR...], got {item!r}")
        runs.append((int(seed), Path(path)))
    return runs


def load(runs: list[tuple[int, Path]], lr: float, arms: list[str]) -> dict[tuple[str, int], dict]:
    """(arm, seed) -> read_run of that run, from the first of the seed's directories that has it;
    runs with no metrics are left out."""
    out = {}
    for seed, root in runs:
        for arm in arms:
            r = read_run(run_dir(root, lr, arm))
            if r["steps"] and (arm, seed) not in out:
                out[(arm, seed)] = r
    return out


def largest(values: list[float]) -> tuple[float, int]:
    """(largest value, its 1-based layer) of one per-layer monitor record."""
    return max((v, layer) for layer, v in enumerate(values, 1))


def table(results: dict[tuple[str, int], dict], milestones=MILESTONES, *, baseline: str = "fast/off",
          compare_step: int = COMPARE_STEP, monitor_step: int = MONITOR_STEP) -> str:
    head = " | ".join(f"loss at {s}" for s in milestones)
    lines = [f"| arm | seed | outcome | {head} | minus {baseline} at {compare_step} "
             f"| lowest loss to {compare_step} (step) "
             f"| largest logit (layer) at {monitor_step} | largest W_Q norm (layer) at {monitor_step} |",
             "|---|---|---|" + "---|" * len(milestones) + "---|---|---|---|"]
    for (arm, seed), r in sorted(results.items()):
        cells = []
        for s in milestones:
            loss = at(r["steps"], r["loss"], s)
            cells.append("-" if loss is None else f"{loss:.2f}")
        base = results.get((baseline, seed))
        mine = at(r["steps"], r["loss"], compare_step)
        theirs = None if base is None else at(base["steps"], base["loss"], compare_step)
        gap = "-" if mine is None or theirs is None else f"{mine - theirs:+.2f}"
        growth = []
        for key, fmt in (("max_logit", ",.0f"), ("spec_wq", ".1f")):
            record = at(r["monitor_steps"], r[key], monitor_step)
            if record is None:
                growth.append("-")
                continue
            value, layer = largest(record)
            growth.append(f"{value:{fmt}} ({layer})")
        low, low_at = min((loss, step) for step, loss in zip(r["steps"], r["loss"]) if step <= compare_step)
        lines.append(f"| {arm} | {seed} | {outcome(r)} | " + " | ".join(cells)
                     + f" | {gap} | {low:.2f} ({low_at}) | {' | '.join(growth)} |")
    return "\n".join(lines) + "\n"


def figure(results: dict[tuple[str, int], dict], lr: float, path: Path, *,
           zoom: tuple[int, int] = (1000, COMPARE_STEP)) -> Path:
    """Loss over the whole runs, loss over `zoom` (where the short seeds separate) and the largest
    logit over layers (log scale): one color per arm, one line style per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({seed for _, seed in results})
    fig, (full, near, logit) = plt.subplots(1, 3, figsize=(15, 5))
    zoomed = {}
    for (arm, seed), r in sorted(results.items()):
        style = dict(ls=STYLES[seeds.index(seed) % len(STYLES)], lw=1, color=arm_color(arm),
                     label=f"{arm}, seed {seed}")
        full.plot(r["steps"], r["loss"], **style)
        inside = [(s, v) for s, v in zip(r["steps"], r["loss"]) if zoom[0] <= s <= zoom[1]]
        if inside:
            near.plot(*zip(*inside), **style)
            zoomed[style["label"]] = [v for _, v in inside]
        logit.plot(r["monitor_steps"], [max(m) for m in r["max_logit"]], **style)
    full.set(xlabel="step", ylabel="training loss (mean of 10 steps)", title="loss")
    near.set(xlabel="step", title=f"loss, steps {zoom[0]}-{zoom[1]}")
    _fit_to_the_close_runs(near, zoomed)
    logit.set(xlabel="step", yscale="log", title="largest attention logit over layers")
    for ax in (full, near, logit):
        ax.grid(alpha=0.3)
    # Below the panels: inside the loss panel the legend covered the first steps and the y label.
    handles, labels = full.get_legend_handles_labels()
    rows = -(-len(labels) // 3)
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    seed_count = f"{len(seeds)} seed" + "s" * (len(seeds) > 1)
    fig.suptitle(f"GPT-2 124M, peak lr {lr:g}: each arm with {seed_count} (initial weights and batch "
                 "order);\narms of one seed differ only in attention numerics / max_adjust", fontsize=10)
    return save_figure(fig, path, bottom=0.035 * rows + 0.02)


def _fit_to_the_close_runs(ax, zoomed: dict[str, list[float]]) -> None:
    """The zoom panel is for runs close to each other: its y range covers the runs whose loss there
    stays under SPIKE_FACTOR x the lowest (explosion.outcome's line); the others run off the top,
    named."""
    if not zoomed:
        return
    lowest = min(min(v) for v in zoomed.values())
    tops = {label: max(v) for label, v in zoomed.items()}
    close = [top for top in tops.values() if top <= SPIKE_FACTOR * lowest]
    above = [label for label, top in tops.items() if top > SPIKE_FACTOR * lowest]
    if not above or not close:
        return
    span = max(close) - lowest or 1.0
    ax.set_ylim(lowest - 0.05 * span, max(close) + 0.1 * span)
    # One name a line, and out of the layout: wrapped to the figure's width, a long arm name
    # squeezed this panel to a sliver between wide gaps.
    note = ax.text(0.02, 0.98, "above the panel:\n" + "\n".join(above), transform=ax.transAxes,
                   va="top", fontsize=7, bbox=dict(facecolor="white", alpha=0.8, lw=0))
    note.set_in_layout(False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproduction.seeds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=parse_runs, required=True, help="SEED=DIR[,SEED=DIR...]")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--arms", type=parse_arms, default=["paper/off", "paper/safe", "fast/off"])
    parser.add_argument("--milestones", default=",".join(map(str, MILESTONES)), help="steps of the loss columns")
    parser.add_argument("--baseline", default="fast/off", help="the arm every arm's loss is compared with")
    parser.add_argument("--compare-step", type=int, default=COMPARE_STEP)
    parser.add_argument("--monitor-step", type=int, default=MONITOR_STEP)
    # No default path: the runs compared differ from one figure to the next, and a default onto a
    # committed figure overwrote it whenever only the table was wanted.
    parser.add_argument("--figure", help="write the figure here (none without it)")
    args = parser.parse_args(argv)
    results = load(args.runs, args.lr, args.arms)
    if not results:
        parser.error(f"no run with metrics for lr {args.lr:g} and arms {args.arms} under --runs")
    print(table(results, [int(x) for x in args.milestones.split(",") if x], baseline=args.baseline,
                compare_step=args.compare_step, monitor_step=args.monitor_step))
    if args.figure:
        print(f"figure: {figure(results, args.lr, Path(args.figure), zoom=(1000, args.compare_step))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
