"""numerics="paper" reproduces the paper repo's bf16 FA2 loop rounding for rounding.

The oracle below is an independent transcription of that loop (attention.py of
github.com/ucker/why-low-precision-training-fails) in NumPy with ml_dtypes bfloat16: every
elementwise op rounds to bf16, matmuls accumulate in fp32 and round once, as torch does.
"""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from stable_attn.api import Options, canonicalize
from stable_attn.reference import blockwise_attention

bf16 = ml_dtypes.bfloat16


def paper_repo_forward(q, k, v, block_k, stable, beta=2.0):
  """q [T, H], k/v [S, H] as bf16 numpy -> O [T, H] bf16; one head, one query block."""
  f32 = np.float32
  T, H = q.shape
  scale = bf16(H ** -0.5)
  neg = bf16(-float(ml_dtypes.finfo(bf16).max))
  o = np.zeros((T, H), bf16)
  l = np.zeros((T, 1), bf16)
  m = np.full((T, 1), neg, bf16)
  for start in range(0, k.shape[0], block_k):
    kc, vc = k[start:start + block_k], v[start:start + block_k]
    w = ((q.astype(f32) @ kc.astype(f32).T).astype(bf16) * scale).astype(bf16)
    bm = w.max(axis=-1, keepdims=True)
    if stable:
      close = w >= (bm.astype(f32) - f32(1e-3)).astype(bf16)
      ties = close.sum(-1, keepdims=True) > 1
      bm = np.where(ties & (bm > 0), (bf16(beta) * bm).astype(bf16), bm)
      bm = np.where(ties & (bm < 0), bf16(0), bm)
    new_m = np.maximum(bm, m)
    p = np.exp((w - new_m).astype(bf16).astype(f32)).astype(bf16)
    block_sum = p.astype(f32).sum(-1, keepdims=True).astype(bf16)
    pv = (p.astype(f32) @ vc.astype(f32)).astype(bf16)
    alpha = np.exp((m - new_m).astype(bf16).astype(f32)).astype(bf16)
    l = ((alpha * l).astype(bf16) + block_sum).astype(bf16)
    o = ((o * alpha).astype(bf16) + pv).astype(bf16)
    m = new_m
  return (o.astype(f32) / l.astype(f32)).astype(bf16)


@pytest.mark.parametrize("stable", [False, True], ids=["off", "paper_rule"])
@pytest.mark.parametrize("ties", [False, True])
def test_paper_preset_matches_the_paper_code(stable, ties):
  rng = np.random.default_rng(int(stable) * 2 + int(ties))
  T, S, H, bk = 32, 96, 64, 32
  q = rng.standard_normal((T, H)).astype(bf16)
  k = rng.standard_normal((S, H)).astype(bf16)
  v = rng.standard_normal((S, H)).astype(bf16)
  if ties:  # duplicate keys within a block: exact ties for the rows they win
    k[5] = k[3]
    k[40] = k[41]
  want = paper_repo_forward(q, k, v, bk, stable)
  spec, ops, _ = canonicalize(jnp.asarray(q)[None, :, None], jnp.asarray(k)[None, :, None],
                              jnp.asarray(v)[None, :, None],
                              options=Options(max_adjust="paper" if stable else "off",
                                              numerics="paper"))
  got = np.asarray(blockwise_attention(spec, ops, block_q=T, block_k=bk))[0, :, 0]
  got32, want32 = got.astype(np.float32), want.astype(np.float32)
  ulps = np.abs(got32 - want32) / np.spacing(np.abs(want32).astype(bf16)).astype(np.float32)
  assert np.mean(got32 == want32) > 0.99, np.mean(got32 == want32)
  assert ulps.max() <= 1.0
