"""train.tokenizer: the genuine GPT-2 tokenizer from the vendored files, offline."""

import hashlib

import pytest
from hypothesis import given, settings, strategies as st

from train import tokenizer as tok


def test_hello_world():
  assert tok.gpt2_encoding().encode("Hello world") == [15496, 995]


def test_gpt2_facts():
  enc = tok.gpt2_encoding()
  assert enc.name == "gpt2"
  assert enc.n_vocab == 50257
  assert enc.eot_token == tok.EOT == 50256
  assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
  # Known GPT-2 ids: leading-space words and a contraction split the GPT-2 way.
  assert enc.encode(" the") == [262]
  assert enc.encode("I'm") == [40, 1101]


def test_vendored_files_match_pinned_hashes():
  for name, want in (("encoder.json", tok.ENCODER_JSON_SHA256),
                     ("vocab.bpe", tok.VOCAB_BPE_SHA256)):
    assert hashlib.sha256((tok.ASSETS / name).read_bytes()).hexdigest() == want


def test_round_trip_alice(alice_text):
  enc = tok.gpt2_encoding()
  ids = enc.encode_ordinary(alice_text)
  assert 35_000 < len(ids) < 45_000
  assert enc.decode(ids) == alice_text


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_round_trip_any_text(text):
  enc = tok.gpt2_encoding()
  assert enc.decode(enc.encode_ordinary(text)) == text


@pytest.fixture(scope="module")
def alice_text():
  from pathlib import Path
  return (Path(__file__).parent / "data" / "carroll-alice.txt").read_bytes().decode("latin-1")
