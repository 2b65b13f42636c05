"""Flash attention forward and backward as Pallas kernels with the Triton lowering.

Layout: q/o/dO [B, Tp, N, Hp], k/v [B, Sp, K, Hp] stay in the caller's [B, T, heads, H] layout (no
transpose); Tp, Sp, Hp are the lengths padded to the block sizes and the head dim padded to a power
of two (only when needed). GQA: the kv head of query head n is n // G (G = N // K), chosen by the
index maps, so K/V are never repeated. bias/mask keep their broadcast shape [Bb, Nb, Tb, Sb] (each
dim 1 or full) and are read tile by tile with per-dim indices; the mask travels as int8.

Kernels (all math from stable_attn.tile, all block ranges from stable_attn.blocks):
  forward  grid (query blocks, B*N): online softmax over visible key blocks -> O, O residual, LSE.
  delta    grid (query blocks, B*N): delta = rowsum(dO * O_residual).
  dK/dV    grid (key blocks, B*K): loops over the G query heads of its kv head and, for each, over
           the query blocks that see the key block; no atomics.
  dQ       grid (query blocks, B*N): loops over visible key blocks; writes dS tiles when a bias
           needs its gradient.
Blocks that are visible in full (no causal/window edge, no padding, no mask) run the same tile
calls with ok=None, which skips the masking arithmetic; the results are identical.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from stable_attn import blocks, tile
from stable_attn.flash import reduce_to_shape
from stable_attn.spec import AttentionSpec, Operands

from pallas_kernels.gpu import tuning

f32 = jnp.float32
i32 = jnp.int32


# ---------------------------------------------------------------------------------------------
# Helpers: padding, broadcast operands, fully visible sub-ranges
# ---------------------------------------------------------------------------------------------

def _round_up(n: int, m: int) -> int:
  return blocks.cdiv(n, m) * m


def _pad_axis(x, axis: int, size: int):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _pad_seq_head(x, seq: int, head: int):
  """[B, L, heads, H] -> [B, seq, heads, head] (zeros)."""
  return _pad_axis(_pad_axis(x, 1, seq), 3, head)


class _Bcast:
  """A bias or mask operand [Bb, Nb, Tb, Sb] and how to read its [bq, bk] tile for (b, n)."""

  def __init__(self, x, Tp: int, Sp: int):
    Bb, Nb, Tb, Sb = x.shape
    self.full_b, self.full_n, self.full_t, self.full_s = Bb > 1, Nb > 1, Tb > 1, Sb > 1
    if self.full_t:
      x = _pad_axis(x, 2, Tp)
    if self.full_s:
      x = _pad_axis(x, 3, Sp)
    self.array = x

  def spec(self):
    zeros = (0, 0, 0, 0)
    return pl.BlockSpec(self.array.shape, lambda *_: zeros)

  def tile(self, ref, b, n, q_start, bq: int, k_start, bk: int):
    bi = b if self.full_b else 0
    ni = n if self.full_n else 0
    ti = pl.ds(q_start, bq) if self.full_t else 0
    si = pl.ds(k_start, bk) if self.full_s else 0
    x = ref[bi, ni, ti, si]
    if self.full_t and self.full_s:
      return x
    if self.full_t:
      return x[:, None]
    if self.full_s:
      return x[None, :]
    return x  # a scalar broadcasts


def _full_kv_range(q_start, bq: int, bk: int, lo, hi, *, causal: bool, window, q_len, kv_len,
                   has_mask: bool):
  """Sub-range [flo, fhi) of the key blocks [lo, hi) that every row of the query block sees whole.

  Such blocks need no visibility mask (ok is all True there): same tile calls with ok=None.
  """
  if has_mask:
    return lo, lo
  flo = lo
  fhi = kv_len // bk                               # key blocks entirely before kv_len
  if causal:
    fhi = jnp.minimum(fhi, (q_start + 1) // bk)    # (j + 1) * bk - 1 <= q_start
  if window is not None:
    left, right = window
    flo = jnp.maximum(flo, blocks.cdiv(q_start + bq - 1 - left, bk))
    fhi = jnp.minimum(fhi, (q_start + right + 1) // bk)
  fhi = jnp.where(q_start + bq <= q_len, fhi, flo)  # padded query rows need the mask
  return _clamp_subrange(lo, hi, flo, fhi)


def _full_q_range(k_start, bk: int, bq: int, lo, hi, *, causal: bool, window, q_len, kv_len,
                  has_mask: bool):
  """Sub-range [flo, fhi) of the query blocks [lo, hi) whose rows all see the whole key block."""
  if has_mask:
    return lo, lo
  flo = lo
  fhi = q_len // bq                                # query blocks entirely before q_len
  k_last = k_start + bk - 1
  if causal:
    flo = jnp.maximum(flo, blocks.cdiv(k_last, bq))      # i * bq >= k_last
  if window is not None:
    left, right = window
    flo = jnp.maximum(flo, blocks.cdiv(k_last - right, bq))
    fhi = jnp.minimum(fhi, (k_start + left + 1) // bq)   # (i + 1) * bq - 1 <= k_start + left
  fhi = jnp.where(k_start + bk <= kv_len, fhi, flo)      # padded keys need the mask
  return _clamp_subrange(lo, hi, flo, fhi)


def _clamp_subrange(lo, hi, flo, fhi):
  """Clamps [flo, fhi) into [lo, hi) (empty where they do not overlap)."""
  flo = jnp.minimum(jnp.maximum(flo, lo), hi)
  fhi = jnp.minimum(jnp.maximum(fhi, flo), hi)
  return flo, fhi


def _split_loop(lo, flo, fhi, hi, body, carry):
  """Runs body(j, carry, masked) over [lo, flo) masked, [flo, fhi) unmasked, [fhi, hi) masked."""
  carry = lax.fori_loop(lo, flo, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(flo, fhi, functools.partial(body, masked=False), carry)
  return lax.fori_loop(fhi, hi, functools.partial(body, masked=True), carry)


def _params(kc: tuning.KernelConfig):
  return plgpu.CompilerParams(num_warps=kc.num_warps, num_stages=kc.num_stages)


class _Layout:
  """Static shapes of one call and the padded operands."""

  def __init__(self, spec: AttentionSpec, config: tuning.Config, ops: Operands):
    B, T, N, H = ops.q.shape
    S, K = ops.k.shape[1], ops.k.shape[2]
    self.B, self.T, self.N, self.H, self.S, self.K = B, T, N, H, S, K
    self.G = N // K
    self.Hp = tuning.padded_head_dim(H)
    qb = max(config.fwd.block_q, config.dkv.block_q, config.dq.block_q)
    kb = max(config.fwd.block_k, config.dkv.block_k, config.dq.block_k)
    self.Tp, self.Sp = _round_up(T, qb), _round_up(S, kb)
    self.dt = spec.numerics.dtypes(ops.q.dtype)
    # Positions at or past T / S are padding: clamp the lengths so padding is never visible.
    self.q_lens = jnp.minimum(ops.q_lens, T).astype(i32)
    self.kv_lens = jnp.minimum(ops.kv_lens, S).astype(i32)
    self.bias = None if ops.bias is None else _Bcast(ops.bias, self.Tp, self.Sp)
    self.mask = None if ops.mask is None else _Bcast(ops.mask.astype(jnp.int8), self.Tp, self.Sp)

  def q_like(self, x):
    return _pad_seq_head(x, self.Tp, self.Hp)

  def kv_like(self, x):
    return _pad_seq_head(x, self.Sp, self.Hp)

  def lens_spec(self):
    return pl.BlockSpec((self.B,), lambda *_: (0,))

  def optional_inputs(self):
    """(arrays, specs) of bias and mask, in that order, present ones only."""
    arrays, specs = [], []
    for op in (self.bias, self.mask):
      if op is not None:
        arrays.append(op.array)
        specs.append(op.spec())
    return arrays, specs


def _tile_visible(spec, lay: _Layout, mask_ref, b, n, q_pos, k_pos, q_start, bq, k_start, bk,
                  q_len, kv_len):
  m = None
  if mask_ref is not None:
    m = lay.mask.tile(mask_ref, b, n, q_start, bq, k_start, bk) != 0
  return tile.visible(q_pos, k_pos, q_len, kv_len, causal=spec.is_causal, window=spec.window,
                      mask=m)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

def _key_tile(spec, lay, dt, q, q_pos, j, bk, k_ref, v_ref, bias_ref, mask_ref, b, n, q_start,
              bq, q_len, kv_len, masked):
  """Key block j for a query block: (K, V tiles, scores, visibility or None when fully visible)."""
  k_start = j * bk
  k = k_ref[pl.ds(k_start, bk), :]
  v = v_ref[pl.ds(k_start, bk), :]
  bias = None
  if bias_ref is not None:
    bias = lay.bias.tile(bias_ref, b, n, q_start, bq, k_start, bk)
  s = tile.scores(q, k, spec.scale, bias, dt)
  ok = None
  if masked:
    ok = _tile_visible(spec, lay, mask_ref, b, n, q_pos, k_start + lax.iota(i32, bk), q_start,
                       bq, k_start, bk, q_len, kv_len)
  return k, v, s, ok


def _forward_kernel(*refs, spec: AttentionSpec, lay: _Layout, kc: tuning.KernelConfig,
                    write_residual: bool):
  q_ref, k_ref, v_ref, qlen_ref, kvlen_ref, *rest = refs
  bias_ref = rest.pop(0) if lay.bias is not None else None
  mask_ref = rest.pop(0) if lay.mask is not None else None
  o_ref, *rest = rest
  res_ref = rest.pop(0) if write_residual else None
  (lse_ref,) = rest

  bq, bk = kc.block_q, kc.block_k
  dt = lay.dt
  nq = lay.Tp // bq
  qi = nq - 1 - pl.program_id(0)      # heaviest causal blocks first
  bh = pl.program_id(1)
  b, n = bh // lay.N, bh % lay.N
  q_start = qi * bq
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  q = q_ref[...]
  q_pos = q_start + lax.iota(i32, bq)
  offset = tile.safe_offset(q_pos, n, dt.p) if spec.max_adjust == "safe" else None
  lo, hi = blocks.kv_block_range(q_start, bq, bk, lay.Sp // bk, causal=spec.is_causal,
                                 window=spec.window, kv_len=kv_len)
  flo, fhi = _full_kv_range(q_start, bq, bk, lo, hi, causal=spec.is_causal, window=spec.window,
                            q_len=q_len, kv_len=kv_len, has_mask=mask_ref is not None)

  def body(j, state, *, masked):
    k, v, s, ok = _key_tile(spec, lay, dt, q, q_pos, j, bk, k_ref, v_ref, bias_ref, mask_ref,
                            b, n, q_start, bq, q_len, kv_len, masked)
    return tile.online_softmax_step(state, s, ok, v, dt=dt, max_adjust=spec.max_adjust,
                                    beta=spec.beta, offset=offset)

  state = _split_loop(lo, flo, fhi, hi, body, tile.init_state(bq, lay.Hp, dt))
  o, residual, lse = tile.finalize(state, dt=dt, offset=offset)
  o_ref[...] = o.astype(o_ref.dtype)
  if res_ref is not None:
    res_ref[...] = residual.astype(res_ref.dtype)
  lse_ref[...] = lse


def forward(spec: AttentionSpec, config: tuning.Config, ops: Operands):
  """-> (O [B,T,N,H], O residual [B,T,N,H] in dt.residual_o, LSE fp32 [B,N,T])."""
  lay = _Layout(spec, config, ops)
  kc = config.fwd
  bq = kc.block_q
  B, N, G, Tp, Sp, Hp = lay.B, lay.N, lay.G, lay.Tp, lay.Sp, lay.Hp
  nq = Tp // bq
  dt = lay.dt
  # The residual equals O unless it is kept in a wider dtype than the input.
  write_residual = dt.residual_o != dt.input

  q_map = lambda i, bh: (bh // N, nq - 1 - i, bh % N, 0)
  kv_map = lambda i, bh: (bh // N, 0, (bh % N) // G, 0)
  opt_arrays, opt_specs = lay.optional_inputs()
  in_specs = [pl.BlockSpec((None, bq, None, Hp), q_map),
              pl.BlockSpec((None, Sp, None, Hp), kv_map),
              pl.BlockSpec((None, Sp, None, Hp), kv_map),
              lay.lens_spec(), lay.lens_spec(), *opt_specs]
  out_shape = [jax.ShapeDtypeStruct((B, Tp, N, Hp), ops.q.dtype)]
  out_specs = [pl.BlockSpec((None, bq, None, Hp), q_map)]
  if write_residual:
    out_shape.append(jax.ShapeDtypeStruct((B, Tp, N, Hp), dt.residual_o))
    out_specs.append(pl.BlockSpec((None, bq, None, Hp), q_map))
  out_shape.append(jax.ShapeDtypeStruct((B, N, Tp), f32))
  out_specs.append(pl.BlockSpec((None, None, bq), lambda i, bh: (bh // N, bh % N, nq - 1 - i)))

  kernel = functools.partial(_forward_kernel, spec=spec, lay=lay, kc=kc,
                             write_residual=write_residual)
  outs = pl.pallas_call(
      kernel, grid=(nq, B * N), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_params(kc), interpret=spec.interpret, name="stable_attn_fwd",
  )(lay.q_like(ops.q), lay.kv_like(ops.k), lay.kv_like(ops.v), lay.q_lens, lay.kv_lens,
    *opt_arrays)
  o, lse = outs[0], outs[-1]
  residual = outs[1] if write_residual else o
  T, H = lay.T, lay.H
  unpad = lambda x: x[:, :T, :, :H] if (Tp, Hp) != (T, H) else x
  o = unpad(o)
  residual = o if not write_residual else unpad(residual)
  return o, residual, lse[:, :, :T] if Tp != T else lse


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

def _delta_kernel(do_ref, o_ref, delta_ref):
  delta_ref[...] = tile.delta(do_ref[...], o_ref[...])


def _dkv_kernel(*refs, spec: AttentionSpec, lay: _Layout, kc: tuning.KernelConfig):
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qlen_ref, kvlen_ref, *rest = refs
  bias_ref = rest.pop(0) if lay.bias is not None else None
  mask_ref = rest.pop(0) if lay.mask is not None else None
  dk_ref, dv_ref = rest

  bq, bk = kc.block_q, kc.block_k
  dt = lay.dt
  in_dtype = dt.input
  kblk = pl.program_id(0)
  bkh = pl.program_id(1)
  b, kvh = bkh // lay.K, bkh % lay.K
  k_start = kblk * bk
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  k = k_ref[...]
  v = v_ref[...]
  k_pos = k_start + lax.iota(i32, bk)
  lo, hi = blocks.q_block_range(k_start, bk, bq, lay.Tp // bq, causal=spec.is_causal,
                                window=spec.window, q_len=q_len)
  flo, fhi = _full_q_range(k_start, bk, bq, lo, hi, causal=spec.is_causal, window=spec.window,
                           q_len=q_len, kv_len=kv_len, has_mask=mask_ref is not None)

  def head_body(g, carry):
    n = kvh * lay.G + g

    def body(i, carry, *, masked):
      dk, dv = carry
      q_start = i * bq
      rows = pl.ds(q_start, bq)
      q = q_ref[rows, g, :]
      do = do_ref[rows, g, :]
      lse = lse_ref[g, rows]
      delta = delta_ref[g, rows]
      bias = None
      if bias_ref is not None:
        bias = lay.bias.tile(bias_ref, b, n, q_start, bq, k_start, bk)
      s = tile.scores(q, k, spec.scale, bias, dt)
      ok = None
      if masked:
        ok = _tile_visible(spec, lay, mask_ref, b, n, q_start + lax.iota(i32, bq), k_pos, q_start,
                           bq, k_start, bk, q_len, kv_len)
      p = tile.probabilities(s, lse, ok)
      dp = tile.matmul(do, v, transpose_b=True)
      ds = tile.score_grad(p, dp, delta)
      dv = dv + tile.matmul(p.astype(in_dtype), do, transpose_a=True)
      dk = dk + tile.matmul(ds.astype(in_dtype), q, transpose_a=True) * spec.scale
      return dk, dv

    return _split_loop(lo, flo, fhi, hi, body, carry)

  zeros = jnp.zeros((bk, lay.Hp), f32)
  dk, dv = lax.fori_loop(0, lay.G, head_body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, spec: AttentionSpec, lay: _Layout, kc: tuning.KernelConfig,
               write_ds: bool):
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qlen_ref, kvlen_ref, *rest = refs
  bias_ref = rest.pop(0) if lay.bias is not None else None
  mask_ref = rest.pop(0) if lay.mask is not None else None
  if write_ds:
    _, dq_ref, ds_ref = rest    # rest[0] is the zeros input aliased to ds_ref
  else:
    (dq_ref,) = rest
    ds_ref = None

  bq, bk = kc.block_q, kc.block_k
  dt = lay.dt
  in_dtype = dt.input
  nq = lay.Tp // bq
  qi = nq - 1 - pl.program_id(0)
  bh = pl.program_id(1)
  b, n = bh // lay.N, bh % lay.N
  q_start = qi * bq
  q_len, kv_len = qlen_ref[b], kvlen_ref[b]
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  q_pos = q_start + lax.iota(i32, bq)
  lo, hi = blocks.kv_block_range(q_start, bq, bk, lay.Sp // bk, causal=spec.is_causal,
                                 window=spec.window, kv_len=kv_len)
  flo, fhi = _full_kv_range(q_start, bq, bk, lo, hi, causal=spec.is_causal, window=spec.window,
                            q_len=q_len, kv_len=kv_len, has_mask=mask_ref is not None)

  def body(j, dq, *, masked):
    k, v, s, ok = _key_tile(spec, lay, dt, q, q_pos, j, bk, k_ref, v_ref, bias_ref, mask_ref,
                            b, n, q_start, bq, q_len, kv_len, masked)
    p = tile.probabilities(s, lse, ok)
    dp = tile.matmul(do, v, transpose_b=True)
    ds = tile.score_grad(p, dp, delta)
    if ds_ref is not None:
      ds_ref[b, n, pl.ds(q_start, bq), pl.ds(j * bk, bk)] = ds
    return dq + tile.matmul(ds.astype(in_dtype), k) * spec.scale

  dq = _split_loop(lo, flo, fhi, hi, body, jnp.zeros((bq, lay.Hp), f32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def backward(spec: AttentionSpec, config: tuning.Config, ops: Operands, o_res, lse, do):
  """-> (dq, dk, dv, dbias or None)."""
  lay = _Layout(spec, config, ops)
  B, N, K, G, Tp, Sp, Hp = lay.B, lay.N, lay.K, lay.G, lay.Tp, lay.Sp, lay.Hp
  T, S, H = lay.T, lay.S, lay.H
  q, k, v = lay.q_like(ops.q), lay.kv_like(ops.k), lay.kv_like(ops.v)
  do_p = lay.q_like(do.astype(ops.q.dtype))
  lse_p = _pad_axis(lse, 2, Tp)
  opt_arrays, opt_specs = lay.optional_inputs()

  # delta pre-pass.
  rows = config.dq.block_q
  row_map = lambda i, bh: (bh // N, i, bh % N, 0)
  delta = pl.pallas_call(
      _delta_kernel, grid=(Tp // rows, B * N),
      in_specs=[pl.BlockSpec((None, rows, None, Hp), row_map)] * 2,
      out_specs=pl.BlockSpec((None, None, rows), lambda i, bh: (bh // N, bh % N, i)),
      out_shape=jax.ShapeDtypeStruct((B, N, Tp), f32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=spec.interpret, name="stable_attn_delta",
  )(do_p, lay.q_like(o_res))

  # dK, dV: one program per (key block, batch, kv head); loops over the G query heads.
  kc = config.dkv
  bq, bk = kc.block_q, kc.block_k
  kv_blk = lambda j, bkh: (bkh // K, j, bkh % K, 0)
  heads_all = lambda j, bkh: (bkh // K, 0, bkh % K, 0)
  stats_all = lambda j, bkh: (bkh // K, bkh % K, 0)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, spec=spec, lay=lay, kc=kc),
      grid=(Sp // bk, B * K),
      in_specs=[pl.BlockSpec((None, Tp, G, Hp), heads_all),
                pl.BlockSpec((None, bk, None, Hp), kv_blk),
                pl.BlockSpec((None, bk, None, Hp), kv_blk),
                pl.BlockSpec((None, Tp, G, Hp), heads_all),
                pl.BlockSpec((None, G, Tp), stats_all),
                pl.BlockSpec((None, G, Tp), stats_all),
                lay.lens_spec(), lay.lens_spec(), *opt_specs],
      out_specs=[pl.BlockSpec((None, bk, None, Hp), kv_blk)] * 2,
      out_shape=[jax.ShapeDtypeStruct(k.shape, ops.k.dtype),
                 jax.ShapeDtypeStruct(v.shape, ops.v.dtype)],
      compiler_params=_params(kc), interpret=spec.interpret, name="stable_attn_dkv",
  )(q, k, v, do_p, lse_p, delta, lay.q_lens, lay.kv_lens, *opt_arrays)

  # dQ (and dS for dbias): one program per (query block, batch, head).
  kc = config.dq
  bq = kc.block_q
  nq = Tp // bq
  write_ds = ops.bias is not None
  q_map = lambda i, bh: (bh // N, nq - 1 - i, bh % N, 0)
  kv_map = lambda i, bh: (bh // N, 0, (bh % N) // G, 0)
  stats_map = lambda i, bh: (bh // N, bh % N, nq - 1 - i)
  in_specs = [pl.BlockSpec((None, bq, None, Hp), q_map),
              pl.BlockSpec((None, Sp, None, Hp), kv_map),
              pl.BlockSpec((None, Sp, None, Hp), kv_map),
              pl.BlockSpec((None, bq, None, Hp), q_map),
              pl.BlockSpec((None, None, bq), stats_map),
              pl.BlockSpec((None, None, bq), stats_map),
              lay.lens_spec(), lay.lens_spec(), *opt_specs]
  args = [q, k, v, do_p, lse_p, delta, lay.q_lens, lay.kv_lens, *opt_arrays]
  out_specs = [pl.BlockSpec((None, bq, None, Hp), q_map)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, ops.q.dtype)]
  aliases = {}
  if write_ds:
    ds_shape = (B, N, Tp, Sp)
    full = pl.BlockSpec(ds_shape, lambda *_: (0, 0, 0, 0))
    aliases = {len(args): 1}
    in_specs.append(full)
    args.append(jnp.zeros(ds_shape, f32))   # blocks never visited keep dS = 0
    out_specs.append(full)
    out_shape.append(jax.ShapeDtypeStruct(ds_shape, f32))
  outs = pl.pallas_call(
      functools.partial(_dq_kernel, spec=spec, lay=lay, kc=kc, write_ds=write_ds),
      grid=(nq, B * N), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, compiler_params=_params(kc), interpret=spec.interpret,
      name="stable_attn_dq",
  )(*args)
  dq = outs[0]

  unpad_q = lambda x: x[:, :T, :, :H] if (Tp, Hp) != (T, H) else x
  unpad_kv = lambda x: x[:, :S, :, :H] if (Sp, Hp) != (S, H) else x
  dbias = None
  if write_ds:
    ds = outs[1]
    if (Tp, Sp) != (T, S):
      ds = ds[:, :, :T, :S]
    dbias = reduce_to_shape(ds, ops.bias.shape).astype(ops.bias.dtype)
  return unpad_q(dq), unpad_kv(dk), unpad_kv(dv), dbias
