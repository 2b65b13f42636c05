"""The paper's stability monitors, computed in a separate jitted function every N steps.

- spectral norm (largest singular value) of each layer's W_Q and W_K ([C, C] slices of c_attn);
- max attention logit per layer (scale * q.k over the causal window);
- tie fraction per layer: the fraction of query rows in which two or more scores round to P = 1.0 in
  bf16, i.e. bf16(exp(s - rowmax)) == 1, the condition under which the PV product adds exact copies
  of V rows and the rounding bias of the paper appears. It is the raw rate under the standard
  softmax max (what an unadjusted kernel sees), measured whatever --max-adjust is set to.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import stable_attn
from stable_attn.tile import tied_rows
from .config import ModelConfig


def spectral_norm(w):
  """Largest singular value of a 2-D float32 matrix."""
  return jnp.linalg.svd(w.astype(jnp.float32), compute_uv=False)[0]


def attention_stats(q, k, *, scale: float, numerics: str = "fast", segment_ids=None):
  """q, k: [B, T, N, H] (compute dtype); segment_ids: [B, T] documents (--pack-documents) or None.
  Scores are rounded to q's dtype where `numerics` keeps them there (the paper's kernel does).
  Returns (max logit, tie fraction) over the visible pairs, as float32 scalars."""
  s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  if stable_attn.numerics.resolve(numerics).score == "input":
    s = s.astype(q.dtype).astype(jnp.float32)
  T = q.shape[1]
  visible = jnp.tril(jnp.ones((T, T), bool))[None, None]  # [B, N, T, S]: causal window
  if segment_ids is not None:
    visible = visible & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  s = jnp.where(visible, s, -jnp.inf)
  tied = tied_rows(s, None, jnp.bfloat16)  # [B, N, T]; no row is all -inf: each sees its own key
  return s.max(), tied.mean(dtype=jnp.float32)


def make_monitor_fn(graphdef, cfg: ModelConfig):
  """(params, x [b, T] int32) -> dict of per-layer float32 arrays of length n_layer."""
  C = cfg.n_embd
  scale = cfg.head_dim ** -0.5

  def monitor(params, x):
    _, captured = nnx.merge(graphdef, params)(x, capture=True)
    wq, wk, max_logit, tie = [], [], [], []
    for i, layer in enumerate(captured):
      q, k = layer["q"], layer["k"]
      kernel = params["h"][i]["attn"]["c_attn"]["kernel"][...]
      wq.append(spectral_norm(kernel[:, :C]))
      wk.append(spectral_norm(kernel[:, C:2 * C]))
      m, t = attention_stats(q, k, scale=scale, numerics=cfg.numerics,
                             segment_ids=layer["segment_ids"])
      max_logit.append(m)
      tie.append(t)
    return {"spec_wq": jnp.stack(wq), "spec_wk": jnp.stack(wk),
            "max_logit": jnp.stack(max_logit), "tie_frac": jnp.stack(tie)}

  return monitor
