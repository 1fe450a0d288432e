"""KV cache events: what the block pool tells a KV-aware router (llm-d, Dynamo) about the
prefix cache, in vLLM's wire format.

Each message the publisher sends (``kvflow/core/kv_event_publisher.py``) is three ZeroMQ
frames: the topic, the batch's sequence number (8 bytes, big-endian, from 0), and a
``KVEventBatch`` encoded with msgspec's msgpack encoder. Every struct is ``array_like`` (a
msgpack array in field order) and an event's first element is its tag, the class name:

* ``KVEventBatch``: ``[ts, events, data_parallel_rank]`` (``ts`` Unix seconds, float);
* ``BlockStored``: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys]``: full blocks now in the prefix cache, a chain
  (each block's parent is the one before it; the first one's is ``parent_block_hash``, None
  at a prompt's start), ``token_ids`` their tokens in order (``block_size`` per block);
  ``lora_name`` the adapter's name (None without one; vLLM added it after 0.11, after the
  six fields 0.10-0.11 decode, and those decoders ignore it), ``extra_keys`` one entry per
  block: None, or the untagged keys mixed into its hash (``block_hashing.event_extra_keys``:
  the LoRA name, ``[identifier, offset]`` per image, the ``cache_salt`` on a prompt's first
  block);
* ``BlockRemoved``: ``["BlockRemoved", block_hashes, medium]``: blocks no longer served;
* ``AllBlocksCleared``: ``["AllBlocksCleared"]``: the prefix cache is empty.

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


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (tagged by class name)."""


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


class BlockRemoved(KVCacheEvent):
    """Blocks the prefix cache no longer serves (evicted for reuse, or reset)."""

    block_hashes: list[int]
    medium: str | None


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
