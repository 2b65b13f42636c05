"""Model and training configurations (`--config NAME`).

Batch sizes are *global*: `batch_size` sequences per micro-step across all devices and hosts, and
`grad_accum` micro-steps per optimizer step, so one step sees batch_size * grad_accum * block_size
tokens whatever the number of devices.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import stable_attn
from .attention import FP8_BACKWARD_IMPL, JAX_NN, OURS

# Ours ("auto" and stable_attn.IMPLEMENTATIONS), then jax.nn's peers "cudnn" and "jax_xla".
ATTENTION_CHOICES = OURS + tuple(JAX_NN)
MAX_ADJUST_CHOICES = stable_attn.MAX_ADJUST_MODES
NUMERICS_CHOICES = tuple(stable_attn.PRESETS)
DTYPE_CHOICES = ("bfloat16", "float32", "float16")
# Fields that are not command-line flags; every other field is set by --field-name.
_NOT_FLAGS = ("n_layer", "n_head", "n_embd", "vocab_size", "b1", "b2", "grad_clip")


def _named(field_name: str) -> str:
  """A field as error messages name it: with its flag, e.g. "lr (--lr)"."""
  if field_name in _NOT_FLAGS:
    return field_name
  return f"{field_name} (--{field_name.replace('_', '-')})"


@dataclass(frozen=True)
class ModelConfig:
  """GPT-2 shape and attention options."""

  n_layer: int = 12
  n_head: int = 12
  n_embd: int = 768
  block_size: int = 1024  # context length T
  vocab_size: int = 50304  # 50257 padded up to a multiple of 64 (faster matmuls, as nanoGPT)
  bias: bool = True  # biases in Linear and LayerNorm (GPT-2 has them; the paper's run does not)
  dtype: str = "bfloat16"  # compute dtype; parameters are always float32 (master weights)
  attention: str = "auto"  # see train/attention.py
  max_adjust: str = "safe"
  numerics: str = "fast"
  beta: float = 2.0
  remat: bool = False  # recompute each block in the backward (saves activation memory)
  # Document masking (--pack-documents): no position attends across an end-of-text token; the
  # segment ids come from the tokens (train.model.document_ids). Off by default, as in nanoGPT.
  pack_documents: bool = False
  # Our attention reads the fused QKV projection in place
  # (stable_attn.dot_product_attention_qkvpacked); False splits q, k and v out first, as the jax.nn
  # arms always do (--no-qkv-packed).
  qkv_packed: bool = True
  # Where the attention reads qkv packed, c_attn's bias rides in its matmul (train.model.
  # linear_bias_in_matmul): split, the slices' copy adds it for free, packed, nothing would fuse
  # it and it took a pass of its own. False adds it after the product, as nnx.Linear does.
  qkv_bias_in_matmul: bool = True
  # The Hopper kernel's FP8 backward (--fp8-backward: e4m3 products in the dQ and dK/dV kernels,
  # TuningConfig.fp8_backward) for numerics with FP8 q, k, v and P; False: its bf16 backward.
  fp8_backward: bool = False

  def __post_init__(self):
    if self.n_embd % self.n_head:
      raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
    for name, value, choices in (
        ("attention", self.attention, ATTENTION_CHOICES),
        ("max_adjust", self.max_adjust, MAX_ADJUST_CHOICES),
        ("dtype", self.dtype, DTYPE_CHOICES),
    ):
      if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    try:  # a preset, or a preset with rounding points moved ("paper+score=float32")
      resolved = stable_attn.numerics.resolve(self.numerics)
    except ValueError as e:
      raise ValueError(f"numerics={self.numerics!r}: {e}") from None
    if self.fp8_backward and (resolved.qkv, resolved.p) != ("e4m3", "e4m3"):
      raise ValueError(f"{_named('fp8_backward')} is the FP8 forward's backward: it needs numerics "
                       f"with e4m3 q, k, v and P (e.g. --numerics fp8), got {self.numerics!r}")
    if self.fp8_backward and self.attention not in ("auto", FP8_BACKWARD_IMPL):
      raise ValueError(f"{_named('fp8_backward')} runs on the Hopper kernel: --attention auto or "
                       f"{FP8_BACKWARD_IMPL}, got {self.attention!r}")
    for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{_named(name)} must be positive, got {getattr(self, name)}")
    if not math.isfinite(self.beta):
      raise ValueError(f"{_named('beta')} must be a finite number, got {self.beta}")

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head


@dataclass(frozen=True)
class TrainConfig:
  """Optimisation, data and logging settings."""

  model: ModelConfig = field(default_factory=ModelConfig)
  batch_size: int = 16  # global sequences per micro-step
  grad_accum: int = 32  # micro-steps per optimizer step
  max_steps: int = 600_000
  lr: float = 6e-4
  min_lr: float = 6e-5
  warmup_steps: int = 2000
  lr_decay_steps: int | None = None  # cosine reaches min_lr here; None = max_steps
  weight_decay: float = 0.1  # applied to matrices and embeddings only
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0  # global-norm clipping; 0 disables
  seed: int = 0
  corpus: str = "default"
  # Intervals in steps. eval/monitor also run at the last step; 0 turns them off. Checkpoints are
  # also written at the end (0 = only then); samples are drawn at the end (sample_tokens 0 = never).
  eval_every: int = 1000
  eval_batches: int = 20
  log_every: int = 10
  monitor_every: int = 500
  ckpt_every: int = 1000
  sample_every: int = 0
  sample_tokens: int = 200
  keep_checkpoints: int = 3
  # Stop when a loss exceeds spike_factor x its running mean (EMA, from step max(100, warmup_steps)
  # on); 0 disables. A real explosion (loss 3 -> 7+) trips it; ordinary noise does not.
  spike_factor: float = 2.0
  fsdp: bool = False
  # Context parallelism (--context-parallel N): each sequence split over N devices (a mesh of
  # data x context: devices / N data-parallel groups of N), in the zigzag order of
  # stable_attn.context, so every device does the same causal work. 1: data parallel only.
  context_parallel: int = 1
  # How the attention meets the other devices' keys there (--context-strategy):
  # stable_attn's context_strategy: "auto" (alltoall where the heads divide by N, else
  # allgather), "allgather" (every key gathered), "ring" or "alltoall" (positions traded for heads).
  context_strategy: str = "auto"

  def __post_init__(self):
    for name in ("batch_size", "grad_accum", "max_steps", "eval_batches"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{_named(name)} must be positive, got {getattr(self, name)}")
    for name in ("log_every", "eval_every", "monitor_every", "ckpt_every", "sample_every",
                 "warmup_steps", "sample_tokens"):
      if getattr(self, name) < 0:
        raise ValueError(f"{_named(name)} must be >= 0, got {getattr(self, name)}")
    # A NaN passes every comparison below as False: each float is checked to be finite first
    # (--lr nan trained, then stopped at step 1 on a NaN loss).
    for name in ("lr", "min_lr", "weight_decay", "b1", "b2", "grad_clip", "spike_factor"):
      if not math.isfinite(getattr(self, name)):
        raise ValueError(f"{_named(name)} must be a finite number, got {getattr(self, name)}")
    if self.lr <= 0:
      raise ValueError(f"{_named('lr')} must be positive, got {self.lr}")
    if not 0 <= self.min_lr <= self.lr:
      raise ValueError(f"{_named('min_lr')} must lie in [0, lr = {self.lr}], got {self.min_lr}")
    if self.weight_decay < 0:
      raise ValueError(f"{_named('weight_decay')} must be >= 0, got {self.weight_decay}")
    if self.grad_clip < 0:
      raise ValueError(f"grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
    if self.lr_decay_steps is not None and self.lr_decay_steps <= 0:
      raise ValueError(f"{_named('lr_decay_steps')} must be positive, got {self.lr_decay_steps}")
    if not 0 <= self.b1 < 1 or not 0 <= self.b2 < 1:
      raise ValueError(f"b1 and b2 must lie in [0, 1), got {self.b1}, {self.b2}")
    if not 0 <= self.seed < 2 ** 32:
      # numpy's batch generator refuses a negative seed, and jax.random.PRNGKey keeps only the low
      # 32 bits of a larger one (seed 2**32 would sample as seed 0).
      raise ValueError(f"{_named('seed')} must be an integer in [0, {2 ** 32 - 1}], got "
                       f"{self.seed}")
    if self.keep_checkpoints < 1:
      # 0 would delete every checkpoint as it is written: the next run would restart from step 0.
      raise ValueError(f"{_named('keep_checkpoints')} must be at least 1, got "
                       f"{self.keep_checkpoints}")
    if self.context_parallel < 1:
      raise ValueError(f"{_named('context_parallel')} must be at least 1, got "
                       f"{self.context_parallel}")
    if self.context_strategy not in stable_attn.context.STRATEGIES:
      raise ValueError(f"{_named('context_strategy')} must be one of "
                       f"{', '.join(stable_attn.context.STRATEGIES)}, got "
                       f"{self.context_strategy!r}")
    if self.context_parallel > 1:
      if self.model.block_size % (2 * self.context_parallel):
        raise ValueError(f"{_named('block_size')} {self.model.block_size} must be a multiple of "
                         f"{2 * self.context_parallel} with --context-parallel "
                         f"{self.context_parallel} (the zigzag order cuts each sequence into two "
                         f"equal chunks per device)")
      if self.model.attention in JAX_NN:
        raise ValueError(f"--attention {self.model.attention} (jax.nn) refuses a sequence split "
                         f"over devices; --context-parallel needs ours (auto, or a GPU kernel)")
    if self.spike_factor and self.spike_factor <= 1:
      raise ValueError(f"{_named('spike_factor')} must be > 1 (or 0 to disable), got "
                       f"{self.spike_factor}")

  @property
  def tokens_per_step(self) -> int:
    return self.batch_size * self.grad_accum * self.model.block_size

  @property
  def decay_steps(self) -> int:
    return self.lr_decay_steps or self.max_steps

  def replace(self, **changes) -> "TrainConfig":
    """Copy with top-level fields changed; model fields may be passed as `model=dict(...)`."""
    model = changes.pop("model", None)
    if isinstance(model, dict):
      model = dataclasses.replace(self.model, **model)
    if model is not None:
      changes["model"] = model
    return dataclasses.replace(self, **changes)


def _gpt2(n_layer, n_head, n_embd, **train) -> TrainConfig:
  return TrainConfig(model=ModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd), **train)


CONFIGS: dict[str, TrainConfig] = {
    # The four GPT-2 sizes, nanoGPT-like optimisation, 524,288 tokens per step.
    "gpt2": _gpt2(12, 12, 768),
    "gpt2-medium": _gpt2(24, 16, 1024, batch_size=8, grad_accum=64, lr=3e-4, min_lr=3e-5),
    "gpt2-large": _gpt2(36, 20, 1280, batch_size=8, grad_accum=64, lr=2.5e-4, min_lr=2.5e-5),
    "gpt2-xl": _gpt2(48, 25, 1600, batch_size=4, grad_accum=128, lr=2e-4, min_lr=2e-5),
    # Long context: GPT-2 124M over 32,768 positions (a learned table of that many rows: GPT-2's
    # own architecture, so checkpoints, monitors and the loss curves compare with --config gpt2;
    # RoPE would be another model). 524,288 tokens per step; meant for --context-parallel N on N
    # GPUs (on one GPU, --batch-size 1 --grad-accum 16).
    "gpt2-long": TrainConfig(model=ModelConfig(block_size=32768), batch_size=4, grad_accum=4),
    # The paper's failing run (paper.md, "Setup of the failing run"; its repo's train.py): GPT-2
    # small without biases, lr 1e-3 after 2000 warm-up steps, cosine to 1e-5 over 600k steps, no
    # weight decay, b2 0.95, clip 1.0, 524,288 tokens per step (32 x 16 x 1024), bf16 compute.
    "paper": TrainConfig(
        model=ModelConfig(bias=False),
        batch_size=32, grad_accum=16, max_steps=600_000, lr=1e-3, min_lr=1e-5, warmup_steps=2000,
        weight_decay=0.0, monitor_every=100, spike_factor=1.5,
    ),
    # The reproduction's loss-explosion attempt (docs/reproduction.md): the paper's model and
    # optimiser, its failing arithmetic by default (--numerics paper --max-adjust off), but a 16x
    # smaller batch (32 x 1024 tokens), 500 warm-up steps and the larger registry corpus, so that
    # thousands of steps fit in one GPU-budget run. Multi-epoch by necessity (9.9M tokens); the peak
    # lr is set per arm.
    "repro": TrainConfig(
        model=ModelConfig(bias=False, numerics="paper", max_adjust="off"),
        corpus="mix", batch_size=32, grad_accum=1, max_steps=20_000, lr=1e-3, min_lr=1e-5,
        warmup_steps=500, weight_decay=0.0, eval_every=500, eval_batches=10, log_every=10,
        monitor_every=50, ckpt_every=1000, keep_checkpoints=4, sample_tokens=0,
        spike_factor=0.0,  # run through spikes (does the loss recover?); only NaN/Inf stops a run
    ),
    # CPU config for the default job: 2-core CPU, < 10 minutes including data preparation. The GPT-2
    # vocabulary makes the tied embedding / LM head most of the cost, so the body stays small.
    "tiny": TrainConfig(
        model=ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
        batch_size=8, grad_accum=1, max_steps=300, lr=3e-3, min_lr=3e-4, warmup_steps=20,
        weight_decay=0.1, eval_every=100, eval_batches=4, log_every=10, monitor_every=50,
        ckpt_every=100, sample_tokens=100,
    ),
}


def get_config(name: str) -> TrainConfig:
  if name not in CONFIGS:
    raise ValueError(f"--config {name!r} is unknown; choose one of {', '.join(CONFIGS)}")
  return CONFIGS[name]


def check_dir(path: Path, flag: str) -> None:
  """ValueError in one line when the directory `flag` names (--out-dir, --compilation-cache) is a
  file or could not be created; creates nothing (checked before any work)."""
  if path.exists():
    if not path.is_dir():
      raise ValueError(f"{flag} {path} is a file, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
      raise ValueError(f"{flag} {path} is not writable")
    return
  parent = next(p for p in path.absolute().parents if p.exists())
  if not parent.is_dir():
    raise ValueError(f"{flag} {path} cannot be created: {parent} is a file")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(f"{flag} {path} cannot be created: {parent} is not writable")
