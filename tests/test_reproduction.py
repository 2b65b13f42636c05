"""reproduction/: the gradient-error bookkeeping against float64, the study on a checkpoint, the
explosion launcher's plan, outcome classification and report."""

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reproduction import explosion, gradients
from stable_attn import dot_product_attention
from stable_attn.reference import exact_attention, exact_attention_vjp
from train.config import ModelConfig, get_config
from train.loop import RunOptions, train

ALICE = str(Path(__file__).parent / "data" / "carroll-alice.txt")


def _rand(rng, shape, dtype=jnp.bfloat16, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def test_exact_causal_attention_matches_float64():
    rng = np.random.default_rng()
    q, k, v = (_rand(rng, (2, 24, 3, 16), jnp.float32) for _ in range(3))
    out, p = jax.jit(gradients.exact_causal_attention)(q, k, v)
    truth = exact_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(out), truth, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("arm", ["paper/off", "fast/off"])
def test_layer_errors_match_an_independent_float64_computation(arm):
    """delta and dW_Q / dW_K errors of the low-precision kernel against float64 NumPy."""
    rng = np.random.default_rng()
    B, T, N, H, C = 2, 32, 2, 16, 24
    q, k, v = (_rand(rng, (B, T, N, H), scale=1.5) for _ in range(3))
    do = _rand(rng, (B, T, N, H), scale=0.1)
    x = jnp.asarray(rng.standard_normal((B, T, C)), jnp.float32)
    model = ModelConfig(n_layer=1, n_head=N, n_embd=N * H, block_size=T, attention="reference")
    got = jax.device_get(jax.jit(lambda *a: gradients.layer_errors(*a, model=model, arm=arm))(q, k, v, do, x))

    numerics, max_adjust = explosion.arm_settings(arm)
    fn = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, implementation="reference",
                                               numerics=numerics, max_adjust=max_adjust)
    o_lp, vjp = jax.vjp(fn, q, k, v)
    dq_lp, dk_lp, _ = (np.asarray(g.astype(jnp.float32), np.float64) for g in vjp(do))
    exact = exact_attention_vjp(q, k, v, do, is_causal=True)
    o_true, dq_true, dk_true = exact.out, exact.dq, exact.dk
    do64 = np.asarray(do.astype(jnp.float32), np.float64)
    ddelta = np.sum(do64 * (np.asarray(o_lp.astype(jnp.float32), np.float64) - o_true), axis=-1)
    X = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    per_head = lambda d: np.einsum("btc,btnh->nch", X, d)
    rel = lambda e, ref: np.linalg.norm(e.reshape(N, -1), axis=1) / np.linalg.norm(ref.reshape(N, -1), axis=1)

    assert np.abs(ddelta).max() > 0  # the kernel does round: there is something to measure
    np.testing.assert_allclose(got["delta_err_sum"], ddelta.sum(axis=(0, 1)), rtol=2e-2,
                               atol=1e-3 * np.abs(ddelta).sum())
    np.testing.assert_allclose(got["dwq_rel_err"], rel(per_head(dq_lp - dq_true), per_head(dq_true)), rtol=2e-2)
    np.testing.assert_allclose(got["dwk_rel_err"], rel(per_head(dk_lp - dk_true), per_head(dk_true)), rtol=2e-2)
    np.testing.assert_allclose(np.asarray(got["e_q"]), per_head(dq_lp - dq_true),
                               atol=2e-2 * np.abs(per_head(dq_lp - dq_true)).max())
    assert np.all((got["dwq_rank1_share"] > 0) & (got["dwq_rank1_share"] <= 1 + 1e-6))


@pytest.mark.slow
def test_study_on_a_tiny_checkpoint(tmp_path):
    cfg = get_config("tiny").replace(
        model=dict(n_layer=2, n_head=2, n_embd=32, block_size=32, attention="reference",
                   numerics="paper", max_adjust="off"),
        batch_size=4, max_steps=3, eval_every=0, monitor_every=1, ckpt_every=0, sample_tokens=0)
    run = tmp_path / "run"
    train(cfg, RunOptions(out_dir=run, data=ALICE, progress=False, tensorboard=False))
    result = gradients.study(run, steps=3, compare=["paper/off", "paper/safe"], data=ALICE,
                             progress=lambda _: None)
    assert result["start_step"] == 3 and result["own_arm"] == "paper/off" and len(result["losses"]) == 3
    for arm in ("paper/off", "paper/safe"):
        r = {k: np.asarray(v, np.float64) for k, v in result["arms"][arm].items()}
        assert r["delta_err_sum"].shape == (3, 2, 2) and r["tie_frac"].shape == (3, 2)
        assert np.isfinite(r["dwq_rel_err"]).all() and (r["dwq_rel_err"] > 0).all()
        assert np.isnan(r["dwq_cos_prev"][0]).all() and (np.abs(r["dwq_cos_prev"][1:]) <= 1 + 1e-9).all()
        assert ((r["dwq_coherence"] > 0) & (r["dwq_coherence"] <= 1 + 1e-9)).all()
        assert set(np.unique(r["delta_sign_positive"] * 3)) <= {0, 1, 2, 3}
    text = gradients.table(result)
    assert text.count("| paper/off |") == 2 and text.count("| paper/safe |") == 2
    fig = gradients.figure(result, tmp_path / "g.png", run / "metrics.jsonl")
    assert fig.stat().st_size > 10_000
    with pytest.raises(ValueError, match="steps"):
        gradients.study(run, steps=1, compare=["paper/off"], data=ALICE)
    with pytest.raises(ValueError, match="--step"):
        gradients.pick_step(run, "soon")
    assert gradients.pick_step(run, "before-instability") is None  # no instability: the latest


def test_plan_assigns_gpus_round_robin_and_builds_commands(tmp_path):
    runs = explosion.plan(tmp_path, [1e-3, 3e-3], list(explosion.ARMS), ["0", "1", "2"])
    assert len(runs) == 8 and [r.gpu for r in runs] == ["0", "1", "2", "0", "1", "2", "0", "1"]
    assert runs[5].out_dir == tmp_path / "lr0.003" / "paper-paper"
    cmd = explosion.train_command(runs[0], config="repro", time_limit=60.0, extra=["--max-steps", "5"])
    assert cmd[:3] == [sys.executable, "-m", "train"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--numerics"] == "paper" and flags["--max-adjust"] == "off"
    assert float(flags["--lr"]) == 1e-3 and flags["--time-limit"] == "60.0" and cmd[-2:] == ["--max-steps", "5"]
    assert [r.gpu for r in explosion.plan(tmp_path, [1e-3], ["fast/off"], [])] == [None]
    with pytest.raises(ValueError, match="arm"):
        explosion.plan(tmp_path, [1e-3], ["paper/on"], [])
    with pytest.raises(ValueError, match="lrs"):
        explosion.plan(tmp_path, [0.0], ["fast/off"], [])


def _write_run(directory: Path, losses, *, stopped_at=None):
    directory.mkdir(parents=True)
    recs = []
    for i, loss in enumerate(losses):
        step = 10 * i
        rec = {"step": step, "loss": loss, "loss_avg": loss, "grad_norm": 1.0}
        if i % 5 == 0:
            rec |= {"spec_wq": [1.0 + i, 2.0 + i], "tie_frac": [0.1, 0.2], "max_logit": [3.0 + i, 4.0 + i]}
        recs.append(rec)
    if stopped_at is not None:
        recs.append({"step": stopped_at, "loss": None, "stopped": "train: STOPPED"})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_outcomes_and_report(tmp_path):
    rng = np.random.default_rng()
    base = list(np.linspace(8, 4, 60) + rng.uniform(-0.05, 0.05, 60))
    series = {
        "paper/off": base[:50] + [9.0] * 10,                  # jumps at step 500, stays up
        "paper/paper": base[:55] + [9.0] + base[56:],          # spikes at 550, recovers
        "paper/safe": base,                                    # stable
        "fast/off": base[:30],                                 # NaN at step 300
    }
    for arm, losses in series.items():
        _write_run(explosion.run_dir(tmp_path, 1e-3, arm), losses,
                   stopped_at=300 if arm == "fast/off" else None)
    out = {arm: explosion.outcome(explosion.read_run(explosion.run_dir(tmp_path, 1e-3, arm))) for arm in series}
    assert out["paper/off"].startswith("diverged: loss above 1.5x its minimum") and "from step 500 on" in out["paper/off"]
    assert out["paper/paper"] == "loss spike at step 550, recovered by step 590"
    assert out["paper/safe"] == "stable to step 590"
    assert out["fast/off"] == "diverged at step 300 (non-finite loss)"
    rise = list(np.linspace(8, 3, 30)) + list(np.linspace(3, 6, 30))
    assert explosion.sustained_rise([10 * i for i in range(60)], rise) == 450  # first loss > 1.5 x 3.0
    _write_run(tmp_path / "slow", rise)
    assert explosion.outcome(explosion.read_run(tmp_path / "slow")).startswith(
        "diverged: loss above 1.5x its minimum 3.00 from step 450 on")
    _write_run(tmp_path / "drift", list(np.linspace(8, 3, 30)) + [3.9] * 5)
    assert explosion.outcome(explosion.read_run(tmp_path / "drift")) == (
        "rising: lowest loss 3.00 at step 290, 3.90 at step 340")
    assert explosion.first_instability(explosion.read_run(tmp_path / "slow")) == 450
    assert explosion.first_instability(explosion.read_run(explosion.run_dir(tmp_path, 1e-3, "fast/off"))) == 300
    assert explosion.first_instability(explosion.read_run(explosion.run_dir(tmp_path, 1e-3, "paper/safe"))) is None
    assert explosion.first_spike([0, 10, 20], [5.0, 9.0, 9.0], after=0) == 10
    assert explosion.first_spike([0, 10, 20], [5.0, 9.0, 9.0], after=500) is None

    assert explosion.main(["report", "--out", str(tmp_path), "--lrs", "1e-3"]) == 0
    table = (tmp_path / "explosion.md").read_text()
    assert table.count("| 0.001 |") == 4
    assert "2.0 -> 57.0 (layer 2)" in table  # largest norm over layers, first and last monitor
    assert (tmp_path / "explosion.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):
        explosion.main(["report", "--out", str(tmp_path), "--arms", "paper/on"])


@pytest.mark.slow
def test_run_launches_arms_on_cpu(tmp_path):
    """The launcher end to end on CPU: two arms one after another, identical until numerics differ."""
    argv = ["run", "--out", str(tmp_path), "--config", "tiny", "--lrs", "3e-3", "--arms", "paper/off,fast/off",
            "--gpus", "", "--report-every", "5", "--data", ALICE, "--max-steps", "2", "--eval-every", "0",
            "--monitor-every", "1", "--ckpt-every", "0", "--sample-tokens", "0", "--block-size", "32"]
    assert explosion.main(argv) == 0
    runs = [explosion.read_run(explosion.run_dir(tmp_path, 3e-3, arm)) for arm in ("paper/off", "fast/off")]
    assert all(r["steps"] == [0, 1] for r in runs)
    assert runs[0]["loss"][0] == pytest.approx(runs[1]["loss"][0], rel=1e-2)  # same weights, same batch
    assert "numerics='paper'" in (explosion.run_dir(tmp_path, 3e-3, "paper/off") / "train.log").read_text()


@pytest.mark.slow
def test_arms_branch_from_a_trunk_on_cpu(tmp_path):
    """--trunk: the arms start from the trunk's checkpoint and continue it exactly as one straight run
    would (same weights, optimizer state, batch position and lr schedule)."""
    common = ["--config", "tiny", "--lrs", "3e-3", "--gpus", "", "--report-every", "5", "--data", ALICE,
              "--max-steps", "4", "--warmup-steps", "1", "--eval-every", "0", "--monitor-every", "1",
              "--ckpt-every", "0", "--sample-tokens", "0", "--block-size", "32"]
    assert explosion.main(["run", "--out", str(tmp_path / "b"), "--arms", "fast/off,paper/off",
                           "--trunk", "fast/off@2", *common]) == 0
    assert explosion.main(["run", "--out", str(tmp_path / "s"), "--arms", "fast/off", *common]) == 0
    trunk = explosion.read_run(tmp_path / "b" / "trunk" / "lr0.003" / "fast-off")
    straight = explosion.read_run(explosion.run_dir(tmp_path / "s", 3e-3, "fast/off"))
    assert trunk["steps"] == [0, 1]
    for arm in ("fast/off", "paper/off"):
        out_dir = explosion.run_dir(tmp_path / "b", 3e-3, arm)
        run = explosion.read_run(out_dir)
        assert run["steps"] == [0, 1, 2, 3]
        assert run["loss"][:2] == trunk["loss"]
        assert "resumed from" in (out_dir / "train.log").read_text()
        assert json.loads((out_dir / explosion.BRANCH_FILE).read_text())["step"] == 2
    same = explosion.read_run(explosion.run_dir(tmp_path / "b", 3e-3, "fast/off"))
    np.testing.assert_allclose(same["loss"], straight["loss"], rtol=1e-5)
    # Run again: the arms have checkpoints of their own now and are not re-branched.
    before = (explosion.run_dir(tmp_path / "b", 3e-3, "paper/off") / "metrics.jsonl").read_text()
    assert explosion.main(["run", "--out", str(tmp_path / "b"), "--arms", "paper/off",
                           "--trunk", "fast/off@2", *common]) == 0
    after = (explosion.run_dir(tmp_path / "b", 3e-3, "paper/off") / "metrics.jsonl").read_text()
    assert after == before


def test_trunk_and_deadline_arguments_are_checked(tmp_path):
    for bad in ("fast/off", "fast/off@0", "fast/off@x", "paper/on@5"):
        with pytest.raises(SystemExit):
            explosion.main(["run", "--out", str(tmp_path), "--trunk", bad])
    with pytest.raises(ValueError, match="max_steps"):
        explosion.trunk_extra("tiny", ["--max-steps", "10"], 10)
    assert explosion.trunk_extra("repro", [], 2500)[-4:] == ["--max-steps", "2500", "--lr-decay-steps", "20000"]
    runs = explosion.plan(tmp_path, [1e-3], ["fast/off"], [])
    with pytest.raises(ValueError, match="end-by"):
        explosion.launch(runs, config="tiny", time_limit=None, extra=[], end_by=0.0)


def test_arm_settings_accept_moved_rounding_points():
    assert explosion.arm_settings("paper+score=float32/safe") == ("paper+score=float32", "safe")
    assert explosion.arm_settings("paper+fp32o/off") == ("paper+fp32o", "off")
    for bad in ("paper", "paper/on", "paper+nope=input/safe"):
        with pytest.raises(ValueError, match="arm"):
            explosion.arm_settings(bad)
    cmd = explosion.train_command(explosion.Run(1e-3, "fast+score=input/safe", Path("x"), None),
                                  config="repro", time_limit=None, extra=[])
    assert cmd[cmd.index("--numerics") + 1] == "fast+score=input"


def test_ablation_table_and_figure(tmp_path, monkeypatch):
    from reproduction import ablation
    rng = np.random.default_rng()
    for arm in ("paper/safe", "paper+score=float32/safe"):
        _write_run(explosion.run_dir(tmp_path / "runs", 1e-3, arm),
                   list(np.linspace(8, 2, 460) + rng.uniform(-0.01, 0.01, 460)))
    runs = ablation.load(tmp_path / "runs" / "lr0.001")
    assert set(runs) == {"paper/safe", "paper+score=float32/safe"}
    text = ablation.table(runs, layer=2)
    # _write_run logs spec_wq [1 + i, 2 + i] at record i (step 10 i): layer 2 at step 1000 is 102.
    assert "| paper+score=float32/safe | 102.0 / 0.20 / 104 / " in text
    assert runs["paper/safe"]["branch_step"] is None
    # A branched arm (explosion --trunk) carries its branch step; the milestones are selectable.
    branched = explosion.run_dir(tmp_path / "runs", 1e-3, "paper/safe")
    (branched / explosion.BRANCH_FILE).write_text(json.dumps({"trunk": "t", "step": 1500}))
    assert ablation.load(tmp_path / "runs" / "lr0.001")["paper/safe"]["branch_step"] == 1500
    assert ablation.table(runs, layer=1, milestones=[500]).splitlines()[2] == "| arm | step 500 |"
    assert ablation.main(["--runs", str(tmp_path / "runs" / "lr0.001"), "--milestones", "500,1000",
                          "--figure", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").stat().st_size > 10_000
    monkeypatch.chdir(tmp_path)  # without --figure only the table
    assert ablation.main(["--runs", str(tmp_path / "runs" / "lr0.001")]) == 0
    assert sorted(tmp_path.rglob("*.png")) == [tmp_path / "a.png"]


def test_seeds_figure_gives_an_arm_one_color_over_seeds(tmp_path, monkeypatch):
    """An arm without a COLORS entry (here a numerics string) keeps its color from seed to seed
    and does not take another arm's (matplotlib's cycle gave its second seed fast/off's)."""
    from matplotlib.colors import to_hex
    from reproduction import seeds
    rng = np.random.default_rng()
    arms = ["fast/off", "fast+p=e4m3+p_scale=16/safe", "fp8_fast/safe"]
    for seed in (0, 1):
        for arm in arms:
            _write_run(explosion.run_dir(tmp_path / f"s{seed}", 3e-3, arm),
                       list(np.linspace(8, 3, 60) + rng.uniform(-0.01, 0.01, 60)))
    results = seeds.load(seeds.parse_runs(f"0={tmp_path / 's0'},1={tmp_path / 's1'}"), 3e-3, arms)
    figs = []
    monkeypatch.setattr(seeds, "save_figure", lambda fig, path, **_: figs.append(fig) or path)
    seeds.figure(results, 3e-3, tmp_path / "f.png")
    colors = {}
    for line in figs[0].axes[0].get_lines():
        arm, _ = line.get_label().split(", seed ")
        colors.setdefault(arm, set()).add(to_hex(line.get_color()))
    assert sorted(colors) == sorted(arms)
    assert all(len(c) == 1 for c in colors.values()), colors
    assert len(set.union(*colors.values())) == len(arms), colors


def test_seeds_figure_zooms_on_the_close_runs_and_keeps_the_legend_off_the_panels(tmp_path, monkeypatch):
    """A diverged run (loss 9 from step 300) ran the zoom panel's y range to 9, flattening the runs
    it is there to separate; the legend sat on the loss panel's first steps."""
    from reproduction import seeds
    rng = np.random.default_rng()
    base = np.linspace(8, 3, 260) + rng.uniform(-0.01, 0.01, 260)
    close = {"fast/off": base, "fp8_fast/safe": base + rng.uniform(0.01, 0.05)}
    for arm, losses in close.items():
        _write_run(explosion.run_dir(tmp_path / "s0", 3e-3, arm), list(losses))
    _write_run(explosion.run_dir(tmp_path / "s0", 3e-3, "paper/off"), list(base[:30]) + [9.0] * 230)
    results = seeds.load(seeds.parse_runs(f"0={tmp_path / 's0'}"), 3e-3, ["paper/off", *close])
    figs, bottoms = [], []
    monkeypatch.setattr(seeds, "save_figure", lambda fig, path, bottom=0.0: figs.append(fig)
                        or bottoms.append(bottom) or path)
    seeds.figure(results, 3e-3, tmp_path / "f.png", zoom=(1000, 2000))
    near = figs[0].axes[1]
    top_of_close = max(max(v[100:201]) for v in close.values())
    low, high = near.get_ylim()
    assert top_of_close < high < 9.0 and low < min(base[100:201]), (low, high)
    assert "paper/off, seed 0" in " ".join(t.get_text() for t in near.texts)
    assert figs[0].axes[0].get_legend() is None and len(figs[0].legends) == 1
    assert bottoms[0] > 0
    assert "each arm with 1 seed (" in figs[0]._suptitle.get_text()
    # All runs close: the range is matplotlib's own, and nothing is named above the panel.
    del results["paper/off", 0]
    seeds.figure(results, 3e-3, tmp_path / "g.png", zoom=(1000, 2000))
    assert not figs[1].axes[1].texts


def test_seeds_figure_keeps_its_panels_wide_with_long_arm_names(tmp_path, monkeypatch):
    """Long arm names above the zoom panel (FlashAttention-3's FP8 numerics string), wrapped to
    the figure's width, once took part in the layout and shrank every panel to a sixth of the
    figure between wide gaps: laid out and written, each panel keeps over a quarter of it."""
    from reproduction import seeds
    base = np.linspace(8, 3, 260)
    long_arm = "fast+qkv=e4m3+p=e4m3+p_scale=256/safe"
    _write_run(explosion.run_dir(tmp_path / "s0", 3e-3, "fast/off"), list(base))
    for seed in (0, 1):
        _write_run(explosion.run_dir(tmp_path / f"s{seed}", 3e-3, long_arm),
                   list(base[:30]) + [9.0] * 230)
    results = seeds.load(seeds.parse_runs(f"0={tmp_path / 's0'},1={tmp_path / 's1'}"), 3e-3,
                         ["fast/off", long_arm])
    import matplotlib.pyplot as plt
    made = []
    monkeypatch.setattr(plt, "close", made.append)   # keep the written figure to measure it
    assert seeds.figure(results, 3e-3, tmp_path / "f.png", zoom=(1000, 2000)).is_file()
    widths = [ax.get_position().width for ax in made[0].axes]
    assert min(widths) > 0.25, widths
    assert f"{long_arm}, seed 1" in made[0].axes[1].texts[0].get_text()


def test_seeds_table_and_figure(tmp_path, capsys, monkeypatch):
    from reproduction import seeds
    rng = np.random.default_rng()
    bases = {}
    for seed, offset in ((0, 0.0), (1, 0.3)):  # distinct baselines: a wrong seed's baseline shows
        bases[seed] = base = list(np.linspace(8, 3, 60) + offset + rng.uniform(-0.01, 0.01, 60))
        _write_run(explosion.run_dir(tmp_path / f"s{seed}", 3e-3, "paper/off"), base[:30] + [9.0] * 30)
        _write_run(explosion.run_dir(tmp_path / f"s{seed}", 3e-3, "fast/off"), base)
    runs = seeds.parse_runs(f"0={tmp_path / 's0'},1={tmp_path / 's1'}")
    results = seeds.load(runs, 3e-3, ["paper/off", "paper/safe", "fast/off"])
    assert sorted(results) == [("fast/off", 0), ("fast/off", 1), ("paper/off", 0), ("paper/off", 1)]
    text = seeds.table(results, milestones=[100, 400], compare_step=400, monitor_step=250)
    # paper/off sits at 9.0 (> 1.5x its lowest) from step 300 on: a sustained rise in both seeds;
    # fast/off is stable. Gap to fast/off of the same seed at step 400; lowest loss up to step 400;
    # the largest logit and W_Q norm over layers at step 250, both in layer 2 (record 25: [3, 4] + 25
    # and [1, 2] + 25).
    for seed, base in bases.items():
        low = min(base[:30])
        assert (f"| paper/off | {seed} | diverged: loss above 1.5x its minimum {low:.2f} from step 300 on, "
                f"9.00 at step 590 | {base[10]:.2f} | 9.00 | {9.0 - base[40]:+.2f} "
                f"| {low:.2f} ({10 * base.index(low)}) | 29 (2) | 27.0 (2) |") in text
        assert (f"| fast/off | {seed} | stable to step 590 | {base[10]:.2f} | {base[40]:.2f} | +0.00 "
                f"| {min(base[:41]):.2f} ({10 * base.index(min(base[:41]))}) | 29 (2) | 27.0 (2) |") in text
    assert seeds.largest([3.0, 7.5, 7.0]) == (7.5, 2)
    # A seed named with several directories: each arm from the first that has it.
    later = base[:20] + [5.0] * 40
    _write_run(explosion.run_dir(tmp_path / "later", 3e-3, "paper/safe"), later)
    _write_run(explosion.run_dir(tmp_path / "later", 3e-3, "fast/off"), [7.0] * 60)
    both = seeds.load(seeds.parse_runs(f"1={tmp_path / 's1'},1={tmp_path / 'later'}"), 3e-3,
                      ["paper/safe", "fast/off"])
    assert sorted(both) == [("fast/off", 1), ("paper/safe", 1)]
    assert both["fast/off", 1]["loss"][-1] == pytest.approx(bases[1][-1])
    assert both["paper/safe", 1]["loss"][-1] == 5.0
    assert seeds.main(["--runs", f"0={tmp_path / 's0'},1={tmp_path / 's1'}",
                       "--figure", str(tmp_path / "seeds.png")]) == 0
    assert (tmp_path / "seeds.png").stat().st_size > 10_000
    # Without --figure only the table: a default path once overwrote a committed figure.
    monkeypatch.chdir(tmp_path)
    before, _ = sorted(tmp_path.rglob("*.png")), capsys.readouterr()
    assert seeds.main(["--runs", f"0={tmp_path / 's0'}"]) == 0
    assert sorted(tmp_path.rglob("*.png")) == before and "figure:" not in capsys.readouterr().out
    # the middle panel ends at --compare-step, as the module says
    zooms = []
    monkeypatch.setattr(seeds, "save_figure", lambda fig, path, **_: zooms.append(
        fig.axes[1].get_title()) or path)
    seeds.main(["--runs", f"0={tmp_path / 's0'}", "--compare-step", "2000",
                "--figure", str(tmp_path / "zoom.png")])
    assert zooms == ["loss, steps 1000-2000"], zooms
    with pytest.raises(SystemExit):
        seeds.main(["--runs", f"0={tmp_path / 's0'}", "--lr", "1e-3", "--figure", str(tmp_path / "x.png")])
    assert "no run with metrics for lr 0.001" in capsys.readouterr().err
    for bad in ("x", "a=b", "1"):
        with pytest.raises(argparse.ArgumentTypeError):
            seeds.parse_runs(bad)
