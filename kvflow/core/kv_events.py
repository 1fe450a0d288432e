"""KV cache events: what the block pool tells a KV-aware router (llm-d, Dynamo) about the
prefix cache, in vLLM 0.32's wire format (``vllm/distributed/kv_events.py``).

Each message the publisher sends (``kvflow/core/kv_event_publisher.py``) is three ZeroMQ
frames: the topic, the batch's sequence number (8 bytes, big-endian, from 0), and a
``KVEventBatch`` encoded with msgspec's msgpack encoder. The batch is ``array_like`` (a msgpack
array in field order); each event is a msgpack map of its fields, its tag (the class name)
under ``"type"``, fields left at their None default omitted (vLLM 0.32's ``omit_defaults``):

* ``KVEventBatch``: ``[ts, events, data_parallel_rank]`` (``ts`` Unix seconds, float);
* ``BlockStored``: ``{"type": "BlockStored", "block_hashes", "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
  "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
  "session_id"}``: full blocks now in the prefix cache, a chain (each block's parent is the
  one before it; the first one's is ``parent_block_hash``, None at a prompt's start),
  ``token_ids`` their tokens in order (``block_size`` per block); ``lora_name`` the adapter's
  name (None without one); ``extra_keys`` one entry per block: None, or the untagged keys
  mixed into its hash (``block_hashing.event_extra_keys``: the LoRA name, ``[identifier,
  offset]`` per image, the ``cache_salt`` on a prompt's first block); ``group_idx`` the KV
  cache group (kvflow's events are group 0's); ``session_id`` the request's ``session_id``
  (the request that stored the blocks; None without one). kvflow leaves
  ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, ``locality`` and ``ownership``
  None (vLLM: unspecified), so they are not on the wire;
* ``BlockRemoved``: ``{"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}``
  (and vLLM's ``locality``, ``ownership``, None here): blocks no longer served;
* ``AllBlocksCleared``: ``{"type": "AllBlocksCleared"}``: the prefix cache is empty.

vLLM up to its PR #42892 (June 2026) encoded events as arrays (``["BlockStored", hashes,
...]``); a decoder of those (vLLM 0.10-0.2x's own structs) refuses a map, and vLLM 0.32's
refuses an array: kvflow sends the maps, as vLLM 0.32 does.

A block's hash on the wire is :func:`external_block_hash` of the block pool's chain hash (its
low 64 bits, ``core/block_hashing.py``), an unsigned integer as vLLM sends by default. ``medium`` is where the
blocks live: ``GPU`` on an accelerator, ``CPU`` on a CPU engine.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
_LOW_64 = (1 << 64) - 1


def external_block_hash(block_hash: int) -> int:
    """The hash a consumer sees for a block: the low 64 bits of the pool's chain hash
    (``core/block_hashing.py``; for vLLM's algorithms the digest's last 8 bytes read
    big-endian, as vLLM converts it), so it fits msgpack's unsigned 64-bit integers."""
    return block_hash & _LOW_64


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's events, in the order they happened."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events: msgpack maps tagged by class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Full blocks newly served by the prefix cache: a run of a chain of blocks."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks the prefix cache no longer serves (evicted for reuse, or reset)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block left the prefix cache (a reset that found no block in use)."""


class KVEventBatch(EventBatch):
    """The batch type on the wire (its events typed, for decoding)."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_kv_event_batch(payload: bytes) -> KVEventBatch:
    """Decode a message's third frame (a subscriber's side).

    Raises:
        msgspec.DecodeError: (a ValueError) if ``payload`` is not an encoded KVEventBatch.
    """
    return _DECODER.decode(payload)
