"""Pallas kernels for stable_attn: gpu/ (Triton lowering) and tpu/ (Mosaic TPU).

Each backend exposes `attention(spec, ops)` and `is_available()`, and takes its tile math from
`stable_attn.tile` and its block ranges from `stable_attn.blocks`: backends differ in how tiles move
through memory, never in the math.
"""
