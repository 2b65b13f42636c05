"""Which rounding point drives the W_Q growth: one layer's W_Q norm and the loss per ablation arm.

    python -m reproduction.ablation --runs docs/results/reproduction/ablation/lr0.001 \
        --reference docs/results/reproduction/explosion/lr0.001 --figure docs/figures/ablation.png

The arms are `python -m reproduction.explosion run --arms ...` runs whose numerics move rounding
points of a preset ("paper+score=float32/safe"; stable_attn.numerics.resolve). Every run directory
under --runs is drawn solid; --reference adds earlier runs of the same seed dashed (by default the
first session's paper/safe and fast/off). Prints a Markdown table of the layer's W_Q spectral norm,
its tie rate, its largest logit and the loss at fixed steps, and with --figure writes the figure
(loss, W_Q norm and largest logit against steps).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from reproduction.explosion import BRANCH_FILE, label_axes, outcome, read_run, save_figure

MILESTONES = (1000, 2000, 2500, 3000, 3500, 4000, 4500, 5000)


def _arm(run_dir: Path) -> str:
    """Directory name -> arm name ("paper+score=float32-safe" -> "paper+score=float32/safe")."""
    numerics, _, max_adjust = run_dir.name.rpartition("-")
    return f"{numerics}/{max_adjust}"


def load(root: Path, only: list[str] | None = None) -> dict[str, dict]:
    runs = {}
    for d in sorted(p for p in Path(root).iterdir() if (p / "metrics.jsonl").exists()):
        if only is None or _arm(d) in only:
            runs[_arm(d)] = read_run(d)
            branch = d / BRANCH_FILE  # arms started from a trunk's checkpoint (explosion --trunk)
            runs[_arm(d)]["branch_step"] = (json.loads(branch.read_text())["step"] if branch.exists()
                                            else None)
    return runs


def at(steps: list[int], values: list, step: int):
    """The value logged at `step` (None when the run has no record there)."""
    return dict(zip(steps, values)).get(step)


def table(runs: dict[str, dict], layer: int, milestones=MILESTONES) -> str:
    head = " | ".join(f"step {s}" for s in milestones)
    lines = [f"W_Q spectral norm of layer {layer} / its tie rate / its largest logit / training loss "
             "(mean of 10 steps)", "", f"| arm | {head} |", "|---|" + "---|" * len(milestones)]
    for name, r in runs.items():
        cells = []
        for s in milestones:
            norm = at(r["monitor_steps"], r["spec_wq"], s)
            tie = at(r["monitor_steps"], r["tie_frac"], s)
            logit = at(r["monitor_steps"], r["max_logit"], s)
            loss = at(r["steps"], r["loss"], s)
            cells.append("-" if norm is None else
                         f"{norm[layer - 1]:.1f} / {tie[layer - 1]:.2f} / {logit[layer - 1]:.0f} / "
                         + ("-" if loss is None else f"{loss:.2f}"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def figure(runs: dict[str, dict], references: dict[str, dict], layer: int, path: Path) -> Path:
    """Loss, the layer's W_Q norm and its largest logit against steps; the x range is the arms'."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_norm, ax_logit) = plt.subplots(3, 1, figsize=(8, 9.5), sharex=True)
    for style, group in (("-", runs), ("--", references)):
        for name, r in group.items():
            label = f"{name}{' (first session)' if style == '--' else ''}: {outcome(r)}"
            line, = ax_loss.plot(r["steps"], r["loss"], style, lw=1, label=label)
            for ax, key in ((ax_norm, "spec_wq"), (ax_logit, "max_logit")):
                ax.plot(r["monitor_steps"], [v[layer - 1] for v in r[key]], style, lw=1.2,
                        color=line.get_color())
    label_axes(ax_loss, ax_norm, f"W_Q spectral norm, layer {layer}", legend_loc="upper right")
    ax_norm.set_xlabel("")
    ax_logit.set(ylabel=f"largest attention logit, layer {layer}", xlabel="step")
    ax_logit.grid(alpha=0.3)
    for ax in (ax_norm, ax_logit):
        ax.set_yscale("log")
    last = max((r["steps"][-1] for r in runs.values() if r["steps"]), default=None)
    if last is not None:
        ax_loss.set_xlim(0, last * 1.03)
    branches = sorted({r["branch_step"] for r in runs.values() if r.get("branch_step")})
    for step in branches:
        for ax in (ax_loss, ax_norm, ax_logit):
            ax.axvline(step, color="gray", ls=":", lw=1)
    shared = f"\nsolid arms share one run up to step {branches[0]} (dotted line)" if len(branches) == 1 else ""
    fig.suptitle("Rounding-point ablation, GPT-2 124M, lr 1e-3, same seed and batch order: arms "
                 f"move rounding points of a preset{shared}", fontsize=9)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproduction.ablation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="directory of run directories (one per arm)")
    parser.add_argument("--reference", help="directory of earlier runs drawn dashed")
    parser.add_argument("--reference-arms", default="paper/safe,fast/off",
                        help="which arms of --reference to draw")
    parser.add_argument("--layer", type=int, default=2, help="1-based layer whose W_Q norm is drawn")
    # No default path: a default onto ablation.png was overwritten by the split runs' figure.
    parser.add_argument("--figure", help="write the figure here (none without it)")
    parser.add_argument("--milestones", default=",".join(map(str, MILESTONES)),
                        help="comma list of the steps the table shows")
    args = parser.parse_args(argv)
    runs = load(Path(args.runs))
    if not runs:
        parser.error(f"--runs: no run directory with metrics.jsonl under {args.runs}")
    references = (load(Path(args.reference), args.reference_arms.split(","))
                  if args.reference else {})
    milestones = [int(x) for x in args.milestones.split(",") if x]
    print(table(runs | {f"{k} (first session)": v for k, v in references.items()}, args.layer,
                milestones))
    if args.figure:
        print(f"figure: {figure(runs, references, args.layer, Path(args.figure))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
