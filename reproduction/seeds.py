"""Do the explosion arms separate for every seed? Loss per arm and seed, and a table of outcomes.

    python -m reproduction.seeds --lr 3e-3 --arms paper/off,paper/safe,fast/off \
        --runs 0=docs/results/reproduction/explosion,1=out/seed1/explosion,2=out/seed2/explosion \
        --figure docs/figures/seeds.png

Each --runs entry is SEED=DIR, DIR an `explosion run --out` directory whose runs were trained with
`--seed SEED` (different initial weights and batch order; `python -m train` refuses to resume a
checkpoint of another seed). Prints a Markdown table (per arm and seed: outcome, loss at the
milestones, lowest loss) and writes the figure (training loss against steps: one color per arm,
one line style per seed).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from reproduction.ablation import at
from reproduction.explosion import COLORS, outcome, parse_arms, read_run, run_dir, save_figure

MILESTONES = (1000, 2000, 2500, 3000, 4000, 5000)
STYLES = ("-", "--", ":", "-.")


def parse_runs(text: str) -> dict[int, Path]:
    """"0=dir,1=dir" -> {seed: directory} (argparse type)."""
    runs = {}
    for item in text.split(","):
        seed, sep, path = item.partition("=")
        if not sep or not seed.strip().isdigit() or not path:
            raise argparse.ArgumentTypeError(f"--runs takes SEED=DIR[,SEED=DIR...], got {item!r}")
        runs[int(seed)] = Path(path)
    return runs


def load(runs: dict[int, Path], lr: float, arms: list[str]) -> dict[tuple[str, int], dict]:
    """(arm, seed) -> read_run of that run; runs with no metrics are left out."""
    out = {}
    for seed, root in runs.items():
        for arm in arms:
            r = read_run(run_dir(root, lr, arm))
            if r["steps"]:
                out[(arm, seed)] = r
    return out


def table(results: dict[tuple[str, int], dict], milestones=MILESTONES) -> str:
    head = " | ".join(f"loss at {s}" for s in milestones)
    lines = [f"| arm | seed | outcome | {head} | lowest loss (step) |",
             "|---|---|---|" + "---|" * len(milestones) + "---|"]
    for (arm, seed), r in sorted(results.items()):
        cells = []
        for s in milestones:
            loss = at(r["steps"], r["loss"], s)
            cells.append("-" if loss is None else f"{loss:.2f}")
        low = min(r["loss"])
        low_at = r["steps"][r["loss"].index(low)]
        lines.append(f"| {arm} | {seed} | {outcome(r)} | " + " | ".join(cells)
                     + f" | {low:.2f} ({low_at}) |")
    return "\n".join(lines) + "\n"


def figure(results: dict[tuple[str, int], dict], lr: float, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({seed for _, seed in results})
    fig, ax = plt.subplots(figsize=(8, 5))
    for (arm, seed), r in sorted(results.items()):
        ax.plot(r["steps"], r["loss"], STYLES[seeds.index(seed) % len(STYLES)], lw=1,
                color=COLORS.get(arm), label=f"{arm}, seed {seed}")
    ax.set(xlabel="step", ylabel="training loss (mean of 10 steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"GPT-2 124M, peak lr {lr:g}: each arm with {len(seeds)} seeds (init and batch "
                 "order); arms of one seed differ only in attention numerics / max_adjust",
                 fontsize=9)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproduction.seeds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=parse_runs, required=True, help="SEED=DIR[,SEED=DIR...]")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--arms", type=parse_arms, default=["paper/off", "paper/safe", "fast/off"])
    parser.add_argument("--milestones", default=",".join(map(str, MILESTONES)))
    parser.add_argument("--figure", default="docs/figures/seeds.png")
    args = parser.parse_args(argv)
    results = load(args.runs, args.lr, args.arms)
    if not results:
        parser.error(f"no run with metrics for lr {args.lr:g} and arms {args.arms} under --runs")
    print(table(results, [int(x) for x in args.milestones.split(",") if x]))
    print(f"figure: {figure(results, args.lr, Path(args.figure))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
