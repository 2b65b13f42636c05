"""Pallas kernels for stable_attn: mosaic_gpu/ (Hopper: TMA, wgmma, warp specialisation), gpu/
(Triton lowering: Ampere and Hopper, every option) and tpu/ (Mosaic TPU).

Each backend exposes `attention(spec, ops, config=None)`, `is_available()` and `covers(spec, ops)`
(stable_attn.backends registers them), and takes its tile math from `stable_attn.tile` and its
block ranges from `stable_attn.blocks`: backends differ in how tiles move through memory, never in
the math.
"""
