"""train.loop end to end on CPU: the loss falls, exact resume, NaN stop, sharded == single device,
CLI."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train.cli import PROG, build_parser, build_config, main as cli_main
from train.config import get_config
import train.loop as train_loop
from train.loop import RunOptions, TrainingStopped, train
from train.metrics import read_metrics, read_tensorboard
from tests.test_train_cache import restore_cache_config  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
ALICE = str(Path(__file__).parent / "data" / "carroll-alice.txt")


def micro(**kw):
  """A model small enough for many CPU runs; the GPT-2 vocabulary keeps the real tokenizer
  usable."""
  base = dict(model=dict(n_layer=2, n_head=2, n_embd=32, block_size=32, attention="jax_xla",
                         max_adjust="off"),
              batch_size=8, grad_accum=1, max_steps=8, lr=1e-2, min_lr=1e-3, warmup_steps=2,
              eval_every=0, eval_batches=2, log_every=1, monitor_every=0, ckpt_every=0,
              sample_tokens=0, spike_factor=0.0)
  base.update(kw)
  return get_config("tiny").replace(**base)


def run(cfg, out, **kw):
  opts = dict(out_dir=out, config_name="micro", data=ALICE, progress=False, tensorboard=False)
  return train(cfg, RunOptions(**{**opts, **kw}))


def losses(out):
  return [(r["step"], r["loss"]) for r in read_metrics(out)]


def test_loss_falls_and_outputs_written(tmp_path):
  cfg = micro(max_steps=12, eval_every=6, monitor_every=6, sample_tokens=8, grad_accum=2)
  summary = run(cfg, tmp_path)
  recs = read_metrics(tmp_path)
  assert [r["step"] for r in recs] == list(range(12))
  assert recs[-1]["loss"] < recs[0]["loss"] - 1.0, (recs[0]["loss"], recs[-1]["loss"])
  assert recs[0]["loss"] == pytest.approx(np.log(50304), abs=0.3)  # uniform at init
  assert {"val_loss", "spec_wq", "spec_wk", "max_logit", "tie_frac"} <= set(recs[6])
  assert len(recs[6]["tie_frac"]) == 2
  assert (tmp_path / "checkpoints" / "12").is_dir()
  assert (tmp_path / "loss.png").stat().st_size > 1000
  assert "step 12" in (tmp_path / "samples.txt").read_text()
  assert summary["last_loss"] == recs[-1]["loss"] and summary["stopped"] is None
  assert summary["tokens_per_s"] > 0 and summary["mfu"] is None   # no peak on a CPU
  assert all(r.get("mfu") is None for r in recs)
  # The loop trains with train.step.make_training's state and step, the set-up that
  # benchmarks/train_speed.py times: the same first loss.
  from train import data as data_lib
  from train.sharding import make_mesh
  from train.step import make_training
  training = make_training(cfg, make_mesh())
  data = data_lib.load_data(ALICE, progress=False, log=lambda _: None)
  x, y = data_lib.train_batch(data, 0, seed=cfg.seed, batch_size=cfg.batch_size,
                              grad_accum=cfg.grad_accum, block_size=cfg.model.block_size)
  _, _, m = training.train_step(training.params, training.opt_state, x, y)
  assert float(m["loss"]) == recs[0]["loss"]


@pytest.mark.slow   # an end-to-end run (the README's test command stays under 15 min)
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
  cfg = micro(max_steps=6, lr_decay_steps=6, grad_accum=2)
  run(cfg, tmp_path / "straight")
  # Same schedule, stopped after 3 steps, then resumed to 6 from the checkpoint.
  run(cfg.replace(max_steps=3), tmp_path / "resumed")
  assert [s for s, _ in losses(tmp_path / "resumed")] == [0, 1, 2]
  # A kill while step 3's record was being appended left half of it (tests/test_train_faults.py
  # cuts it at every byte): the resume drops it, says so in one line, and logs step 3 again.
  with open(tmp_path / "resumed" / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "loss": 10.1')
  summary = run(cfg, tmp_path / "resumed")
  assert summary["start_step"] == 3
  assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")  # bitwise equal
  said = [line for line in (tmp_path / "resumed" / "train.log").read_text().splitlines()
          if line.startswith("metrics:")]
  assert said == [f"metrics: {tmp_path / 'resumed' / 'metrics.jsonl'}: dropped its last line, cut "
                  f"short when the run before was killed (24 bytes: '{{\"step\": 3, \"loss\": "
                  f"10.1')"], said
  # A finished run started again has nothing to do, and keeps the outputs of the run that trained.
  outputs = ("summary.json", "loss.png")
  written = {name: (tmp_path / "resumed" / name).read_bytes() for name in outputs}
  again = run(cfg, tmp_path / "resumed")
  assert again["start_step"] == again["end_step"] == 6
  assert again["first_loss"] == losses(tmp_path / "straight")[0][1]
  assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
  assert {name: (tmp_path / "resumed" / name).read_bytes() for name in outputs} == written
  assert json.loads(written["summary.json"])["start_step"] == 3
  # The first loss is step 0's, trained before the resume.
  assert json.loads(written["summary.json"])["first_loss"] == losses(tmp_path / "straight")[0][1]
  assert json.loads(written["summary.json"])["tokens_per_s"] > 0
  # ... unless that run was cut off before its summary: then the rerun writes one.
  (tmp_path / "resumed" / "summary.json").unlink()
  run(cfg, tmp_path / "resumed")
  rewritten = json.loads((tmp_path / "resumed" / "summary.json").read_text())
  assert rewritten["end_step"] == 6
  assert (rewritten["first_loss"], rewritten["last_loss"]) == (losses(tmp_path / "straight")[0][1],
                                                               losses(tmp_path / "straight")[-1][1])


# Orbax's failed reads leave callbacks into a closed event loop; each would print a traceback.
@pytest.mark.slow   # an end-to-end run (the README's test command stays under 15 min)
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_resume_after_a_crash_logs_each_step_once(tmp_path, monkeypatch):
  """A run killed after its last checkpoint had logged later steps: the resumed run logs them again,
  and metrics.jsonl and TensorBoard hold each step once; the first loss_avg after the resume
  averages its whole log interval, and summary.json keeps step 0's loss as the first loss. Then
  the newest checkpoint is cut short: one line names it, it is set aside, and the run resumes from
  the one before and redoes the same steps."""
  import train.data as data_lib
  import train.loop as loop
  cfg = micro(max_steps=6, log_every=4, ckpt_every=3)
  seen = {}  # step -> loss of every step trained; the records hold every 4th

  check, batch = loop._check_loss, data_lib.train_batch

  def spy(step, loss, *args):
    seen[step] = loss
    return check(step, loss, *args)

  def killed_at_5(data, step, **kw):
    if step == 5:
      raise RuntimeError("killed")  # no checkpoint, nothing closed: as a kill -9
    return batch(data, step, **kw)

  monkeypatch.setattr(loop, "_check_loss", spy)
  monkeypatch.setattr(data_lib, "train_batch", killed_at_5)
  with pytest.raises(RuntimeError, match="killed"):
    run(cfg, tmp_path, tensorboard=True)
  monkeypatch.setattr(data_lib, "train_batch", batch)
  # Steps 0-4 ran and 0 and 4 were logged, but the newest checkpoint is step 3's.
  assert [r["step"] for r in read_metrics(tmp_path)] == [0, 4]
  assert [s for s, _ in read_tensorboard(tmp_path / "tb")["loss"]] == [0, 4]
  killed = dict(seen)

  summary = run(cfg, tmp_path, tensorboard=True)
  assert summary["start_step"] == 3 and seen[3] == killed[3] and seen[4] == killed[4]
  recs = read_metrics(tmp_path)
  assert [r["step"] for r in recs] == [0, 4, 5]
  assert recs[1]["loss_avg"] == float(np.mean([killed[s] for s in (1, 2, 3, 4)]))
  tb = read_tensorboard(tmp_path / "tb")
  for tag, points in tb.items():
    steps = [s for s, _ in points]
    assert len(steps) == len(set(steps)), (tag, steps)
  for key in ("loss", "loss_avg", "grad_norm"):
    assert [s for s, _ in tb[key]] == [0, 4, 5], key
    assert [v for _, v in tb[key]] == pytest.approx([r[key] for r in recs], rel=1e-6), key
  assert summary["first_loss"] == killed[0] == recs[0]["loss"]
  assert json.loads((tmp_path / "summary.json").read_text())["first_loss"] == killed[0]

  from tests.test_train_checkpoint import _truncate_arrays
  _truncate_arrays(tmp_path / "checkpoints" / "6")
  log_before = (tmp_path / "train.log").read_text()
  summary = run(cfg, tmp_path, tensorboard=True)
  said = [line for line in (tmp_path / "train.log").read_text()[len(log_before):].splitlines()
          if "read back" in line]
  assert len(said) == 1, said
  assert said[0].startswith(f"checkpoint: {tmp_path / 'checkpoints' / '6'} does not read back: "
                            f"its arrays do not read"), said
  assert summary["start_step"] == 3 and (tmp_path / "checkpoints" / "6.corrupt").is_dir()
  keys = ("step", "loss", "loss_avg", "grad_norm", "lr")
  assert [{k: r[k] for k in keys} for r in read_metrics(tmp_path)] == [{k: r[k] for k in keys}
                                                                       for r in recs]
  assert [s for s, _ in read_tensorboard(tmp_path / "tb")["loss"]] == [0, 4, 5]


@pytest.mark.slow   # README test command's time (2026-12-03): CI's slow part runs it
def test_a_finished_run_started_again_keeps_its_sample(tmp_path):
  cfg = micro(max_steps=2, sample_tokens=4)
  run(cfg, tmp_path)
  samples = (tmp_path / "samples.txt").read_text()
  assert samples.count("===== step 2 =====") == 1
  run(cfg, tmp_path)
  assert (tmp_path / "samples.txt").read_text() == samples


def test_a_stop_on_the_first_step_is_reported(tmp_path, monkeypatch):
  """The run stops before any loss is recorded: the stop, not a formatting error, reaches the
  caller."""
  import train.loop as loop

  def stop(step, *args, **kwargs):
    raise TrainingStopped(f"train: STOPPED at step {step}: test stop")
  monkeypatch.setattr(loop, "_check_loss", stop)
  with pytest.raises(TrainingStopped, match="STOPPED at step 0: test stop"):
    run(micro(max_steps=3), tmp_path)


def test_time_limit_checkpoints_and_the_same_run_resumes(tmp_path):
  cfg = micro(max_steps=5)
  summary = run(cfg, tmp_path, time_limit=1e-6)
  assert summary["time_limit_reached"] and summary["last_checkpoint"] == 1
  assert [s for s, _ in losses(tmp_path)] == [0]
  summary = run(cfg, tmp_path)
  assert summary["start_step"] == 1 and not summary["time_limit_reached"]
  assert [s for s, _ in losses(tmp_path)] == list(range(5))
  with pytest.raises(ValueError, match="--time-limit must be a positive number"):
    run(cfg, tmp_path / "other", time_limit=0)


@pytest.mark.slow   # an end-to-end run (the README's test command stays under 15 min)
def test_interrupt_checkpoints_and_resume_refusals(tmp_path, monkeypatch):
  """Ctrl-C during a run leaves a resumable checkpoint; --no-resume and incompatible runs refuse
  it."""
  import train.data as data_lib
  cfg = micro(max_steps=5)
  batch = data_lib.train_batch

  def interrupted_at_3(data, step, **kw):
    if step == 3:
      raise KeyboardInterrupt
    return batch(data, step, **kw)

  monkeypatch.setattr(data_lib, "train_batch", interrupted_at_3)
  with pytest.raises(KeyboardInterrupt):
    run(cfg, tmp_path)
  monkeypatch.setattr(data_lib, "train_batch", batch)
  # Steps 0-2 completed: their records are written and a checkpoint holds them.
  assert [s for s, _ in losses(tmp_path)] == [0, 1, 2]
  assert (tmp_path / "checkpoints" / "3").is_dir()
  assert "interrupted; checkpoint at step 3" in (tmp_path / "train.log").read_text()
  # A checkpoint of another run is never silently reused.
  with pytest.raises(ValueError, match="--no-resume"):
    run(cfg, tmp_path, resume=False)
  with pytest.raises(ValueError, match="same seed"):
    run(cfg.replace(seed=1), tmp_path)
  with pytest.raises(ValueError, match="another shape"):
    run(micro(max_steps=5, model=dict(n_layer=2, n_head=2, n_embd=64, block_size=32,
                                      attention="jax_xla", max_adjust="off")), tmp_path)
  summary = run(cfg, tmp_path)
  assert summary["start_step"] == 3 and summary["end_step"] == 5
  assert [s for s, _ in losses(tmp_path)] == list(range(5))


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
  # A learning rate of 1e30 overflows the weights after one update: the next loss is NaN.
  cfg = micro(max_steps=6, ckpt_every=1, lr=1e30, min_lr=1e30, warmup_steps=0, grad_clip=0.0)
  with pytest.raises(TrainingStopped,
                     match=r"STOPPED at step \d+: loss nan.*last good checkpoint \(step \d\)"):
    run(cfg, tmp_path)
  # No "done" line; the stop is in train.log once, and left to the caller to print last (the
  # command line does, on stderr).
  printed = capsys.readouterr().out
  assert "train: done" not in printed and "STOPPED" not in printed, printed
  assert (tmp_path / "train.log").read_text().count("STOPPED") == 1
  ckpts = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  stopped_at = json.loads((tmp_path / "summary.json").read_text())["last_checkpoint"]
  assert ckpts and max(ckpts) == stopped_at and stopped_at < 6
  last = read_metrics(tmp_path)[-1]
  assert last["loss"] is None and "STOPPED" in last["stopped"] and last["step"] >= stopped_at


def test_spike_detection():
  from train.loop import RunState, _check_loss
  cfg = micro(spike_factor=1.5, warmup_steps=0)
  state = RunState(last_good=100)
  for step in range(150):
    _check_loss(step, 4.0 + 0.1 * (step % 3), 1.0, cfg, state, Path("out"))
  _check_loss(150, 5.9, 1.0, cfg, state, Path("out"))  # below 1.5 x ~4.1
  with pytest.raises(TrainingStopped, match=r"step 151: loss spike 7\.000 > 1\.5 x running mean"):
    _check_loss(151, 7.0, 1.0, cfg, state, Path("out"))
  with pytest.raises(TrainingStopped, match="grad norm inf"):
    _check_loss(152, 4.0, float("inf"), cfg, state, Path("out"))
  early = RunState(loss_ema=4.0)
  _check_loss(50, 9.0, 1.0, cfg, early, Path("out"))  # before step 100: not judged
  assert early.loss_ema == pytest.approx(0.95 * 4.0 + 0.05 * 9.0)


def test_the_schedule_line_says_where_a_run_does_not_leave_its_warm_up():
  """Issue 48: `--config gpt2 --max-steps 80` logged "warm-up 2000, cosine to 6e-05 at 80" while the
  lr stayed in the warm-up, reaching 2.4e-05."""
  from train.optim import describe_schedule, lr_schedule
  gpt2 = get_config("gpt2")
  line, warning = describe_schedule(gpt2.replace(max_steps=80))
  assert line == ("lr 0.0006 (warm-up 2000 steps, longer than this run's 80: the lr only reaches "
                  "2.4e-05; --warmup-steps sets it)")
  assert float(lr_schedule(gpt2.replace(max_steps=80))(79)) == pytest.approx(2.4e-5, rel=0.01)
  assert warning == ("the warm-up (2000 steps) is longer than this run (80 steps): the lr rises to "
                     "2.4e-05 at most, not to --lr 0.0006, and no cosine follows; --warmup-steps "
                     "sets it")
  assert describe_schedule(gpt2.replace(max_steps=2000))[0] == (
      "lr 0.0006 (warm-up 2000 steps, as long as this run: no cosine follows; --warmup-steps sets "
      "it)")
  ends_early = gpt2.replace(max_steps=3000, lr_decay_steps=1500)
  line, warning = describe_schedule(ends_early)
  assert "then 6e-05 from step 2001: --lr-decay-steps 1500 ends the cosine within" in line, line
  assert float(lr_schedule(ends_early)(2001)) == pytest.approx(6e-5) and warning
  for cfg in (gpt2, gpt2.replace(max_steps=2002), micro(warmup_steps=0, max_steps=1)):
    assert describe_schedule(cfg) == (f"lr {cfg.lr:g} (warm-up {cfg.warmup_steps}, cosine to "
                                      f"{cfg.min_lr:g} at {cfg.decay_steps})", None)


SHARDED = """
import json, sys
sys.path.insert(0, {root!r})
import jax
from tests.test_train_loop import micro, run, losses, first_monitors
assert jax.device_count() == {n}, jax.devices()
out = {{}}
ours = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, max_adjust="safe")
# A Pallas kernel partitions itself over the data axis (stable_attn.partition), also when FSDP
# shards the projections that make q, k and v.
arms = {{"dp": dict(),
        "ours_fsdp": dict(fsdp=True, model=dict(ours, attention="reference")),
        "pallas_fsdp": dict(fsdp=True, model=dict(ours, attention="pallas_gpu"))}}
# The final sample reads whole parameters: XLA 0.11's GPU compiler segfaulted on the sampler's
# loop over FSDP-split ones (4 H200s). Recorded per sample: were they replicated?
import train.loop
whole, generate = [], train.loop.generate_text
def spy(sampler, params, *args, **kwargs):
    whole.append(all(x.sharding.is_fully_replicated for x in jax.tree.leaves(params)))
    return generate(sampler, params, *args, **kwargs)
train.loop.generate_text = spy
# The monitors on 2 rows, which 4 devices do not divide: each device runs their attention whole
# (left to stable_attn's partitioning beside FSDP, JAX failed: IndivisibleError).
train.loop.MONITOR_ROWS = 2
monitors = {{}}
for name, kw in arms.items():
    d = {tmp!r} + "/" + name
    run(micro(max_steps=4, grad_accum=2, sample_tokens=2, monitor_every=2, **kw), d)
    out[name] = losses(d)
    monitors[name] = first_monitors(d)
print("RESULT" + json.dumps(dict(losses=out, whole=whole, monitors=monitors)))
"""


def first_monitors(out):
  """The attention monitors of the first record (before any update: the seed's parameters)."""
  record = read_metrics(out)[0]
  return [record[k] for k in ("max_logit", "tie_frac")]


@pytest.mark.slow
def test_sharded_training_matches_single_device(tmp_path, monkeypatch):
  monkeypatch.setattr(train_loop, "MONITOR_ROWS", 2)
  run(micro(max_steps=4, grad_accum=2, monitor_every=2), tmp_path / "single")
  single = [l for _, l in losses(tmp_path / "single")]
  single_monitors = first_monitors(tmp_path / "single")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, "-c", SHARDED.format(root=str(ROOT), n=4, tmp=str(tmp_path))],
      env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.split("RESULT")[-1])
  assert result["whole"] == [True] * 3, result["whole"]
  for name, got in result["monitors"].items():
    np.testing.assert_allclose(got, single_monitors, rtol=5e-3, err_msg=name)
  for name, traj in result["losses"].items():
    got = [l for _, l in traj]
    # Data parallel changes only reduction order; our attention vs jax.nn's adds bf16 rounding.
    np.testing.assert_allclose(got, single, rtol=2e-3 if name == "dp" else 5e-3, err_msg=name)


# ----------------------------------------------------------------------------- CLI


def test_cli_defaults_and_flags():
  args = build_parser().parse_args([])
  cfg = build_config(args)
  assert args.config == "tiny" and cfg == get_config("tiny")
  args = build_parser().parse_args(["--config", "paper", "--max-steps", "10", "--attention",
                                    "reference", "--max-adjust", "paper", "--numerics", "paper",
                                    "--batch-size", "4"])
  cfg = build_config(args)
  assert (cfg.max_steps, cfg.batch_size, cfg.model.attention, cfg.model.max_adjust,
          cfg.model.numerics) == (10, 4, "reference", "paper", "paper")
  assert not cfg.model.bias and cfg.lr == 1e-3 and cfg.tokens_per_step == 4 * 16 * 1024
  assert cfg.model.qkv_packed and cfg.model.qkv_bias_in_matmul   # the defaults
  cfg = build_config(build_parser().parse_args(["--no-qkv-packed", "--no-qkv-bias-in-matmul"]))
  assert not cfg.model.qkv_packed and not cfg.model.qkv_bias_in_matmul


def test_cli_choices_follow_stable_attn():
  """--attention / --max-adjust / --numerics accept exactly what stable_attn offers, plus jax.nn's
  peers."""
  import stable_attn
  from train.config import ATTENTION_CHOICES, MAX_ADJUST_CHOICES, NUMERICS_CHOICES
  assert ATTENTION_CHOICES == ("auto",) + stable_attn.IMPLEMENTATIONS + ("cudnn", "jax_xla")
  assert MAX_ADJUST_CHOICES == stable_attn.MAX_ADJUST_MODES
  assert set(NUMERICS_CHOICES) == set(stable_attn.PRESETS)
  for impl in stable_attn.IMPLEMENTATIONS:
    assert build_config(build_parser().parse_args(["--attention", impl])).model.attention == impl


@pytest.mark.parametrize("argv,match", [
    (["--config", "gpt5"], "--config 'gpt5' is unknown"),
    (["--attention", "flash"], "attention='flash' is not one of"),
    (["--max-adjust", "sometimes"], "max_adjust='sometimes'"),
    (["--numerics", "fp4"], "numerics='fp4'"),
    (["--attention", "cudnn", "--max-adjust", "paper"], "does not apply"),
    (["--max-steps", "0"], r"max_steps \(--max-steps\) must be positive"),
    (["--corpus", "owt"], "--corpus 'owt' is unknown"),
    (["--keep-checkpoints", "0"], r"keep_checkpoints \(--keep-checkpoints\) must be at least 1"),
    (["--fp8-backward"], r"fp8_backward \(--fp8-backward\) is the FP8 forward's backward: it "
                         r"needs numerics with e4m3 q, k, v and P .* got 'fast'"),
    (["--fp8-backward", "--numerics", "fp8", "--attention", "xla"],
     r"fp8_backward \(--fp8-backward\) runs on the Hopper kernel: .* got 'xla'"),
])
def test_cli_bad_flags_raise_value_error(argv, match):
  with pytest.raises(ValueError, match=match):
    build_config(build_parser().parse_args(argv))


def test_fp8_backward_needs_the_hopper_kernel():
  """--fp8-backward (the Hopper kernel's FP8 backward) is refused before anything runs where the
  attention is another backend: "auto" on a CPU."""
  from train.attention import check_attention
  assert build_config(build_parser().parse_args(
      ["--fp8-backward", "--numerics", "fp8"])).model.fp8_backward
  cfg = micro(model=dict(attention="auto", numerics="fp8", max_adjust="safe", fp8_backward=True))
  with pytest.raises(ValueError, match=r"--fp8-backward: the FP8 backward is the Hopper kernel's "
                                       r"\(pallas_mosaic_gpu, on an sm_90 GPU\); the attention "
                                       r"here is auto -> '"):
    check_attention(cfg)


def test_cli_main_reports_bad_flags(capsys):
  assert cli_main(["--attention", "flash"]) == 2
  assert "attention='flash' is not one of" in capsys.readouterr().err


@pytest.mark.usefixtures("restore_cache_config")
def test_cli_refuses_bad_inputs_before_writing_anything(tmp_path, capsys):
  """A bad --keep-checkpoints, --out-dir, --data or --compilation-cache: exit code 2 and one line
  naming it, before an out dir or its train.log exists."""
  a_file = tmp_path / "a_file"
  a_file.write_text("not a directory")
  short = tmp_path / "short.txt"
  short.write_text("Too short to hold one window of 32 tokens.")
  cases = [
      (["--keep-checkpoints", "0", "--data", ALICE], tmp_path / "keep", "--keep-checkpoints"),
      (["--data", ALICE], a_file, f"--out-dir {a_file} is a file, not a directory"),
      (["--data", ALICE], a_file / "out",
       f"--out-dir {a_file / 'out'} cannot be created: {a_file} is a file"),
      (["--data", str(tmp_path / "missing")], tmp_path / "missing_data",
       f"--data {tmp_path / 'missing'}: no such file or directory"),
      (["--data", str(short)], tmp_path / "short_data", "fewer than block_size + 1 = 33"),
      (["--data", ALICE, "--compilation-cache", str(a_file / "cache")], tmp_path / "cache_out",
       f"--compilation-cache {a_file / 'cache'} cannot be created: {a_file} is a file"),
  ]
  for argv, out, says in cases:
    cache = [] if "--compilation-cache" in argv else ["--no-compilation-cache"]
    rc = cli_main(["--config", "tiny", "--block-size", "32", "--batch-size", "2", "--no-progress",
                   "--no-tensorboard", "--out-dir", str(out)] + argv + cache)
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"{PROG}: error: "), (argv, err)
    assert says in err[0], (says, err[0])
    assert out == a_file or not out.exists(), out
  assert a_file.read_text() == "not a directory"


@pytest.mark.slow   # an end-to-end run (the README's test command stays under 15 min)
@pytest.mark.usefixtures("restore_cache_config")
def test_cli_runs_a_job_and_reports_unreadable_checkpoints_in_one_line(tmp_path, capsys):
  out, cache = tmp_path / "cli", tmp_path / "jax_cache"
  flags = ["--config", "tiny", "--out-dir", str(out), "--data", ALICE, "--block-size", "32",
           "--batch-size", "2", "--attention", "jax_xla", "--sample-tokens", "4", "--no-progress",
           "--no-tensorboard", "--eval-batches", "1", "--compilation-cache", str(cache)]
  assert cli_main(flags + ["--max-steps", "2"]) == 0
  # The persistent compilation cache was on, where the flag said, and the log says so.
  assert any(p.name.startswith("jit_step-") for p in cache.iterdir()), sorted(cache.iterdir())
  assert f"persistent compilation cache: {cache}" in (out / "train.log").read_text()
  recs = read_metrics(out)
  assert recs[0]["step"] == 0 and "loss" in recs[0]
  assert (out / "checkpoints" / "2").is_dir() and (out / "loss.png").exists()
  capsys.readouterr()
  # Its array files cut short: python -m train ends in one line naming the directory, exit code 2;
  # Orbax's tracebacks of the reads in flight (printed up to the interpreter's exit, thousands of
  # lines for a model) go to checkpoint_errors.log.
  pristine = tmp_path / "pristine"
  shutil.copytree(out / "checkpoints", pristine)
  from tests.test_train_checkpoint import _garble_meta, _truncate_arrays
  _truncate_arrays(out / "checkpoints" / "2")
  proc = subprocess.run([sys.executable, "-m", "train", *flags, "--max-steps", "4"], cwd=ROOT,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  lines = proc.stdout.splitlines()
  assert proc.returncode == 2 and lines[-1].startswith(
      f"{PROG}: error: no checkpoint in {out / 'checkpoints'} reads back (steps 2); the newest, 2: "
      f"its arrays do not read ("), lines[-3:]
  assert lines[-1].endswith(f"(tracebacks in {out / 'checkpoint_errors.log'})"), lines[-1]
  assert not any("Traceback" in line or "exception" in line for line in lines), lines
  assert "Traceback" in (out / "checkpoint_errors.log").read_text()
  shutil.rmtree(out / "checkpoints")
  shutil.copytree(pristine, out / "checkpoints")
  # No checkpoint reads back: one line naming the directory, exit code 2, nothing moved.
  _garble_meta(out / "checkpoints" / "2")
  assert cli_main(flags + ["--max-steps", "4"]) == 2
  assert capsys.readouterr().err.splitlines() == [
      f"{PROG}: error: no checkpoint in {out / 'checkpoints'} reads back (steps 2); the newest, 2: "
      f"its JSON part {out / 'checkpoints' / '2' / 'meta'} does not read (JSONDecodeError: "
      f"Unterminated string starting at: line 1 column 18 (char 17)); move the directory away to "
      f"start afresh (tracebacks in {out / 'checkpoint_errors.log'})"]
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2"]


def test_deterministic_sets_xla_flags_and_refuses_cudnn(tmp_path, monkeypatch, capsys):
  """--deterministic appends XLA's flag to XLA_FLAGS (last, so that it wins over an earlier
  `=false`); with jax.nn's cuDNN attention, which fails under it, exit code 2 naming both flags,
  before anything is written."""
  from train.cli import DETERMINISTIC_XLA_FLAG as FLAG, deterministic_xla_flags
  assert FLAG == "--xla_gpu_deterministic_ops=true"
  assert deterministic_xla_flags(None) == deterministic_xla_flags("  ") == FLAG
  assert deterministic_xla_flags("--xla_gpu_deterministic_ops=false") == (
      f"--xla_gpu_deterministic_ops=false {FLAG}")
  assert deterministic_xla_flags(f"--xla_foo=1 {FLAG}") == f"--xla_foo=1 {FLAG}"
  monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
  out = tmp_path / "out"
  assert cli_main(["--attention", "cudnn", "--deterministic", "--data", ALICE, "--out-dir",
                   str(out), "--no-progress"]) == 2
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith(f"{PROG}: error: --attention cudnn cannot run under "
                                             f"--deterministic"), err
  assert os.environ["XLA_FLAGS"] == f"--xla_foo=1 {FLAG}" and not out.exists()
  assert "bitwise-reproducible steps on GPUs" in build_parser().format_help()


DETERMINISTIC_FIRST = """
import sys
import train.cli as cli
# The flags --deterministic sets, swapped for one that CPU XLA shows: 3 devices if XLA read them,
# that is if nothing before main's write started a JAX backend.
cli.deterministic_xla_flags = lambda flags: "--xla_force_host_platform_device_count=3"
cli._run = lambda args, cfg, opts: print("DEVICES", __import__("jax").device_count())
sys.exit(cli.main(["--deterministic", "--no-compilation-cache"]))
"""


def test_deterministic_sets_xla_flags_before_jax_starts(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-c", DETERMINISTIC_FIRST], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and "DEVICES 3" in proc.stdout, proc.stdout + proc.stderr[-2000:]


@pytest.mark.slow   # README test command's time (2026-12-03): CI's slow part runs it
def test_python_m_train_without_tensorboardx_says_so_once_and_trains_on(tmp_path):
  """One `python -m train` run (one, to keep the suite fast) for the lines of issues 48 and 44:
  tensorboardX made unimportable (a package of that name that fails as a missing one does) gives
  one line before the model is built, and the run trains on without tb/; a warm-up longer than the
  run is kept (each step's lr is the long run's) and the log says so; against a peak far too low,
  the first MFU above 100% gets one warning naming the peak, and the closing line calls it wrong;
  --deterministic is logged, with the CPU's line."""
  blocker = tmp_path / "blocker" / "tensorboardX"
  blocker.mkdir(parents=True)
  (blocker / "__init__.py").write_text(
      "raise ModuleNotFoundError(\"No module named 'tensorboardX'\", name='tensorboardX')\n")
  out = tmp_path / "out"
  proc = subprocess.run(
      [sys.executable, "-m", "train", "--config", "tiny", "--block-size", "32", "--batch-size",
       "2", "--attention", "jax_xla", "--data", ALICE, "--max-steps", "3", "--log-every", "1",
       "--eval-every", "0", "--monitor-every", "0", "--sample-tokens", "0", "--no-progress",
       "--no-compilation-cache", "--deterministic", "--peak-tflops", "1e-9", "--out-dir",
       str(out)],
      cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": f"{tmp_path / 'blocker'}{os.pathsep}{ROOT}"})
  lines = proc.stdout.splitlines()
  assert proc.returncode == 0, lines[-20:]
  said = ("tensorboard: tensorboardX is not installed; metrics go to metrics.jsonl only "
          "(--no-tensorboard silences this)")
  assert lines.count(said) == 1 and (out / "train.log").read_text().count(said) == 1, lines
  assert lines.index(said) < next(i for i, l in enumerate(lines) if "M parameters;" in l)
  records = read_metrics(out)
  assert [r["step"] for r in records] == [0, 1, 2] and not list(out.glob("tb/*tfevents*"))
  # tiny's 20 warm-up steps, not scaled to the 3 of this run.
  assert [r["lr"] for r in records] == pytest.approx([3e-3 * (s + 1) / 21 for s in range(3)])
  assert any("; 3 steps; lr 0.003 (warm-up 20 steps, longer than this run's 3: the lr only reaches "
             "0.00043; --warmup-steps sets it); AdamW" in line for line in lines), lines
  warned = [line for line in lines if line.startswith("train: warning: ")]
  assert len(warned) == 2, warned   # the warm-up's, then the first of two MFUs above 100%
  assert warned[0] == ("train: warning: the warm-up (20 steps) is longer than this run (3 steps): "
                       "the lr rises to 0.00043 at most, not to --lr 0.003, and no cosine follows; "
                       "--warmup-steps sets it")
  peak = "1e-09 TFLOP/s per device from --peak-tflops"
  assert re.fullmatch(rf"train: warning: MFU [\d.]+% at step 1 is above 100%, so the peak it "
                      rf"divides by \({re.escape(peak)}\) must be wrong; --peak-tflops sets one",
                      warned[1]), warned[1]
  (closing,) = [line for line in lines if line.startswith("train: median ")]
  assert closing.endswith(f"% (above 100%, so the peak it divides by ({peak}) must be wrong; "
                          f"--peak-tflops sets one)"), closing
  summary = json.loads((out / "summary.json").read_text())
  assert summary["mfu"] > 1 and (summary["mfu_peak"], summary["peak_tflops"]) == (peak, 1e-9)
  assert any("; FSDP False; data parallel; deterministic True; " in line for line in lines), lines
  assert ("train: --deterministic applies to GPUs (XLA's deterministic reductions); CPU XLA is "
          "deterministic already") in lines


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  """Multi-host code path (jax.distributed, per-host batch rows, Orbax from 2 processes) on
  localhost CPU."""
  flags = ["--data", ALICE, "--block-size", "32", "--batch-size", "4", "--max-steps", "3",
           "--log-every", "1", "--eval-every", "0", "--monitor-every", "0", "--ckpt-every", "2",
           "--sample-tokens", "0", "--attention", "jax_xla", "--no-progress", "--no-tensorboard",
           "--no-compilation-cache"]
  port = _free_port()
  base_env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  base_env.pop("XLA_FLAGS", None)
  procs = [subprocess.Popen(
      [sys.executable, "-m", "train", *flags, "--out-dir", str(tmp_path / "multi")],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**base_env, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)})
           for i in range(2)]
  single = subprocess.run(
      [sys.executable, "-m", "train", *flags, "--out-dir", str(tmp_path / "single")],
      cwd=ROOT, capture_output=True, text=True, env=base_env, timeout=300)
  outs = [p.communicate(timeout=300)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
  assert single.returncode == 0, single.stderr[-2000:]
  assert "2 process(es)" in outs[0]
  multi_l = [l for _, l in losses(tmp_path / "multi")]
  single_l = [l for _, l in losses(tmp_path / "single")]
  assert len(multi_l) == 3
  np.testing.assert_allclose(multi_l, single_l, rtol=1e-4)
  assert (tmp_path / "multi" / "checkpoints" / "3").is_dir()
