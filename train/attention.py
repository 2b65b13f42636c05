"""The one place where the model calls attention (`--attention IMPL`).

Values of IMPL:
- "auto" and the names in `stable_attn.IMPLEMENTATIONS` (reference, xla, the Pallas kernels, ...):
  ours, `stable_attn.dot_product_attention` (with max_adjust / numerics / beta); "auto" lets
  stable_attn choose the best available kernel.
- "cudnn", "jax_xla": JAX's own `jax.nn.dot_product_attention` (implementation "cudnn" / "xla"), the
  peers we compare against; max_adjust and numerics do not apply to them.
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import PartitionSpec as P

import stable_attn

OURS = ("auto",) + stable_attn.IMPLEMENTATIONS
JAX_NN = {"cudnn": "cudnn", "jax_xla": "xla"}

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


def causal_attention(q, k, v, *, implementation: str = "auto", max_adjust: str = "safe",
                     numerics: str = "fast", beta: float = 2.0, segment_ids=None):
    """Causal self-attention.

    q, k, v: [B, T, N, H] in the compute dtype (bf16 in training). segment_ids: None or int32 [B, T]
    document ids (a position attends only within its document). Returns [B, T, N, H], same dtype.
    """
    if implementation in JAX_NN:
        # jax.nn takes no segment ids: the peers get the equivalent mask.
        mask = None if segment_ids is None else segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                            implementation=JAX_NN[implementation])
    if implementation not in OURS:
        raise ValueError(f"attention implementation {implementation!r} is not one of "
                         f"{', '.join(OURS + tuple(JAX_NN))}")
    impl = None if implementation == "auto" else implementation
    # Pallas kernels (every implementation named pallas*) cannot compile for the CPU; there they run
    # in interpret mode (tests, smoke runs).
    interpret = implementation.startswith("pallas") and jax.default_backend() == "cpu"

    def call(q, k, v, segment_ids):
        return stable_attn.dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                                 max_adjust=max_adjust, beta=beta, numerics=numerics,
                                                 interpret=interpret, q_segment_ids=segment_ids)

    mesh = _MESH
    if mesh is not None and mesh.shape["data"] > 1 and q.shape[0] % mesh.shape["data"] == 0:
        # Small unsharded batches (monitors, sampling) fall through to the plain call.
        spec = P("data")
        seg_spec = None if segment_ids is None else spec
        call = jax.shard_map(call, mesh=mesh, in_specs=(spec, spec, spec, seg_spec), out_specs=spec,
                             check_vma=False)
    return call(q, k, v, segment_ids)


def describe(implementation: str, max_adjust: str, numerics: str) -> str:
    """One line for the log saying what attention actually runs."""
    if implementation in JAX_NN:
        return f"jax.nn.dot_product_attention(implementation={JAX_NN[implementation]!r}) (no max adjustment)"
    impl = implementation
    if impl == "auto":
        impl = f"auto -> {stable_attn.default_implementation()}"
    return (f"stable_attn.dot_product_attention(implementation={impl!r}, "
            f"max_adjust={max_adjust!r}, numerics={numerics!r})")


def short_name(implementation: str, max_adjust: str, numerics: str) -> str:
    """A few words for plot titles and tables, e.g. "stable_attn reference, max_adjust safe, fast"."""
    if implementation in JAX_NN:
        return f"jax.nn {JAX_NN[implementation]}"
    impl = stable_attn.default_implementation() if implementation == "auto" else implementation
    return f"stable_attn {impl}, max_adjust {max_adjust}, {numerics}"
