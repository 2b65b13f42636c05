"""GPT-2 in Flax NNX: pre-LayerNorm blocks, learned positions, GELU, tied token embedding / LM head.

Parameters are float32 (the master weights the optimizer updates); matmuls and attention run in
`config.dtype` (bf16 by default), like PyTorch autocast in the paper's run: the residual stream and
LayerNorms stay float32, each Linear casts its input and kernel to the compute dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from stable_attn.flash import RESIDUAL_NAMES

from stable_attn import context

from .attention import causal_attention_qkv, context_devices, reads_packed
from .config import ModelConfig
from .tokenizer import EOT


def _normal(std: float):
  return nnx.initializers.normal(stddev=std)


def linear_bias_in_matmul(linear: nnx.Linear, x, multiple: int = 64):
  """linear(x) with the bias as one more row of the kernel and x given a column of ones (and
  zeros up to a contraction that is a multiple of `multiple`, whole tiles for cuBLAS).

  x: [..., C] -> [..., D] in linear.dtype. The bias joins the product in its fp32 accumulator,
  before the one rounding (nnx.Linear rounds the product, then adds the bias and rounds again),
  and its gradient comes out of the kernel's gradient matmul. Why: XLA fuses no vector bias into
  cuBLAS's matmul; added after, it is an elementwise pass over the [..., D] output unless another
  pass over it absorbs it (the copies of q, k and v split out of the fused projection did; read
  in place by the attention, nothing does: 0.56 ms of a GPT-2 124M step on an H200).
  """
  kernel, bias = linear.kernel[...], linear.bias[...]
  C = kernel.shape[0]
  pad = multiple - C % multiple
  dt = linear.dtype or jnp.result_type(x, kernel)
  kernel = jnp.concatenate([kernel, bias[None], jnp.zeros((pad - 1, kernel.shape[1]),
                                                          kernel.dtype)]).astype(dt)
  ones = jnp.ones(x.shape[:-1] + (1,), dt)
  x = jnp.concatenate([x.astype(dt), ones, jnp.zeros(x.shape[:-1] + (pad - 1,), dt)], axis=-1)
  return jnp.einsum("...c,cd->...d", x, kernel, precision=linear.precision)


class CausalSelfAttention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = jnp.dtype(cfg.dtype)
    # One fused projection; columns [0:C] are W_Q, [C:2C] W_K, [2C:3C] W_V (monitors slice it).
    self.c_attn = nnx.Linear(cfg.n_embd, 3 * cfg.n_embd, use_bias=cfg.bias, dtype=dt,
                             kernel_init=_normal(0.02), rngs=rngs)
    # GPT-2's scaled init of the projections that write into the residual stream.
    self.c_proj = nnx.Linear(cfg.n_embd, cfg.n_embd, use_bias=cfg.bias, dtype=dt,
                             kernel_init=_normal(0.02 / math.sqrt(2 * cfg.n_layer)), rngs=rngs)

  def __call__(self, x, tap=None, segment_ids=None):
    """x: [B, T, C] float32 -> ([B, T, C] compute dtype, captured).

    captured = {"x": x, "q", "k", "v": each [B, T, N, H] compute dtype, "segment_ids": [B, T] or
    None} for the monitors and the gradient study. `tap` (optional, [B, T, N, H] compute dtype,
    zeros) is added to the attention output: the gradient of the loss with respect to it is the
    dO that the attention backward sees. segment_ids: document ids (document masking) or None.
    """
    cfg = self.cfg
    B, T, C = x.shape
    # [B, T, 3C] -> [B, T, 3, N, H] is free (columns [0:C] are q, then k, then v); the attention
    # reads it packed (cfg.qkv_packed), the monitors' q, k, v are its slices.
    packed = reads_packed(cfg.attention, cfg.qkv_packed)
    if packed and cfg.bias and cfg.qkv_bias_in_matmul:
      qkv = linear_bias_in_matmul(self.c_attn, x)
    else:
      qkv = self.c_attn(x)
    qkv = qkv.reshape(B, T, 3, cfg.n_head, cfg.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    y = causal_attention_qkv(qkv, packed=packed, implementation=cfg.attention,
                             max_adjust=cfg.max_adjust, numerics=cfg.numerics, beta=cfg.beta,
                             fp8_backward=cfg.fp8_backward, segment_ids=segment_ids)
    if tap is not None:
      y = y + tap
    captured = {"x": x, "q": q, "k": k, "v": v, "segment_ids": segment_ids}
    return self.c_proj(y.reshape(B, T, C)), captured


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    self.c_fc = nnx.Linear(cfg.n_embd, 4 * cfg.n_embd, use_bias=cfg.bias, dtype=dt,
                           kernel_init=_normal(0.02), rngs=rngs)
    self.c_proj = nnx.Linear(4 * cfg.n_embd, cfg.n_embd, use_bias=cfg.bias, dtype=dt,
                             kernel_init=_normal(0.02 / math.sqrt(2 * cfg.n_layer)), rngs=rngs)

  def __call__(self, x):
    # GPT-2 uses the tanh approximation of GELU.
    return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


def _layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  # float32 statistics whatever the compute dtype (autocast keeps LayerNorm in fp32 too).
  return nnx.LayerNorm(cfg.n_embd, epsilon=1e-5, use_bias=cfg.bias, dtype=jnp.float32, rngs=rngs)


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.ln_1 = _layer_norm(cfg, rngs)
    self.attn = CausalSelfAttention(cfg, rngs=rngs)
    self.ln_2 = _layer_norm(cfg, rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, tap=None, segment_ids=None):
    """x: [B, T, C] float32 residual stream -> (same, the attention's captured inputs)."""
    a, captured = self.attn(self.ln_1(x), tap, segment_ids)
    x = x + a.astype(jnp.float32)
    x = x + self.mlp(self.ln_2(x)).astype(jnp.float32)
    return x, captured


def _block_forward(block: Block, x, tap=None, segment_ids=None):
  return block(x, tap, segment_ids)


# Recomputes the block in the backward pass instead of storing its activations (--remat), except
# the attention's own residuals (O and its log-sum-exp, named by stable_attn): keeping them spares
# re-running the attention forward, the block's most expensive part, for 2 x [B, T, C] per layer.
_block_forward_remat = nnx.remat(
    _block_forward, policy=jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES))


class GPT(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=_normal(0.02), rngs=rngs)
    self.wpe = nnx.Embed(cfg.block_size, cfg.n_embd, embedding_init=_normal(0.02), rngs=rngs)
    self.h = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)])
    self.ln_f = _layer_norm(cfg, rngs)

  def __call__(self, idx, *, capture: bool = False, taps=None):
    """idx: [B, T] int32 token ids, T <= block_size; traced under a context-parallel
    train.attention.on_mesh, in the zigzag order over its devices (logits in the same order).

    Returns logits [B, T, vocab_size] in the compute dtype; with capture=True also the list of
    per-layer attention inputs (dicts of x [B, T, C] and q, k, v [B, T, N, H], see
    CausalSelfAttention). `taps`: None or one zero [B, T, N, H] array per layer added to the
    attention outputs, so that a gradient with respect to taps yields each layer's dO.
    """
    cfg = self.cfg
    B, T = idx.shape
    if T > cfg.block_size:
      raise ValueError(f"sequence length {T} exceeds block_size {cfg.block_size}")
    # Context parallel (train.attention.on_mesh): the positions come in the zigzag order over n
    # devices, and each token's position and document are those of its natural place.
    n = context_devices()
    natural = (lambda a: a) if n == 1 else (lambda a: context.unzigzag(a, n))
    laid_out = (lambda a: a) if n == 1 else (lambda a: context.zigzag(a, n))
    x = self.wte(idx) + self.wpe(laid_out(jnp.arange(T)[None]))
    layers = []
    if taps is not None and len(taps) != cfg.n_layer:
      raise ValueError(f"taps must hold one array per layer ({cfg.n_layer}), got {len(taps)}")
    forward = _block_forward_remat if cfg.remat and not capture else _block_forward
    segment_ids = laid_out(document_ids(natural(idx))) if cfg.pack_documents else None
    for i, block in enumerate(self.h):
      x, captured = forward(block, x, None if taps is None else taps[i], segment_ids)
      if capture:
        layers.append(captured)
    x = self.ln_f(x)
    dt = jnp.dtype(cfg.dtype)
    # Tied LM head: the token embedding, transposed, in the compute dtype.
    logits = jnp.dot(x.astype(dt), self.wte.embedding[...].astype(dt).T)
    return (logits, layers) if capture else logits


def abstract_model(cfg: ModelConfig) -> GPT:
  """The model with abstract (shape-only) parameters: its structure, at no memory cost."""
  return nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))


def document_ids(idx, eot: int = EOT):
  """int32 [B, T]: the document of each position of a packed row. An end-of-text token closes its
  document, so the ids count the end-of-text tokens strictly before each position."""
  ends = (idx == eot).astype(jnp.int32)
  return jnp.cumsum(ends, axis=-1) - ends


def count_params(model_or_state, *, exclude_positions: bool = False) -> int:
  """Number of parameters (optionally without the position table, as the MFU formula wants)."""
  params = (nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module)
            else model_or_state)
  total = sum(x.size for x in jax.tree.leaves(params))
  if exclude_positions:
    total -= sum(x.size for x in jax.tree.leaves(params["wpe"]))
  return int(total)


def flops_per_token(cfg: ModelConfig, n_params_no_pos: int) -> float:
  """Training FLOPs per token: 6N for the matmuls (forward + backward) plus 12*L*T*d for
  attention."""
  return 6.0 * n_params_no_pos + 12.0 * cfg.n_layer * cfg.block_size * cfg.n_embd
