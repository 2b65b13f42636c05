"""Orbax checkpoints under DIR/checkpoints/<step>/: params, optimizer state and a JSON of the rest.

Step numbers count completed optimizer steps, so a checkpoint named s resumes by running step s
next. The JSON part holds what exact resume needs besides the arrays: the data position (the step:
batches are a pure function of seed and step), the seed, the PRNG key data used for sampling, and
the config.

A checkpoint that does not read back whole (a truncated array file, garbage in a manifest or in the
JSON part) is moved aside to <step>.corrupt when an older one does read back, and the run resumes
from that one: `Checkpointer.restore_latest`.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

# What every checkpoint's JSON part holds (besides optional bookkeeping), with its JSON type.
META_FIELDS = {"data_step": int, "seed": int, "sample_key": list, "config": dict}


class CheckpointError(ValueError):
  """Checkpoints exist but none of them reads back; the message is one line naming the directory."""


class _Unreadable(Exception):
  """One checkpoint does not read back; the message says which part and why, in one line."""


def _one_line(e: BaseException) -> str:
  """An exception as one short line: its type and first line, without tensorstore's spec dump."""
  lines = str(e).strip().splitlines()
  text = re.split(r" \[tensorstore_spec", lines[0])[0] if lines else ""
  if len(text) > 240:  # tensorstore's chain of contexts: keep its head and the root cause
    text = f"{text[:80]} ... {text[-150:]}"
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _drop_closed_loop_noise() -> None:
  """Installs, once, an unraisable-exception hook that drops RuntimeError('Event loop is closed').

  When one array of a checkpoint fails to read, Orbax closes its event loop while tensorstore still
  has the other arrays' reads in flight; each of them then reports, from its own thread, a
  traceback of that RuntimeError: hundreds of lines for a model, saying nothing that the one-line
  report of the failed read does not. Every other unraisable exception goes to the previous hook.
  """
  previous = sys.unraisablehook
  if getattr(previous, "drops_closed_loop", False):
    return

  def hook(unraisable):
    e = unraisable.exc_value
    if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
      return
    previous(unraisable)

  hook.drops_closed_loop = True
  sys.unraisablehook = hook


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
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "meta"))

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
    # Before any read: the noise starts while the failing read is still being raised.
    _drop_closed_loop_noise()
    bad = []  # (step, why), newest first
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        meta = self._valid_meta(step)
      except _Unreadable as e:
        bad.append((step, str(e)))
        continue
      if check is not None:
        check(meta)
      try:
        params_out, opt_out, _ = self.restore(step, params, opt_state)
      except Exception as e:  # tensorstore raises ValueError for cut and garbled files alike
        bad.append((step, f"its arrays do not read ({_one_line(e)})"))
        continue
      self._set_aside(bad, step, warn)
      return step, params_out, opt_out, meta
    if not bad:
      return None
    steps = ", ".join(str(s) for s, _ in bad)
    raise CheckpointError(f"no checkpoint in {self.directory} reads back (steps {steps}); the "
                          f"newest, {bad[0][0]}: {bad[0][1]}; move the directory away to start "
                          f"afresh")

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
           f"step {good}")
    if jax.process_count() > 1:
      # Every process must see the renames before Orbax lists the steps again.
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("stable_attn_train: corrupt checkpoints set aside")
    self.manager.reload()

  def close(self) -> None:
    self.manager.close()
