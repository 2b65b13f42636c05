"""train.model: GPT-2 against an independent plain-jnp forward; attention implementations inside it;
the paper's monitors."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from train.config import ModelConfig
from train.model import GPT, count_params, flops_per_token, linear_bias_in_matmul
from train.monitors import attention_stats, make_monitor_fn, spectral_norm

SMALL = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=512)


def make(**kw):
  cfg = ModelConfig(**{**SMALL, **kw})
  model = GPT(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  # Non-zero biases and LayerNorm parameters, so that a mix-up of any of them shows.
  key = iter(jax.random.split(jax.random.key(1), 1000))
  params = jax.tree.map(lambda p: p + 0.02 * jax.random.normal(next(key), p.shape, p.dtype), params)
  return cfg, graphdef, params


def tokens(cfg, batch=2, seed=0):
  return jax.random.randint(jax.random.key(seed), (batch, cfg.block_size), 0, cfg.vocab_size)


# ---------------------------------------------------------------------------- independent reference


def reference_gpt2(p, idx, cfg):
  """GPT-2 forward in float32 from the pure-dict parameters, written from the GPT-2 paper/code
  shape."""
  def layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * scale + bias

  def gelu(x):
    return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

  B, T = idx.shape
  N, H = cfg.n_head, cfg.n_embd // cfg.n_head
  x = p["wte"]["embedding"][idx] + p["wpe"]["embedding"][jnp.arange(T)]
  for i in range(cfg.n_layer):
    b = p["h"][i]
    h = layer_norm(x, b["ln_1"]["scale"], b["ln_1"]["bias"])
    qkv = h @ b["attn"]["c_attn"]["kernel"] + b["attn"]["c_attn"]["bias"]
    q, k, v = [qkv[..., j * cfg.n_embd:(j + 1) * cfg.n_embd].reshape(B, T, N, H)
               .transpose(0, 2, 1, 3) for j in range(3)]
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(H)
    scores = jnp.where(np.tril(np.ones((T, T), bool)), scores, -jnp.inf)
    y = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, T, cfg.n_embd)
    x = x + y @ b["attn"]["c_proj"]["kernel"] + b["attn"]["c_proj"]["bias"]
    h = layer_norm(x, b["ln_2"]["scale"], b["ln_2"]["bias"])
    h = gelu(h @ b["mlp"]["c_fc"]["kernel"] + b["mlp"]["c_fc"]["bias"])
    x = x + h @ b["mlp"]["c_proj"]["kernel"] + b["mlp"]["c_proj"]["bias"]
  x = layer_norm(x, p["ln_f"]["scale"], p["ln_f"]["bias"])
  return x @ p["wte"]["embedding"].T


@pytest.mark.parametrize("attention", ["jax_xla", "xla"])
def test_float32_forward_matches_reference(attention):
  cfg, graphdef, params = make(dtype="float32", attention=attention, max_adjust="off")
  idx = tokens(cfg)
  with jax.default_matmul_precision("highest"):
    got = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, idx)
    want = reference_gpt2(nnx.to_pure_dict(params), idx, cfg)
  chex.assert_shape(got, (2, cfg.block_size, cfg.vocab_size))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.slow   # README test command's time (2026-12-03): CI's slow part runs it
def test_bfloat16_forward_close_to_float32_reference():
  cfg, graphdef, params = make(dtype="bfloat16", attention="jax_xla")
  idx = tokens(cfg)
  got = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, idx)
  assert got.dtype == jnp.bfloat16
  # Master weights stay float32 whatever the compute dtype.
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  with jax.default_matmul_precision("highest"):
    want = reference_gpt2(nnx.to_pure_dict(params), idx, cfg)
  err = jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want)
  assert err < 2e-2, err


def test_no_bias_config_has_no_bias_parameters():
  cfg = ModelConfig(**{**SMALL, "bias": False})
  params = nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
  names = [jax.tree_util.keystr(path)
           for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert names and not any("bias" in n for n in names), names


def test_tied_embedding_and_parameter_count():
  cfg = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=True)
  abstract = nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  # GPT-2 small with the padded vocabulary: 124.4M parameters (no separate LM head).
  assert count_params(abstract) == 124_475_904
  assert count_params(abstract, exclude_positions=True) == 124_475_904 - 1024 * 768
  assert flops_per_token(cfg, 1) == 6 + 12 * 12 * 1024 * 768


# ---------------------------------------------------------------------------- implementations agree


def _loss_and_grads(graphdef, params, idx):
  """((loss, logits), grads) of the next-token loss, one jitted call."""
  def loss(p):
    logits = nnx.merge(graphdef, p)(idx[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         idx[:, 1:]).mean()
    return ce, logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("dtype,max_adjust,tol",
                         [("float32", "off", 1e-4), ("bfloat16", "safe", 3e-2)])
def test_attention_implementations_agree_in_model(dtype, max_adjust, tol):
  """Ours (reference blockwise, xla) and jax.nn's XLA attention: same logits, loss and gradients."""
  results = {}
  for impl in ("reference", "xla", "jax_xla"):
    cfg, graphdef, params = make(dtype=dtype, attention=impl,
                                 max_adjust="off" if impl == "jax_xla" else max_adjust)
    with jax.default_matmul_precision("highest"):
      results[impl] = _loss_and_grads(graphdef, params, tokens(cfg, seed=3))
  (base_loss, base_logits), base_grads = results["jax_xla"]
  for impl in ("reference", "xla"):
    (loss, logits), grads = results[impl]
    assert _rel(logits, base_logits) < tol, (impl, _rel(logits, base_logits))
    assert abs(float(loss) - float(base_loss)) < tol * 10, impl
    for (path, g), gb in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                             jax.tree.leaves(base_grads)):
      chex.assert_tree_all_finite(g)
      assert _rel(g, gb) < 5 * tol, (impl, jax.tree_util.keystr(path), _rel(g, gb))


@pytest.mark.slow
def test_pallas_gpu_interpret_matches_reference_in_model():
  """The Pallas GPU kernel in interpret mode (CPU) inside the model: values and gradients."""
  out = {}
  for impl in ("reference", "pallas_gpu"):
    cfg, graphdef, params = make(dtype="float32", attention=impl, n_layer=1, block_size=16)
    out[impl] = _loss_and_grads(graphdef, params, tokens(cfg, seed=5))
  ((l1, _), g1), ((l2, _), g2) = out["reference"], out["pallas_gpu"]
  assert abs(float(l1) - float(l2)) < 1e-4
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    assert _rel(b, a) < 1e-3


def test_packed_and_split_attention_agree_in_model():
  """The attention reading the fused projection packed (stable_attn's qkvpacked form, the default)
  and on q, k, v split out of it (--no-qkv-packed): with c_attn's bias added after its product
  in both, the same loss, logits and gradients, bitwise; with the packed default's bias in the
  matmul (one rounding of qkv instead of two), the same to bf16's precision."""
  out = {}
  for name, kw in {"packed": dict(qkv_bias_in_matmul=False), "split": dict(qkv_packed=False),
                   "default": {}}.items():
    cfg, graphdef, params = make(dtype="bfloat16", attention="reference", **kw)
    out[name] = _loss_and_grads(graphdef, params, tokens(cfg, seed=7))
  for a, b in zip(jax.tree.leaves(out["packed"]), jax.tree.leaves(out["split"])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ((l_def, _), g_def), ((l_split, _), g_split) = out["default"], out["split"]
  assert abs(float(l_def) - float(l_split)) < 2e-2 * abs(float(l_split))
  for a, b in zip(jax.tree.leaves(g_def), jax.tree.leaves(g_split)):
    assert _rel(a, b) < 3e-2
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g_def),
                                                      jax.tree.leaves(g_split)))


@pytest.mark.parametrize("C, D", [(64, 192), (96, 288), (768, 48)])
def test_linear_bias_in_matmul_matches_float64(C, D):
  """train.model.linear_bias_in_matmul (the packed model's c_attn): x [..., C] -> [..., D], values
  and gradients (x, kernel, bias) against float64; in bf16 within one rounding of the product,
  at least as close as nnx.Linear (which rounds the product and the sum)."""
  keys = jax.random.split(jax.random.key(C + D), 4)
  x = jax.random.normal(keys[0], (3, 5, C))
  w = jax.random.normal(keys[1], (C, D)) / math.sqrt(C)
  b = jax.random.normal(keys[2], (D,))
  ct = jax.random.normal(keys[3], (3, 5, D))
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2 ** -8)):
    # The truth for the inputs as the layer sees them (cast to its dtype): what is left is the
    # product's rounding.
    x64, w64, b64, ct64 = (np.asarray(a.astype(dtype), np.float64) for a in (x, w, b, ct))
    want = x64 @ w64 + b64
    want_grads = (ct64 @ w64.T, np.einsum("abc,abd->cd", x64, ct64), ct64.sum((0, 1)))

    def f(x, w, b, fold, dtype=dtype):
      linear = nnx.Linear(C, D, dtype=dtype, rngs=nnx.Rngs(0))
      linear.kernel[...], linear.bias[...] = w, b
      return (linear_bias_in_matmul(linear, x) if fold else linear(x)).astype(jnp.float32)

    got, vjp = jax.vjp(lambda x, w, b: f(x, w, b, True), x, w, b)
    scale = np.abs(want).max()
    err = np.abs(np.asarray(got, np.float64) - want).max() / scale
    assert got.shape == want.shape and err < tol, (dtype, err)
    if dtype == jnp.bfloat16:
      plain = np.asarray(f(x, w, b, False), np.float64)
      assert err <= np.abs(plain - want).max() / scale + 1e-7
    for g, w_g in zip(vjp(ct), want_grads):
      assert np.abs(np.asarray(g, np.float64) - w_g).max() / np.abs(w_g).max() < 4 * tol


# ----------------------------------------------------------------------------- monitors


def test_tie_fraction_counts_rows_with_two_maxima():
  """Row t of head 0 attends over keys 0..t; make keys 0 and 1 identical and dominant so rows >= 1
  tie."""
  T, H = 8, 4
  k = jnp.zeros((1, T, 1, H)).at[0, :, 0, 0].set(-1.0).at[0, :2, 0, 0].set(3.0)
  q = jnp.zeros((1, T, 1, H)).at[0, :, 0, 0].set(2.0)
  max_logit, tie = attention_stats(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), scale=1.0,
                                   numerics="fast")
  assert float(max_logit) == pytest.approx(6.0)
  assert float(tie) == pytest.approx((T - 1) / T)  # row 0 sees a single key
  # A gap of 0.01 is far more than bf16's rounding of P near 1 (2^-9): no tie any more.
  k2 = k.at[0, 1, 0, 0].set(2.995)
  _, tie2 = attention_stats(q.astype(jnp.float32), k2, scale=1.0, numerics="fast")
  assert float(tie2) == 0.0
  # ... but a gap of 0.0005 rounds to P = 1.0 in bf16: still tied.
  k3 = k.at[0, 1, 0, 0].set(3.0 - 0.00025)
  _, tie3 = attention_stats(q.astype(jnp.float32), k3, scale=1.0, numerics="fast")
  assert float(tie3) == pytest.approx((T - 1) / T)
  # Scores 6.0 and 5.99 differ in fp32 (P = 0.990 rounds below 1) but are one bf16 value: a tie
  # exactly where the arm's numerics keep scores in the input dtype.
  k4 = k.at[0, 1, 0, 0].set(2.995)
  q4 = q.astype(jnp.bfloat16)
  ties = {nx: float(attention_stats(q4, k4, scale=1.0, numerics=nx)[1])
          for nx in ("fast", "paper", "fast+score=input", "paper+score=float32")}
  assert ties == {"fast": 0.0, "paper+score=float32": 0.0, "paper": pytest.approx((T - 1) / T),
                  "fast+score=input": pytest.approx((T - 1) / T)}


def test_monitor_outputs_per_layer():
  cfg, graphdef, params = make(attention="jax_xla")
  out = jax.jit(make_monitor_fn(graphdef, cfg))(params, tokens(cfg))
  for key in ("spec_wq", "spec_wk", "max_logit", "tie_frac"):
    chex.assert_shape(out[key], (cfg.n_layer,))
    chex.assert_tree_all_finite(out[key])
  w = np.asarray(
      nnx.to_pure_dict(params)["h"][1]["attn"]["c_attn"]["kernel"])[:, cfg.n_embd:2 * cfg.n_embd]
  np.testing.assert_allclose(out["spec_wk"][1], np.linalg.svd(w, compute_uv=False)[0], rtol=1e-4)
  np.testing.assert_allclose(spectral_norm(jnp.diag(jnp.array([1.0, -3.0, 2.0]))), 3.0, rtol=1e-6)


def test_pack_documents_masks_across_end_of_text():
  """With --pack-documents no position attends across an end-of-text token: changing the first
  document's tokens leaves every later position's logits unchanged, to the bit (and without the
  flag they change)."""
  from train.model import document_ids
  from train.tokenizer import EOT
  vocab = EOT + 1                                    # the real end-of-text token must embed
  idx = tokens(make(dtype="float32", vocab_size=vocab)[0], seed=7)
  idx = idx.at[:, 5].set(EOT)                       # document 0 is positions 0..5
  other = idx.at[:, 1:4].set((idx[:, 1:4] + 17) % 300)
  np.testing.assert_array_equal(np.asarray(document_ids(idx))[0, 4:8], [0, 0, 1, 1])
  for packed in (True, False):
    cfg, graphdef, params = make(dtype="float32", attention="reference", pack_documents=packed,
                                 vocab_size=vocab)
    model = nnx.merge(graphdef, params)
    a, b = np.asarray(model(idx)), np.asarray(model(other))
    later = slice(6, None)
    if packed:
      np.testing.assert_array_equal(a[:, later], b[:, later])
    else:
      assert np.abs(a[:, later] - b[:, later]).max() > 1e-4
    assert np.abs(a[:, 1:4] - b[:, 1:4]).max() > 1e-4   # the changed document itself changes


def test_remat_keeps_the_attention_residuals_and_the_gradients():
  """--remat recomputes each block in the backward but keeps the attention's named residuals
  (its forward is not re-run); the gradients are those of the plain model."""
  import contextlib
  import io
  out = {}
  for remat in (False, True):
    cfg, graphdef, params = make(dtype="float32", attention="reference", remat=remat)
    idx = tokens(cfg, seed=9)
    out[remat] = _loss_and_grads(graphdef, params, idx)
    if remat:
      def loss(p):
        logits = nnx.merge(graphdef, p)(idx[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, idx[:, 1:]).mean()
      buf = io.StringIO()
      with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(loss, params)
      assert buf.getvalue().count("named 'attn_lse'") == cfg.n_layer, buf.getvalue()
  for a, b in zip(jax.tree.leaves(out[False][1]), jax.tree.leaves(out[True][1])):
    assert _rel(b, a) < 1e-5
