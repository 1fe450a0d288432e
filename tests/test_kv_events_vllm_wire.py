"""kvflow's KV cache events on vLLM 0.32's wire: encoded by kvflow, decoded by vLLM 0.32's own
struct definitions, and back.

Oracle: ``Vllm032*`` below are vLLM 0.32's ``vllm/distributed/kv_events.py`` structs written
out field for field (names, order, types, defaults; events tagged by class name and, since
vLLM's PR #42892, not ``array_like``: msgpack maps; the batch still an array). vLLM itself is
not imported (not installed in CI). Also: a decoder of vLLM 0.10-0.2x's array events refuses
kvflow's (the docs say which decoders match), and the replay socket's frames are vLLM 0.32's.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from kvflow.config import KVEventsConfig
from kvflow.core.kv_event_publisher import END_OF_REPLAY, ZmqEventPublisher
from kvflow.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_kv_event_batch,
)


# ---- vLLM 0.32's structs (vllm/distributed/kv_events.py), the oracle ---------------------------
class Vllm032EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class Vllm032KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class Vllm032BlockStored(Vllm032KVCacheEvent, tag="BlockStored"):
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


class Vllm032BlockRemoved(Vllm032KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class Vllm032AllBlocksCleared(Vllm032KVCacheEvent, tag="AllBlocksCleared"):
    pass


class Vllm032KVEventBatch(Vllm032EventBatch):
    events: list[Vllm032BlockStored | Vllm032BlockRemoved | Vllm032AllBlocksCleared]


# vLLM 0.10-0.11's array events (six BlockStored fields), for the refusal below
class OldBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[OldBlockStored]
    data_parallel_rank: int | None = None


H = 2**64 - 1  # the largest hash on the wire (unsigned 64-bit)
STORED = {"block_hashes": [H, 7], "parent_block_hash": 5, "token_ids": [1, 2, 3, 4],
          "block_size": 2, "lora_id": 3, "medium": "CPU", "lora_name": "ad",
          "extra_keys": [("ad", "salt"), None], "group_idx": 0, "session_id": "conversation-1"}


def test_kvflow_events_decode_with_vllm_032s_structs():
    """Every field of every event reaches vLLM 0.32's decoder with its value; the fields
    kvflow leaves None are vLLM's None (omitted on the wire by both)."""
    batch = KVEventBatch(ts=3.25, events=[
        BlockStored(**STORED), BlockStored([9], None, [8, 8], 2, None, "GPU", None, [None]),
        BlockRemoved([H], "CPU", group_idx=0), AllBlocksCleared()], data_parallel_rank=2)
    got = msgspec.msgpack.Decoder(Vllm032KVEventBatch).decode(msgspec.msgpack.encode(batch))
    assert got == Vllm032KVEventBatch(ts=3.25, events=[
        Vllm032BlockStored(**STORED),
        Vllm032BlockStored([9], None, [8, 8], 2, None, "GPU", None, [None]),
        Vllm032BlockRemoved([H], "CPU", group_idx=0), Vllm032AllBlocksCleared()],
        data_parallel_rank=2)


def test_vllm_032s_events_decode_with_kvflows_decoder():
    """What vLLM 0.32 sends (every field set, its extra ones included) is read by kvflow's
    decoder, value for value; the byte strings of the two encoders are identical."""
    full = {**STORED, "kv_cache_spec_kind": "full_attention",
            "kv_cache_spec_sliding_window": 128, "locality": "LOCAL", "ownership": "tier-1"}
    removed = {"block_hashes": [7], "medium": "GPU", "group_idx": 1, "locality": "REMOTE",
               "ownership": "o"}
    vllm = Vllm032KVEventBatch(ts=1.0, events=[Vllm032BlockStored(**full),
                                               Vllm032BlockRemoved(**removed),
                                               Vllm032AllBlocksCleared()], data_parallel_rank=0)
    raw = msgspec.msgpack.encode(vllm)
    ours = KVEventBatch(ts=1.0, events=[BlockStored(**full), BlockRemoved(**removed),
                                        AllBlocksCleared()], data_parallel_rank=0)
    assert decode_kv_event_batch(raw) == ours
    assert msgspec.msgpack.encode(ours) == raw


def test_the_maps_field_names_and_tags_are_vllm_032s():
    """The raw msgpack, read untyped: a batch array, each event a map of vLLM's field names
    in vLLM's order under its class-name tag ``type``."""
    raw = msgspec.msgpack.encode(KVEventBatch(ts=0.5, events=[BlockStored(**STORED)]))
    ts, events, rank = msgspec.msgpack.decode(raw)
    assert (ts, rank) == (0.5, None)  # the publisher stamps its rank (test_kv_events.py)
    assert list(events[0]) == ["type", *STORED]
    assert events[0]["type"] == "BlockStored" and events[0]["session_id"] == "conversation-1"
    assert list(Vllm032BlockStored.__struct_fields__) == list(BlockStored.__struct_fields__)
    assert list(Vllm032BlockRemoved.__struct_fields__) == list(BlockRemoved.__struct_fields__)


def test_an_array_event_decoder_of_vllm_0_11_refuses_the_maps():
    """vLLM up to PR #42892 sent (and decoded) events as arrays: such a decoder refuses
    kvflow's maps, as it refuses vLLM 0.32's (docs: which decoders match)."""
    raw = msgspec.msgpack.encode(KVEventBatch(ts=2.0, events=[BlockStored(**STORED)]))
    with pytest.raises(msgspec.ValidationError, match="Expected `array`, got `object`"):
        msgspec.msgpack.Decoder(OldBatch).decode(raw)


def test_replay_frames_are_vllm_032s(tmp_path):
    """vLLM 0.32's ROUTER answers ``[b"", topic, seq, payload]`` per batch from the asked
    sequence number, then ``[b"", b"", -1, b""]``; the payload decodes with its structs."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
                            replay_endpoint=f"ipc://{tmp_path}/replay", topic="t")
    publisher = ZmqEventPublisher(config)
    ctx = zmq.Context()
    try:
        for i in range(3):
            publisher.publish(KVEventBatch(ts=float(i), events=[AllBlocksCleared()]))
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(config.replay_endpoint)
        frames = []
        for _ in range(50):  # the batches are queued; ask until all three went out
            dealer.send_multipart((b"", (1).to_bytes(8, "big")))
            frames = []
            while True:
                assert dealer.poll(5000)
                frames.append(dealer.recv_multipart())
                if frames[-1][2] == END_OF_REPLAY:
                    break
            if len(frames) == 3:
                break
        assert frames[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert [f[:3] for f in frames[:-1]] == [[b"", b"t", (s).to_bytes(8, "big")]
                                                for s in (1, 2)]
        decoder = msgspec.msgpack.Decoder(Vllm032KVEventBatch)
        assert [decoder.decode(f[3]) for f in frames[:-1]] == [
            Vllm032KVEventBatch(float(s), [Vllm032AllBlocksCleared()], 0) for s in (1, 2)]
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
