"""Diagnostics that show what the paper talks about: the tie-stress rounding-bias probe, and what
the max adjustment costs in accuracy.

    python -m stable_attn.diagnostics            # prints the bias-probe table
    python -m stable_attn.diagnostics.accuracy   # errors of O and the gradients against float64
    python -m stable_attn.diagnostics.fp8_backward   # an FP8 backward's arithmetic, emulated
"""
from stable_attn.diagnostics.probe import (PLACEMENTS, REGIMES, GradientProbeResult, ProbeResult,
                                           measure, measure_gradients, signed_ulp_error, sweep,
                                           tie_inputs, ulp)

__all__ = ["PLACEMENTS", "REGIMES", "ProbeResult", "GradientProbeResult", "measure",
           "measure_gradients", "signed_ulp_error", "sweep", "tie_inputs", "ulp"]
