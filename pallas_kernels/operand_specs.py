"""BlockSpecs from the operand table: a kernel says once how its grid walks each logical axis, and
every operand (and any other array named by its axes) gets its BlockSpec from that.

    dims = dict(batch=squeezed(lambda i, bh: bh // N), query=blocked(bq, lambda i, bh: i), ...)
    pl.pallas_call(kernel, in_specs=(operand_specs(x, dims),), ...)(x)   # x: padded Operands
    def kernel(refs, ...): refs.q_seg ...                                # named refs; None if absent

An axis a kernel does not name is read whole. A broadcast dim (size 1 in a bias or mask) is read at
index 0 whatever the axis does. An array every one of whose dims is squeezed is read whole instead
(a scalar per program, such as a length or a sink, is indexed in the kernel: Triton and Mosaic
load scalars from vectors, not 0-d blocks). `read` indexes a ref the same way, so that a kernel
does not care which dims of a bias or mask broadcast.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from jax.experimental import pallas as pl

from stable_attn.spec import Operands


class Dim(NamedTuple):
  """How a kernel's grid walks one logical axis."""
  block: Optional[int]    # None: one index per program (squeezed); 0: the whole axis; n: n at a time
  index: Callable         # (*grid indices, *scalar-prefetch refs) -> block index along the axis


def squeezed(index: Callable) -> Dim:
  return Dim(None, index)


def blocked(size: int, index: Callable) -> Dim:
  return Dim(size, index)


WHOLE = Dim(0, lambda *_: 0)
SQUEEZED = pl.squeezed


def block_spec(axes, shape, dims: dict, *, broadcast: bool = False, **kwargs) -> pl.BlockSpec:
  """The BlockSpec of an array whose dims are the logical `axes`; `dims` maps axis -> Dim."""
  block, index = [], []
  for size, axis in zip(shape, axes):
    dim = dims.get(axis, WHOLE)
    if broadcast and size == 1:
      dim = Dim(None if dim.block is None else 1, WHOLE.index)
    block.append(SQUEEZED if dim.block is None else (size if dim.block == 0 else dim.block))
    index.append(dim.index)
  if all(b is SQUEEZED for b in block) and block:
    block, index = list(shape), [WHOLE.index] * len(shape)
  return pl.BlockSpec(tuple(block), lambda *args: tuple(f(*args) for f in index), **kwargs)


def operand_specs(ops: Operands, dims: dict, axes: Optional[dict] = None) -> Operands:
  """A BlockSpec for every present operand (None for the absent ones), by its table row. `axes`
  overrides the logical axes of arrays a backend laid out differently (name -> axes)."""
  table = type(ops).TABLE
  specs = {}
  for row, x in table.present(ops):
    row_axes = (axes or {}).get(row.name, row.axes)
    specs[row.name] = block_spec(row_axes, x.shape, dims, broadcast=row.broadcast)
  return table.make(**specs)


def read(ref, *index):
  """ref[index], where dims of size 1 (broadcast) are read at 0: an integer index there becomes
  0 and a slice keeps the dim's one element, so the tile broadcasts against full tiles."""
  fixed = tuple(i if n != 1 else (slice(None) if isinstance(i, (slice, pl.Slice)) else 0)
                for i, n in zip(index, ref.shape))
  return ref[fixed]

