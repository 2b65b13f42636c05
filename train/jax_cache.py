"""JAX's persistent compilation cache for `python -m train` and the scripts in benchmarks/.

With it, a second launch loads what the first one compiled (the train step, evaluation, monitors,
sampling; the benchmarks' programs) from disk instead of compiling it again. The library
(stable_attn) never turns it on behind the user's back; the trainer and the benchmarks do, through
`add_flags` and `configure`:

  --compilation-cache DIR   where (default: $JAX_COMPILATION_CACHE_DIR when set, else
                            $XDG_CACHE_HOME/stable_attn/jax, i.e. ~/.cache/stable_attn/jax)
  --no-compilation-cache    none in this run (as --compilation-cache '')

A cache directory is trusted code (JAX runs what it finds there): keep it private to you.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax

from .config import check_dir

ENV = "JAX_COMPILATION_CACHE_DIR"
# What `configure` sets with the directory; a setting whose environment variable (the upper-case
# name) is set is left as the user set it.
SETTINGS = {
    # Every program that compiled is written, not only those over JAX's default second: a launch
    # also compiles dozens of small programs (initialisation, eager ops), and together they count.
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    # The Pallas kernels partition themselves with custom_partitioning, whose callback's address is
    # part of every multi-device program that calls them: without this, a second process never
    # finds the entry (and writes another). The address stands for stable_attn/partition.py's
    # rules, which this key then does not cover: after changing those rules, clear the cache.
    "jax_remove_custom_partitioning_ptr_from_cache_key": True,
}


def default_dir() -> Path:
  """$XDG_CACHE_HOME/stable_attn/jax, or ~/.cache/stable_attn/jax."""
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stable_attn" / "jax"


def add_flags(parser: argparse.ArgumentParser) -> None:
  """--compilation-cache DIR and --no-compilation-cache (args.compilation_cache: None = the
  default, '' = off)."""
  group = parser.add_mutually_exclusive_group()
  group.add_argument(
      "--compilation-cache", metavar="DIR",
      help=f"JAX's persistent compilation cache: a second launch loads what the first compiled "
           f"(default: ${ENV} when set, else {default_dir()}; '' = none)")
  group.add_argument("--no-compilation-cache", dest="compilation_cache", action="store_const",
                     const="", help="no persistent compilation cache in this run")


def configure(flag: str | None) -> str | None:
  """Turns JAX's persistent compilation cache on (in the directory `flag` names, else
  $JAX_COMPILATION_CACHE_DIR, else `default_dir()`) or off (flag ''); returns the directory, or
  None when off. Call it before anything compiles. A directory named by the flag or the
  environment that cannot be created raises ValueError in one line, before anything is created;
  a default one that cannot be is passed over with a note on stderr."""
  if flag is not None:
    path, source = flag, "--compilation-cache"
  elif ENV in os.environ:
    path, source = os.environ[ENV], f"${ENV}"
  else:
    path, source = str(default_dir()), None
  if path:
    try:
      check_dir(Path(path), source or "the default compilation cache")
    except ValueError as e:
      if source is not None:
        raise
      print(f"note: {e}; running without a persistent compilation cache", file=sys.stderr)
      path = ""
  if not path:
    _set_dir(None)
    return None
  for name, value in SETTINGS.items():
    if name.upper() not in os.environ:
      jax.config.update(name, value)
  _set_dir(str(path))
  return str(path)


def configure_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
  """`configure(args.compilation_cache)` for a script; a directory that cannot be created ends it
  with the parser's error (exit code 2)."""
  try:
    return configure(args.compilation_cache)
  except ValueError as e:
    parser.error(str(e))


def describe() -> str:
  """One line for a log: where the persistent compilation cache is, or that there is none."""
  path = jax.config.jax_compilation_cache_dir
  if not path or not jax.config.jax_enable_compilation_cache:
    return "persistent compilation cache: off"
  return f"persistent compilation cache: {path}"


def _set_dir(path: str | None) -> None:
  if jax.config.jax_compilation_cache_dir != path:
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX opens its cache once, at the first compilation: make a change after that one count.
    from jax.experimental.compilation_cache import compilation_cache
    compilation_cache.reset_cache()
