"""Shared equivalence cases: every implementation against the exact float64 reference.

Each case is a small dict of shapes and options. `check_case` draws fresh random inputs in the
requested dtype, runs the implementation (values and gradients through jax.vjp) and compares with
`stable_attn.reference.exact_attention_vjp` evaluated in float64 on the same low-precision inputs,
by relative Frobenius error with dtype-appropriate tolerances.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stable_attn
from stable_attn.reference import exact_attention_vjp

CASES = [
    dict(name="mha", B=2, T=33, S=33, N=2, K=2, H=32),
    dict(name="gqa_causal", B=1, T=40, S=40, N=4, K=2, H=64, is_causal=True),
    dict(name="mqa_cross", B=2, T=17, S=45, N=2, K=1, H=32),
    dict(name="causal_T_gt_S", B=1, T=50, S=21, N=2, K=2, H=32, is_causal=True),
    dict(name="window_lengths", B=2, T=48, S=48, N=2, K=2, H=32, is_causal=True, window=(7, 0),
         q_lens=(48, 30), kv_lens=(48, 25)),
    dict(name="window_symmetric", B=1, T=40, S=40, N=2, K=1, H=32, window=5),
    dict(name="bias_mask", B=2, T=24, S=40, N=2, K=2, H=32, bias=(1, 2, 24, 40),
         mask=(2, 1, 24, 40)),
    dict(name="fully_masked_rows", B=2, T=20, S=36, N=2, K=2, H=32, mask=(2, 1, 20, 36),
         masked_rows=(0, 7, 19), q_lens=(20, 13)),
    dict(name="head128", B=1, T=20, S=28, N=1, K=1, H=128, is_causal=True),
    # Packed documents (monotone segment ids), with a soft cap; in the cross case some query
    # segments have no key at all (those rows must be 0 with zero gradients).
    dict(name="packed_causal", B=2, T=48, S=48, N=2, K=1, H=32, is_causal=True, segments=True),
    dict(name="packed_cross_softcap", B=2, T=24, S=40, N=2, K=2, H=32, segments=True,
         soft_cap=4.0, bias=(1, 2, 24, 40)),
    dict(name="softcap_window_gqa", B=1, T=40, S=40, N=4, K=2, H=64, is_causal=True,
         window=(9, 0), soft_cap=2.5),
]
CASE_NAMES = [c["name"] for c in CASES]

# Relative Frobenius error bounds (values, gradients) per input dtype.
# Compiled on the GPU machine only (`-m gpu`); the interpret-mode arms run everywhere.
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend")
COMPILED_PALLAS_GPU = pytest.param("pallas_gpu", False, marks=[pytest.mark.gpu, on_gpu],
                                   id="pallas_gpu-compiled")
# Every implementation for the feature tests: (implementation, interpret).
FEATURE_IMPLS = [("reference", False), ("xla", False), ("pallas_gpu", True), ("pallas_tpu", True),
                 COMPILED_PALLAS_GPU]

TOLERANCE = {jnp.float32: (1e-4, 2e-4), jnp.float16: (4e-3, 8e-3), jnp.bfloat16: (2e-2, 3e-2)}


def case_by_name(name: str) -> dict:
  return next(c for c in CASES if c["name"] == name)


def make_inputs(case: dict, dtype, seed: int):
  """-> (args, kwargs, d_out) for dot_product_attention; fresh normal inputs, never zeros."""
  rng = np.random.default_rng(seed)
  B, T, S, N, K, H = (case[k] for k in ("B", "T", "S", "N", "K", "H"))
  cast = lambda x: jnp.asarray(x, dtype)
  q = cast(rng.standard_normal((B, T, N, H)))
  k = cast(rng.standard_normal((B, S, K, H)))
  v = cast(rng.standard_normal((B, S, K, H)))
  d_out = cast(rng.standard_normal((B, T, N, H)))
  bias = None
  if "bias" in case:
    bias = jnp.asarray(rng.standard_normal(case["bias"]), case.get("bias_dtype", dtype))
  mask = None
  if "mask" in case:
    mask = rng.random(case["mask"]) > 0.3
    mask[..., 0] = True  # at least one visible key per row unless a row is masked on purpose
    if case.get("whole_blocks"):   # blocks all True or all False (kernels run them unmasked)
      mask[...] = True
    if "sparse_blocks" in case:   # whole blocks of False: the kernels' block ranges skip them
      block, keep = case["sparse_blocks"]
      nq, nk = -(-mask.shape[-2] // block), -(-mask.shape[-1] // block)
      hidden = np.repeat(np.repeat(rng.random((nq, nk)) > keep, block, 0), block, 1)
      mask &= ~hidden[:mask.shape[-2], :mask.shape[-1]]
    for row in case.get("masked_rows", ()):
      mask[..., row, :] = False
    mask = jnp.asarray(mask)
  kwargs = dict(is_causal=case.get("is_causal", False),
                local_window_size=case.get("window"),
                logits_soft_cap=case.get("soft_cap"),
                query_seq_lengths=None if "q_lens" not in case else jnp.asarray(case["q_lens"],
                                                                               jnp.int32),
                key_value_seq_lengths=None if "kv_lens" not in case else jnp.asarray(
                    case["kv_lens"], jnp.int32))
  if case.get("sinks"):   # around and above the rows' maxima (scores here are ~N(0, 1))
    kwargs["sinks"] = jnp.asarray(rng.normal(1.0, 2.0, N), jnp.float32)
  if case.get("segments"):
    kwargs.update(segment_ids(rng, B, T, S, case.get("docs", 4)))
  return (q, k, v, bias, mask), kwargs, d_out


def segment_ids(rng, B: int, T: int, S: int, docs: int = 4) -> dict:
  """Monotone document ids per row (packing, about `docs` documents a row); for T != S, key
  documents are drawn separately, so some query documents have no key. kv_segment_ids is omitted
  when T == S (it defaults to q's)."""
  draw = lambda n: np.cumsum(rng.random((B, n)) < docs / n, axis=1).astype(np.int32)
  ids = {"q_segment_ids": jnp.asarray(draw(T))}
  if S != T:
    ids["kv_segment_ids"] = jnp.asarray(draw(S))
  return ids


def relative_error(x, ref) -> float:
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_o_dithered(o_out, o_grid, offsets, rows=None) -> None:
  """Numerics.dither="out" in bf16: O (o_out [B, T, N, H]) is o_grid (the same call with
  dither="max" on offsets rounded to P's grid) times round(w) / w per row, w = exp(-offsets)
  ([N, T]) and round() bf16's, computed here by ml_dtypes -- within one bf16 rounding (two half
  spacings, one of them times the factor, each at most the spacing at the larger value) -- and
  visibly not o_grid. rows: [B, T, N] bool, the rows compared (default all)."""
  import ml_dtypes
  w = np.exp(-np.asarray(offsets, np.float64))
  factor = w.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64) / w
  assert np.abs(factor - 1).max() < 2 ** -8 and abs(np.mean(factor) - 1) < 1e-4
  as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  got, want = as64(o_out), as64(o_grid) * factor.T[None, :, :, None]
  if rows is not None:
    got, want, o_grid = got[rows], want[rows], as64(o_grid)[rows]
  larger = np.maximum(np.abs(want), np.abs(got))
  spacing = 2.0 ** (np.floor(np.log2(np.maximum(larger, 1e-30))) - 7)
  assert np.all(np.abs(got - want) <= spacing * 1.01 + 1e-30)
  assert np.mean(got != as64(o_grid)) > 0.2


def run_case(implementation, case, dtype, max_adjust, numerics, *, interpret=False, seed=0,
             jit=True, config=None):
  """-> (out, grads, exact) where exact = (O, dQ, dK, dV, dBias) in float64."""
  (q, k, v, bias, mask), kwargs, d_out = make_inputs(case, dtype, seed)

  def f(q, k, v, bias):
    return stable_attn.dot_product_attention(
        q, k, v, bias, mask, implementation=implementation, max_adjust=max_adjust,
        numerics=numerics, interpret=interpret, config=config, **kwargs)

  if jit:
    f = jax.jit(f)
  out, vjp = jax.vjp(f, q, k, v, bias)
  grads = vjp(d_out)
  exact = exact_attention_vjp(q, k, v, d_out, bias, mask, **kwargs)
  return out, grads, exact


def check_case(implementation, case, dtype, max_adjust, numerics, *, interpret=False, seed=0,
               jit=True, config=None):
  """Asserts values and gradients match the exact reference within the dtype's tolerance."""
  out, grads, exact = run_case(implementation, case, dtype, max_adjust, numerics,
                               interpret=interpret, seed=seed, jit=jit, config=config)
  chex.assert_shape(out, exact[0].shape)
  chex.assert_tree_all_finite((out, [g for g in grads if g is not None]))
  assert out.dtype == dtype
  tol_value, tol_grad = TOLERANCE[dtype]
  errors = {"out": relative_error(out, exact[0])}
  for name, g, ref in zip(("dq", "dk", "dv", "dbias"), grads, exact[1:]):
    if ref is not None:
      errors[name] = relative_error(g, ref)
  bad = {k: e for k, e in errors.items() if e > (tol_value if k == "out" else tol_grad)}
  assert not bad, f"{implementation} {case['name']} {dtype.__name__} {max_adjust}/{numerics}: {bad}"
  if case.get("masked_rows"):
    rows = list(case["masked_rows"])
    np.testing.assert_array_equal(np.asarray(out[:, rows], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0][:, rows], np.float32), 0.0)
  return errors


FP8_HAZARDS = ("huge logits", "a head of zeros in each of q, k, v", "v near bf16's edges",
               "rows with no key")


def fp8_hazard(hazard: str, seed: int, shape=(2, 48, 2, 32)):
  """(q, k, v, call kwargs) for one of FP8_HAZARDS: bf16 inputs of `shape` [B, T, N, H] (B >= 2),
  causal. "rows with no key": batch row 1 sees no key (key length 0), row 0's queries from 3T/4
  on are past its query length."""
  rng = np.random.default_rng(seed)
  B, T = shape[:2]
  q, k, v = (rng.standard_normal(shape) for _ in range(3))
  kw = dict(is_causal=True)
  if hazard == "huge logits":
    kw["scale"] = 1e3
  elif hazard == "a head of zeros in each of q, k, v":
    q[:, :, 0], k[:, :, 1], v[:, :, 0] = 0.0, 0.0, 0.0
  elif hazard == "v near bf16's edges":
    v[:, :, 0] *= 2.0 ** 60
    v[:, :, 1] *= 2.0 ** -60
  elif hazard == "rows with no key":
    kw.update(query_seq_lengths=jnp.array([3 * T // 4] + [T] * (B - 1), jnp.int32),
              key_value_seq_lengths=jnp.array([T, 0] + [T] * (B - 2), jnp.int32))
  else:
    raise ValueError(f"hazard {hazard!r} is not one of {FP8_HAZARDS}")
  return (*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), kw)


def _near_ties(q, k, v, scale):
  """Causal q, k, v [B, T, N, H] (e4m3 values, a kv head per query head) -> (tied [B, T, N]:
  rows whose two best scores lie within the FP8 product's error of each other; lo, hi
  [B, T, N, H]: per column the least and largest v among the keys scoring within that error of
  the row's best). Hopper's e4m3 MMA keeps ~13 bits while it accumulates, so a score errs by up
  to ~2^-11 of sum_h |q_h k_h| (x scale): at scale 1e3 a few logits, which decides how such a
  row splits its weight but not which v's it mixes."""
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  s = np.einsum("bthd,bshd->bhts", q, k) * scale
  margin = np.einsum("bthd,bshd->bhts", np.abs(q), np.abs(k)) * scale * 2.0 ** -11
  T = q.shape[1]
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  best = s.max(axis=-1, keepdims=True)
  near = s >= best - np.take_along_axis(margin, s.argmax(axis=-1)[..., None], axis=-1)
  tied = np.moveaxis(near.sum(axis=-1) > 1, 1, 2)   # [B, T, N]
  vv = np.moveaxis(v, 1, 2)[:, :, None]   # [B, N, 1, S, H]
  pick = lambda fill, f: np.moveaxis(f(np.where(near[..., None], vv, fill), axis=3), 1, 2)
  return tied, pick(np.inf, np.min), pick(-np.inf, np.max)


def check_fp8_hazard(hazard: str, q, k, v, kw, out, grads) -> None:
  """Finite values and gradients, O within FP8's error of float64 attention of the e4m3-quantized
  inputs (each head against its own largest |O|: the scales are per head), and the rows and
  heads that must be 0 exactly 0. With huge logits, a row whose best keys score within the FP8
  product's error of each other (`_near_ties`) is held to the range of those keys' v instead:
  how it splits its weight between them is the product's rounding."""
  from stable_attn import fp8
  from stable_attn.reference import exact_attention
  chex.assert_tree_all_finite((out, grads))
  quantized = fp8.quantize_inputs(q, k, v, "e4m3")[:3]
  want = exact_attention(*quantized, **kw)
  got = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  head_max = np.abs(want).max(axis=(0, 1, 3))
  # an e4m3 P (3 mantissa bits) errs by up to ~6% of a key's weight; over a row's keys that
  # averages out to 1-3% of a head's largest |O| (2.5% at most in the CPU cases)
  tol = 0.06 * head_max[:, None]   # [N, 1]
  tied = np.zeros(got.shape[:3], bool)
  if hazard == "huge logits":
    tied, lo, hi = _near_ties(*quantized, kw["scale"])
    assert tied.mean() < 0.02, tied.mean()   # the check against `want` still covers most rows
    assert np.all((got >= lo - tol) & (got <= hi + tol)), "a near-tie row outside its keys' v"
  err = np.where(tied[..., None], 0.0, np.abs(got - want)).max(axis=(0, 1, 3))
  assert np.all(err <= tol[:, 0]), (err, head_max)
  if hazard == "rows with no key":
    T = q.shape[1]
    np.testing.assert_array_equal(got[1], 0.0)
    np.testing.assert_array_equal(got[0, 3 * T // 4:], 0.0)
    np.testing.assert_array_equal(np.asarray(jnp.asarray(grads[0][1], jnp.float32)), 0.0)
  if hazard == "a head of zeros in each of q, k, v":
    np.testing.assert_array_equal(got[..., 0, :], 0.0)   # v's head 0 is zero


def abstract_mesh(device_kind: str, cores: int, platform: str):
  """A one-device abstract mesh naming a device this host does not have (lowering for it here),
  or None where this JAX cannot describe one."""
  try:
    from jax._src import mesh as mesh_lib
    device = mesh_lib.AbstractDevice(device_kind, cores, platform)
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  except (ImportError, AttributeError, TypeError):   # private API moved
    return None


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H100 80GB HBM3", cores: int = 132):
  """Lowering for CUDA on a host without a GPU: JAX 0.12's Pallas Triton lowering asks which GPU
  it lowers for (an abstract device of an abstract mesh); older JAX does not ask."""
  mesh = abstract_mesh(device_kind, cores, "gpu")
  if mesh is None:
    yield
    return
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def lower_vjp_for_cuda(flash, ops) -> str:
  """HLO text of a kernel's forward and backward (flash: canonical Operands -> O) lowered for CUDA
  on this host -- the whole Pallas lowering, short of the GPU compiler; skips the calling test
  where this jaxlib cannot lower for CUDA."""
  import pytest

  def f(ops):
    o, vjp = jax.vjp(flash, ops)
    return o, vjp(o)

  try:
    return jax.jit(f).trace(ops).lower(lowering_platforms=("cuda",)).as_text()
  except NotImplementedError as e:
    pytest.skip(f"no CUDA lowering here: {e}")


ROOT = Path(__file__).resolve().parents[1]


def run_on_cpu_devices(script: str, devices: int = 8, timeout: float = 600) -> dict:
  """Runs `script` (Python source that prints "RESULT" + a JSON object last) in a subprocess with
  `devices` virtual CPU devices (XLA's host platform; the repo root is its working directory) and
  returns that object; the subprocess's failure fails the test with the end of its stderr."""
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                        cwd=ROOT, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.split("RESULT")[-1])


def numpy_e4m3(x):
  """x (float64 [B, T, N, H]) -> its e4m3 rounding under one power-of-two scale per head that
  puts the head's max |x| in (224, 448] (ml_dtypes' cast), unscaled: an FP8 quantization built
  independently of stable_attn.fp8."""
  import ml_dtypes
  amax = np.max(np.abs(x), axis=(0, 1, 3))
  scale = np.where(amax > 0, 2.0 ** np.floor(np.log2(448 / np.where(amax > 0, amax, 1))), 1.0)
  assert np.all((amax == 0) | ((amax * scale > 224) & (amax * scale <= 448)))
  scale = scale[None, None, :, None]
  return ((x * scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
          / scale)
