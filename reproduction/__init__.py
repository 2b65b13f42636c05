"""Reproducing Qiu & Yao with our code (docs/reproduction.md).

- `python -m reproduction.explosion`: the training arms (same seed, same batches; numerics and max
  adjustment differ), run in parallel over the visible GPUs, then the loss / W_Q-norm figure and table.
- `python -m reproduction.gradients`: the delta and dW_Q / dW_K errors of a checkpoint, step by step.
- The mechanism tables come from `python -m stable_attn.diagnostics`.
"""
