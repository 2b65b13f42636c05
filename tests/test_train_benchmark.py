"""benchmarks/train_speed.py times the trainer's own set-up through public functions of train."""

import ast
from pathlib import Path

import pytest

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "train_speed.py"


def test_train_speed_uses_only_public_names_of_train():
  """No private import, and no second copy of the set-up (params, optimizer, shardings, jit)."""
  imported = {}
  for node in ast.walk(ast.parse(SCRIPT.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "train":
      for alias in node.names:
        imported[alias.name] = node.module
  private = sorted(name for name in imported if name.startswith("_"))
  assert not private, f"benchmarks/train_speed.py imports private names of train: {private}"
  assert imported.get("make_training") == "train.step"
  # What make_training does, train_speed must not redo.
  redone = {"make_train_step", "make_optimizer", "init_params", "param_shardings"} & set(imported)
  assert not redone, redone


def test_train_speed_runs_on_cpu(tmp_path, capsys, monkeypatch):
  from benchmarks import train_speed
  from tests.test_train_loop import micro
  # --config tiny made smaller still: the script's own path in a fraction of the compile time.
  monkeypatch.setattr(train_speed, "get_config", lambda name: micro())
  rc = train_speed.main(["--config", "tiny", "--seq", "16", "--batch-size", "2", "--steps", "1",
                         "--warmup", "0", "--arms", "xla", "--out", str(tmp_path), "--n-head", "4",
                         "--no-compilation-cache"])
  assert rc == 0
  table = capsys.readouterr().out
  assert "| xla | jax.nn xla |" in table
  assert "heads 4 x 8," in table  # micro()'s 2 heads of 16 made 4 of 8: the width kept
  assert (tmp_path / "train_speed_tiny_cpu.md").exists(), sorted(tmp_path.iterdir())
  with pytest.raises(ValueError, match="--n-head must divide the config's width 32, got 5"):
    train_speed.main(["--config", "tiny", "--n-head", "5", "--out", str(tmp_path)])


def test_train_profile_attributes_attention_kernels():
  """benchmarks/train_profile.py's table: attention kernels (ours and cuDNN's, by name) apart from
  the rest, per arm, and the largest per-kernel differences between two arms."""
  from benchmarks import train_profile
  times = {"ours": {"stable_attn_forward_mosaic_gpu_kernel": 1000.0, "loop_fusion": 3000.0},
           "cudnn": {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop": 900.0,
                     "void cudnn::fusion::compute_dot_do_o_specialized": 400.0,
                     "loop_fusion": 2500.0}}
  table = train_profile.markdown(times, "# header")
  assert "| ours | 4.00 | 1.00 | 3.00 | stable_attn_forward_mosaic_gpu_kernel 1000 |" in table
  assert "| cudnn | 3.80 | 1.30 | 2.50 |" in table
  assert "- loop_fusion: 3000 - 2500 = +500" in table


@pytest.mark.slow   # README test command's time (2026-12-03): CI's slow part runs it
def test_train_profile_runs_on_cpu(tmp_path, capsys, monkeypatch):
  from benchmarks import train_profile
  from tests.test_train_loop import micro
  monkeypatch.setattr(train_profile, "get_config", lambda name: micro())
  assert train_profile.main(["--config", "tiny", "--arms", "xla", "--steps", "1",
                             "--out", str(tmp_path)]) == 0
  assert "| xla |" in capsys.readouterr().out
  assert (tmp_path / "train_profile_tiny_cpu.md").exists(), sorted(tmp_path.iterdir())
