"""Gradient errors of the low-precision attention on a partly trained checkpoint, step by step.

    python -m reproduction.gradients --run out/explosion/lr0.003/paper-off --steps 20 \\
        --out docs/results/gradients.json --figure docs/figures/gradients.png

From the run's latest checkpoint (or --step) training continues for --steps optimizer steps with the
run's own attention. At every step, for every layer, the attention inputs q, k, v (bf16), the
gradient dO arriving at the attention output and the c_attn input X are captured; then, for each
arithmetic in --compare, the attention forward and backward are recomputed on exactly those inputs
and compared with an fp32 reference (the same bf16 inputs upcast, fp32 softmax, HIGHEST matmuls):

- delta = rowsum(dO * O): its error summed over the batch's tokens per head (the paper's "summed
  delta error": does it keep one sign over consecutive steps?) and its mean relative to mean|delta|;
- dW_Q and dW_K (= X^T dq, X^T dk per head): the error's size relative to the reference gradient;
  the cosine between consecutive steps' dW_Q errors and their coherence ||sum_t E_t/||E_t|| || / steps
  (1: every step errs along one direction and the errors compound; ~1/sqrt(steps): they average out);
  the share of the error's energy in its largest singular direction (the paper's low-rank claim);
  the part of the dW_Q error that the delta error alone explains, -scale * (ddelta * P) K;
- the tie rate per layer (rows with two or more scores giving P = 1.0 in bf16).

Everything but the attention arithmetic is shared between the compared arms, so the numbers isolate
the kernel's rounding. The model update uses the run's own arithmetic, as its training did.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from reproduction.explosion import ARMS, arm_settings, parse_arms, first_instability, read_run, save_figure
from train import data as data_lib
from train.attention import causal_attention
from train.checkpoint import Checkpointer
from train.config import ModelConfig, TrainConfig
from train.loop import abstract_model, init_params
from train.monitors import attention_stats
from train.optim import make_optimizer


def config_from_meta(meta: dict) -> TrainConfig:
    saved = dict(meta["config"])
    model = ModelConfig(**saved.pop("model"))
    return TrainConfig(model=model, **saved)


def arm_of(model: ModelConfig) -> str:
    return f"{model.numerics}/{model.max_adjust}"


def exact_causal_attention(q, k, v):
    """fp32 causal softmax attention with HIGHEST-precision matmuls; q, k, v: [B, T, N, H] fp32."""
    hp = jax.lax.Precision.HIGHEST
    s = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hp) * q.shape[-1] ** -0.5
    T = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v, precision=hp), p


def layer_errors(q, k, v, do, x, *, model: ModelConfig, arm: str):
    """Errors of one layer's attention gradients under `arm` vs the fp32 reference (see module doc).

    q, k, v, do: [B, T, N, H] compute dtype; x: [B, T, C] float32 (c_attn's input). Returns a dict of
    float32 arrays, per head N first.
    """
    hp = jax.lax.Precision.HIGHEST
    numerics, max_adjust = arm_settings(arm)
    f32 = lambda a: a.astype(jnp.float32)

    def low(q, k, v):
        return causal_attention(q, k, v, implementation=model.attention, max_adjust=max_adjust,
                                numerics=numerics, beta=model.beta)

    o_lp, vjp_lp = jax.vjp(low, q, k, v)
    dq_lp, dk_lp, _ = vjp_lp(do)
    (o_hp, p), vjp_hp = jax.vjp(exact_causal_attention, f32(q), f32(k), f32(v))
    dq_hp, dk_hp, _ = vjp_hp((f32(do), jnp.zeros_like(p)))
    # The kernels' delta: rowsum(dO * O) from the O they keep (bf16 in these presets).
    delta_lp = jnp.sum(f32(do) * f32(o_lp), axis=-1)          # [B, T, N]
    delta_hp = jnp.sum(f32(do) * o_hp, axis=-1)
    ddelta = delta_lp - delta_hp
    scale = q.shape[-1] ** -0.5
    dq_from_delta = -scale * jnp.einsum("bnts,bsnh->btnh", jnp.swapaxes(ddelta, 1, 2)[..., None] * p,
                                        f32(k), precision=hp)
    X = f32(x.astype(q.dtype))  # what c_attn's matmul multiplies
    per_head = lambda d: jnp.einsum("btc,btnh->nch", X, d, precision=hp)     # [N, C, H]
    e_q, e_k = per_head(f32(dq_lp) - dq_hp), per_head(f32(dk_lp) - dk_hp)
    e_q_delta = per_head(dq_from_delta)
    norm = lambda a: jnp.sqrt(jnp.sum(jnp.square(a), axis=(1, 2)))
    sv = jnp.linalg.svd(e_q, compute_uv=False)
    _, tie = attention_stats(q, k, scale=scale, numerics=numerics)
    return {
        "delta_err_sum": ddelta.sum(axis=(0, 1)),
        "delta_rel_bias": ddelta.mean(axis=(0, 1)) / jnp.mean(jnp.abs(delta_hp), axis=(0, 1)),
        "delta_rel_rms": jnp.sqrt(jnp.mean(ddelta ** 2, axis=(0, 1))) / jnp.sqrt(
            jnp.mean(delta_hp ** 2, axis=(0, 1))),
        "dwq_rel_err": norm(e_q) / norm(per_head(dq_hp)),
        "dwk_rel_err": norm(e_k) / norm(per_head(dk_hp)),
        "dwq_rank1_share": sv[:, 0] ** 2 / jnp.sum(sv ** 2, axis=1),
        "dwq_delta_cos": jnp.sum(e_q * e_q_delta, axis=(1, 2)) / (norm(e_q) * norm(e_q_delta) + 1e-30),
        "dwq_delta_norm_ratio": norm(e_q_delta) / norm(e_q),
        "tie_frac": tie,
        "e_q": e_q,
    }


def make_capture_step(graphdef, tx, model_cfg: ModelConfig):
    """(params, opt_state, x, y) -> (params, opt_state, loss, per-layer captures, per-layer dO)."""

    def step(params, opt_state, x, y):
        B, T = x.shape
        taps = [jnp.zeros((B, T, model_cfg.n_head, model_cfg.head_dim), model_cfg.dtype)
                for _ in range(model_cfg.n_layer)]

        def loss_fn(params, taps):
            logits, captured = nnx.merge(graphdef, params)(x, capture=True, taps=taps)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
            return loss, captured

        (loss, captured), (grads, d_out) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            params, taps)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, captured, d_out

    return step


def restore(run: Path, step: int | None):
    """-> (config, params, opt_state, step) from RUN/checkpoints (latest when step is None)."""
    ckpt = Checkpointer(Path(run) / "checkpoints")
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise ValueError(f"--run {run}: no checkpoint under {Path(run) / 'checkpoints'}")
    cfg = config_from_meta(ckpt.read_meta(step))
    params = init_params(cfg)
    opt_state = make_optimizer(cfg).init(params)
    params, opt_state, meta = ckpt.restore(step, params, opt_state)
    ckpt.close()
    return cfg, params, opt_state, int(meta["data_step"])


def captured_steps(run: Path, step: int | None = None, data: str | None = None):
    """-> (config, first step, iterator): from RUN's checkpoint at `step` (latest when None),
    training continues with the run's own attention on the batches its data order gives, one
    (loss, per-layer captures, per-layer dO) per optimizer step (make_capture_step)."""
    cfg, params, opt_state, start = restore(run, step)
    if cfg.grad_accum != 1:
        raise ValueError(f"--run {run}: the capture takes one micro-batch per step; grad_accum is "
                         f"{cfg.grad_accum}, need 1")
    tokens = data_lib.load_data(data, corpus=cfg.corpus, progress=False, log=lambda _: None)
    graphdef, _ = nnx.split(abstract_model(cfg.model), nnx.Param)
    step_fn = jax.jit(make_capture_step(graphdef, make_optimizer(cfg), cfg.model), donate_argnums=(0, 1))

    def steps():
        nonlocal params, opt_state
        for t in itertools.count(start):
            x, y = data_lib.train_batch(tokens, t, seed=cfg.seed, batch_size=cfg.batch_size,
                                        grad_accum=1, block_size=cfg.model.block_size)
            params, opt_state, loss, captured, d_out = step_fn(params, opt_state, jnp.asarray(x[0]),
                                                               jnp.asarray(y[0]))
            yield float(loss), captured, d_out

    return cfg, start, steps()


def pick_step(run: Path, choice: str) -> int | None:
    """--step: a number, "latest" (None) or "before-instability"."""
    if choice == "latest":
        return None
    if choice != "before-instability":
        try:
            return int(choice)
        except ValueError:
            raise ValueError(f"--step must be a number, 'latest' or 'before-instability', got {choice!r}") from None
    unstable = first_instability(read_run(run))
    if unstable is None:
        return None
    ckpt = Checkpointer(Path(run) / "checkpoints")
    steps = [s for s in ckpt.manager.all_steps() if s <= unstable]
    ckpt.close()
    if not steps:
        raise ValueError(f"--run {run}: no checkpoint left before the instability at step {unstable}")
    return max(steps)


def study(run: Path, *, steps: int, compare: list[str], step: int | None = None, data: str | None = None,
          progress=print) -> dict:
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (consecutive steps are compared), got {steps}")
    cfg, start, captures = captured_steps(run, step, data)
    mcfg = cfg.model
    own = arm_of(mcfg)
    layer_fns = {arm: jax.jit(lambda q, k, v, do, x, arm=arm: layer_errors(q, k, v, do, x, model=mcfg, arm=arm))
                 for arm in compare}
    L, N = mcfg.n_layer, mcfg.n_head
    scalars = ("delta_err_sum", "delta_rel_bias", "delta_rel_rms", "dwq_rel_err", "dwk_rel_err",
               "dwq_rank1_share", "dwq_delta_cos", "dwq_delta_norm_ratio")
    out = {arm: {k: np.zeros((steps, L, N)) for k in scalars} | {
        "tie_frac": np.zeros((steps, L)), "dwq_cos_prev": np.full((steps, L, N), np.nan)} for arm in compare}
    e_sum = {arm: np.zeros((L, N, mcfg.n_embd, mcfg.head_dim)) for arm in compare}
    e_prev = {arm: [None] * L for arm in compare}
    losses = []
    for t, (loss, captured, d_out) in zip(range(steps), captures):
        losses.append(loss)
        for arm in compare:
            for layer in range(L):
                c = captured[layer]
                r = jax.device_get(layer_fns[arm](c["q"], c["k"], c["v"], d_out[layer], c["x"]))
                for key in scalars:
                    out[arm][key][t, layer] = r[key]
                out[arm]["tie_frac"][t, layer] = r["tie_frac"]
                e = np.asarray(r["e_q"], np.float64)
                # Unit directions: a coherence that one large step cannot dominate.
                e_sum[arm][layer] += e / np.maximum(np.linalg.norm(e.reshape(N, -1), axis=1), 1e-300)[:, None, None]
                if e_prev[arm][layer] is not None:
                    a, b = e.reshape(N, -1), e_prev[arm][layer].reshape(N, -1)
                    out[arm]["dwq_cos_prev"][t, layer] = np.sum(a * b, 1) / (
                        np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-300)
                e_prev[arm][layer] = e
        progress(f"gradients: step {start + t} ({t + 1}/{steps}) loss {losses[-1]:.3f}")
    result = {"run": str(run), "start_step": start, "steps": steps, "own_arm": own,
              "model": {"n_layer": L, "n_head": N, "n_embd": mcfg.n_embd, "block_size": mcfg.block_size},
              "batch_tokens": cfg.batch_size * mcfg.block_size, "device": jax.devices()[0].device_kind,
              "losses": losses, "arms": {}}
    for arm in compare:
        coherence = np.linalg.norm(e_sum[arm].reshape(L, N, -1), axis=2) / steps
        result["arms"][arm] = {k: np.asarray(v).tolist() for k, v in out[arm].items()} | {
            "dwq_coherence": coherence.tolist(),
            "delta_sign_positive": (out[arm]["delta_err_sum"] > 0).mean(axis=0).tolist()}
    return result


# --------------------------------------------------------------------------------- report


def table(result: dict) -> str:
    """Per arm and layer: head-averaged numbers, plus the head whose dW_Q errors cohere most."""
    steps = result["steps"]
    lines = [f"Checkpoint {result['run']} at step {result['start_step']} (trained with "
             f"{result['own_arm']}), {steps} consecutive steps of {result['batch_tokens']:,} tokens, "
             f"{result['device']}. dW_Q error coherence of unrelated directions: ~1/sqrt(steps) = "
             f"{steps ** -0.5:.2f}; 1 = one direction every step.", "",
             "| arm | layer | tie rate | delta rel. bias | steps with summed delta err > 0 (most one-signed head) "
             "| dW_Q rel. err (median) | dW_K rel. err (median) | dW_Q err cos(t, t-1) | dW_Q err coherence (max head) "
             "| rank-1 share | delta-path cos |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in result["arms"].items():
        a = {k: np.asarray(v, np.float64) for k, v in r.items()}
        for layer in range(result["model"]["n_layer"]):
            sign = a["delta_sign_positive"][layer]
            one_sided = int(np.argmax(np.abs(sign - 0.5)))
            coh = a["dwq_coherence"][layer]
            lines.append(
                f"| {arm} | {layer + 1} | {a['tie_frac'][:, layer].mean():.3f} | "
                f"{a['delta_rel_bias'][:, layer].mean():+.1e} | "
                f"{sign.mean():.2f} (head {one_sided + 1}: {sign[one_sided]:.2f}) | "
                f"{np.median(a['dwq_rel_err'][:, layer]):.1e} | {np.median(a['dwk_rel_err'][:, layer]):.1e} | "
                f"{np.nanmean(a['dwq_cos_prev'][:, layer]):+.2f} | "
                f"{coh.mean():.2f} (head {int(np.argmax(coh)) + 1}: {coh.max():.2f}) | "
                f"{a['dwq_rank1_share'][:, layer].mean():.2f} | {a['dwq_delta_cos'][:, layer].mean():+.2f} |")
    return "\n".join(lines) + "\n"


def figure(result: dict, path: Path, run_metrics: Path | None = None) -> Path:
    """Heat maps (layer x head) per compared arm: summed-delta-error sign consistency and dW_Q error
    coherence across steps; plus the tie rate per layer over the run's training."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["arms"])
    extra = run_metrics is not None and Path(run_metrics).exists()
    fig, axes = plt.subplots(2, len(arms) + extra, figsize=(3.6 * (len(arms) + extra), 6.6), squeeze=False)
    for col, arm in enumerate(arms):
        r = result["arms"][arm]
        for row, (key, title, cmap, lim) in enumerate((
                ("delta_sign_positive", "steps with summed delta error > 0", "coolwarm", (0, 1)),
                ("dwq_coherence", "dW_Q error coherence over steps", "viridis", (0, 1)))):
            ax = axes[row, col]
            im = ax.imshow(np.asarray(r[key]), cmap=cmap, vmin=lim[0], vmax=lim[1], aspect="auto")
            ax.set_title(f"{arm}\n{title}", fontsize=8)
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            n_layer, n_head = np.asarray(r[key]).shape
            ax.set_xticks(range(0, n_head, 2), [str(h + 1) for h in range(0, n_head, 2)], fontsize=6)
            ax.set_yticks(range(n_layer), [str(i + 1) for i in range(n_layer)], fontsize=6)
            fig.colorbar(im, ax=ax, fraction=0.046)
    if extra:
        history = read_run(Path(run_metrics).parent)
        steps, ties = history["monitor_steps"], np.asarray(history["tie_frac"])
        ax = axes[0, -1]
        for layer in range(ties.shape[1]):
            ax.plot(steps, ties[:, layer], lw=1, label=f"layer {layer + 1}")
        ax.set_title("tie rate per layer over training", fontsize=8)
        ax.set_xlabel("step")
        ax.legend(fontsize=5, ncol=2)
        ax = axes[1, -1]
        spec = np.asarray(history["spec_wq"])
        for layer in range(spec.shape[1]):
            ax.plot(steps, spec[:, layer], lw=1)
        ax.set_title("W_Q spectral norm per layer", fontsize=8)
        ax.set_xlabel("step")
    fig.suptitle(f"Gradient errors vs fp32, {result['steps']} steps from step {result['start_step']} of "
                 f"{result['run']}", fontsize=9)
    return save_figure(fig, path)


def load_results(path: Path) -> dict:
    """A study's JSON, plain or gzip-compressed."""
    if path.suffix == ".gz":
        import gzip
        return json.loads(gzip.decompress(path.read_bytes()))
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproduction.gradients", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a training run directory (with checkpoints/; for "
                                                     "--from-results only its metrics.jsonl is read)")
    parser.add_argument("--from-results", help="re-render the table and figure from a saved JSON "
                                               "(.json or .json.gz) instead of running the study")
    parser.add_argument("--step", default="latest",
                        help="checkpoint step, 'latest', or 'before-instability': the last checkpoint before "
                             "the run's first spike, sustained rise or non-finite loss (the latest if none)")
    parser.add_argument("--steps", type=int, default=20, help="consecutive optimizer steps to study")
    parser.add_argument("--compare", type=parse_arms, default=list(ARMS),
                        help=f"comma list of NUMERICS/MAX_ADJUST arms (default {','.join(ARMS)})")
    parser.add_argument("--data", help="token data directory (default: ./data/<the run's corpus>)")
    parser.add_argument("--out", help="JSON results (default RUN/gradients.json)")
    parser.add_argument("--table", help="Markdown table (default: beside --out, .md)")
    parser.add_argument("--figure", help="figure (default: beside --out, .png)")
    args = parser.parse_args(argv)
    compare = args.compare
    run = Path(args.run)
    if args.from_results:
        result = load_results(Path(args.from_results))
        out = Path(args.out or args.from_results)
    else:
        try:
            result = study(run, steps=args.steps, compare=compare, step=pick_step(run, args.step),
                           data=args.data)
        except ValueError as e:
            print(f"python -m reproduction.gradients: error: {e}", file=sys.stderr)
            return 2
        out = Path(args.out or run / "gradients.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result) + "\n")
    out = out.with_name(out.name.removesuffix(".gz"))
    text = table(result)
    Path(args.table or out.with_suffix(".md")).write_text(text)
    fig = figure(result, Path(args.figure or out.with_suffix(".png")), run / "metrics.jsonl")
    print(text + f"\nresults: {out}\nfigure: {fig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
