"""Orders of a sequence sharded over n devices (context parallelism; `context_layout`).

"contiguous": device d holds positions [d T/n, (d+1) T/n). Under a causal mask device d's queries
  see (2d+1)/(2n) of the keys on average, so the last device does 2n-1 times the first's work.
"zigzag": the sequence cut into 2n chunks of T/(2n); device d holds chunks d and 2n-1-d, so every
  device holds one early and one late chunk and does equal causal work. A caller puts tokens,
  positions and segment ids in this order once (`zigzag`), before sharding them; the attention
  call then returns O and the log-sum-exp in the same order (`unzigzag` restores the natural one).

On a call that is not sharded over its sequence, n = 1 and both orders are the natural one.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag")
# How each device meets the keys the others hold (stable_attn.partition): all of them gathered to
# every device, each device's keys passed round a ring of the devices, or positions traded for
# heads (an all-to-all: each device then holds every position of 1/n of the heads); "auto":
# `choose_strategy`.
STRATEGIES = ("auto", "allgather", "ring", "alltoall")
# The strategies under which K and V stay split like the queries: only a kernel that partitions
# itself runs them (XLA would choose its own collectives), and they take no bias or mask (its key
# columns would have to travel with the keys).
KEYS_SPLIT = ("ring", "alltoall")


def choose_strategy(strategy: str, heads: int, kv_heads: int, ways: int, bias: bool = False) -> str:
  """The context_strategy a call runs: "auto" -> "alltoall" where each of the `ways` shards of the
  heads (the sequence's devices times any head sharding) takes whole query and key/value heads
  and no bias or mask is given, else "allgather"; any other strategy as it is. Why alltoall
  first: measured fastest (benchmarks/results/context_parallel_*: causal T 64k on 4 H200s,
  89.9% of one GPU's per-GPU throughput against allgather's 80.4% and the ring's 68.0%; on 2,
  93.8%, 90.8%, 87.0%), and bitwise the one-device call."""
  if strategy != "auto":
    return strategy
  return "alltoall" if not (heads % ways or kv_heads % ways or bias) else "allgather"


def zigzag_chunks(n: int) -> np.ndarray:
  """The natural chunk (of 2n) at each chunk position of the zigzag order: 0, 2n-1, 1, 2n-2, ..."""
  return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def _reorder(x, n: int, axis: int, chunks: np.ndarray):
  # numpy in, numpy out: a trainer lays its host batches out before they reach a device.
  xp = np if isinstance(x, np.ndarray) else jnp
  if x.shape[axis] % (2 * n):
    raise ValueError(f"a zigzag order over {n} devices cuts the sequence into {2 * n} equal "
                     f"chunks: its length {x.shape[axis]} (axis {axis}) must be a multiple of "
                     f"{2 * n}")
  shape = x.shape[:axis] + (2 * n, x.shape[axis] // (2 * n)) + x.shape[axis + 1:]
  return xp.take(x.reshape(shape), chunks, axis=axis).reshape(x.shape)


def zigzag(x, n: int, axis: int = 1):
  """x (natural order along `axis`; a jax or numpy array, the result the same) in the zigzag
  order over n devices: shard the result evenly over `axis` and device d holds natural chunks d
  and 2n-1-d."""
  return _reorder(x, n, axis, zigzag_chunks(n))


def unzigzag(x, n: int, axis: int = 1):
  """The inverse of `zigzag`: x in the zigzag order over n devices -> the natural order."""
  return _reorder(x, n, axis, np.argsort(zigzag_chunks(n)))


class Chunk(NamedTuple):
  """A run of consecutive positions on one device: its rows [start, stop) in the device's shard
  and `shift`, the global position of its first row (an int32 scalar: the device's index is
  only known when the program runs)."""
  start: int
  stop: int
  shift: jax.Array


def device_chunks(layout: str, rows: int, n: int, device) -> list[Chunk]:
  """The runs of consecutive positions in device `device`'s shard of `rows` rows, of n devices."""
  if layout == "contiguous" or n == 1:
    return [Chunk(0, rows, device * rows)]
  half = rows // 2
  return [Chunk(0, half, device * half), Chunk(half, rows, (2 * n - 1 - device) * half)]
