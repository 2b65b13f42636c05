"""Diagnostics that show what the paper talks about: the tie-stress rounding-bias probe.

    python -m stable_attn.diagnostics            # prints the table
"""
from stable_attn.diagnostics.probe import (PLACEMENTS, REGIMES, GradientProbeResult, ProbeResult,
                                           measure, measure_gradients, signed_ulp_error, sweep,
                                           tie_inputs, ulp)

__all__ = ["PLACEMENTS", "REGIMES", "ProbeResult", "GradientProbeResult", "measure",
           "measure_gradients", "signed_ulp_error", "sweep", "tie_inputs", "ulp"]
