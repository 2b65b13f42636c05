"""Head dim 256 on the Hopper kernel's forward, a probe (pallas_mosaic_gpu covers 64 and 128): does
the forward compile at H256 with 64 x 64 tiles, 2 stages (ptxas figures with
MOSAIC_GPU_DUMP_PTXAS=1), is it right, and how fast is it against pallas_gpu and cuDNN, B2 T4096 N8
causal bf16. The backward tilings do not fit shared memory at H256 (printed first).

  MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/h256_forward.py     # on an H100/H200
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

import stable_attn
from stable_attn.api import Options, canonicalize
from stable_attn.reference import exact_attention
from pallas_kernels import mosaic_gpu as mosaic
from pallas_kernels.mosaic_gpu import tuning
from benchmarks.attention import time_calls, fwd_flops
T_ = tuning.Tiles
cfg = tuning.TuningConfig(fwd=T_(64, 64, 2), dkv=T_(64, 64, 2), dq=T_(64, 64, 2))
print(cfg.smem_problem(256, 2))
B, T, N, H = 2, 4096, 8, 256
key = jax.random.split(jax.random.PRNGKey(0), 3)
q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16) for kk in key)
spec, ops, _ = canonicalize(q, k, v, None, None, Options(is_causal=True, max_adjust="safe"))
ours = jax.jit(lambda ops: mosaic._flash(spec, cfg, ops)[0])
t0 = time.time()
o = ours(ops)
o.block_until_ready()
print("compile+run s", time.time() - t0, flush=True)
want = exact_attention(q[:1, :512], k[:1, :512], v[:1, :512], is_causal=True)
print("max err (first 512 rows of batch 0)", float(np.abs(np.asarray(o[:1, :512], np.float64) - want).max()))
arms = {"mosaic H256 fwd": lambda: ours(ops),
        "pallas_gpu fwd": jax.jit(lambda q, k, v: stable_attn.dot_product_attention(
            q, k, v, is_causal=True, implementation="pallas_gpu")),
        "cudnn fwd": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"))}
fl = fwd_flops(B, T, N, N, H, True)
for name, f in arms.items():
  try:
    t = time_calls(f, () if name.startswith("mosaic") else (q, k, v), 20, 5)
    print(f"{name}: {fl / t / 1e12:.0f} TFLOP/s", flush=True)
  except Exception as e:  # a peer that cannot run this shape is reported, not fatal
    print(name, "failed:", str(e)[:300], flush=True)
