"""Where the forward rounds: the `Numerics` type and its presets.

A `Numerics` names each rounding point of the attention forward pass and the dtype of the output
residual that the backward uses for delta = rowsum(dO * O). Each field is either "float32" or
"input" (the dtype of query/key/value), so one preset serves bf16, fp16 and fp32 inputs alike: with
fp32 inputs every preset computes in fp32.

The backward always recomputes scores in the forward's score dtype and works in fp32 with matmul
operands in the input dtype (what production kernels do); the presets differ in the forward and in
the residual O, which is where the paper locates the failure.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

_CHOICES = ("float32", "input")
# P_bar may also be cast to FP8 (e4m3, as FP8 attention kernels feed their PV product).
_P_CHOICES = _CHOICES + ("e4m3",)
# q, k and v may be quantized to FP8 before any backend runs (stable_attn.fp8).
_QKV_CHOICES = ("input", "e4m3")
_DTYPES = {"e4m3": np.dtype(jnp.float8_e4m3fn)}
_BOOL_FIELDS = ("sum_of_rounded_p", "sum_keeps_max", "center_v")
_BOOLS = {"true": True, "false": False}
# Where max_adjust="safe" puts its per-row dither (Numerics.dither).
_DITHER_CHOICES = ("max", "out")
# The rounding points a Numerics names, in the order the forward meets them (and "dither", where
# "safe" perturbs them).
_FIELDS = ("qkv", "center_v", "score", "p", "p_top", "p_scale", "pv", "acc", "sum",
           "sum_of_rounded_p", "sum_keeps_max", "out", "residual_o", "dither")


class Dtypes(NamedTuple):
  """Concrete numpy dtypes of a `Numerics` for one input dtype (hashable, static)."""
  input: np.dtype
  score: np.dtype       # S = scale * Q K^T + bias, the running max and S - m
  p: np.dtype           # P_bar as fed to the PV product
  pv: np.dtype          # each key block's P_bar V product, before it is accumulated
  acc: np.dtype         # the O accumulator
  sum: np.dtype         # the running row sum l
  out: np.dtype         # the division O / l
  residual_o: np.dtype  # O as saved for delta in the backward
  sum_of_rounded_p: bool
  p_scale: float = 1.0  # P_bar * p_scale is what is rounded to `p`; PV is divided by it after
  sum_keeps_max: bool = False  # with sum_of_rounded_p: each block's largest P_bar adds unrounded
  p_top: Optional[np.dtype] = None  # each block's top key's P_bar for PV; None: as `p`
  dither_out: bool = False  # "safe"'s dither multiplies O (Numerics.dither="out")


@dataclasses.dataclass(frozen=True)
class Numerics:
  """Rounding points of the forward pass; see the module docstring.

  Attributes:
    qkv: "input" (q, k, v as given) or "e4m3": each of q, k and v rounded to float8_e4m3fn with a
      power-of-two scale per head, before any backend runs (stable_attn.fp8; the gradient passes
      straight through the rounding). Not a rounding point of the tile math, so every backend,
      the compiled ones too, computes it exactly: the products of FP8 values are exact in fp32.
    center_v: with qkv="e4m3", v less its mean over the keys (per batch row, kv head and column)
      is what is quantized and attended, and the mean is added in fp32 to the backend's O (already
      rounded to the input dtype), as each row's weights (which sum to 1) give it, and O rounded
      again: the same attention in exact arithmetic, while the P V products' terms change sign
      down a column instead of all erring one way where Hopper's FP8 tensor cores truncate
      (docs/fp8.md, "V centred"). Not tile math either: every backend runs it unchanged
      (stable_attn.fp8.center, add_mean).
    score: dtype of the scores, the running max and S - m (exp is always evaluated in fp32).
    p: dtype P_bar is rounded to before the PV product: "float32", "input", or "e4m3" (FP8,
      float8_e4m3fn: 3 mantissa bits, spacing 1/16 just below 1, subnormals from 2^-9, max 448),
      whatever the input dtype. With "e4m3", V stays in its own dtype for that product.
    p_top: the dtype each key block's top key (its largest score) has its P_bar rounded to for
      the PV product: "p" (as every key) or "input"/"float32". With an FP8 p, "input" keeps
      "safe"'s weight of the row's maximum on bf16's grid instead of e4m3's 1/16 one (an error
      of up to 3% in a key that may hold most of the row: docs/fp8.md); an FP8 kernel adds
      that key's term apart from its FP8 product (one row of V per query row and block).
    p_scale: P_bar * p_scale is rounded to `p` and the PV product divided by p_scale (the fixed
      pre-cast scale of FP8 kernels, 2^8 in FlashAttention-3): a power of two, so both are
      exact; it moves P_bar's small values above the format's underflow. With "e4m3", at most
      2^8 (P_bar <= 1, and 2^9 would pass e4m3's 448).
    pv: dtype each key block's P_bar V product is rounded to before accumulation.
    acc: dtype of the O accumulator (and of its rescaling).
    sum: dtype of the running row sum l. "input" (bf16) drops a long tail of small
      probabilities (each key block adds less than half an ulp of l), so LSE is low in every such
      row, with or without a max adjustment; in the ablation this point alone drove the W_Q and
      logit growth of the paper's arithmetic, and "float32" stopped it (docs/reproduction.md, 5).
    sum_of_rounded_p: l sums the rounded P_bar (as the paper's code does) instead of fp32 P_bar.
    sum_keeps_max: with sum_of_rounded_p, the keys at their key block's largest score add their
      fp32 P_bar to l instead: O becomes a convex combination of the rounded P for every other
      key (their rounding bias cancels between O and l), while the dither that "safe" gives the
      row's maximum stays out of the denominator (docs/fp8.md).
    out: dtype of the final division O / l (the result is then cast to the input dtype).
    residual_o: dtype of the O saved for the backward's delta; "float32" is the paper's
      diagnostic fix (keep O in fp32 for delta).
    dither: where max_adjust="safe" puts its per-row dither (stable_attn.tile's docstring).
      "max": in the exponent, the row maximum's weight w = exp(-c) < 1 rounded where P_bar is.
      "out": the maximum's weight is w rounded to P's grid (exact in P's dtype) and O is
      multiplied by round(w) / w, round() the output dtype's, before O is rounded: what "max"
      does to a row of tied maxima when P_bar is rounded to the output dtype, without an FP8
      P's 1/16 grid, which makes "max" an error of up to 3% in a key that may hold most of the
      row.
  """
  name: str = "custom"
  qkv: str = "input"
  center_v: bool = False
  score: str = "float32"
  p: str = "input"
  p_top: str = "p"
  p_scale: float = 1.0
  pv: str = "float32"
  acc: str = "float32"
  sum: str = "float32"
  sum_of_rounded_p: bool = False
  sum_keeps_max: bool = False
  out: str = "float32"
  residual_o: str = "input"
  dither: str = "max"

  def __post_init__(self):
    if self.center_v is True and self.qkv != "e4m3":
      raise ValueError(f"Numerics.center_v=True needs qkv='e4m3' (it centres v before its FP8 "
                       f"quantization), got qkv={self.qkv!r}")
    if self.sum_keeps_max and not self.sum_of_rounded_p:
      raise ValueError("Numerics.sum_keeps_max=True needs sum_of_rounded_p=True (it keeps the "
                       "block maximum's P_bar out of a sum of rounded P_bar)")
    for field in _FIELDS:
      if field in _BOOL_FIELDS:
        if not isinstance(getattr(self, field), bool):
          raise ValueError(f"Numerics.{field} must be a bool, got {getattr(self, field)!r}")
        continue
      if field == "p_scale":
        scale = self.p_scale
        if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or
            not math.isfinite(scale) or scale <= 0 or math.frexp(scale)[0] != 0.5):
          raise ValueError(f"Numerics.p_scale must be a power of two (exact scaling), got "
                           f"{scale!r}")
        if self.p == "e4m3" and scale > 2 ** 8:
          raise ValueError(f"Numerics.p_scale must be at most 2^8 = 256 with p='e4m3' (P_bar * "
                           f"p_scale must fit e4m3's largest value, 448), got {scale!r}")
        continue
      value = getattr(self, field)
      choices = {"p": _P_CHOICES, "qkv": _QKV_CHOICES, "p_top": ("p",) + _CHOICES,
                 "dither": _DITHER_CHOICES}.get(field, _CHOICES)
      if value not in choices:
        raise ValueError(f"Numerics.{field} must be one of {choices}, got {value!r}")

  @property
  def fp8(self) -> bool:
    """Whether the tile math rounds to an FP8 type (P_bar in e4m3); `qkv` is not tile math."""
    return self.p in _DTYPES

  def replace(self, **changes) -> "Numerics":
    return dataclasses.replace(self, **changes)

  def with_fp32_residual(self) -> "Numerics":
    """The same rounding, but O is kept in fp32 for the backward's delta."""
    return self.replace(name=f"{self.name}+fp32o", residual_o="float32")

  def dtypes(self, input_dtype) -> Dtypes:
    input_dtype = np.dtype(input_dtype)

    def pick(choice):
      if choice in _DTYPES:
        return _DTYPES[choice]
      return np.dtype(np.float32) if choice == "float32" else input_dtype

    return Dtypes(input_dtype, pick(self.score), pick(self.p), pick(self.pv), pick(self.acc),
                  pick(self.sum), pick(self.out), pick(self.residual_o), self.sum_of_rounded_p,
                  float(self.p_scale), self.sum_keeps_max,
                  None if self.p_top == "p" else pick(self.p_top), self.dither == "out")


# fp32 scores and statistics, P cast to the input dtype for PV, one final rounding of O.
FAST = Numerics(name="fast")
# The paper's pure-PyTorch FA2 under bf16 autocast: everything but exp in the input dtype.
PAPER = Numerics(name="paper", score="input", p="input", pv="input", acc="input", sum="input",
                 sum_of_rounded_p=True, out="input")

# FP8 attention (issue 49): e4m3 q, k, v with per-head scales; P_bar in e4m3 with
# FlashAttention-3's 2^8 pre-cast scale but for each block's top key (bf16), and a row sum of the
# rounded P_bar but for that key: "safe" unbiased and about as accurate as in bf16 (docs/fp8.md).
FP8 = FAST.replace(name="fp8", qkv="e4m3", p="e4m3", p_top="input", p_scale=256.0,
                   sum_of_rounded_p=True, sum_keeps_max=True)

# FP8 attention in FlashAttention-3's arithmetic (every P_bar in e4m3, one e4m3 P V product) with
# the row sum of the rounded P_bar, and "safe"'s dither on O: the row maximum's weight on e4m3's
# grid, exact (docs/fp8.md, "safe's dither on O").
FP8_FAST = FAST.replace(name="fp8_fast", qkv="e4m3", p="e4m3", p_scale=256.0,
                        sum_of_rounded_p=True, dither="out")

PRESETS = {"fast": FAST, "paper": PAPER, "fp8": FP8, "fp8_fast": FP8_FAST,
           "fast+fp32o": FAST.with_fp32_residual(), "paper+fp32o": PAPER.with_fp32_residual()}


def resolve(numerics) -> Numerics:
  """A `Numerics`, a preset name, or a preset with some rounding points moved -> `Numerics`.

  The third form is "PRESET+FIELD=VALUE[+FIELD=VALUE...]", e.g. "paper+score=float32" (the paper's
  arithmetic with fp32 scores), "fast+sum=input+sum_of_rounded_p=true" or "fast+p=e4m3+p_scale=256"
  (FP8 P_bar with FlashAttention-3's pre-cast scale); VALUE is "float32" or "input" ("e4m3" too
  for p and qkv, "p" too for p_top, "true"/"false" for sum_of_rounded_p, sum_keeps_max and
  center_v, a number for p_scale, "max" or "out" for dither). The result is named by the string,
  so one spelling serves the API, the CLIs and the names of result files. Anything else raises
  ValueError.
  """
  if isinstance(numerics, Numerics):
    return numerics
  if isinstance(numerics, str) and numerics in PRESETS:
    return PRESETS[numerics]
  if isinstance(numerics, str) and "=" in numerics:
    base, *changes = numerics.split("+")
    while changes and "=" not in changes[0]:   # a preset whose name holds a "+" ("paper+fp32o")
      base, changes = f"{base}+{changes[0]}", changes[1:]
    if base not in PRESETS:
      raise ValueError(f"numerics {numerics!r}: {base!r} is not a preset ({sorted(PRESETS)})")
    fields = {}
    for change in changes:
      field, _, value = change.partition("=")
      if field not in _FIELDS:
        raise ValueError(f"numerics {numerics!r}: {field!r} is not a rounding point ({_FIELDS})")
      if field in _BOOL_FIELDS:
        if value not in _BOOLS:
          raise ValueError(f"numerics {numerics!r}: {field} takes true or false, got {value!r}")
        value = _BOOLS[value]
      elif field == "p_scale":
        try:
          value = float(value)
        except ValueError:
          raise ValueError(f"numerics {numerics!r}: p_scale takes a number, "
                           f"got {value!r}") from None
      fields[field] = value
    return PRESETS[base].replace(name=numerics, **fields)
  raise ValueError(f"numerics must be one of {sorted(PRESETS)}, a preset with rounding points "
                   f"moved (e.g. 'paper+score=float32') or a stable_attn.Numerics, got {numerics!r}")
