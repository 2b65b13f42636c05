"""The bias-probe expectations of the Foundation issue (reference implementation, bf16).

With 4 x 128 rows the probe's noise floor is ~0.01 ulp (its no-tie control shows it)."""
import pytest

from stable_attn.diagnostics import PLACEMENTS, REGIMES, measure

SMALL = dict(batch=4, rows=128, keys=512)


@pytest.mark.parametrize("regime", ["positive", "negative", "zero", "tiny"])
def test_paper_numerics_without_fix_rounds_outward(regime):
  r = measure("reference", "paper", "off", regime, "adjacent", **SMALL)
  assert 0.15 < r.bias_ulp < 0.3 and r.nan_count == 0, r


@pytest.mark.parametrize("regime", ["positive", "negative"])
def test_paper_rule_removes_bias_for_signed_maxima(regime):
  r = measure("reference", "paper", "paper", regime, "adjacent", **SMALL)
  assert abs(r.bias_ulp) < 0.05, r


@pytest.mark.parametrize("regime", ["zero", "tiny"])
def test_paper_rule_leaves_zero_and_tiny_maxima(regime):
  r = measure("reference", "paper", "paper", regime, "adjacent", **SMALL)
  assert r.bias_ulp > 0.15, r


def test_paper_rule_breaks_for_large_maxima_with_beta_7():
  r = measure("reference", "paper", "paper", "large", "adjacent", beta=7.0, **SMALL)
  assert r.nan_count > 0 or abs(r.bias_ulp) > 10, r   # NaN or garbage (underflow: l = 0)


@pytest.mark.parametrize("numerics", ["fast", "paper"])
@pytest.mark.parametrize("regime", REGIMES)
def test_safe_removes_bias_everywhere(numerics, regime):
  for placement in PLACEMENTS:
    r = measure("reference", numerics, "safe", regime, placement, **SMALL)
    assert abs(r.bias_ulp) < 0.05 and r.nan_count == 0, r
    assert r.abs_err_ulp < 0.75, r   # still within dtype tolerance of the truth


def test_safe_probe_on_xla_path():
  for regime in ("zero", "large"):
    r = measure("xla", "paper", "safe", regime, "adjacent", **SMALL)
    assert abs(r.bias_ulp) < 0.05 and r.nan_count == 0, r


def test_probe_cli_prints_table(capsys):
  from stable_attn.diagnostics.__main__ import main
  main(["--implementations", "reference", "--numerics", "paper", "--max-adjust", "off,safe",
        "--regimes", "zero", "--rows", "16", "--keys", "256", "--batch", "1"])
  out = capsys.readouterr().out
  assert "| reference | paper | off | zero |" in out and "| reference | paper | safe | zero |" in out
  # The row-sum table follows: one more row per configuration, an LSE error in every cell.
  assert out.count("| reference | paper | off | zero |") == 2 and "Row sum: mean LSE" in out
  with pytest.raises(SystemExit):
    main(["--implementations", "reference", "--tail", "9"])


@pytest.mark.parametrize("regime", ["positive", "zero", "large"])
def test_sink_keeps_the_tie_bias_and_its_fix(regime):
  """A sink (3: above the zero and some positive maxima, negligible at large ones) joins after the
  P_bar tiles: the paper's arithmetic still rounds tie cases outward, and "safe" still removes it."""
  off = measure("reference", "paper", "off", regime, "adjacent", sink=3.0, **SMALL)
  assert 0.15 < off.bias_ulp < 0.3 and off.nan_count == 0, off
  for numerics in ("fast", "paper"):
    for placement in ("adjacent", "split"):
      r = measure("reference", numerics, "safe", regime, placement, sink=3.0, **SMALL)
      assert abs(r.bias_ulp) < 0.05 and r.nan_count == 0, r


LONG_TAIL = dict(SMALL, tail=(9.0, 12.0))


@pytest.mark.parametrize("max_adjust", ["off", "safe"])
@pytest.mark.parametrize("numerics", ["paper", "paper+acc=float32", "paper+out=float32"])
def test_bf16_row_sum_drops_a_long_tail_in_every_row(numerics, max_adjust):
  """With the other keys 9-12 below the max, each key block adds less than half an ulp of a bf16 l:
  the running sum drops it, so LSE is low in every row (by ~the tail's share of the mass), whatever
  the max adjustment and whichever other point is widened."""
  r = measure("reference", numerics, max_adjust, "positive", "adjacent", **LONG_TAIL)
  assert r.lse_bias < -5e-3 and r.lse_low_frac == 1.0 and r.nan_count == 0, r


@pytest.mark.parametrize("implementation", ["reference", "pallas_gpu"])
def test_fp32_row_sum_removes_the_one_signed_lse_error(implementation):
  """Numerics.sum="float32" (the fix the ablation found) keeps the tail: LSE to fp32 accuracy,
  sign mixed. Its O still rounds inward (the bf16 accumulator drops the tail), which the ablation
  showed does not drive the W_Q growth."""
  small = dict(LONG_TAIL, batch=2, rows=64, interpret=implementation == "pallas_gpu")
  fixed = measure(implementation, "paper+sum=float32", "safe", "positive", "adjacent", **small)
  assert abs(fixed.lse_bias) < 1e-4 and 0.2 < fixed.lse_low_frac < 0.8, fixed
  assert fixed.bias_ulp < -1.0 and fixed.nan_count == 0, fixed
  broken = measure(implementation, "paper", "safe", "positive", "adjacent", **small)
  assert broken.lse_bias < -5e-3 and broken.lse_low_frac == 1.0, broken


def test_probe_rejects_a_bad_tail():
  with pytest.raises(ValueError, match="tail"):
    measure("reference", "paper", "off", "positive", "adjacent", tail=(12.0, 9.0), **SMALL)


def test_probe_rejects_too_few_keys_for_the_split_ties(capsys):
  """The split placement ties keys 127 and 128: fewer keys is a ValueError naming keys (it was an
  IndexError from inside the input builder), and the CLI, which runs every placement, says so."""
  from stable_attn.diagnostics import tie_inputs
  from stable_attn.diagnostics.__main__ import main
  with pytest.raises(ValueError, match="keys must be more than 128"):
    tie_inputs("positive", "split", batch=1, rows=8, keys=128)
  tie_inputs("positive", "random", batch=1, rows=8, keys=128)   # other placements need no more
  with pytest.raises(SystemExit):
    main(["--keys", "128", "--implementations", "reference"])
  assert "--keys: need more than 128" in capsys.readouterr().err


def test_row_spread_gives_each_row_its_own_tail():
  """tie_inputs(row_spread=r): the tied keys still score exactly each row's max M_i, every other
  key M_i - f_i d_j with f_i in [1, 1 + r] per row (rows differ), and r = 0 is the shared-tail
  inputs exactly (the spread is drawn after everything else)."""
  import numpy as np
  from stable_attn.diagnostics import tie_inputs
  seed = int(np.random.default_rng().integers(1 << 16))
  as64 = lambda x: np.asarray(x.astype("float32"), np.float64)
  q0, k0, v0 = map(as64, tie_inputs("positive", "adjacent", batch=1, rows=64, keys=256, seed=seed))
  q, k, v = map(as64, tie_inputs("positive", "adjacent", batch=1, rows=64, keys=256, seed=seed,
                                 row_spread=0.25))
  np.testing.assert_array_equal(k, k0)
  np.testing.assert_array_equal(v, v0)
  s = np.einsum("bqh,bkh->bqk", q[:, :, 0], k[:, :, 0]) / 8
  m = q[0, :, 0, 0] / 8
  np.testing.assert_array_equal(s[0, :, :2], np.stack([m, m], axis=1))   # the ties, exact
  factor = (m[:, None] - s[0, :, 2:]) / -k[0, None, 2:, 0, 1]
  assert np.all(factor >= 1) and np.all(factor <= 1.25) and np.ptp(factor[:, 0]) > 0.05
  np.testing.assert_allclose(factor, factor[:, :1] * np.ones_like(factor), rtol=1e-12)
  with pytest.raises(ValueError, match="row_spread"):
    tie_inputs("positive", "adjacent", batch=1, rows=8, keys=16, row_spread=2.0)
