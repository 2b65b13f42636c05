"""The static description of one call (`AttentionSpec`) and the table of its arrays (`OPERANDS`).

Every array a call carries is one row of `OPERANDS`: its name, its logical axes, how padding fills
it, its dtype rule, whether it is optional, may broadcast, or gets a gradient from the backward
kernels. `Operands`, the pytree the backends receive, is built from the table; so are the
argument checks of `stable_attn.api`, the padding of `stable_attn.layout`, the Pallas BlockSpecs
of the kernels and the sharding and vmap rules of `stable_attn.partition`. Adding an operand is
one row here (and the code that uses it).

Logical axes: "batch" B, "query" T, "key" S, "heads" N (query heads), "kv_heads" K, "head_dim" H,
and "qkv" (size 3: q, k, v of a packed self-attention projection). "batch", "heads" and "kv_heads"
may be partitioned (split over devices, vmapped); the kernels need whole "query", "key", "qkv" and
"head_dim" extents.

`PACKED_OPERANDS` is the same table with q, k and v as one row, `qkv` [B, T, 3, N, H]: the output
of a fused QKV projection, read in place by a backend that takes it (no split copies in the forward
and no concatenation of dq, dk, dv in the backward); `unpack` gives the plain operands.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from stable_attn.numerics import Numerics

AXES = ("batch", "query", "key", "heads", "kv_heads", "head_dim", "qkv")
PARTITIONABLE = ("batch", "heads", "kv_heads")
ROW_AXES = ("batch", "query", "heads", "head_dim")    # O, dO, the O residual: shaped like q
LSE_AXES = ("batch", "heads", "query")                # LSE, delta, dLSE
QKV_AXES = ("batch", "query", "qkv", "heads", "head_dim")   # a packed q, k, v (PACKED_OPERANDS)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Everything about a call that is not an array (hashable; a jit/custom_vjp static argument)."""
  scale: float
  is_causal: bool
  window: Optional[tuple[int, int]]  # (left, right) or None
  max_adjust: str                    # "off" | "paper" | "safe"
  beta: float
  numerics: Numerics
  interpret: bool = False
  # Whether sequence lengths were given: if not, ops.q_lens / kv_lens are T and S, and a kernel may
  # use those static values instead of reading the arrays.
  has_lengths: bool = False
  logits_soft_cap: Optional[float] = None   # logits -> cap * tanh(logits / cap)
  return_residuals: bool = False            # the caller also wants the (differentiable) LSE
  # The backward must sum each gradient in a fixed order (no reduce-adds in CTA order).
  deterministic: bool = False
  # How a sequence sharded over devices is ordered (stable_attn.context): "contiguous" | "zigzag".
  context_layout: str = "contiguous"
  # How a context-parallel call meets the other devices' keys: "auto" | "allgather" | "ring" |
  # "alltoall" (stable_attn.context.choose_strategy).
  context_strategy: str = "auto"


@dataclasses.dataclass(frozen=True)
class Operand:
  """One row of the operand table.

  Attributes:
    name: the field of `Operands`.
    axes: logical axes of its dims (see the module docstring); "batch" comes first when present.
    dtype: "input" (q's dtype), "float" (any floating dtype), "bool", "int" (any integer dtype,
      stored as int32), "float32" or "e4m3" (float8_e4m3fn).
    fill: how padding of its "query", "key" and "head_dim" dims is filled: "zero" (0 / False) or
      "edge" (the last value repeated: a block's id range stays as tight as its real ids).
    counts: for lengths, the axis they count; they are clamped to that axis's size.
    optional: None when absent.
    broadcast: its dims may be 1 where the axis is larger (broadcast, never materialised).
    grad: the backward kernels return its gradient (flash.py derives the others).
    arg: the argument of dot_product_attention it comes from (None: built by canonicalize).
  """
  name: str
  axes: tuple[str, ...]
  dtype: str
  fill: str = "zero"
  counts: Optional[str] = None
  optional: bool = False
  broadcast: bool = False
  grad: bool = False
  arg: Optional[str] = None

  def __post_init__(self):
    assert set(self.axes) <= set(AXES) and ("batch" not in self.axes or self.axes[0] == "batch"), self

  def sizes(self, shape) -> dict:
    """{axis: size} of an array of this row (broadcast dims of size 1 included as 1)."""
    return dict(zip(self.axes, shape))


class OperandTable:
  """The rows, in `Operands` field order; `tuple_type` is the pytree built from them."""

  def __init__(self, rows, name: str = "Operands"):
    self.rows = tuple(rows)
    self.by_name = {r.name: r for r in self.rows}
    # Required fields first (no default), optional ones default to None.
    order = [r.name for r in self.rows]
    required = [r.name for r in self.rows if not r.optional]
    assert order[:len(required)] == required, "required operands come first"
    base = collections.namedtuple("Operands", order, defaults=[None] * (len(order) - len(required)))
    self.tuple_type = type(name, (base,), {
        "__slots__": (), "TABLE": self, "__doc__": _doc(self.rows),
        "__module__": __name__})

  def __getitem__(self, name: str) -> Operand:
    return self.by_name[name]

  def make(self, **arrays):
    """Operands from the arrays given by name; every other field is None."""
    return self.tuple_type(**{r.name: arrays.get(r.name) for r in self.rows})

  def packed(self) -> "OperandTable":
    """This table with q, k and v replaced by one row, qkv [B, T, 3, N, H] (self-attention, as
    many key/value heads as query heads): `PACKED_OPERANDS`."""
    rest = [r for r in self.rows if r.name not in ("q", "k", "v")]
    return OperandTable([Operand("qkv", QKV_AXES, "input", grad=True, arg="qkv")] + rest,
                        "PackedOperands")

  def with_row(self, row: Operand) -> "OperandTable":
    """A new table with one more (optional) row: how a new operand is added, and tested."""
    return OperandTable(self.rows + (row,), self.tuple_type.__name__)

  def present(self, ops):
    """(row, array) of every operand that is not None, in table order."""
    return [(r, getattr(ops, r.name)) for r in self.rows if getattr(ops, r.name) is not None]

  def sizes(self, ops) -> dict:
    """{axis: full size} read off the required operands (q and k give every axis)."""
    sizes = {}
    for row in self.rows:
      x = getattr(ops, row.name)
      if x is not None and not row.broadcast and row.counts is None:
        sizes.update(row.sizes(x.shape))
    return sizes


def _doc(rows) -> str:
  lines = ["Canonical arrays of one call (a pytree; absent optional operands are None):"]
  for r in rows:
    extra = ", ".join(x for x in ("optional" if r.optional else "",
                                  "broadcastable" if r.broadcast else "") if x)
    lines.append(f"  {r.name}: [{', '.join(r.axes)}] {r.dtype}{' (' + extra + ')' if extra else ''}")
  return "\n".join(lines)


OPERANDS = OperandTable([
    Operand("q", ROW_AXES, "input", grad=True, arg="query"),
    Operand("k", ("batch", "key", "kv_heads", "head_dim"), "input", grad=True, arg="key"),
    Operand("v", ("batch", "key", "kv_heads", "head_dim"), "input", grad=True, arg="value"),
    # Lengths are always present (T and S when not given), clamped to T and S.
    Operand("q_lens", ("batch",), "int", counts="query", arg="query_seq_lengths"),
    Operand("kv_lens", ("batch",), "int", counts="key", arg="key_value_seq_lengths"),
    # 4-D, each dim full or 1; added to the scaled scores / True = attend.
    Operand("bias", ("batch", "heads", "query", "key"), "float", optional=True, broadcast=True,
            grad=True, arg="bias"),
    Operand("mask", ("batch", "heads", "query", "key"), "bool", optional=True, broadcast=True,
            arg="mask"),
    # Packed documents: both or neither; query t sees key s only if their ids match.
    Operand("q_seg", ("batch", "query"), "int", fill="edge", optional=True, arg="q_segment_ids"),
    Operand("kv_seg", ("batch", "key"), "int", fill="edge", optional=True, arg="kv_segment_ids"),
    # max_adjust="safe"'s per-row offsets in natural units (tile.safe_offset of each query head and
    # position). An operand rather than recomputed in every kernel: one definition, and a
    # partitioned call gets each shard's global rows.
    Operand("offset", ("heads", "query"), "float32", optional=True),
    # Where a batch row's queries stand among its keys: causal and window masks compare key k with
    # query t + q_shift (lengths still count the call's own rows). Absent: 0. Built by
    # stable_attn.partition for a sequence-sharded (context-parallel) call: a run of queries' first
    # global position minus that of the keys the call gets (the whole sequence's under allgather,
    # one block's under a ring, so possibly negative).
    Operand("q_shift", ("batch",), "int", optional=True),
    # Attention sinks: one logit per query head joining every row's denominator without a value
    # (gpt-oss / splash). Differentiable; its gradient needs only delta (flash.py).
    Operand("sinks", ("heads",), "float", optional=True, arg="sinks"),
    # numerics qkv="e4m3": the per-head powers of two q, k and v were quantized under (the
    # caller's fp8_scales, or measured by stable_attn.fp8.quantize_inputs), so that an FP8 kernel
    # gets its e4m3 payloads by one exact multiply instead of measuring every head again.
    Operand("q_scale", ("heads",), "float32", optional=True, arg="fp8_scales[0] (q_scale)"),
    Operand("k_scale", ("kv_heads",), "float32", optional=True, arg="fp8_scales[1] (k_scale)"),
    Operand("v_scale", ("kv_heads",), "float32", optional=True, arg="fp8_scales[2] (v_scale)"),
    # ... and q, k and v times those scales as e4m3 (stable_attn.fp8.payload_under), the values an
    # FP8 kernel reads: cast from the unquantized inputs, in the pass that reads them.
    Operand("q_e4m3", ROW_AXES, "e4m3", optional=True),
    Operand("k_e4m3", ("batch", "key", "kv_heads", "head_dim"), "e4m3", optional=True),
    Operand("v_e4m3", ("batch", "key", "kv_heads", "head_dim"), "e4m3", optional=True),
    # An FP8 kernel's descale factors, per query head (built by the backend from the scales
    # above): the scores' (q's times its kv head's k's) and O's (v's).
    Operand("qk_descale", ("heads",), "float32", optional=True),
    Operand("v_descale", ("heads",), "float32", optional=True),
    # numerics center_v: the mean over the keys that v was centred by before its quantization
    # (stable_attn.fp8.center), which backends.run adds back to O; no backend reads it.
    Operand("v_mean", ("batch", "kv_heads", "head_dim"), "float32", optional=True),
])
Operands = OPERANDS.tuple_type
PACKED_OPERANDS = OPERANDS.packed()
PackedOperands = PACKED_OPERANDS.tuple_type


def is_packed(ops) -> bool:
  """Whether `ops` holds q, k and v as one packed qkv array (PackedOperands)."""
  table = getattr(type(ops), "TABLE", None)
  return table is not None and "qkv" in table.by_name


def unpack(ops) -> Operands:
  """Operands from PackedOperands: q, k, v sliced out of qkv (copies, under XLA); the other fields
  as they are. Operands are returned unchanged."""
  if not is_packed(ops):
    return ops
  fields = {name: getattr(ops, name) for name in ops._fields if name != "qkv"}
  q, k, v = (ops.qkv[:, :, i] for i in range(3))
  return OPERANDS.make(q=q, k=k, v=v, **fields)


def pack(qkv: jax.Array, ops: Operands) -> PackedOperands:
  """PackedOperands: `qkv` [B, T, 3, N, H] in place of ops.q, ops.k, ops.v (which must be its
  slices), ops's other fields as they are."""
  fields = {name: getattr(ops, name) for name in ops._fields if name not in ("q", "k", "v")}
  return PACKED_OPERANDS.make(qkv=qkv, **fields)


class Lengths(NamedTuple):
  """A batch row's query and key lengths and its q_shift, what tile.visible and the block ranges
  compare positions with: int32 scalars read from the operands (`of`), or Python ints where a
  kernel knows them statically (T, S, 0)."""
  q: object
  kv: object
  shift: object

  @classmethod
  def of(cls, ops, b=None) -> "Lengths":
    """Batch row b's lengths and q_shift from ops (Operands or a kernel's refs; no q_shift
    operand: 0), or with b None every row's as [B] arrays (no q_shift operand: zeros)."""
    if b is None:
      shift = jnp.zeros_like(ops.q_lens) if ops.q_shift is None else ops.q_shift
      return cls(ops.q_lens, ops.kv_lens, shift)
    return cls(ops.q_lens[b], ops.kv_lens[b], 0 if ops.q_shift is None else ops.q_shift[b])


class BackwardInputs(NamedTuple):
  """What the backward kernels read besides the operands: dO (ROW_AXES, the input dtype), the
  forward's LSE and delta = rowsum(dO * O) (LSE_AXES, fp32), each padded like the operands."""
  do: jax.Array
  lse: jax.Array
  delta: jax.Array


BACKWARD_AXES = BackwardInputs(ROW_AXES, LSE_AXES, LSE_AXES)
