"""Text sampling from the model (temperature + top-k), one jitted loop over a fixed-size window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from . import tokenizer as tok


def make_sampler(graphdef, block_size: int, *, temperature: float = 0.8, top_k: int = 200):
  """(params, buf [1, block_size] int32, start, stop, key) -> buf with tokens start..stop-1 sampled.

  The whole window is re-run for each new token (no KV cache): causal attention makes the unfilled
  tail irrelevant, and shapes stay static, so it compiles once.
  """

  def sample(params, buf, start, stop, key):
    model = nnx.merge(graphdef, params)

    def body(pos, carry):
      buf, key = carry
      logits = model(buf)[0, pos - 1].astype(jnp.float32)
      # Padded vocabulary entries (50257..vocab_size-1) are never real tokens.
      logits = jnp.where(jnp.arange(logits.shape[0]) < tok.N_VOCAB, logits, -jnp.inf) / temperature
      kth = jax.lax.top_k(logits, min(top_k, logits.shape[0]))[0][-1]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
      key, sub = jax.random.split(key)
      nxt = jax.random.categorical(sub, logits).astype(jnp.int32)
      return buf.at[0, pos].set(nxt), key

    buf, _ = jax.lax.fori_loop(start, stop, body, (buf, key))
    return buf

  return jax.jit(sample)


def generate_text(sampler, params, block_size: int, key, *, prompt: str = "",
                  max_new_tokens: int = 200) -> str:
  """Prompt text (empty: start after <|endoftext|>) -> prompt + continuation, decoded."""
  enc = tok.gpt2_encoding()
  ids = [tok.EOT] + enc.encode_ordinary(prompt)
  ids = ids[-(block_size - 1):]
  stop = min(block_size, len(ids) + max_new_tokens)
  buf = jnp.zeros((1, block_size), jnp.int32).at[0, :len(ids)].set(jnp.asarray(ids, jnp.int32))
  out = jax.device_get(sampler(params, buf, len(ids), stop, key))[0, 1:stop]
  return enc.decode([int(t) for t in out])
