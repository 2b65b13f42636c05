"""Block sizes, warps and pipeline stages of the GPU kernels: one small table.

The table is keyed by (head dim bucket, dtype class) and was chosen on an H100/H200 with JAX's
Triton lowering (see docs/gpu_kernel_notes.md for the measurements behind it). Every config is
clamped to the problem (a block never exceeds the next power of two of the sequence, and never goes
below 16, Triton's smallest dot).

Another tiling for benchmarking or tests is a `Config` passed as a static argument:

    stable_attn.dot_product_attention(q, k, v, implementation="pallas_gpu",
                                      config=tuning.table_config(64, q.dtype).replace(
                                          fwd=tuning.KernelConfig(128, 64, 4, 3)))
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

MIN_BLOCK = 16  # smallest dot Triton emits


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """One kernel's tiling: block_q query rows x block_k key rows per tile."""
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      v = getattr(self, name)
      if v < 1 or v & (v - 1):
        raise ValueError(f"{name} must be a positive power of two, got {v}")
    if self.num_warps < 1 or self.num_stages < 1:
      raise ValueError(f"num_warps and num_stages must be >= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class Config:
  """Forward, dK/dV and dQ kernels each have their own tiling; the delta pre-pass uses dq's rows."""
  fwd: KernelConfig
  dkv: KernelConfig
  dq: KernelConfig

  def replace(self, **changes) -> "Config":
    return dataclasses.replace(self, **changes)


_K = KernelConfig
# (max head dim, "16bit" | "32bit") -> Config. First matching row wins.
TABLE: list[tuple[int, str, Config]] = [
    (64, "16bit", Config(fwd=_K(128, 64, 4, 3), dkv=_K(64, 64, 4, 2), dq=_K(128, 64, 8, 2))),
    (128, "16bit", Config(fwd=_K(128, 64, 8, 3), dkv=_K(64, 64, 4, 2), dq=_K(128, 128, 8, 2))),
    (256, "16bit", Config(fwd=_K(64, 32, 4, 2), dkv=_K(32, 64, 4, 2), dq=_K(64, 32, 4, 2))),
    (64, "32bit", Config(fwd=_K(64, 32, 4, 2), dkv=_K(32, 64, 4, 2), dq=_K(64, 32, 4, 2))),
    (128, "32bit", Config(fwd=_K(64, 32, 4, 2), dkv=_K(32, 32, 4, 2), dq=_K(32, 32, 4, 2))),
    (256, "32bit", Config(fwd=_K(32, 16, 4, 1), dkv=_K(16, 32, 4, 1), dq=_K(32, 16, 4, 1))),
]
MAX_HEAD_DIM = 256

# Small tiles for interpret mode on CPU: several blocks per test sequence, so the block loops,
# the block skipping and the masked/full split are all exercised.
INTERPRET = Config(fwd=_K(16, 16, 4, 1), dkv=_K(16, 32, 4, 1), dq=_K(32, 16, 4, 1))

def next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
  return max(MIN_BLOCK, next_pow2(head_dim))


def table_config(head_dim: int, dtype, *, interpret: bool = False) -> Config:
  """The table's config for a head dim and dtype (before clamping)."""
  if head_dim > MAX_HEAD_DIM:
    raise ValueError(f"pallas_gpu supports head dims up to {MAX_HEAD_DIM}, got H={head_dim}")
  if interpret:
    return INTERPRET
  kind = "32bit" if np.dtype(dtype).itemsize >= 4 else "16bit"
  hp = padded_head_dim(head_dim)
  for max_h, k, config in TABLE:
    if k == kind and hp <= max_h:
      return config
  raise ValueError(f"no tuning entry for head dim {head_dim}, dtype {np.dtype(dtype).name}")


def _clamp(kc: KernelConfig, q_len: int, kv_len: int) -> KernelConfig:
  bq = min(kc.block_q, max(MIN_BLOCK, next_pow2(q_len)))
  bk = min(kc.block_k, max(MIN_BLOCK, next_pow2(kv_len)))
  return dataclasses.replace(kc, block_q=bq, block_k=bk)


# With a bias the dQ kernel also stores its fp32 dS tile, whose layout conversion takes shared
# memory: above this many key-block x head-dim elements it ran out (H200: 263 KB asked, 227 KB
# available at block_k 128, head dim 128), so block_k is halved.
_DS_TILE_LIMIT = 64 * 128


def resolve(head_dim: int, dtype, q_len: int, kv_len: int, *, interpret: bool = False,
            writes_ds: bool = False, config: Optional[Config] = None) -> Config:
  """The config a call uses: `config`, else the table's; clamped to the sequence lengths."""
  if config is None:
    config = table_config(head_dim, dtype, interpret=interpret)
  elif not isinstance(config, Config):
    raise ValueError(f"config for implementation='pallas_gpu' must be a "
                     f"pallas_kernels.gpu.tuning.Config, got {config!r}")
  dq = config.dq
  while writes_ds and dq.block_k > MIN_BLOCK and dq.block_k * padded_head_dim(head_dim) > \
      _DS_TILE_LIMIT:
    dq = dataclasses.replace(dq, block_k=dq.block_k // 2)
  return Config(*(_clamp(kc, q_len, kv_len) for kc in (config.fwd, config.dkv, dq)))
