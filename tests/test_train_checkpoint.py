"""train.checkpoint: a corrupt newest checkpoint is set aside with one line and the newest one that
reads back is resumed; when none reads back, one line names the directory."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from train.checkpoint import CheckpointError, Checkpointer


def _meta(step):
  return {"data_step": step, "seed": 0, "sample_key": [0, 0], "config": {}}


def _arrays(step):
  params = {"w": jnp.full((4, 8), float(step)), "b": jnp.arange(8.0) + step}
  return params, {"m": jnp.ones(3) * step}


def _truncate_arrays(step_dir: Path):
  # Orbax (OCDBT) keeps array bytes in files under .../d/; a kill mid-copy leaves them short.
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files
  for p in files:
    p.write_bytes(p.read_bytes()[:p.stat().st_size // 2])


def _garble_manifests(step_dir: Path):
  files = list((step_dir / "state").rglob("manifest.ocdbt"))
  assert files
  for p in files:
    p.write_bytes(b"garbage" * 8)


def _garble_meta(step_dir: Path):
  (step_dir / "meta" / "metadata").write_text('{"data_step": 3, "se')


def _garble_tree_metadata(step_dir: Path):
  (step_dir / "state" / "_METADATA").write_text("{not json")


def _meta_without_seed(step_dir: Path):
  (step_dir / "meta" / "metadata").write_text(
      '{"data_step": 3, "sample_key": [0, 0], "config": {}}')


CORRUPTIONS = {"truncated array file": _truncate_arrays, "garbage manifest": _garble_manifests,
               "garbage metadata JSON": _garble_meta,
               "garbage tree metadata": _garble_tree_metadata,
               "JSON without the seed": _meta_without_seed}


@pytest.fixture
def three(tmp_path):
  """Checkpoints of steps 1, 2, 3 with distinct values."""
  ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
  for step in (1, 2, 3):
    ckpt.save(step, *_arrays(step), _meta(step))
  ckpt.close()
  return tmp_path / "checkpoints"


# Orbax's failed reads leave callbacks into a closed event loop; each would print a traceback.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_corrupt_newest_checkpoint_falls_back_with_one_line(three, kind):
  CORRUPTIONS[kind](three / "3")
  ckpt = Checkpointer(three, keep=3)
  warnings = []
  step, params, opt_state, meta = ckpt.restore_latest(*_arrays(0), warn=warnings.append)
  assert step == 2 and meta == _meta(2)
  np.testing.assert_array_equal(params["w"], np.full((4, 8), 2.0))
  np.testing.assert_array_equal(opt_state["m"], np.full(3, 2.0))
  assert len(warnings) == 1 and "\n" not in warnings[0], warnings
  assert f"{three / '3'} does not read back" in warnings[0]
  assert "resuming from step 2" in warnings[0]
  # Set aside, not deleted; the step can be written again (Orbax refuses an existing step).
  assert (three / "3.corrupt").is_dir() and not (three / "3").exists()
  assert ckpt.latest_step() == 2
  ckpt.save(3, *_arrays(3), _meta(3))
  assert ckpt.restore_latest(*_arrays(0), warn=warnings.append)[0] == 3 and len(warnings) == 1
  ckpt.close()


def test_two_corrupt_checkpoints_each_get_a_line(three):
  _truncate_arrays(three / "3")
  _garble_meta(three / "2")
  ckpt = Checkpointer(three, keep=3)
  warnings = []
  assert ckpt.restore_latest(*_arrays(0), warn=warnings.append)[0] == 1
  assert [w.split(" does not")[0] for w in warnings] == [f"checkpoint: {three / '3'}",
                                                         f"checkpoint: {three / '2'}"]
  assert "its arrays do not read" in warnings[0] and "its JSON part" in warnings[1]
  ckpt.close()


def test_no_readable_checkpoint_is_one_error_naming_the_directory(three):
  for step, kind in zip((1, 2, 3), ("truncated array file", "garbage manifest",
                                    "garbage metadata JSON")):
    CORRUPTIONS[kind](three / str(step))
  ckpt = Checkpointer(three, keep=3)
  with pytest.raises(CheckpointError) as e:
    ckpt.restore_latest(*_arrays(0), warn=pytest.fail)
  msg = str(e.value)
  assert "\n" not in msg and f"no checkpoint in {three} reads back (steps 3, 2, 1)" in msg, msg
  assert f"{three / '3' / 'meta'} does not read" in msg
  # Nothing is moved when nothing can be resumed: the next attempt reports the same.
  assert sorted(p.name for p in three.iterdir()) == ["1", "2", "3"]
  ckpt.close()


def test_an_incompatible_checkpoint_is_refused_not_skipped(three):
  ckpt = Checkpointer(three, keep=3)

  def check(meta):
    raise ValueError(f"another run's checkpoint (step {meta['data_step']})")
  with pytest.raises(ValueError, match=r"another run's checkpoint \(step 3\)"):
    ckpt.restore_latest(*_arrays(0), check=check, warn=pytest.fail)
  assert sorted(p.name for p in three.iterdir()) == ["1", "2", "3"]
  ckpt.close()


def test_no_checkpoint_is_none(tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints")
  assert ckpt.restore_latest(*_arrays(0), warn=pytest.fail) is None
  ckpt.close()
