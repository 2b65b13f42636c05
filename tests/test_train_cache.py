"""train/jax_cache.py: JAX's persistent compilation cache of `python -m train` and the benchmarks
(--compilation-cache DIR, --no-compilation-cache; $JAX_COMPILATION_CACHE_DIR respected)."""

import argparse

import jax
import pytest

from train import jax_cache

NAMES = ("jax_compilation_cache_dir", *jax_cache.SETTINGS)


@pytest.fixture
def restore_cache_config(monkeypatch):
  """The JAX settings that jax_cache changes, put back afterwards (this process keeps running
  other tests), and no cache-related environment from outside the test."""
  for name in NAMES:
    monkeypatch.delenv(name.upper(), raising=False)
  saved = {name: getattr(jax.config, name) for name in NAMES}
  yield
  for name, value in saved.items():
    jax.config.update(name, value)
  from jax.experimental.compilation_cache import compilation_cache
  compilation_cache.reset_cache()


def _parse(argv):
  p = argparse.ArgumentParser()
  jax_cache.add_flags(p)
  return p.parse_args(argv).compilation_cache


def test_flags():
  assert _parse([]) is None
  assert _parse(["--compilation-cache", "/x"]) == "/x"
  assert _parse(["--no-compilation-cache"]) == ""
  assert _parse(["--compilation-cache", ""]) == ""
  with pytest.raises(SystemExit):   # one or the other
    _parse(["--compilation-cache", "/x", "--no-compilation-cache"])


def test_flag_sets_the_config_and_creates_nothing(tmp_path, restore_cache_config):
  where = tmp_path / "a" / "cache"
  assert jax_cache.configure(str(where)) == str(where)
  assert jax.config.jax_compilation_cache_dir == str(where)
  for name, value in jax_cache.SETTINGS.items():
    assert getattr(jax.config, name) == value, name
  assert not (tmp_path / "a").exists()   # JAX creates it at the first compilation
  assert jax_cache.describe() == f"persistent compilation cache: {where}"


def test_off_switch_leaves_it_unset(tmp_path, monkeypatch, restore_cache_config):
  jax.config.update("jax_compilation_cache_dir", None)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert jax_cache.configure("") is None
  assert jax.config.jax_compilation_cache_dir is None
  assert jax_cache.describe() == "persistent compilation cache: off"
  # Off also over a directory from the environment (JAX read it at import).
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "env"))
  assert jax_cache.configure("") is None
  assert jax.config.jax_compilation_cache_dir is None
  assert not list(tmp_path.iterdir())


def test_default_and_environment(tmp_path, monkeypatch, restore_cache_config):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert jax_cache.configure(None) == str(tmp_path / "xdg" / "stable_attn" / "jax")
  monkeypatch.setenv(jax_cache.ENV, str(tmp_path / "mine"))
  assert jax_cache.configure(None) == str(tmp_path / "mine")
  assert jax_cache.configure(str(tmp_path / "flag")) == str(tmp_path / "flag")   # the flag wins
  # A setting the user made in the environment stays theirs.
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "5")
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 5.0)
  jax_cache.configure(None)
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 5.0


def test_a_directory_that_cannot_be_created(tmp_path, monkeypatch, capsys, restore_cache_config):
  jax.config.update("jax_compilation_cache_dir", None)
  a_file = tmp_path / "a_file"
  a_file.write_text("not a directory")
  for flag, says in [(str(a_file / "cache"), f"cannot be created: {a_file} is a file"),
                     (str(a_file), "is a file, not a directory")]:
    with pytest.raises(ValueError, match=f"^--compilation-cache {a_file}.* {says}$"):
      jax_cache.configure(flag)
  monkeypatch.setenv(jax_cache.ENV, str(a_file / "env"))
  with pytest.raises(ValueError, match=rf"^\${jax_cache.ENV} {a_file / 'env'} cannot be created"):
    jax_cache.configure(None)
  # The default one is passed over with a note: the cache is an optimisation, not an input.
  monkeypatch.delenv(jax_cache.ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(a_file))
  assert jax_cache.configure(None) is None
  assert jax.config.jax_compilation_cache_dir is None
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith("note: the default compilation cache "), err
  assert a_file.read_text() == "not a directory"
