"""Prefix-cache block hashes (``--prefix-caching-hash-algo``): kvflow's own, or vLLM's.

Every full block of a request's tokens gets a chain hash: it names the block's tokens, every
token before them, and whatever else changes their K/V (a LoRA adapter, images, a
``cache_salt``). Two families, chosen once per engine:

* ``blake2b`` (the default): kvflow's hash, ``hash_block_tokens`` in ``core/block_pool.py``
  (BLAKE2b-128 over parent, tokens and ``repr`` of a nested extra key). Only kvflow computes it.
* ``sha256`` / ``sha256_cbor``: vLLM v1's (``vllm/v1/core/kv_cache_utils.py:
  hash_block_tokens``, ``vllm/utils/hashing.py``), so a router can recompute a block's hash
  from a prompt's tokens. A block's 32-byte digest is

      SHA-256(serialize((parent, tuple(block_token_ids), extra_keys)))

  with ``serialize`` = ``pickle.dumps(x, protocol=5)`` (``sha256``) or canonical CBOR
  (RFC 8949 section 4.2.1, ``sha256_cbor``: reproducible outside Python). ``parent`` is the
  previous block's digest; the first block's is ``NONE_HASH = SHA-256(serialize(seed))``, the
  seed being ``$PYTHONHASHSEED`` when set, else the string ``"vllm-none-hash"`` (vLLM's rule
  for its cryptographic algorithms since it fixed the seed; vLLM 0.10-0.11 drew random bytes
  when ``PYTHONHASHSEED`` was unset, so match those by setting it on both sides).
  ``extra_keys`` is None or a tuple, in this order: ``("lora", lora_name, lora_path)``; one
  ``("mm", identifier, placeholder offset - block start)`` per image overlapping the block;
  ``("cache_salt", salt)`` on the first block only; then kvflow's own keys where vLLM has none
  (``("kvflow_prompt_embeds", identifier)``, ``("kvflow_long_prompt_rope",)``,
  ``("kvflow_siblings_of", parent request id)`` with prefix caching off).

Hashes are Python ints inside kvflow (the digest read big-endian for vLLM's algorithms), so
the block pool keys every algorithm alike; a KV event carries the low 64 bits
(``kv_events.external_block_hash``), which for vLLM's algorithms is vLLM's
``int.from_bytes(digest, "big") & (2**64 - 1)``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
from typing import Any

from kvflow.core.block_pool import hash_block_tokens
from kvflow.inputs.multimodal import overlapping_features
from kvflow.request import Request

PREFIX_CACHING_HASH_ALGOS = ("blake2b", "sha256", "sha256_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def cbor_canonical(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 section 4.2.1: shortest heads, definite lengths) of None,
    bool, int (-2**64 <= x < 2**64), str, bytes and tuples/lists of them: what
    ``cbor2.dumps(obj, canonical=True)`` writes for these types (checked against cbor2 6.3 in
    docs/architecture.md "Prefix-cache block hashes").

    Raises:
        TypeError: for another type (a float, a dict) or an int outside 64 bits.
    """
    out = bytearray()
    _cbor_into(out, obj)
    return bytes(out)


def _cbor_head(out: bytearray, major: int, value: int) -> None:
    if value < 24:
        out.append(major << 5 | value)
        return
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            out.append(major << 5 | extra)
            out += value.to_bytes(size, "big")
            return
    raise TypeError(f"integer {value} does not fit CBOR's 64-bit head")


def _cbor_into(out: bytearray, obj: Any) -> None:
    if obj is None:
        out.append(0xF6)
    elif isinstance(obj, bool):
        out.append(0xF5 if obj else 0xF4)
    elif isinstance(obj, int):
        _cbor_head(out, 0, obj) if obj >= 0 else _cbor_head(out, 1, -1 - obj)
    elif isinstance(obj, bytes):
        _cbor_head(out, 2, len(obj))
        out += obj
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        _cbor_head(out, 3, len(data))
        out += data
    elif isinstance(obj, (tuple, list)):
        _cbor_head(out, 4, len(obj))
        for item in obj:
            _cbor_into(out, item)
    else:
        raise TypeError(f"no canonical CBOR encoding here for {type(obj).__name__}")


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is bytes and len(obj[0]) == 32 \
            and type(obj[1]) is tuple:  # a block: (parent, token ids, extra keys)
        return hashlib.sha256(_cbor_block(*obj)).digest()
    return hashlib.sha256(cbor_canonical(obj)).digest()


def _cbor_block(parent: bytes, token_ids: tuple[int, ...], extra: Any) -> bytes:
    """``cbor_canonical((parent, token_ids, extra))`` with the token ids' heads written in
    one pass (about twice as fast as the general encoder on a 16-token block)."""
    out = bytearray(b"\x83\x58\x20")  # array of 3; byte string of 32
    out += parent
    _cbor_head(out, 4, len(token_ids))
    for t in token_ids:
        if 0 <= t < 24:
            out.append(t)
        elif 0 <= t < 256:
            out += b"\x18" + t.to_bytes(1, "big")
        elif 0 <= t < 65536:
            out += b"\x19" + t.to_bytes(2, "big")
        else:
            _cbor_into(out, t)
    _cbor_into(out, extra)
    return bytes(out)


class BlockHasher:
    """One engine's block hash: ``request_key`` once per request, then ``hash_block`` per
    full block, each block's hash chained from its parent's.

    Args:
        algo: one of ``PREFIX_CACHING_HASH_ALGOS``.
        none_hash_seed: the first block's parent seed for vLLM's algorithms (None:
            ``$PYTHONHASHSEED`` if set, else ``"vllm-none-hash"``); unused by ``blake2b``.

    Raises:
        ValueError: for an unknown ``algo``, naming the choices.
    """

    def __init__(self, algo: str = "blake2b", none_hash_seed: str | None = None) -> None:
        if algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo={algo!r}: choose one of "
                             f"{', '.join(PREFIX_CACHING_HASH_ALGOS)}")
        self.algo = algo
        self.is_vllm = algo != "blake2b"
        self._digest: Callable[[Any], bytes] = _sha256_cbor if algo == "sha256_cbor" \
            else _sha256_pickle
        if none_hash_seed is None:
            none_hash_seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
        self.none_hash: bytes = self._digest(none_hash_seed)

    def hash_block(self, parent_hash: int | None, token_ids: tuple[int, ...],
                   extra_key: Any) -> int:
        """The chain hash of one full block (an int: 128 bits for ``blake2b``, the 256-bit
        digest read big-endian for vLLM's algorithms). ``extra_key`` is what
        ``block_extra_key`` returned for the block."""
        if not self.is_vllm:
            return hash_block_tokens(parent_hash, token_ids, extra_key)
        parent = self.none_hash if parent_hash is None else parent_hash.to_bytes(32, "big")
        return int.from_bytes(self._digest((parent, token_ids, extra_key)), "big")

    def request_key(self, request: Request, shared: bool, long_prompt: bool) -> Any:
        """What every block of the request mixes in, before images and salt.

        Args:
            request: the request (its LoRA adapter and prompt embeddings are read).
            shared: prefix caching is on (else only the request's own samples, keyed by the
                parent id, may share blocks).
            long_prompt: a LongRoPE prompt past the model's original context (its keys are
                rotated differently).
        """
        lora, embeds = request.lora_request, request.prompt_embeds
        if not self.is_vllm:  # kvflow's nesting, unchanged
            key = None if shared else request.parent_id
            # the adapter's id, name and folder: an id removed and loaded again for another
            # folder must not hit the blocks the old adapter filled (vLLM keys name + path)
            key = key if lora is None else \
                (key, (lora.lora_int_id, lora.lora_name, lora.lora_path))
            key = (key, "long_prompt_rope") if long_prompt else key
            return key if embeds is None else (key, "prompt_embeds", embeds.identifier)
        own = ([] if embeds is None else [("kvflow_prompt_embeds", embeds.identifier)]) \
            + ([("kvflow_long_prompt_rope",)] if long_prompt else []) \
            + ([] if shared else [("kvflow_siblings_of", request.parent_id)])
        return ([] if lora is None else [("lora", lora.lora_name, lora.lora_path)]), own

    def block_extra_key(self, request_key: Any, request: Request, start: int, end: int) -> Any:
        """The extra key of the request's block of token positions ``[start, end)``: the
        request's key, the images whose placeholders overlap the block, and the
        ``cache_salt`` on the first block (later blocks chain from its hash)."""
        salt = request.cache_salt if start == 0 else None
        if not self.is_vllm:
            key = request_key
            if request.mm_features is not None:
                images = tuple((f.identifier, f.offset - start)
                               for f in overlapping_features(request.mm_features, start, end))
                key = (key, images) if images else key
            return key if salt is None else (key, ("cache_salt", salt))
        lora, own = request_key
        mm = [("mm", f.identifier, f.offset - start)
              for f in overlapping_features(request.mm_features, start, end)]
        keys = lora + mm + ([("cache_salt", salt)] if salt else []) + own
        return tuple(keys) if keys else None


def connector_extra_keys(long_prompt_threshold: int | None
                         ) -> Callable[[Request], Callable[[int, int], Any]]:
    """The KV connector's block extra keys (``distributed/kv_transfer/shared_storage.py``):
    a request -> ``(start, end)`` -> the extra key ``block_extra_key`` gives its block
    ``[start, end)`` in vLLM's tagged form (LoRA name and path, images, salt, prompt
    embeddings, the LongRoPE mark for a prompt longer than ``long_prompt_threshold``; never
    the siblings key: storage is shared). Nested tuples of str and int, or None."""
    hasher = BlockHasher("sha256_cbor", none_hash_seed="")

    def of(request: Request) -> Callable[[int, int], Any]:
        long_prompt = long_prompt_threshold is not None and \
            request.num_prompt_tokens > long_prompt_threshold
        request_key = hasher.request_key(request, True, long_prompt)
        return lambda start, end: hasher.block_extra_key(request_key, request, start, end)

    return of


def event_extra_keys(request: Request, start: int, end: int) -> tuple[Any, ...] | None:
    """The extra keys of the request's block ``[start, end)`` as vLLM's
    ``BlockStored.extra_keys`` carries them (untagged, whatever the hash algorithm): the LoRA
    name, ``(identifier, offset in the block)`` per overlapping image, the ``cache_salt`` on
    the first block; None when there are none. kvflow's own keys are left out."""
    lora, salt = request.lora_request, request.cache_salt if start == 0 else None
    keys = ([] if lora is None else [lora.lora_name]) \
        + [(f.identifier, f.offset - start)
           for f in overlapping_features(request.mm_features, start, end)] \
        + ([salt] if salt else [])
    return tuple(keys) if keys else None
