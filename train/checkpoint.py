"""Orbax checkpoints under DIR/checkpoints/<step>/: params, optimizer state and a JSON of the rest.

Step numbers count completed optimizer steps, so a checkpoint named s resumes by running step s
next. The JSON part holds what exact resume needs besides the arrays: the data position (the step:
batches are a pure function of seed and step), the seed, the PRNG key data used for sampling, and
the config.

A checkpoint that does not read back whole (a truncated array file, garbage in a manifest or in the
JSON part) is moved aside to <step>.corrupt when an older one does read back, and the run resumes
from that one: `Checkpointer.restore_latest`. Each such checkpoint is reported in one line; the
tracebacks, Orbax's own included, go to checkpoint_errors.log in the run directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import traceback
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp

# What every checkpoint's JSON part holds (besides optional bookkeeping), with its JSON type.
META_FIELDS = {"data_step": int, "seed": int, "sample_key": list, "config": dict}


ERROR_LOG = "checkpoint_errors.log"  # in the run directory, beside checkpoints/
PARTIAL_SAVE = ".orbax-checkpoint-tmp"  # Orbax's suffix of a checkpoint being written


class CheckpointError(ValueError):
  """Checkpoints exist but none of them reads back; the message is one line naming the directory."""


class _Unreadable(Exception):
  """One checkpoint does not read back; the message says which part and why, in one line."""


# Where the spec dump of a tensorstore read error starts.
_SPEC_DUMP = r" \[tensorstore_spec| See full TensorStore details"


def _one_line(e: BaseException) -> str:
  """An exception as one short line: its type and first line, without tensorstore's spec dump;
  for Orbax's "Encountered error while reading array index", the tensorstore error under it."""
  while e.__cause__ is not None and str(e).startswith("Encountered error while reading"):
    e = e.__cause__
  lines = str(e).strip().splitlines()
  text = re.split(_SPEC_DUMP, lines[0])[0] if lines else ""
  if len(text) > 240:  # tensorstore's chain of contexts: keep its head and the root cause
    text = f"{text[:80]} ... {text[-150:]}"
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ------------------------------------------------------------- what Orbax reports on its own
#
# One failed read is reported once, in one line, by restore_latest. Orbax and tensorstore report it
# again where no caller can catch it: the other arrays' reads still in flight end as unraisable
# exceptions ("Exception ignored in: <coroutine ...>", "Event loop is closed"), futures nobody
# awaited are logged by asyncio when collected (often at exit, after the run's last line), and
# Orbax logs through absl. For one bad file that was up to thousands of lines of tracebacks on the
# terminal; they go to the run's checkpoint_errors.log instead.

_PACKAGES = tuple(f"{os.sep}{name}{os.sep}" for name in ("orbax", "tensorstore"))


class _ErrorLog:
  """The file that Orbax's reports go to: the latest restore's (one run per process)."""

  path: Path | None = None

  def write(self, text: str) -> bool:
    """Appends `text`; False when there is no file or it cannot be written (the caller then lets
    the report through, rather than lose it)."""
    if self.path is None:
      return False
    try:
      with open(self.path, "a") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    except Exception:  # also at interpreter exit, when open itself may be gone
      return False
    return True


_ERRORS = _ErrorLog()


def _from_orbax(exc: BaseException | None, code_file: str = "") -> bool:
  """Whether an exception was raised by (or for) Orbax's or tensorstore's reads."""
  if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
    return True  # tensorstore's callbacks into the event loop Orbax closed after the failure
  files = [code_file] + [f.filename for f in traceback.extract_tb(getattr(exc, "__traceback__",
                                                                          None))]
  return (any(p in f for f in files for p in _PACKAGES)
          or "tensorstore" in str(exc).lower())  # tensorstore's errors carry no Python frames


def _unraisable_hook(previous):
  """An unraisable-exception hook that writes Orbax's to the error log, the rest to `previous`."""

  def hook(unraisable):
    code = getattr(getattr(unraisable.object, "cr_code", None), "co_filename", "")
    if _from_orbax(unraisable.exc_value, code):
      head = unraisable.err_msg or "Exception ignored in"
      if unraisable.object is not None:
        head += f": {unraisable.object!r}"
      text = "".join([head + "\n", *traceback.format_exception(
          unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)])
      if _ERRORS.write(text):
        return
    previous(unraisable)

  hook.to_checkpoint_errors = True
  return hook


def _orbax_on_stack() -> bool:
  """Whether Orbax's code is running in this thread (it logs through absl, whose records name
  absl's own file as their origin)."""
  frame = sys._getframe(1)
  while frame is not None:
    if any(p in frame.f_code.co_filename for p in _PACKAGES):
      return True
    frame = frame.f_back
  return False


class _ToErrorLog(logging.Filter):
  """Keeps a logger's records about Orbax's reads off the terminal: they go to the error log."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if not (_from_orbax(exc) or _orbax_on_stack()):
      return True
    try:
      text = logging.Formatter("%(levelname)s:%(name)s:%(message)s").format(record)
    except Exception:
      return True
    return not _ERRORS.write(text)


def _send_reports_to(path: Path) -> None:
  """From now on in this process, Orbax's unraisable exceptions and asyncio's records of its
  futures go to `path` (they come up to the interpreter's exit)."""
  _ERRORS.path = path
  if not getattr(sys.unraisablehook, "to_checkpoint_errors", False):
    sys.unraisablehook = _unraisable_hook(sys.unraisablehook)
  # A coroutine Orbax abandoned warns that it was never awaited, naming neither Orbax nor itself
  # beyond its name; raised instead, the warning becomes an unraisable exception that names the
  # coroutine, which the hook above sends to the error log (others' still reach the terminal).
  warnings.filterwarnings("error", message=r"coroutine '.*' was never awaited",
                          category=RuntimeWarning)
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _ToErrorLog) for f in asyncio_log.filters):
    asyncio_log.addFilter(_ToErrorLog())


@contextlib.contextmanager
def _absl_to_error_log():
  """Orbax's absl records go to the error log meanwhile: "Failed to read Metadata file" when it
  lists the steps, a checkpoint's bookkeeping that the restore does not need."""
  absl_log, only = logging.getLogger("absl"), _ToErrorLog()
  absl_log.addFilter(only)
  try:
    yield
  finally:
    absl_log.removeFilter(only)


class Checkpointer:
  def __init__(self, directory: Path, keep: int = 3):
    self.directory = Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=True,
        # Synchronous saves: when save() returns the checkpoint is complete, so the "last good
        # checkpoint" promised after a NaN or a spike really is on disk.
        enable_async_checkpointing=False,
    )
    # Each process of a multi-host job keeps its own, in the shared run directory.
    suffix = f".process{jax.process_index()}" if jax.process_count() > 1 else ""
    self.error_log = self.directory.parent / ERROR_LOG.replace(".log", f"{suffix}.log")
    _send_reports_to(self.error_log)
    with _absl_to_error_log():  # the manager reads every step's bookkeeping here
      self.manager = ocp.CheckpointManager(self.directory, options=options,
                                           item_names=("state", "meta"))

  def remove_partial_saves(self, warn=print) -> None:
    """Removes what saves cut short by a kill left, each with one line through `warn`: Orbax
    writes a checkpoint into <step>.orbax-checkpoint-tmp and renames it once complete, so such a
    directory is never a checkpoint (and the next save at its step would report it)."""
    partial = sorted(p for p in self.directory.glob(f"*{PARTIAL_SAVE}*") if p.is_dir())
    for path in partial:
      if jax.process_index() == 0:
        shutil.rmtree(path)
      warn(f"checkpoint: removed {path}, a save cut short when the run before was killed")
    if jax.process_count() > 1:
      # Unconditional: a process that lists the directory after the removal finds nothing, and
      # every process must reach the barrier.
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("stable_attn_train: partial saves removed")

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, params, opt_state, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        meta=ocp.args.JsonSave(meta),
    ), force=True)
    self.manager.wait_until_finished()

  def read_meta(self, step: int) -> dict:
    """The JSON part of a checkpoint alone (config, data position), without the arrays."""
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def _valid_meta(self, step: int) -> dict:
    """The JSON part, or _Unreadable when it does not parse or lacks a field exact resume needs."""
    where = f"{self.directory / str(step) / 'meta'}"
    try:
      meta = self.read_meta(step)
    except Exception as e:  # whatever the parser or Orbax raise: reported, never swallowed
      raise _Unreadable(f"its JSON part {where} does not read ({_one_line(e)})") from e
    if not isinstance(meta, dict):
      raise _Unreadable(f"its JSON part {where} is not a JSON object")
    bad = [k for k, kind in META_FIELDS.items() if not isinstance(meta.get(k), kind)]
    if bad:
      raise _Unreadable(f"its JSON part {where} lacks a valid {', '.join(bad)}")
    if meta["data_step"] != step:
      raise _Unreadable(f"its JSON part {where} is of step {meta['data_step']}")
    return meta

  def restore(self, step: int, params, opt_state):
    """Arrays restored onto the shardings (and into the tree structure) of the given templates."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        {"params": params, "opt_state": opt_state})
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out["state"]["params"], out["state"]["opt_state"], out["meta"]

  def restore_latest(self, params, opt_state, *, check=None, warn=print):
    """(step, params, opt_state, meta) of the newest checkpoint that reads back whole, or None when
    there is no checkpoint at all.

    `check(meta)` runs on the newest readable JSON part before its arrays are read; what it raises
    (a run of another shape or seed) propagates: that checkpoint is not corrupt, it is someone
    else's. Newer checkpoints that do not read back are moved aside to <step>.corrupt (an Orbax save
    at their step would fail otherwise), each reported in one line through `warn`. When none reads
    back, CheckpointError names the directory and nothing is moved: the same error (say, a code
    change that altered the optimizer state's structure) then stays visible on every attempt.
    """
    with _absl_to_error_log():
      bad = []  # (step, why), newest first
      for step in sorted(self.manager.all_steps(), reverse=True):
        try:
          meta = self._valid_meta(step)
        except _Unreadable as e:
          bad.append(self._unreadable(step, str(e)))
          continue
        if check is not None:
          check(meta)
        try:
          params_out, opt_out, _ = self.restore(step, params, opt_state)
        except Exception as e:  # tensorstore raises ValueError for cut and garbled files alike
          bad.append(self._unreadable(step, f"its arrays do not read ({_one_line(e)})"))
          continue
        self._set_aside(bad, step, warn)
        return step, params_out, opt_out, meta
    if not bad:
      return None
    steps = ", ".join(str(s) for s, _ in bad)
    raise CheckpointError(f"no checkpoint in {self.directory} reads back (steps {steps}); the "
                          f"newest, {bad[0][0]}: {bad[0][1]}; move the directory away to start "
                          f"afresh (tracebacks in {self.error_log})")

  def _unreadable(self, step: int, why: str) -> tuple[int, str]:
    """(step, why), with the traceback being handled written to the error log."""
    _ERRORS.write(f"checkpoint {self.directory / str(step)} does not read back: {why}\n"
                  f"{traceback.format_exc()}")
    return step, why

  def _set_aside(self, bad, good: int, warn) -> None:
    """Renames the unreadable checkpoints newer than `good` to <step>.corrupt[.n] (process 0)."""
    if not bad:
      return
    for step, why in bad:
      src = self.directory / str(step)
      dst = src.with_name(f"{step}.corrupt")
      n = 0
      while dst.exists():
        n += 1
        dst = src.with_name(f"{step}.corrupt.{n}")
      if jax.process_index() == 0:
        os.rename(src, dst)
      warn(f"checkpoint: {src} does not read back: {why}; moved to {dst.name}, resuming from "
           f"step {good} (tracebacks in {self.error_log})")
    if jax.process_count() > 1:
      # Every process must see the renames before Orbax lists the steps again.
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("stable_attn_train: corrupt checkpoints set aside")
    self.manager.reload()

  def close(self) -> None:
    self.manager.close()
