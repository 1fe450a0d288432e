"""``--prefix-caching-hash-algo``: the KV-cache manager's block hashes against oracles written
out by hand here.

* ``sha256``: vLLM's documented recipe, SHA-256 of ``pickle.dumps((parent, tokens,
  extra_keys), protocol=5)``, the first parent being SHA-256 of the pickled seed.
* ``sha256_cbor``: the same tuple's canonical CBOR bytes spelled out head by head
  (RFC 8949: major type << 5 | length), so the encoder is checked against the standard, not
  against itself.
* ``blake2b`` (the default): the hashes main's kvflow computed before the option existed
  (recorded hex values, without LoRA: the default is unchanged), and with LoRA its byte
  layout written out by hand (the adapter's id, name and path keyed since an id can be
  reused for another folder).

A 13-token prompt at block size 4 has 3 full blocks; the request carries a LoRA adapter
(name ``ad``, id 7, path ``/adapters/ad``) and ``cache_salt`` ``tenant-a``.
"""

from __future__ import annotations

import hashlib
import pickle

import pytest

from kvflow.config.cache import CacheConfig
from kvflow.core.block_hashing import BlockHasher, cbor_canonical, event_extra_keys
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_events import external_block_hash
from kvflow.lora.request import LoRARequest
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from tests.core.fake_kv import fake_kv_cache_config

PROMPT = [1, 2, 30, 300, 5, 6, 7, 8, 9, 10, 11, 12, 13]
BLOCKS = [(1, 2, 30, 300), (5, 6, 7, 8), (9, 10, 11, 12)]
LORA = LoRARequest("ad", 7, "/adapters/ad")
SALT = "tenant-a"
# vLLM's extra_keys: the adapter on every block, the salt on the first block only
EXTRA = [(("lora", "ad", "/adapters/ad"), ("cache_salt", "tenant-a")),
         (("lora", "ad", "/adapters/ad"),), (("lora", "ad", "/adapters/ad"),)]


def engine_hashes(algo: str | None, lora: LoRARequest | None = LORA,
                  salt: str | None = SALT) -> list[int]:
    hasher = None if algo is None else BlockHasher(algo)
    kv = KVCacheManager(fake_kv_cache_config(16, 4), True, hasher=hasher)
    req = Request("r", PROMPT, SamplingParams(max_tokens=1), lora_request=lora,
                  cache_salt=salt)
    kv.get_computed_blocks(req)
    return req.block_hashes


def sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def text(s: str) -> bytes:  # CBOR text string shorter than 24 bytes: 0x60 | length
    assert len(s) < 24
    return bytes([0x60 | len(s)]) + s.encode()


def cbor_block(parent: bytes, tokens: tuple[int, ...], first: bool) -> bytes:
    """Canonical CBOR of ``(parent, tokens, extra_keys)`` for this file's blocks, by hand."""
    # ints below 24 are one byte; 30: 0x18 + 1 byte; 300: 0x19 + 2 bytes big-endian
    wide = {30: b"\x18\x1e", 300: b"\x19\x01\x2c"}
    out = b"\x83" + b"\x58\x20" + parent  # array(3), byte string of 32 (1-byte length)
    out += b"\x84" + b"".join(wide[t] if t in wide else bytes([t]) for t in tokens)
    lora = b"\x83" + text("lora") + text("ad") + text("/adapters/ad")
    salt = b"\x82" + text("cache_salt") + text("tenant-a")
    return out + (b"\x82" + lora + salt if first else b"\x81" + lora)


@pytest.mark.parametrize("seed", [None, "0"])
def test_sha256_is_vllms_pickle_chain(seed, monkeypatch):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    parent = sha256_pickle("vllm-none-hash" if seed is None else seed)
    expected = []
    for tokens, extra in zip(BLOCKS, EXTRA):
        parent = sha256_pickle((parent, tokens, extra))
        expected.append(int.from_bytes(parent, "big"))
    assert engine_hashes("sha256") == expected
    # the event hash: the digest's last 8 bytes, big-endian (vLLM's int conversion)
    assert [external_block_hash(h) for h in expected] == \
        [int.from_bytes(h.to_bytes(32, "big")[-8:], "big") for h in expected]


def test_sha256_without_extra_keys_hashes_none():
    parent = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    expected = []
    for tokens in BLOCKS:
        parent = sha256_pickle((parent, tokens, None))
        expected.append(int.from_bytes(parent, "big"))
    assert engine_hashes("sha256", lora=None, salt=None) == expected


def test_sha256_cbor_is_the_canonical_cbor_chain(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    parent = hashlib.sha256(b"\x6e" + b"vllm-none-hash").digest()  # text string of 14
    expected = []
    for i, tokens in enumerate(BLOCKS):
        parent = hashlib.sha256(cbor_block(parent, tokens, i == 0)).digest()
        expected.append(int.from_bytes(parent, "big"))
    assert engine_hashes("sha256_cbor") == expected


def test_cbor_encoder_heads_and_refusals():
    assert cbor_canonical((None, True, 23, 24, -25, 65536, b"ab")) == \
        b"\x87\xf6\xf5\x17\x18\x18\x38\x18\x1a\x00\x01\x00\x00\x42ab"
    with pytest.raises(TypeError, match="float"):
        cbor_canonical((1.5,))


def test_block_fast_path_writes_the_general_encoders_bytes():
    """``_cbor_block`` (token heads in one pass) against ``cbor_canonical``, itself checked
    by hand above, on every head width a token id can take (1, 2, 3, 5 and 9 bytes)."""
    from kvflow.core.block_hashing import _cbor_block

    parent = bytes(range(32))
    tokens = (0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1)
    for extra in (None, (("lora", "ad", "/adapters/ad"), ("cache_salt", "s"))):
        assert _cbor_block(parent, tokens, extra) == cbor_canonical((parent, tokens, extra))
    assert _cbor_block(parent, (24, 300), None)[35:] == b"\x82\x18\x18\x19\x01\x2c\xf6"


def blake2b_block(parent: int | None, tokens: tuple[int, ...], extra: str) -> int:
    """kvflow's BLAKE2b-128 block hash written out: a parent flag (and the parent's 16 bytes,
    little-endian), the token count (4 bytes), the tokens as int64, ``repr`` of the extra
    key; the digest read little-endian."""
    payload = (b"\x00" if parent is None else b"\x01" + parent.to_bytes(16, "little")) \
        + len(tokens).to_bytes(4, "little") \
        + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens) + extra.encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=16).digest(), "little")


def test_default_blake2b_keys_the_adapters_id_name_and_folder():
    """With a LoRA adapter, kvflow's extra key is ``(None, (id, name, path))`` (the salt
    nested after it on the first block): an id reused for another folder keys apart."""
    adapter = "(None, (7, 'ad', '/adapters/ad'))"
    extras = [f"({adapter}, ('cache_salt', 'tenant-a'))", adapter, adapter]
    expected, parent = [], None
    for block, extra in zip(BLOCKS, extras):
        parent = blake2b_block(parent, block, extra)
        expected.append(parent)
    assert engine_hashes(None) == expected
    assert engine_hashes("blake2b") == expected
    assert engine_hashes(None, lora=LoRARequest("other", 7, "/adapters/other"))[0] \
        != expected[0]


def test_default_is_kvflows_blake2b_unchanged():
    """Values main's kvflow computed for the same requests before the option existed."""
    assert [hex(h) for h in engine_hashes("blake2b", lora=None, salt=None)] == [
        "0x75ea20995bf22aa4f8cdfb158ffb51a3", "0x723934125059de6ab4de62941217c28e",
        "0x3ccbc1961c5011dcc8876f1230a76c1d"]
    assert CacheConfig().prefix_caching_hash_algo == "blake2b"


def test_event_extra_keys_are_vllms_untagged_form():
    req = Request("r", PROMPT, SamplingParams(max_tokens=1), lora_request=LORA,
                  cache_salt=SALT)
    assert [event_extra_keys(req, 4 * i, 4 * i + 4) for i in range(3)] == \
        [("ad", "tenant-a"), ("ad",), ("ad",)]
    plain = Request("p", PROMPT, SamplingParams(max_tokens=1))
    assert event_extra_keys(plain, 0, 4) is None


@pytest.mark.parametrize("make", [lambda: BlockHasher("md5"),
                                  lambda: CacheConfig(prefix_caching_hash_algo="xxhash")])
def test_unknown_algo_is_refused_naming_the_choices(make):
    with pytest.raises(ValueError, match="prefix_caching_hash_algo") as info:
        make()
    assert all(name in str(info.value) for name in ("blake2b", "sha256", "sha256_cbor"))
