"""The one place where the model calls attention (`--attention IMPL`).

Values of IMPL:
- "auto", "reference", "pallas_gpu", "pallas_tpu", "xla": ours, `stable_attn.dot_product_attention`
  (with max_adjust / numerics / beta); "auto" lets stable_attn choose the best available kernel.
- "cudnn", "jax_xla": JAX's own `jax.nn.dot_product_attention` (implementation "cudnn" / "xla"), the
  peers we compare against; max_adjust and numerics do not apply to them.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax
from jax.sharding import PartitionSpec as P

OURS = ("auto", "reference", "pallas_gpu", "pallas_tpu", "xla")
JAX_NN = {"cudnn": "cudnn", "jax_xla": "xla"}


@functools.cache
def stable_attn_function():
    """`stable_attn.dot_product_attention`, or None while the package does not provide it."""
    try:
        import stable_attn
    except ImportError:
        return None
    return getattr(stable_attn, "dot_product_attention", None)


# The data-parallel mesh while a training function is being traced (see `batch_sharded`).
_MESH = None


@contextlib.contextmanager
def batch_sharded(mesh):
    """Trace attention per device over the mesh's 'data' axis (batch) while this context is active.

    XLA cannot partition a Pallas custom call: inside a GSPMD-sharded jit it would gather q, k, v and
    run the whole global batch on every device. Under this context our attention runs in a shard_map
    over the batch instead, each device on its own rows (jax.nn's cuDNN call has its own partitioner).
    """
    global _MESH
    previous, _MESH = _MESH, mesh
    try:
        yield
    finally:
        _MESH = previous


def is_ours(implementation: str) -> bool:
    return implementation in OURS


def causal_attention(q, k, v, *, implementation: str = "auto", max_adjust: str = "safe",
                     numerics: str = "fast", beta: float = 2.0):
    """Causal self-attention.

    q, k, v: [B, T, N, H] in the compute dtype (bf16 in training). Returns [B, T, N, H], same dtype.
    """
    if implementation in JAX_NN:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=JAX_NN[implementation])
    if implementation not in OURS:
        raise ValueError(f"attention implementation {implementation!r} is not one of "
                         f"{', '.join(OURS + tuple(JAX_NN))}")
    fn = stable_attn_function()
    if fn is None:
        # stable_attn not importable yet (it is being written): keep the model runnable with JAX's
        # plain attention, loudly, so nobody mistakes these numbers for ours.
        warnings.warn("stable_attn.dot_product_attention is not available; falling back to "
                      "jax.nn.dot_product_attention(implementation='xla')", stacklevel=2)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    impl = None if implementation == "auto" else implementation
    # Pallas kernels cannot compile for the CPU; there they run in interpret mode (tests, smoke runs).
    interpret = implementation.startswith("pallas") and jax.default_backend() == "cpu"

    def call(q, k, v):
        return fn(q, k, v, is_causal=True, implementation=impl, max_adjust=max_adjust,
                  beta=beta, numerics=numerics, interpret=interpret)

    mesh = _MESH
    if mesh is not None and mesh.shape["data"] > 1 and q.shape[0] % mesh.shape["data"] == 0:
        # Small unsharded batches (monitors, sampling) fall through to the plain call.
        spec = P("data")
        call = jax.shard_map(call, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
    return call(q, k, v)


def describe(implementation: str, max_adjust: str, numerics: str) -> str:
    """One line for the log saying what attention actually runs."""
    if implementation in JAX_NN:
        return f"jax.nn.dot_product_attention(implementation={JAX_NN[implementation]!r}) (no max adjustment)"
    if stable_attn_function() is None:
        return "jax.nn.dot_product_attention(implementation='xla') [FALLBACK: stable_attn missing]"
    impl = implementation
    if impl == "auto":
        import stable_attn
        picked = getattr(stable_attn, "default_implementation", lambda: "?")()
        impl = f"auto -> {picked}"
    return (f"stable_attn.dot_product_attention(implementation={impl!r}, "
            f"max_adjust={max_adjust!r}, numerics={numerics!r})")


def short_name(implementation: str, max_adjust: str, numerics: str) -> str:
    """A few words for plot titles and tables, e.g. "stable_attn reference, max_adjust safe, fast"."""
    if implementation in JAX_NN:
        return f"jax.nn {JAX_NN[implementation]}"
    if stable_attn_function() is None:
        return "jax.nn xla (stable_attn missing)"
    impl = implementation
    if impl == "auto":
        import stable_attn
        impl = getattr(stable_attn, "default_implementation", lambda: "auto")()
    return f"stable_attn {impl}, max_adjust {max_adjust}, {numerics}"
