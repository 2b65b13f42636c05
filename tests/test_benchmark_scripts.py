"""The benchmark scripts run end to end (smoke mode: interpret mode, tiny shapes, CPU).

Their timings mean nothing here; what is checked is that they still run against the current API,
so the next GPU session does not spend device time on a broken script.
"""
import contextlib
import json
import os
import re
import shlex
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import (attention, compile_time, config_ab, features, fp8, mosaic_sweep, peers,
                        profile_mosaic, safe_cost)
from pallas_kernels import mosaic_gpu
from pallas_kernels.mosaic_gpu import tuning


@pytest.mark.slow
def test_features_smoke(capsys):
  features.main(["--smoke", "--implementations", "pallas_mosaic_gpu,pallas_gpu,tokamax",
                 "--no-compilation-cache"])
  text = capsys.readouterr().out
  assert re.search(r"Matmul ceiling in this run: a dense bfloat16 256 x 256 x 256 matmul \(XLA\) "
                   r"at [0-9]+ TFLOP/s", text)
  assert "| pallas_gpu | packed / unpacked, 4 x 32 |" in text
  assert "| pallas_gpu | soft cap / no cap, B1 T64 N2 H32 causal, forward |" in text
  assert "| pallas_gpu | B1 T64 N2 H256 causal, ALiBi bias [1, N, T, T] bfloat16 |" in text
  assert "not run: Mosaic GPU kernels have no interpret mode" in text
  assert "FAILED" not in text
  try:
    import tokamax  # noqa: F401
  except ImportError:
    assert "| tokamax | B1 T64 N2 H32 causal, soft cap 50 | nan | not run: tokamax is not " in text


def test_device_slug_names_the_result_files():
  """The slug the benchmarks name their result files with, as those files are named."""
  import pathlib
  results = pathlib.Path(attention.RESULTS)
  assert attention.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
  assert (results / f"safe_cost_{attention.device_slug('NVIDIA H200')}.md").exists()
  assert (results / f"attention_{attention.device_slug('NVIDIA H100 80GB HBM3')}.md").exists()


@pytest.mark.slow
def test_safe_cost_smoke(capsys):
  """benchmarks/safe_cost.py runs its three arms through the profiler; the CPU's trace has no GPU
  kernels, so its table says so ("-") instead of dividing by zero."""
  safe_cost.main(["--smoke"])
  text = capsys.readouterr().out
  assert "| B1 T128 N2 H64 causal | - | - | - | - |" in text, text
  assert safe_cost.ratio_cell([2.0, 3.3], [2.0, 3.0]) == "1.050 (1.000-1.100)"


@pytest.mark.parametrize("H", [64, 128])
def test_fp8_sweep_variants_are_configs_of_the_table(H):
  """Every variant of benchmarks/fp8.py --sweep (the forward's) and --backward --sweep (the FP8
  backward's) is a valid change to the FP8 call's table config whose kernels fit shared memory,
  and --sweep-variants refuses a name it does not know."""
  from pallas_kernels.mosaic_gpu import tuning
  table = tuning.table_config(H, causal=True)
  for name, changes in [*fp8.SWEEP.items(), *fp8.BACKWARD_SWEEP.items()]:
    config = table.replace(fp8_backward=name in fp8.BACKWARD_SWEEP, **changes)
    assert all(getattr(config, k) == v for k, v in changes.items()), name
    assert config.smem_problem(H, 2, fp8=True) is None, name
    assert "," not in name, name   # --sweep-variants is a comma list
  with pytest.raises(SystemExit):
    fp8.main(["--sweep", "--sweep-variants", "table,P in SMEM"])
  with pytest.raises(SystemExit):
    fp8.main(["--backward", "--sweep", "--sweep-variants", "dq: 4 warpgroups"])


@pytest.mark.parametrize("name", ["fp8_nvidia_h200.md", "fp8_dv_promoted_nvidia_h200.md"])
def test_fp8_plot_renders_a_results_file(tmp_path, name):
  """benchmarks/fp8.py --plot: a results file's first table to a PNG beside it (the second file:
  the bf16 arm and one with the FP8 backward only)."""
  import shutil
  md = tmp_path / "fp8.md"
  shutil.copy(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", name), md)
  assert fp8.main(["--plot", str(md)]) == 0
  assert (tmp_path / "fp8.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow   # README test command's time (2026-12-03): CI's slow part runs it
def test_fp8_ceiling_copies_still_cut_what_they_name():
  """benchmarks/fp8_ceilings.py: every replacement still matches the FP8 backward's source, each
  copy lowers for CUDA (dQ and dK/dV kernels, on the CPU), and a replacement that no longer
  matches is refused by name."""
  from benchmarks import fp8_ceilings
  from pallas_kernels.mosaic_gpu import fp8_backward
  from stable_attn.api import Options, canonicalize
  q, k, v, do = attention.make_inputs(1, 256, 2, 2, 128, jnp.bfloat16)
  spec, ops, _ = canonicalize(q, k, v, None, None, Options(
      is_causal=True, implementation="pallas_mosaic_gpu", numerics=fp8.FP8_NUMERICS,
      max_adjust="off"))
  config = mosaic_gpu.default_config(spec, ops).replace(fp8_backward=True)
  lse = jnp.zeros((1, 2, 256), jnp.float32)
  texts = {}
  for name in [None, *fp8_ceilings.CEILINGS]:
    m = fp8_backward if name is None else fp8_ceilings.kernel_copy(name)

    def grads(ops, o, lse, do, m=m):
      call, x, g, dq_r, dkv_r = m.backward_inputs(spec, config, ops, o, lse, do)
      return m.dq_call(call, x, g, dq_r, jnp.bfloat16), m.dkv_call(call, x, g, dkv_r, jnp.bfloat16)
    texts[name] = jax.jit(grads).trace(ops, q, lse, do).lower(
        lowering_platforms=("cuda",)).as_text()
  assert len(set(texts.values())) == len(texts)   # each copy is another kernel
  old = fp8_ceilings.CEILINGS["no rescale"]
  try:
    fp8_ceilings.CEILINGS["no rescale"] = old + [("no such line", "pass")]
    with pytest.raises(ValueError, match="no such line"):
      fp8_ceilings.kernel_copy("no rescale")
  finally:
    fp8_ceilings.CEILINGS["no rescale"] = old


def test_cudnn_fp8_operands_descale_what_cudnn_reads_and_scale_what_it_writes():
  """benchmarks/peers.py: the scalar operands of cuDNN's FP8 forward and backward from one power
  of two per tensor (descale_X = 1 / X's scale, scale_X = X's scale); the backward's are the ones
  JAX's own wrapper passes (fp8_params_keys_bwd), in the order measured on the GPU."""
  fa, why = peers.cudnn_fp8_module()
  if fa is None:
    pytest.skip(why)
  assert peers.CUDNN_FP8_FORWARD == tuple(fa.fp8_params_keys_fwd)
  assert sorted(peers.CUDNN_FP8_BACKWARD) == sorted(fa.fp8_params_keys_bwd)
  rng = np.random.default_rng()
  scales = {name: float(2.0 ** rng.integers(-8, 9)) for name in peers.CUDNN_FP8_TENSORS}
  for names in (peers.CUDNN_FP8_FORWARD, peers.CUDNN_FP8_BACKWARD):
    for name, value in zip(names, peers.cudnn_fp8_operands(scales, names)):
      assert value.shape == (1, 1, 1, 1) and value.dtype == jnp.float32, name
      kind, tensor = name.split("_", 1)
      want = scales[tensor.lower()]
      assert float(value[0, 0, 0, 0]) == (1.0 / want if kind == "descale" else want), name
  x = jnp.asarray(rng.standard_normal((1, 8, 2, 4)) * 1e3, jnp.bfloat16)
  x8 = peers.cudnn_fp8_cast(x, 2.0 ** -3)   # saturates past 448
  assert x8.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(x8, np.float32), np.asarray(jnp.clip(
      x.astype(jnp.float32) / 8, -448, 448).astype(jnp.float8_e4m3fn), np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic_gpu.is_available(), reason="needs a Hopper (sm_90) GPU")
def test_gpu_cudnn_fp8_peer_is_fp8_attention():
  """The cudnn_fp8 arm (cuDNN's FP8 attention through JAX, bf16 in and out) computes causal
  attention and its gradients: O within e4m3's rounding of float64 attention (relative Frobenius
  error < 0.1: q, k, v, P and O each rounded to 3 mantissa bits), dQ, dK, dV within 0.3, and not
  bf16's O (it really is FP8)."""
  from stable_attn.reference import exact_attention_vjp
  q, k, v, do = attention.make_inputs(1, 1024, 4, 4, 128, jnp.bfloat16, seed=3)
  f = fp8.attention_fn("cudnn_fp8", "pallas_mosaic_gpu", (q, k, v))
  o, pullback = jax.vjp(jax.jit(f), q, k, v)
  got = (o,) + tuple(pullback(do))
  exact = exact_attention_vjp(q, k, v, do, is_causal=True)
  rel = lambda x, ref: float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))
  errors = [rel(jnp.asarray(x, jnp.float32), ref)
            for x, ref in zip(got, (exact.out, exact.dq, exact.dk, exact.dv))]
  assert errors[0] < 0.1 and max(errors[1:]) < 0.3, errors
  bf16 = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  assert rel(jnp.asarray(bf16, jnp.float32), exact.out) < errors[0] / 4, errors


@pytest.mark.slow
def test_fp8_smoke(capsys):
  """benchmarks/fp8.py's arms that run on a CPU (the reference in each numerics) and its error
  table; the FP8 arm's O is further from float64 than bf16's (q, k, v and P in e4m3)."""
  fp8.main(["--smoke"])
  text = capsys.readouterr().out
  with pytest.raises(SystemExit):
    fp8.main(["--smoke", "--arms", "bf16,fp9"])
  errors = {row[0]: float(row[1]) for row in
            re.findall(r"^\| (bf16|bf16_q|fp8|fp8_given|preset) \| ([0-9.e+-]+) \|", text, re.M)}
  assert set(errors) == {"bf16", "bf16_q", "fp8", "fp8_given", "preset"}, text
  assert errors["bf16"] < 5e-3 < errors["bf16_q"] < errors["fp8"] < 0.1, errors
  assert errors["bf16_q"] < errors["preset"] < 0.1, errors
  # the caller's scales are the inputs' own here: the same e4m3 payloads
  assert errors["fp8_given"] == errors["fp8"], errors
  assert "| B1 T256 N2 H128 | fp8 |" in text and "| B1 T256 N2 H128 | fp8_given |" in text


def test_features_figure_from_a_written_table(tmp_path):
  """--plot-from redraws a written table's figure beside a copy of it, on the CPU; every row of
  the table is read back; a missing table is a usage error."""
  table = os.path.join(attention.RESULTS, "features_nvidia_h200.md")
  with open(table) as f:
    lines = [line for line in f if line.startswith("| ") and not line.startswith("| implementation")]
  rows = features.read_table(table)
  assert len(rows) == len(lines) and ("pallas_mosaic_gpu", "packed / unpacked, 8 x 1024") in {
      r[:2] for r in rows}
  copy = tmp_path / "features_copy.md"
  copy.write_text(open(table).read())
  features.main(["--plot-from", str(copy)])
  assert (tmp_path / "features_copy.png").stat().st_size > 10_000
  with pytest.raises(SystemExit):
    features.main(["--plot-from", str(tmp_path / "missing.md")])


def test_attention_arms_and_peer_columns():
  """tokamax is an arm where it imports (a note line where it does not), with x tokamax columns
  beside x cuDNN; JAX's deprecated Pallas Triton mha runs only when named."""
  shape = (2, 256, 4, 4, 64, True)
  arms = attention.implementations(shape)
  assert "pallas_mha" not in arms
  assert ("tokamax" in arms) == (peers.tokamax_attention() is not None)
  assert "cudnn" in arms and "mosaic_safe" in arms
  if peers.pallas_mha()[0] is not None:
    assert set(attention.implementations(shape, only=["pallas_mha", "cudnn"])) == {
        "pallas_mha", "cudnn"}
  rows = [attention.Row(shape, "cudnn", fwd_ms=1.0, fb_ms=3.0),
          attention.Row(shape, "tokamax", fwd_ms=1.1, fb_ms=3.3),
          attention.Row(shape, "mosaic_safe", fwd_ms=1.0, fb_ms=3.0)]
  notes = ["tokamax: not run, tokamax is not importable."]
  text = attention.markdown(rows, "cpu", np.dtype("bfloat16"), 30, 5, notes)
  assert notes[0] in text.splitlines()
  header = next(line for line in text.splitlines() if line.startswith("| shape | impl |"))
  assert "| fwd x cuDNN | x cuDNN | fwd x tokamax | x tokamax |" in header
  assert " x mha " not in header   # no mha row, no mha column
  row = next(line for line in text.splitlines() if "| mosaic_safe |" in line)
  assert "| 1.00 | 1.00 | 1.10 | 1.10 |" in row
  assert len(row.split("|")) == len(header.split("|"))
  if peers.tokamax_attention() is None:
    assert attention.peer_notes() == ["tokamax: not run, tokamax is not importable."]
    assert attention.peer_notes(["cudnn"]) == []


def _column(table: str, label: str, column: str) -> float:
  lines = [line for line in table.splitlines() if line.startswith("|")]
  names = [c.strip() for c in lines[0].split("|")]
  row = next(line for line in lines if f"| {label} |" in line)
  return float(row.split("|")[names.index(column)])


@pytest.mark.slow
def test_attention_refuses_an_unknown_arm(capsys):
  with pytest.raises(SystemExit):
    attention.main(["--only", "cudnn,pallas_mosaic_gpu"])
  assert "unknown arm(s) pallas_mosaic_gpu" in capsys.readouterr().err
  arms = attention.implementations((1, 128, 2, 2, 64, True), only=list(attention.ARMS))
  assert set(arms) <= set(attention.ARMS) and "mosaic_safe" in arms


def test_config_ab_parses_arms_and_refuses_what_is_not_a_config():
  name, changes = config_ab.parse_arm("x:dkv=64x64x3,producer=False,fwd_producer=None,"
                                      "persistent_order=grid,refill_lag=2")
  assert name == "x" and changes == dict(dkv=tuning.Tiles(64, 64, 3), producer=False,
                                         fwd_producer=None, persistent_order="grid",
                                         refill_lag=2)
  # a tuple value keeps its commas
  assert config_ab.parse_arm("y:heaviest_first=('fwd', 'dkv'),refill_lag=2") == (
      "y", dict(heaviest_first=("fwd", "dkv"), refill_lag=2))
  for bad, match in (("noname", "NAME:FIELD"), ("default:producer=False", "other than"),
                     ("x:", "no FIELD=VALUE"), ("x:nofield=1", "TuningConfig field"),
                     ("x:producer", "TuningConfig field")):
    with pytest.raises(ValueError, match=match):
      config_ab.parse_arm(bad)
  _, _, spec, ops = config_ab.call_of("h64full")
  with pytest.raises(ValueError, match="--arm x: fwd_wgs must be 2 or 3"):
    config_ab.arm_configs(spec, ops, {"x": dict(fwd_wgs=5)})
  configs = config_ab.arm_configs(spec, ops, {"x": dict(fwd_persistent=False,
                                                        fwd_producer=False)})
  # the arm is the call's own default with the change (here a full call's: _FULL's tiles)
  assert configs["default"] == mosaic_gpu.default_config(spec, ops)
  assert configs["x"] == configs["default"].replace(fwd_persistent=False, fwd_producer=False)
  assert config_ab.changes_from(configs["default"], configs["x"]) == (
      "fwd_persistent=False, fwd_producer=False")


@pytest.mark.slow   # README test command's time (2026-12-03): CI's slow part runs it
def test_config_ab_dry_run_and_its_errors(capsys):
  config_ab.main(["--shapes", "h64full,gqa,packed", "--arm", "x:producer=False,"
                  "fwd_persistent=False,dkv_persistent=False", "--dry-run"])
  out = capsys.readouterr().out
  assert "h64full B8 T2048 N16 H64 full: default TuningConfig(" in out
  assert "gqa B2 T8192 N32 K8 H128 causal" in out and "  x: " in out
  _, kwargs, spec, ops = config_ab.call_of("packed")   # 8 documents of 1024
  assert ops.q_seg is not None and int(kwargs["q_segment_ids"][0, -1]) == 7
  assert mosaic_gpu.default_config(spec, ops) == tuning.table_config(
      128, packed=True, kv_shape=(1, 16, 8192),
      entry_registers=tuning.registers_fixed_at_entry(jax.__version__))
  (q, _, _, _, bias), kwargs, spec, ops = config_ab.call_of("alibi256")   # an argument
  assert bias.shape == (1, 8, 4096, 4096) and ops.bias is not None and "bias" not in kwargs
  assert q.shape == (2, 4096, 8, 256) and float(bias[0, 0, 0, 1]) == -2.0 ** -1   # ALiBi's slope
  assert mosaic_gpu.default_config(spec, ops).heaviest_first == ("fwd", "dq", "dkv")   # causal
  *_, spec, ops = config_ab.call_of("alibi")
  assert ops.bias is not None and mosaic_gpu.default_config(spec, ops).heaviest_first == ()
  for arm in ("x:dkv=64x64x3", "f:heaviest_first=('fwd',)", "hf:dkv_persistent=False,"
              "heaviest_first=('fwd','dq')"):   # the results' header: commands a shell takes back
    assert shlex.split(config_ab._quoted(arm)) == [arm]
  for argv, match in ((["--shapes", "h65"], "unknown h65"),
                      (["--arm", "x:fwd_wgs=5", "--dry-run"], "fwd_wgs must be 2 or 3")):
    with pytest.raises(SystemExit):
      config_ab.main(argv)
    assert match in capsys.readouterr().err


def test_fp8_shapes_must_be_indices(capsys):
  """benchmarks/fp8.py --shapes takes indices into its SHAPES: anything else is a usage error
  naming the flag, not an IndexError."""
  for bad in ("7", "a", "0,,1"):
    with pytest.raises(SystemExit):
      fp8.main(["--shapes", bad, "--backward"])
    assert "--shapes" in capsys.readouterr().err


def test_fp8_profile_takes_attention_arms_and_runs_both_passes(capsys):
  """benchmarks/fp8.py --profile: arms that are no attention call (quantize, *_kernel) are a
  usage error; each arm is profiled forward and fwd+bwd (on a CPU the profiler sees no GPU
  kernels, so only the sections are checked here)."""
  with pytest.raises(SystemExit):
    fp8.main(["--profile", "--arms", "bf16,quantize"])
  assert "--profile takes attention arms" in capsys.readouterr().err
  text = fp8.profile([(1, 64, 2, 2, 64)], ["bf16"], implementation="reference", calls=1)
  assert [line.split(": ")[0] for line in text.splitlines() if "us per call" in line] == [
      "(1, 64, 2, 2, 64) bf16, fwd", "(1, 64, 2, 2, 64) bf16, fwd+bwd"], text


@pytest.mark.slow
def test_fp8_payloads_ab_hides_the_payloads_from_one_side(capsys):
  """benchmarks/fp8.py --payloads: each FP8 arm traced with and without the api's e4m3 payload
  rows (inside `_casting_again` quantize_inputs hands over the scales only, and the real
  function is back afterwards), one row per arm and side with a bitwise column (on a CPU the
  reference, which reads no payloads: the two sides are then bitwise equal)."""
  full = fp8.fp8.quantize_inputs
  x = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
  with fp8._casting_again():
    assert set(fp8.fp8.quantize_inputs(x, x, x, "e4m3")[3]) == set(fp8.fp8.SCALE_ROWS)
  assert fp8.fp8.quantize_inputs is full
  fp8.main(["--payloads", "--smoke"])
  rows = re.findall(r"^\| B1 T256 N2 H128 \| (\w+) \| ([a-z -]+) \|.* \| (\S+) \|$",
                    capsys.readouterr().out, re.M)
  assert rows == [("bf16", "-", "-")] + [(arm, how, "True" if how == "payloads" else "-")
                                         for arm in ("fp8", "fp8_given", "fp8_bwd")
                                         for how in ("payloads", "cast again")], rows


def test_config_ab_rounds_and_bitwise_column():
  x = jnp.arange(8.0)
  fns = {name: (jax.jit(f), jax.jit(lambda x, f=f: (f(x), 2 * f(x)))) for name, f in (
      ("default", lambda x: x * 3), ("same", lambda x: x + x + x), ("other", lambda x: x * 3 + 1))}
  ms = config_ab.run_arms(fns, (x,), rounds=2, calls=2, blocks=1)
  assert set(ms) == set(fns) and all(a > 0 and b > 0 for a, b in ms.values())
  outputs = {name: list(pair[1](x)) for name, pair in fns.items()}
  assert config_ab.bitwise(outputs) == {"default": True, "same": True, "other": False}


@pytest.mark.slow   # README test command's time (2026-12-03): CI's slow part runs it
def test_compile_time_tiny(tmp_path, capsys):
  """The whole script on the CPU: attention programs (here, after jax.clear_caches()), the train
  step cold and then warm from the persistent cache in a second process."""
  out = tmp_path / "compile_time.md"
  rc = compile_time.main(["--tiny", "--in-process", "--train-arms", "xla", "--out", str(out)])
  printed = capsys.readouterr().out
  table = out.read_text()
  assert rc == 0, printed
  assert printed.rstrip().endswith(table.rstrip())   # the table comes last
  assert "- pallas_mosaic_gpu: not run, ValueError: implementation='pallas_mosaic_gpu' needs a " \
         "Hopper (sm_90) GPU" in table
  assert "- cudnn: not run, cuDNN needs a GPU" in table
  for label in ("fwd", "bwd", "fwd+bwd", "train step, xla, cold", "train step, xla, warm"):
    assert _column(table, label, "compile s") >= 0, label
  # The second launch read what the first wrote.
  assert (_column(table, "train step, xla, warm", "compile s")
          < _column(table, "train step, xla, cold", "compile s") / 2), table
  assert jax.config.jax_enable_compilation_cache   # this process's setting is back


def test_compile_time_leaves_out_backward_kernels():
  """pallas_mosaic_gpu's backward without its dQ or dK/dV kernel (lowered for CUDA on this host):
  one Mosaic GPU kernel fewer each, none with both left out; the functions are back after."""
  from pallas_kernels import mosaic_gpu as mosaic
  from pallas_kernels.mosaic_gpu import backward, tuning
  from stable_attn.api import Options, canonicalize
  from tests import cases
  kernels, why = compile_time.separable_kernels("pallas_mosaic_gpu")
  assert why is None and set(kernels) == {"dK/dV", "dQ"}, (
      f"{why}: say in benchmarks/compile_time.SEPARABLE which functions launch the kernels now")
  q = jax.random.normal(jax.random.key(0), (1, 256, 2, 64), jax.numpy.bfloat16)
  spec, ops, _ = canonicalize(q, q, q, options=Options(is_causal=True, max_adjust="safe"))
  config = tuning.table_config(64)
  originals = {name: getattr(backward, name) for name in kernels.values()}

  def count(left_out):
    with compile_time.kernels_left_out("pallas_mosaic_gpu", left_out):
      text = cases.lower_vjp_for_cuda(lambda o: mosaic._flash(spec, config, o)[0], ops)
    found = re.search(r"mosaic_gpu\w* (\d+) \((\d+) distinct\)", compile_time.custom_calls(text))
    return int(found.group(1)) if found else 0

  assert count([]) == 3
  assert count(["dQ"]) == 2 and count(["dK/dV"]) == 2
  assert count(["dQ", "dK/dV"]) == 1
  assert {name: getattr(backward, name) for name in kernels.values()} == originals


@pytest.mark.parametrize("wgs,producer", [(2, True), (3, True), (2, False), (3, False)])
def test_profile_summary_of_a_known_trace(tmp_path, wgs, producer):
  """profile_mosaic reads Mosaic GPU's Chrome trace (ts = (globaltimer ns + cycles) / 1e3, trace
  id 1 + warpgroup + warpgroups * CTA, a producer being warpgroup wgs): nested regions,
  per-entry and per-warpgroup cycles, the producer left out, every compute warpgroup kept where
  there is none (JAX 0.12's tables), and per SM the time from one CTA's start to the next's."""
  rng = np.random.default_rng()
  qk, rest, tail = (int(x) for x in rng.integers(50, 500, size=3))
  full = qk + rest   # qk nests inside full
  events = []
  for cta, start_ns in ((0, 1000.0), (1, 9000.0)):   # one SM, one CTA after the other
    for wg in range(wgs + producer):
      names = [("Init", 0, 10)] if wg == wgs else [
          ("full", 10, 10 + full), ("qk", 10, 10 + qk), ("epilogue", 10 + full, 10 + full + tail)]
      for name, enter, leave in names:
        for ph, t in (("B", enter), ("E", leave)):
          events.append(dict(name=name, ph=ph, ts=(start_ns + t) / 1e3, pid=7,
                             tid=1 + wg + (wgs + producer) * cta))
  events.sort(key=lambda e: (e["tid"], e["ts"], e["ph"] == "B"))   # E before B at equal times
  path = tmp_path / "trace.json"
  path.write_text(json.dumps({"traceEvents": events}))
  text = "\n".join(profile_mosaic.summarize(str(path), wgs, producer))
  span = full + tail
  assert f"{2 * wgs} compute-warpgroup traces; mean span {span:,.0f} cycles" in text
  row = next(line for line in text.splitlines() if line.startswith("| full/qk |"))
  assert row.startswith(f"| full/qk | 1.00 | {qk:,} | {qk:,} | "), row
  # the share to 0.1% (printed from a mean of floats: 78 / 416 = 18.75% showed as 18.7%)
  assert abs(float(row.split("|")[5].strip(" %")) - 100 * qk / span) <= 0.051, (row, qk / span)
  assert f"| epilogue | 1.00 | {tail:,} | {tail:,} |" in text
  assert "Init" not in text   # the producer's
  assert "median 8,000 ns over 1 pairs" in text


@pytest.mark.parametrize("fits_at,bounded", [(384, True), (96, True), (20, True), (96, False)])
def test_profile_halves_ranges_until_the_kernels_fit(tmp_path, monkeypatch, fits_at, bounded):
  """profile_mosaic.profiled: where the trace buffers leave a kernel too little shared memory
  (Mosaic GPU's error), it retries with half the ranges, down to 32, and returns the count that
  ran, with only that attempt's traces left; below 32, without bounded traces (a shorter buffer
  would then be overrun), or on any other error, the error propagates."""
  tried = []

  @contextlib.contextmanager
  def profiling(directory, ranges):
    tried.append(ranges)
    (tmp_path / f"trace{ranges}.json").write_text("{}")
    yield
    if ranges > fits_at:
      raise ValueError("Mosaic GPU kernel exceeds available shared memory: smem_bytes=1 > 0")
  monkeypatch.setattr(profile_mosaic.common, "profiling", profiling)
  monkeypatch.setattr(profile_mosaic.common, "PROFILE_BOUNDS_CHECKED", bounded)
  ran = []
  run = lambda: ran.append(1)
  if fits_at < 32 or not bounded:
    with pytest.raises(ValueError, match="exceeds available shared memory"):
      profile_mosaic.profiled(run, str(tmp_path), 384)
    assert tried == ([384, 192, 96, 48] if bounded else [384])
  else:
    assert profile_mosaic.profiled(run, str(tmp_path), 384) == fits_at
    assert tried == [384, 192, 96][:tried.index(fits_at) + 1] and len(ran) == len(tried)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"trace{fits_at}.json"]
  with pytest.raises(RuntimeError, match="other"):   # not a shared-memory error: no retry
    tried.clear()
    profile_mosaic.profiled(lambda: (_ for _ in ()).throw(RuntimeError("other")),
                            str(tmp_path), 384)
  assert tried == [384]


def test_profile_refuses_an_unknown_shape(capsys):
  """--shapes takes a comma-separated list of its names; an unknown one is a usage error that
  names it and lists the choices, before any device work."""
  with pytest.raises(SystemExit) as exit_info:
    profile_mosaic.main(["--shapes", "gqa,h512"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "unknown ['h512']" in err and "h64full" in err


def test_profile_fused_needs_backward(capsys):
  """--fused changes only the backward, so without --backward it is refused before any device
  work, with a one-line usage error."""
  with pytest.raises(SystemExit) as exit_info:
    profile_mosaic.main(["--fused"])
  assert exit_info.value.code == 2
  assert "--fused changes only the backward" in capsys.readouterr().err


def test_scale_out_reads_losses_and_compares(tmp_path):
  """benchmarks/scale_out.py: a run's losses by step from metrics.jsonl (a torn last line
  skipped), their comparison with a reference, and the table rows it writes from both."""
  from benchmarks import scale_out
  rng = np.random.default_rng()
  want = {s: float(x) for s, x in enumerate(10 - np.sort(rng.random(6)) * 3)}
  got = {**want, 4: want[4] * (1 + 1e-6), 5: want[5] - 1e-3}
  lines = [json.dumps({"step": s, "loss": x, "grad_norm": 1.0}) for s, x in got.items()]
  (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')
  assert scale_out.losses(tmp_path) == got
  c = scale_out._compare(scale_out.losses(tmp_path), want)
  assert (c["steps"], c["n"], c["equal"]) == ("0-5", 6, 4)
  assert c["max_abs_diff"] == pytest.approx(1e-3) and c["max_rel_diff"] == pytest.approx(
      1e-3 / want[5])
  rows = [{"part": "dp", "gpus": 1, "ours_tokens_per_s": 100.0, "cudnn_tokens_per_s": 80.0},
          {"part": "resume", "case": "kill -9 mid-training, resume on 4", "exit": 0, **c}]
  table = scale_out.markdown(rows, "cpu", jax.__version__)
  assert "| 1 | 100 | 80 | 1.250 |" in table
  assert "| kill -9 mid-training, resume on 4 | 0 | 0-5 | 4/6 | 0.001 |" in table


CONTEXT_PARALLEL_SMOKE = """
import json, sys, tempfile
from benchmarks import context_parallel as cp
out = tempfile.mkdtemp()
cp.main(["--lengths", "256", "--devices", "1,4", "--heads", "4", "--arms",
         "ours_alltoall,ours_alltoall_explicit,ours_heads", "--implementation", "pallas_gpu",
         "--interpret", "--calls", "1", "--blocks", "1", "--profile", "--out", out])
rows = json.load(open(out + "/context_parallel_cpu.json"))
print("RESULT" + json.dumps(rows))
"""


@pytest.mark.slow
def test_context_parallel_arms_on_four_devices():
  """benchmarks/context_parallel.py on 4 CPU devices (pallas_gpu in interpret mode): each arm,
  the Explicit-axes alltoall included, runs on 1 and 4 devices and its 4-device values and
  gradients are bitwise its one-device call's; --profile adds each row's GPU time by kind (none
  on a CPU)."""
  from tests.cases import run_on_cpu_devices
  rows = run_on_cpu_devices(CONTEXT_PARALLEL_SMOKE, devices=4)
  assert sorted((r["arm"], r["devices"]) for r in rows) == sorted(
      (arm, n) for arm in ("ours_alltoall", "ours_alltoall_explicit", "ours_heads")
      for n in (1, 4)), rows
  for r in rows:
    assert "error" not in r, r
    if r["devices"] == 4:
      assert r["err_o"] == 0.0 and r["err_grads"] == 0.0, r
    assert r["gpu_ms"] == {"attention": 0.0, "collectives": 0.0, "other": 0.0}, r


def test_context_parallel_gpu_time_by_kind():
  """benchmarks/context_parallel.gpu_time: per-kernel-name us per step, summed over n devices ->
  ms per step and device for attention kernels (ours, cuDNN's), collectives (NCCL's kernels,
  XLA's collective thunks) and the rest."""
  from benchmarks import context_parallel
  rng = np.random.default_rng()
  us = {name: float(rng.uniform(1, 1000)) for name in (
      "stable_attn_forward", "stable_attn_dkv", "cudnn::fusion::compute_sdpa_fwd",
      "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all-to-all-start.3",
      "loop_transpose_fusion_1", "input_concatenate_fusion")}
  n = int(rng.integers(1, 9))
  got = context_parallel.gpu_time(us, n)
  want = lambda *names: sum(us[k] for k in names) / n / 1e3
  assert got == pytest.approx({
      "attention": want("stable_attn_forward", "stable_attn_dkv",
                        "cudnn::fusion::compute_sdpa_fwd"),
      "collectives": want("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                          "all-to-all-start.3"),
      "other": want("loop_transpose_fusion_1", "input_concatenate_fusion")})


def test_context_parallel_refuses_an_unknown_arm(capsys):
  """A misspelt --arms name stops the script before anything runs, naming the flag and the arms."""
  from benchmarks import context_parallel
  with pytest.raises(SystemExit) as exit_info:
    context_parallel.main(["--arms", "ours_alltoall,ours_alltoal"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "--arms: ours_alltoal not among" in err and "ours_alltoall_explicit" in err


def test_context_parallel_figure_from_written_rows(tmp_path):
  """--plot-from redraws the figure of rows the script wrote (a copy of the 2 x H200 rows), on the
  CPU, with no GPU and no JAX devices needed; a missing file is a usage error."""
  from benchmarks import context_parallel
  rows = os.path.join(attention.RESULTS, "context_parallel_nvidia_h200_x2.json")
  copy = tmp_path / "rows.json"
  copy.write_text(open(rows).read())
  assert context_parallel.main(["--plot-from", str(copy), "--device", "2 x NVIDIA H200"]) == 0
  assert (tmp_path / "rows.png").stat().st_size > 10_000
  with pytest.raises(SystemExit):
    context_parallel.main(["--plot-from", str(tmp_path / "missing.json")])


@pytest.mark.parametrize("entry_registers", [False, True])
def test_mosaic_sweep_variants_are_configs_of_every_table(entry_registers):
  """Every tiling variant of benchmarks/mosaic_sweep.py, applied to each head dim's table (and
  JAX 0.12's), is a valid TuningConfig that changes only what it names: a variant that left the
  table's dkv_split on under two passes would be refused, and one pass would run split."""
  from pallas_kernels.mosaic_gpu import tuning
  for h in tuning.HEAD_DIMS:
    base = tuning.table_config(h, entry_registers=entry_registers)
    for kernel, variants in mosaic_sweep.VARIANTS.items():
      for variant in variants:
        config = base.replace(**variant)
        assert config.dkv_split == (kernel == "dkvs") or kernel in ("fwd", "dq"), (h, variant)


def test_fp8_mma_model_truncates_as_described():
  """benchmarks/fp8_mma_model.truncating_accumulate against float64 by hand: with bits to spare
  it is the exact sum; with 3 bits below the accumulator's exponent (1024: unit 128) a group's
  products lose what lies below 128, toward zero (+100 and +50 vanish, -200 counts -128); a
  fresh accumulator every 32 keys (promote) aligns the second group to its own products, as
  does taking each row's largest products out (top_exact); and promote must be a multiple of 32
  keys that divides the block's."""
  from benchmarks import fp8_mma_model as mm
  rng = np.random.default_rng()
  e4m3 = lambda x: jnp.asarray(x, jnp.float8_e4m3fn).astype(jnp.float32)
  p = e4m3(rng.uniform(0, 256, (8, 96)))
  v = e4m3(rng.standard_normal((96, 16)) * 3)
  c = jnp.asarray(rng.standard_normal((8, 16)) * 100, jnp.float32)
  exact = np.asarray(c, np.float64) + np.asarray(p, np.float64) @ np.asarray(v, np.float64)
  # (fp32's own rounding of sums near 7,000: a few 4.9e-4 spacings)
  np.testing.assert_allclose(mm.truncating_accumulate(c, p, v, bits=40), exact, rtol=1e-6,
                             atol=0.02)
  one = jnp.ones((1, 1), jnp.float32)
  group = jnp.zeros((1, 32), jnp.float32).at[0, :3].set(jnp.asarray([100.0, 50.0, -200.0]))
  out = mm.truncating_accumulate(1024 * one, group, one.repeat(32, axis=0), bits=3)
  assert float(out[0, 0]) == 1024 - 128
  # two groups of one product each: 4096 then 9 (lost below 4096's unit 512) ...
  two = jnp.zeros((1, 64), jnp.float32).at[0, 0].set(4096.0).at[0, 32].set(9.0)
  ones = jnp.ones((64, 1), jnp.float32)
  assert float(mm.truncating_accumulate(0 * one, two, ones, bits=3)[0, 0]) == 4096
  # ... unless the second group starts a fresh accumulator, added in fp32
  assert float(mm.truncating_accumulate(0 * one, two, ones, bits=3, promote=32)[0, 0]) == 4105
  # ... or the row's largest product (every key at it) stays out of the product: 9 kept, and
  # 4096 + 4096 + 9 with a tie at the top
  assert float(mm.truncating_accumulate(0 * one, two, ones, bits=3, top_exact=True)[0, 0]) == 4105
  tied = two.at[0, 40].set(4096.0)
  assert float(mm.truncating_accumulate(0 * one, tied, ones, bits=3, top_exact=True)[0, 0]) == 8201
  assert float(mm.truncating_accumulate(0 * one, tied, ones, bits=3)[0, 0]) == 8192
  for bad in (48, 64):   # not a multiple of 32; not dividing the 96 keys
    with pytest.raises(ValueError, match="multiple of 32 keys dividing"):
      mm.truncating_accumulate(c, p, v, promote=bad)


@pytest.mark.slow   # README test command's time (2026-12-05, 14:33-16:46 on a slower machine)
def test_fp8_mma_model_probe_changes_only_the_fp8_pv(capsys):
  """benchmarks/fp8_mma_model.py runs the bias probe on the reference with the model swapped in
  and restores tile's functions after; with bits to spare its tables are the plain probe's, and
  with 3 bits (a coarse accumulator) its FP8 O moves while the bf16 numerics' does not, nor the
  row sums (l stays the exact sum of the rounded P, as in the kernel)."""
  from benchmarks import fp8_mma_model as mm
  from stable_attn import tile
  from stable_attn.diagnostics import __main__ as probe_cli
  args = ["--numerics", "fast,fp8_fast", "--max-adjust", "off", "--regimes", "positive",
          "--batch", "1", "--rows", "16", "--keys", "256", "--tail", "4,8"]
  rows = lambda text: [line for line in text.split("Row sum")[0].splitlines()
                       if line.startswith("| reference")]
  sums = lambda text: [line for line in text.split("Row sum")[1].splitlines()
                       if line.startswith("| reference")]
  before = (tile.pv_product, tile.accumulate)
  probe_cli.main(args)
  text = capsys.readouterr().out
  plain, plain_sums = rows(text), sums(text)
  assert mm.main(["--bits", "40", *args]) == 0
  assert rows(capsys.readouterr().out) == plain
  assert (tile.pv_product, tile.accumulate) == before
  mm.main(["--bits", "3", *args])
  text = capsys.readouterr().out
  coarse = rows(text)
  assert sums(text) == plain_sums
  changed = [a != b for a, b in zip(plain, coarse)]
  labels = [line.split("|")[2].strip() for line in plain]
  assert changed == [label == "fp8_fast" for label in labels] and any(changed), (plain, coarse)


@pytest.mark.slow   # README test command's time (2026-12-05, 14:33-16:46 on a slower machine)
def test_fp8_mma_model_compares_with_a_measured_probe(tmp_path, capsys):
  """--against FILE: the model's bias cells beside a probe's written output, row by row. The plain
  probe's own file against the model with bits to spare differs by 0; against a coarse model
  (3 bits) the FP8 rows differ; a file with no row in common is a ValueError naming it."""
  from benchmarks import fp8_mma_model as mm
  from stable_attn.diagnostics import __main__ as probe_cli
  args = ["--numerics", "fp8_fast", "--max-adjust", "off", "--regimes", "positive,zero",
          "--batch", "1", "--rows", "16", "--keys", "256", "--tail", "4,8"]
  measured = tmp_path / "measured.md"
  probe_cli.main([*args, "--out", str(measured)])
  cells = mm.bias_cells(measured.read_text())
  assert set(cells) == {("fp8_fast", "off", "positive"), ("fp8_fast", "off", "zero")}
  assert all(len(v) == 4 for v in cells.values())
  capsys.readouterr()
  mm.main(["--bits", "40", *args, "--against", str(measured)])
  assert "Largest difference over 2 rows: 0.000 ulp" in capsys.readouterr().out
  mm.main(["--bits", "3", *args, "--against", str(measured)])
  worst = re.search(r"Largest difference over 2 rows: ([0-9.]+) ulp", capsys.readouterr().out)
  assert float(worst.group(1)) > 0.01
  other = tmp_path / "other.md"
  other.write_text(measured.read_text().replace("fp8_fast", "fast"))
  with pytest.raises(ValueError, match="other.md: no .* row in common"):
    mm.main(["--bits", "40", *args, "--against", str(other)])


@pytest.mark.slow   # README test command's time (2026-12-05, 14:33-16:46 on a slower machine)
def test_fp8_mma_model_takes_the_kernels_key_blocks(capsys):
  """--block-k 128: the reference's key blocks as the Hopper FP8 forward's (restored after), so
  --promote 128 models the kernel's promotion per block; a coarse accumulator then moves O less
  promoted than along the row; --promote must divide --block-k, and --block-k be a multiple of
  32 keys."""
  from benchmarks import fp8_mma_model as mm
  from stable_attn import reference
  default = reference.DEFAULT_BLOCK_K
  with mm.modelled_pv(13, 128, 128):
    assert reference.DEFAULT_BLOCK_K == 128
  assert reference.DEFAULT_BLOCK_K == default == 64
  args = ["--numerics", "fp8_fast", "--max-adjust", "off", "--regimes", "positive",
          "--batch", "1", "--rows", "16", "--keys", "512", "--tail", "4,8", "--block-k", "128"]
  cells = {}
  for promote in ("0", "128"):
    assert mm.main(["--bits", "6", "--promote", promote, *args]) == 0
    cells[promote] = mm.bias_cells(capsys.readouterr().out)[("fp8_fast", "off", "positive")]
  assert reference.DEFAULT_BLOCK_K == 64
  assert max(abs(x) for x in cells["128"]) < min(abs(x) for x in cells["0"]), cells
  for bad in (["--promote", "128"], ["--block-k", "48"]):
    with pytest.raises(SystemExit):
      mm.main(bad)
    assert "--promote takes" in capsys.readouterr().err or bad[0] == "--block-k"


@pytest.mark.slow   # README test command's time (2026-12-05, 14:33-16:46 on a slower machine)
def test_fp8_mma_model_center_v_keeps_the_sum_and_takes_out_the_signs_imbalance(tmp_path, capsys):
  """--center-v: each block's V less its mean through the model, the mean's term in fp32. With
  bits to spare O is the plain probe's (the same sum, cells within 0.002 ulp); with a coarse
  accumulator over the probe's all-negative V columns (every truncation inward) the centred cells
  sit nearer zero than the plain ones; it and --top-exact together are a usage error."""
  from benchmarks import fp8_mma_model as mm
  from stable_attn.diagnostics import __main__ as probe_cli
  args = ["--numerics", "fp8_fast", "--max-adjust", "off", "--regimes", "positive",
          "--batch", "1", "--rows", "16", "--keys", "512", "--tail", "4,8", "--block-k", "128",
          "--promote", "128"]
  measured = tmp_path / "plain.md"
  probe_cli.main([*args[:-4], "--out", str(measured)])
  capsys.readouterr()
  mm.main(["--bits", "40", "--center-v", *args, "--against", str(measured)])
  worst = re.search(r"Largest difference over 1 rows: ([0-9.]+) ulp", capsys.readouterr().out)
  assert float(worst.group(1)) <= 0.002
  cells = {}
  for center in ([], ["--center-v"]):
    assert mm.main(["--bits", "8", *center, *args]) == 0
    cells[bool(center)] = mm.bias_cells(capsys.readouterr().out)[("fp8_fast", "off", "positive")]
  assert max(abs(x) for x in cells[True]) < min(abs(x) for x in cells[False]), cells
  with pytest.raises(SystemExit):
    mm.main(["--top-exact", "--center-v", *args])
  assert "two designs" in capsys.readouterr().err


@pytest.mark.slow   # README test command's time (2026-12-05, 14:33-16:46 on a slower machine)
def test_fp8_mma_model_under_the_center_v_numerics(capsys):
  """The modelled truncating accumulation under numerics center_v (v centred over the whole
  sequence before its quantization, the mean added to O after the backend): the probe's
  near-tail cells sit nearer zero than without it, promoted per block or not."""
  from benchmarks import fp8_mma_model as mm
  args = ["--numerics", "fp8_fast,fp8_fast+center_v=true", "--max-adjust", "safe", "--regimes",
          "positive", "--batch", "1", "--rows", "16", "--keys", "512", "--tail", "4,8",
          "--block-k", "128", "--bits", "8"]
  for promote in ("128", "0"):
    assert mm.main([*args, "--promote", promote]) == 0
    cells = mm.bias_cells(capsys.readouterr().out)
    plain = cells[("fp8_fast", "safe", "positive")]
    centred = cells[("fp8_fast+center_v=true", "safe", "positive")]
    assert max(abs(x) for x in centred) < min(abs(x) for x in plain), (promote, cells)


def test_fp8_accumulation_measures_signed_ulps_and_needs_a_hopper(capsys):
  """benchmarks/fp8_accumulation.py: its signed error in bf16 ulps by hand (outward > 0, zeros
  left out, the late half of the rows apart), --backward's in ulps at the RMS, and on a host
  without a Hopper GPU a usage error naming the kernel, not a traceback."""
  from benchmarks import fp8_accumulation as acc
  want = np.zeros((1, 4, 1, 2))
  want[0, :, 0, 0] = [1.0, -1.0, 2.0, -2.0]   # bf16 ulps 2^-7 at 1, 2^-6 at 2
  got = want.copy()
  got[0, :, 0, 0] += [2 ** -7, 2 ** -7, -2 ** -6, 3 * 2 ** -6]   # +1, -1, -1, -3 ulps
  all_rows, late = acc.signed_ulps(got, want)
  assert (all_rows, late) == (-1.0, -2.0)
  # --backward's: errors in bf16 ulps at want's RMS (1 here: 2^-7), toward +inf and outward
  want = np.array([1.0, -1.0, 1.0, -1.0]).reshape(1, 2, 1, 2)
  got = want + np.array([1, 1, -1, -3]).reshape(1, 2, 1, 2) * 2 ** -7
  rel, toward_inf, outward, long = acc.rms_ulps(got, want, slice(1, None))
  assert (toward_inf, outward, long) == (-0.5, 0.5, 1.0)
  assert rel == pytest.approx(2 ** -7 * np.sqrt(12) / 2)
  # dO's lean: per column |mean| / RMS over positions, the median over columns
  do = np.zeros((1, 4, 1, 3))
  do[0, :, 0, 0] = [1, 1, 1, 1]      # 1
  do[0, :, 0, 1] = [1, -1, 1, -1]    # 0
  do[0, :, 0, 2] = [3, 1, 3, 1]      # 2 / sqrt(5)
  assert acc.lean(do) == pytest.approx(2 / np.sqrt(5))
  with pytest.raises(SystemExit):
    acc.main(["--gpt2", "somewhere"])
  assert "add --backward" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    acc.main(["--backward", "--lean-only"])
  assert "--lean-only go with --gpt2 RUN" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    acc.main(["--backward", "--gpt2", "somewhere", "--layers", "1,six"])
  assert "--layers takes a comma list" in capsys.readouterr().err
  if acc.mosaic.is_available():
    pytest.skip("a Hopper GPU is present: the script would run")
  with pytest.raises(SystemExit):
    acc.main(["--seq", "256"])
  assert "needs a Hopper" in capsys.readouterr().err


@pytest.mark.slow   # README test command's time (2026-12-05, 14:33-16:46 on a slower machine)
def test_fp8_accumulation_captures_a_gpt2_runs_attention(tmp_path):
  """--gpt2: one step of a checkpointed run gives every layer's q, k, v and dO (batch row 0, the
  capture of reproduction.gradients, tested there); a run with grad_accum > 1 is refused."""
  from benchmarks import fp8_accumulation as acc
  from tests.test_train_loop import ALICE, micro, run
  cfg = micro(max_steps=2, model=dict(n_layer=2, n_head=2, n_embd=32, block_size=32,
                                      attention="jax_xla", max_adjust="off", dtype="float32"))
  run(cfg, tmp_path / "run")
  what, layers = acc.gpt2_captures(str(tmp_path / "run"), data=ALICE)
  assert "at step 2" in what and "T32 N2 H16" in what
  assert len(layers) == 2
  for q, k, v, do in layers:
    for a in (q, k, v, do):
      assert a.shape == (1, 32, 2, 16) and np.all(np.isfinite(np.asarray(a)))
    assert float(np.abs(np.asarray(do)).max()) > 0
  # --lean-only: no kernel, any host; one row per layer, each the lean of that layer's dO
  assert acc.main(["--backward", "--gpt2", str(tmp_path / "run"), "--data", ALICE, "--lean-only",
                   "--out", str(tmp_path / "lean.md")]) == 0
  rows = [r for r in (tmp_path / "lean.md").read_text().splitlines() if r[:3] in ("| 1", "| 2")]
  assert [float(r.split("|")[2]) for r in rows] == pytest.approx(
      [acc.lean(layer[3]) for layer in layers], abs=5e-4)
  run(micro(max_steps=1, grad_accum=2), tmp_path / "accum")
  with pytest.raises(ValueError, match="grad_accum is 2, need 1"):
    acc.gpt2_captures(str(tmp_path / "accum"), data=ALICE)


def test_clocks_reads_nvidia_smi_samples_per_window():
  from benchmarks import clocks
  lines = ["2026/12/05 12:18:55.000, 1980, 120.50, 40, 0x0000000000000000",
           "garbage line", "2026/12/05 12:18:56.000, 1605, 691.00, 61, 0x0000000000000004",
           "2026/12/05 12:18:57.000, 1290, 704.00, 62, 0x000000000000000C",
           "2026/12/05 12:18:58.000, 1860, 689.00, 63, 0x0000000000000004"]
  samples = clocks.parse_samples(lines)
  assert [s[1:] for s in samples] == [(1980, 120.5, 40, 0), (1605, 691.0, 61, 4),
                                      (1290, 704.0, 62, 12), (1860, 689.0, 63, 4)]
  t0 = samples[0][0]
  assert samples[1][0] - t0 == pytest.approx(1.0)
  windows = [dict(shape=(4, 4096, 16, 16, 128), arm="bf16", round=0, start=t0 + 0.4,
                  end=t0 + 2.5, us=545.9),
             dict(shape=(4, 4096, 16, 16, 128), arm="fp8_fast", round=0, start=t0 + 2.6,
                  end=t0 + 3.2, us=424.9)]
  table = clocks.summarize(windows, samples).splitlines()
  # the first window reads the samples at +1.0 and +2.0 s (from 0.5 s after its start)
  assert table[2] == ("| B4 T4096 N16 H128 causal | bf16 | 0 | 545.9 | 2 | 1448 (1290) | 698 (704) "
                      "| 62 | sw_power_cap, sw_power_cap+hw_slowdown |")
  assert table[3] == "| B4 T4096 N16 H128 causal | fp8_fast | 0 | 424.9 | 0 | - | - | - | - |"
  with pytest.raises(SystemExit):   # cuDNN's is a call: no kernel alone to time
    clocks.main(["--arms", "bf16,cudnn"])
  with pytest.raises(SystemExit):   # the kernel alone has no backward to change
    clocks.main(["--what", "kernel", "--arms", "bf16,fp8_fast_bwd"])
  with pytest.raises(SystemExit, match="reads an NVIDIA GPU's clocks"):
    clocks.main(["--seconds", "2"])


def test_clocks_ramp_reads_each_marked_burst_and_the_clock_sampled_by_then():
  from benchmarks import clocks
  t0 = 1_000_000.0
  samples = [(t0 - 0.05, 1980, 120.0, 40, 0), (t0 + 0.0125, 1755, 690.0, 55, 4),
             (t0 + 0.5, 1500, 700.0, 60, 4)]
  ramps = [dict(shape=(4, 4096, 16, 16, 128), arm="bf16", start=t0,
                ends=[t0 + 0.005 * (i + 1) for i in range(3)], us=[490.0, 495.5, 555.25]),
           dict(shape=(4, 4096, 16, 16, 128), arm="fp8_fast", start=t0 - 1.0,
                ends=[t0 - 0.995], us=[410.0])]
  table = clocks.ramp_table(ramps, samples, marks=(1, 3, 5)).splitlines()
  assert table[0] == "| shape | arm | burst 1 | burst 3 |"   # no ramp reached burst 5
  assert table[2] == ("| B4 T4096 N16 H128 causal | bf16 | 490.0 us (5 ms, 1980 MHz) | "
                      "555.2 us (15 ms, 1755 MHz) |")
  assert table[3] == "| B4 T4096 N16 H128 causal | fp8_fast | 410.0 us (5 ms) | - |"
  with pytest.raises(SystemExit):
    clocks.main(["--ramp", "-1"])


def test_clocks_ramp_ratios_are_the_first_arms_time_over_each_others_per_burst_and_held():
  from benchmarks import clocks
  rng = np.random.default_rng()
  shape, other = (4, 4096, 16, 16, 128), (1, 16384, 16, 16, 128)
  bf16, fp8_ = rng.uniform(400.0, 600.0, 150), rng.uniform(300.0, 500.0, 150)
  ramps = [dict(shape=shape, arm="bf16", us=list(bf16)), dict(shape=shape, arm="fp8_fast",
                                                              us=list(fp8_)),
           dict(shape=other, arm="bf16", us=[500.0, 510.0]),
           dict(shape=other, arm="fp8_fast", us=[400.0, 425.0, 1.0])]
  table = clocks.ramp_ratios(ramps, first=3, held=100).splitlines()
  assert table[0] == "| shape | arm | burst 1 | burst 2 | burst 3 | median of the last 100 |"
  cells = table[2].split(" | ")
  assert cells[:2] == ["| B4 T4096 N16 H128 causal", "bf16 / fp8_fast"]
  for k in range(3):
    assert float(cells[2 + k]) == pytest.approx(bf16[k] / fp8_[k], abs=6e-4)
  held = np.median(bf16[50:]) / np.median(fp8_[50:])
  assert float(cells[5].rstrip(" |")) == pytest.approx(held, abs=6e-4)
  # bursts past the shorter ramp are not compared; the held median then covers what both ran
  assert table[3] == "| B1 T16384 N16 H128 causal | bf16 / fp8_fast | 1.250 | 1.200 | - | 1.224 |"
  assert len(table) == 4


def test_clocks_ratios_reads_a_ramps_json_and_names_a_file_that_is_not_one(tmp_path, capsys):
  from benchmarks import clocks
  run = tmp_path / "ramp.json"
  run.write_text(json.dumps(dict(title="t", samples=[], ramps=[
      dict(shape=[4, 4096, 16, 16, 128], arm="bf16", us=[500.0, 480.0]),
      dict(shape=[4, 4096, 16, 16, 128], arm="fp8_fast", us=[400.0, 400.0])])))
  assert clocks.main(["--ratios", str(run)]) == 0
  assert "| bf16 / fp8_fast | 1.250 | 1.200 | - | - | - | 1.225 |" in capsys.readouterr().out
  (tmp_path / "other.json").write_text("{}")
  for path in (tmp_path / "missing.json", tmp_path / "other.json"):
    with pytest.raises(SystemExit):
      clocks.main(["--ratios", str(path)])
    assert "not a --ramp run's .json" in capsys.readouterr().err


def test_clocks_ramp_times_every_burst_of_every_arm_after_compiling_each(monkeypatch):
  from benchmarks import clocks
  made = []

  def timed(what, arm, shape):
    made.append((what, arm, shape))
    return jax.jit(lambda x: x * 2.0), (jnp.ones(8),)
  monkeypatch.setattr(clocks, "timed", timed)
  monkeypatch.setattr(clocks.time, "sleep", lambda s: None)
  shape = (1, 128, 2, 2, 64)
  ramps = clocks.run_ramp(["bf16", "fp8_fast"], [shape], bursts=3, what="forward", calls=2)
  assert made == [("forward", "bf16", shape), ("forward", "fp8_fast", shape)]
  assert [(r["arm"], r["shape"], len(r["us"]), len(r["ends"])) for r in ramps] == [
      ("bf16", shape, 3, 3), ("fp8_fast", shape, 3, 3)]
  for r in ramps:
    assert r["start"] <= r["ends"][0] <= r["ends"][1] <= r["ends"][2]
    # each burst's time per call is its share of the time since the previous burst ended
    assert r["us"][1] == pytest.approx(1e6 * (r["ends"][1] - r["ends"][0]) / 2)
  windows = clocks.run_windows(["bf16", "fp8_fast"], [shape], seconds=0.05, rounds=1)
  assert [(w["arm"], w["round"]) for w in windows] == [("bf16", 0), ("fp8_fast", 0)]
  for w in windows:   # bursts of 20 until the window's length has passed
    assert w["end"] - w["start"] >= 0.05 and w["us"] > 0


def test_clocks_ramp_writes_its_table_and_json_which_plot_draws(tmp_path, monkeypatch):
  from benchmarks import clocks

  class Gpu:
    platform, device_kind, local_hardware_id = "gpu", "NVIDIA H100 80GB HBM3", 0

  smi = tmp_path / "nvidia-smi"   # samples every 50 ms until terminated, as nvidia-smi -lms does
  smi.write_text('#!/bin/bash\nwhile true; do date +"%Y/%m/%d %H:%M:%S.%3N, 1755, 690.00, 60, '
                 '0x0000000000000004"; sleep 0.05; done\n')
  smi.chmod(0o755)
  monkeypatch.setattr(jax, "devices", lambda *a: [Gpu()])
  monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

  def run_ramp(arms, shapes, bursts, what):
    assert (arms, bursts, what) == (["bf16", "fp8_fast"], 3, "forward")
    ramps = []
    for shape in shapes:
      for arm in arms:
        start = time.time()
        time.sleep(0.1)
        ramps.append(dict(shape=shape, arm=arm, start=start, us=[480.0, 490.0, 550.0],
                          ends=[start + 0.005, start + 0.01, time.time()]))
    return ramps
  monkeypatch.setattr(clocks, "run_ramp", run_ramp)
  md = tmp_path / "ramp.md"
  assert clocks.main(["--what", "forward", "--shapes", "0,1", "--ramp", "3", "--out", str(md)]) == 0
  text = md.read_text()
  rows = [line for line in text.splitlines() if line.startswith("| B") and " us (" in line]
  assert len(rows) == 4 and rows[0].startswith("| B4 T4096 N16 H128 causal | bf16 | 480.0 us (5 ms")
  assert "550.0 us" in rows[3] and "1755 MHz" in rows[3]   # burst 3 ended after a sample
  ratios = text.split("Speed-ups over the first arm:")[1]   # the arms ran the same times here
  assert ratios.count("| bf16 / fp8_fast | 1.000 | 1.000 | 1.000 | - | - | 1.000 |") == 2
  run = json.loads((tmp_path / "ramp.json").read_text())
  assert [r["arm"] for r in run["ramps"]] == ["bf16", "fp8_fast"] * 2
  assert run["samples"] and all(x[1] == 1755 for x in run["samples"])
  assert clocks.main(["--plot", str(tmp_path / "ramp.json"), str(tmp_path / "ramp.png")]) == 0
  assert (tmp_path / "ramp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_clocks_stops_at_once_when_nvidia_smi_refuses_its_query(tmp_path, monkeypatch):
  from benchmarks import clocks

  class Gpu:
    platform, device_kind, local_hardware_id = "gpu", "NVIDIA H200", 0

  smi = tmp_path / "nvidia-smi"
  smi.write_text('#!/bin/sh\necho \'Field "clocks_event_reasons.active" is not a valid field\'\n'
                 'exit 2\n')
  smi.chmod(0o755)
  monkeypatch.setattr(jax, "devices", lambda *a: [Gpu()])
  monkeypatch.setattr(clocks, "run_windows", lambda *a: pytest.fail("ran with no sampler"))
  monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
  with pytest.raises(SystemExit, match="stopped: 'Field \"clocks_event_reasons.active\" is not"):
    clocks.main(["--out", str(tmp_path / "clocks.md")])
  monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
  with pytest.raises(SystemExit, match="nvidia-smi, which is not on PATH"):
    clocks.main(["--out", str(tmp_path / "clocks.md")])
