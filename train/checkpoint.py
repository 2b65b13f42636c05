"""Orbax checkpoints under DIR/checkpoints/<step>/: params, optimizer state and a JSON of the rest.

Step numbers count completed optimizer steps, so a checkpoint named s resumes by running step s
next. The JSON part holds what exact resume needs besides the arrays: the data position (the step:
batches are a pure function of seed and step), the seed, the PRNG key data used for sampling, and
the config.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


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

  def restore(self, step: int, params, opt_state):
    """Arrays restored onto the shardings (and into the tree structure) of the given templates."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        {"params": params, "opt_state": opt_state})
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out["state"]["params"], out["state"]["opt_state"], out["meta"]

  def close(self) -> None:
    self.manager.close()
