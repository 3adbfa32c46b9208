"""Tokenizers: round trips, persistence, the unknown-character error and id validation."""

import json

import numpy as np
import pytest

from attnlab.data import ByteTokenizer, CharTokenizer, load_tokenizer, validate_ids

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
UNICODE = "naïve café — 日本語 😀\n"


def test_char_vocabulary_is_sorted_distinct_characters():
    tok = CharTokenizer.from_text("banana")
    assert tok.chars == "abn"
    assert tok.vocab_size == 3
    np.testing.assert_array_equal(tok.encode("nab"), [2, 0, 1])


@pytest.mark.parametrize("text", [TEXT, UNICODE, ""])
def test_char_round_trip(text):
    tok = CharTokenizer.from_text(TEXT + UNICODE)
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", [TEXT, UNICODE, ""])
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert ids.dtype == np.int32 and ids.shape == (len(text.encode("utf-8")),)
    assert ids.min(initial=0) >= 0 and ids.max(initial=0) < 256
    assert tok.decode(ids) == text


def test_byte_decode_replaces_invalid_utf8():
    tok = ByteTokenizer()
    broken = tok.encode("é")[:1]  # half of a two-byte character
    assert tok.decode(broken) == "\ufffd"


def test_char_order_given_explicitly():
    tok = CharTokenizer("cab")
    np.testing.assert_array_equal(tok.encode("abc"), [1, 2, 0])
    assert tok.decode([0, 1, 2]) == "cab"


def test_char_rejects_repeated_characters():
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("aba")


def test_unknown_character_error_names_character_and_corpus():
    tok = CharTokenizer.from_text("hello world")
    with pytest.raises(ValueError, match="built from the training corpus") as info:
        tok.encode("hello Zorld")
    assert "'Z'" in str(info.value)
    assert "index 6" in str(info.value)


@pytest.mark.parametrize("tok", [CharTokenizer.from_text(TEXT + UNICODE), ByteTokenizer()])
def test_save_load_round_trip(tmp_path, tok):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    assert json.loads(path.read_text())["kind"] == tok.kind
    loaded = load_tokenizer(path)
    assert type(loaded) is type(tok)
    assert loaded == tok
    np.testing.assert_array_equal(loaded.encode(UNICODE), tok.encode(UNICODE))


def test_load_rejects_unknown_kind(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"kind": "sentencepiece"}))
    with pytest.raises(ValueError, match="sentencepiece"):
        load_tokenizer(path)


@pytest.mark.parametrize("tok", [CharTokenizer("ab"), ByteTokenizer()])
def test_decode_rejects_out_of_range_ids(tok):
    with pytest.raises(ValueError, match="outside the valid range"):
        tok.decode([0, tok.vocab_size])


def test_validate_ids_accepts_in_range():
    ids = np.array([[0, 4], [2, 3]], np.int32)
    assert validate_ids(ids, 5) is not None


@pytest.mark.parametrize(
    ("ids", "value", "index"),
    [([0, 1, 5, 2], 5, "index 2"), ([[0, 1], [-1, 2]], -1, r"index \(1, 0\)")],
)
def test_validate_ids_message(ids, value, index):
    with pytest.raises(ValueError, match=index) as info:
        validate_ids(np.array(ids), 5, name="batch['inputs']")
    message = str(info.value)
    assert "batch['inputs']" in message
    assert f"id {value}" in message
    assert "[0, 5)" in message


def test_validate_ids_rejects_floats():
    with pytest.raises(ValueError, match="integers"):
        validate_ids(np.array([0.0, 1.0]), 5)


def test_tiny_shakespeare_vocabulary(shared_dir):
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == 65
    assert tok.decode(tok.encode(text[:1000])) == text[:1000]
