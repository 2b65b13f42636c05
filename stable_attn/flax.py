"""Flax adapters: an `attention_fn` for nnx.MultiHeadAttention and linen.MultiHeadDotProductAttention.

    attention_fn = stable_attn.flax.make_attention_fn(max_adjust="safe", implementation=None)
    layer = nnx.MultiHeadAttention(num_heads=8, in_features=512, attention_fn=attention_fn,
                                   decode=False, rngs=nnx.Rngs(0))
"""
from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp

from stable_attn.api import Options, attend, dot_product_attention


def make_attention_fn(**options):
  """Returns attention_fn(query, key, value, bias=None, mask=None, ...) with Flax's signature.

  `options` are the keyword arguments of stable_attn.dot_product_attention (the same names and
  defaults; `stable_attn.api.Options`), fixed for every call. Flax's masks may be float
  (1 = attend) or bool; extra leading batch dims are flattened; `is_causal` from Flax's call is
  or-ed with the option. Dropout on attention weights is not supported: a non-zero dropout_rate
  outside Flax's deterministic mode raises ValueError. That call-time `deterministic` is
  dropout's; the option `deterministic` (bitwise-reproducible gradients) is fixed here and never
  changed by it. Segment ids: Flax's attention modules never pass
  them (they build a mask, e.g. nnx.make_attention_mask(ids, ids, jnp.equal), which works here
  too), so attention_fn takes q_segment_ids / kv_segment_ids ([..., T] / [..., S]) as keywords for
  callers that can pass them (a custom module or a functools.partial); the kernels then skip key
  blocks of other documents.
  """
  names = [f.name for f in dataclasses.fields(Options)]
  unknown = sorted(set(options) - set(names))
  if unknown:
    raise ValueError(f"make_attention_fn got unknown options {unknown}; expected keyword "
                     f"arguments of stable_attn.dot_product_attention: {names}")
  fixed = Options(**options)
  for name in ("return_residual", "return_residuals"):
    if getattr(fixed, name):
      raise ValueError(f"make_attention_fn cannot take {name}=True: Flax's attention modules "
                       f"expect attention_fn to return the output alone")

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, is_causal=False, q_segment_ids=None,
                   kv_segment_ids=None, **unused):
    del broadcast_dropout, dropout_rng, precision, unused
    if dropout_rate > 0.0 and not deterministic:
      raise ValueError(f"stable_attn does not apply attention dropout (dropout_rate="
                       f"{dropout_rate}); set dropout_rate=0 or deterministic=True")
    if module is not None:
      raise ValueError("stable_attn never materialises attention weights, so sow_weights=True "
                       "cannot record them; use implementation='xla' of jax.nn for that")
    if dtype is not None:
      query, key, value = (x.astype(dtype) for x in (query, key, value))
    if mask is not None and mask.dtype != jnp.bool_:
      mask = mask != 0
    batch_shape = query.shape[:-3]
    flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[-3:])
    flat_pairwise = lambda x: x if x is None or x.ndim <= 4 else flat(x)
    flat_ids = lambda x: None if x is None else x.reshape((-1, x.shape[-1]))
    call = dataclasses.replace(fixed, is_causal=bool(fixed.is_causal or is_causal))
    if q_segment_ids is not None:
      call = dataclasses.replace(call, q_segment_ids=flat_ids(q_segment_ids),
                                 kv_segment_ids=flat_ids(kv_segment_ids))
    out = attend(flat(query), flat(key), flat(value), flat_pairwise(bias), flat_pairwise(mask),
                 call)
    return out.reshape(batch_shape + out.shape[-3:])

  attention_fn.__signature__ = inspect.signature(attention_fn)
  return attention_fn


# The options of dot_product_attention, keyword-only, with their defaults.
make_attention_fn.__signature__ = inspect.Signature(
    [p for p in inspect.signature(dot_product_attention).parameters.values()
     if p.kind is inspect.Parameter.KEYWORD_ONLY])
