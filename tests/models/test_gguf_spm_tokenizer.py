"""A sentencepiece vocabulary (``tokenizer.ggml.model = llama``, as Llama 2 / Mistral /
TinyLlama GGUFs carry) tokenizes as sentencepiece itself does. Oracle: a
``sentencepiece.SentencePieceProcessor`` built from the same pieces, scores and types (a BPE
model; ``add_dummy_prefix`` = ``tokenizer.ggml.add_space_prefix``), which is also llama.cpp's
algorithm. Before: transformers' ``Metaspace`` always prepended a space (``add_space_prefix =
false`` ignored) and swallowed a leading one (``" hello"`` encoded as ``"hello"`` and decoded
without its space)."""

from __future__ import annotations

import os
import struct

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.models.gguf_tokenizer import load_gguf_tokenizer

gguf = pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")

_WORDS = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "he", "ll", "llo", "hello",
          "\u2581hello", "\u2581w", "or", "\u2581wor", "\u2581world", "ld", "wor", "world"]
# (piece, score, GGUF/sentencepiece type: 1 normal, 2 unknown, 3 control, 6 byte)
PIECES = ([("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
          + [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
          + [(w, -float(i), 1) for i, w in enumerate(_WORDS)])
TEXTS = ["hello world", " hello", "  hello", "hello  world ", "world\nhello", "héllo 🙂", ""]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _msg(number: int, body: bytes) -> bytes:
    return _field(number, 2, _varint(len(body)) + body)


def sentencepiece_oracle(add_dummy_prefix: bool):
    """A sentencepiece BPE model of PIECES (ModelProto written by hand: no protobuf here)."""
    proto = b"".join(_msg(1, _msg(1, p.encode()) + _field(2, 5, struct.pack("<f", s))
                          + _field(3, 0, _varint(t))) for p, s, t in PIECES)
    trainer = b"".join(_field(n, 0, _varint(v)) for n, v in
                       ((3, 2), (4, len(PIECES)), (35, 1), (40, 0), (41, 1), (42, 2)))
    normalizer = (_msg(1, b"identity") + _field(3, 0, _varint(int(add_dummy_prefix)))
                  + _field(4, 0, _varint(0)) + _field(5, 0, _varint(1)))
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto + _msg(2, trainer) + _msg(3, normalizer))
    return sp


def _write(path, add_space_prefix: bool | None) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([p for p, _, _ in PIECES])
    w.add_token_scores([s for _, s, _ in PIECES])
    w.add_token_types([t for _, _, t in PIECES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("add_space_prefix", [True, False, None])
def test_spm_vocabulary_matches_sentencepiece(tmp_path, monkeypatch, add_space_prefix):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = _write(tmp_path / "spm.gguf", add_space_prefix)
    oracle = sentencepiece_oracle(add_space_prefix is not False)  # llama.cpp's default: true
    for attempt in ("converted", "from the cache"):
        tokenizer = load_gguf_tokenizer(path)
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert ids == oracle.encode(text), (attempt, text)
            assert tokenizer.decode(ids) == oracle.decode(ids) == text, (attempt, text)
