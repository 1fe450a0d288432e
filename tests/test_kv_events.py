"""KV cache events (vLLM's ``kv_events_config``), received by a ZeroMQ SUB socket here.

Oracles, by hand: a prompt's tokens are the HF tokenizer's ids sliced by ``BLOCK_SIZE``; each
full block's hash is ``hash_block_tokens`` chained over those slices (parent = the previous
block's hash), cut to its low 64 bits; the wire format is read back with msgspec's untyped
msgpack decoder (the batch a list, each event a map: vLLM 0.32's form). Eviction: the
``BlockRemoved`` hashes are exactly the stored ones that left the pool's hash table. Bad configs: ValueError naming the
field, before any model loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from transformers import AutoTokenizer

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig, KVEventsConfig
from kvflow.core.block_pool import hash_block_tokens
from kvflow.core.kv_event_publisher import (
    END_OF_REPLAY,
    ZmqEventPublisher,
    make_kv_event_publisher,
    offset_endpoint,
)
from kvflow.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_kv_event_batch,
)
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import make_adapter

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 40  # 39 usable blocks: 156 tokens
SHARED = "the quick brown fox jumps over a lazy dog while kvflow pages keys"
PROMPTS = [SHARED + " and values through blocks of tokens;",
           SHARED + " prefix caching reuses them, chunked prefill splits long"]
LONG = " ".join(["preemption recomputes what it evicted"] * 8)
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)  # KV of the prompt only


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("llama")


def make_llm(tiny, tmp_path, **events) -> LLM:
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub",
           "replay_endpoint": f"ipc://{tmp_path}/replay", **events}
    return LLM(model=tiny.path, dtype="float32", block_size=BLOCK_SIZE,
               num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=True, kv_events_config=cfg)


class Subscriber:
    """A SUB socket on the engine's endpoint; ``drain`` returns ``(seq, raw payload)``."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        time.sleep(0.3)  # PUB/SUB: messages sent before the subscription lands are dropped

    def drain(self, topic: bytes = b"") -> list[tuple[int, bytes]]:
        out = []
        while self.sock.poll(1000):
            frames = self.sock.recv_multipart()
            assert len(frames) == 3 and frames[0] == topic and len(frames[1]) == 8
            out.append((int.from_bytes(frames[1], "big"), frames[2]))
        return out


def chain(token_ids: list[int]) -> list[tuple[int, int | None, list[int]]]:
    """(hash, parent hash, tokens) of each full block, 64-bit, computed by hand."""
    out, parent = [], None
    for i in range(len(token_ids) // BLOCK_SIZE):
        block = token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        h = hash_block_tokens(parent, tuple(block))
        out.append((h & (2**64 - 1), None if parent is None else parent & (2**64 - 1), block))
        parent = h
    return out


def events_of(messages: list[tuple[int, bytes]]) -> list:
    return [e for _, payload in messages for e in decode_kv_event_batch(payload).events]


def stored_blocks(events: list) -> dict[int, tuple[int | None, list[int]]]:
    """Each stored hash -> (its parent, its tokens); checks that every event is a chain."""
    out: dict[int, tuple[int | None, list[int]]] = {}
    for e in events:
        if not isinstance(e, BlockStored):
            continue
        assert e.block_size == BLOCK_SIZE and e.medium == "CPU" and e.lora_id is None
        assert len(e.token_ids) == BLOCK_SIZE * len(e.block_hashes)
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            assert h not in out, "a block stored twice"
            out[h] = (parent, e.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            parent = h
    return out


def test_stored_blocks_are_the_prompts_chains_and_evictions_are_removed(tiny, tmp_path,
                                                                         assert_no_leaks):
    tok = AutoTokenizer.from_pretrained(tiny.path)
    llm = make_llm(tiny, tmp_path)
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, f"ipc://{tmp_path}/pub")
        outs = llm.generate(PROMPTS, ONE_TOKEN, use_tqdm=False)  # both in one step
        ids = [tok(p).input_ids for p in PROMPTS]
        assert [o.prompt_token_ids for o in outs] == ids
        messages = sub.drain()
        assert [seq for seq, _ in messages] == list(range(len(messages)))
        stored = stored_blocks(events_of(messages))
        expected = {h: (parent, block) for p in ids for h, parent, block in chain(p)}
        shared = sum(1 for a, b in zip(*(chain(p) for p in ids)) if a == b)
        assert shared >= 2  # the prompts share whole blocks, stored once
        assert stored == expected
        pool = llm.engine.core.kv_cache_manager.pool
        assert {h & (2**64 - 1) for h in pool._cached} == set(expected)

        # a long prompt evicts least recently freed blocks: exactly those are removed
        (out,) = llm.generate([LONG], ONE_TOKEN, use_tqdm=False)
        events = events_of(sub.drain())
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert all(e.medium == "CPU" for e in events if isinstance(e, BlockRemoved))
        stored.update(stored_blocks(events))
        assert set(stored_blocks(events)) == {h for h, _, _ in chain(out.prompt_token_ids)}
        in_pool = {h & (2**64 - 1) for h in pool._cached}
        assert removed and len(removed) == len(set(removed))
        assert set(removed) == set(stored) - in_pool
        assert_no_leaks(llm)

        # reset: every block is free, so the cache empties: AllBlocksCleared
        assert llm.reset_prefix_cache() is True
        events = events_of(sub.drain())
        assert [type(e) for e in events] == [AllBlocksCleared]
        assert not pool._cached
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)


def test_wire_format_and_replay_of_missed_batches(tiny, tmp_path):
    """Raw msgpack in vLLM's field order; the replay socket resends what a late subscriber
    missed, byte for byte, then the end marker."""
    tok = AutoTokenizer.from_pretrained(tiny.path)
    llm = make_llm(tiny, tmp_path, topic="kv")
    ctx = zmq.Context()
    try:
        llm.generate(PROMPTS[:1], ONE_TOKEN, use_tqdm=False)  # nobody listens yet
        time.sleep(0.3)
        sub = Subscriber(ctx, f"ipc://{tmp_path}/pub", b"kv")
        llm.generate(PROMPTS[1:], ONE_TOKEN, use_tqdm=False)
        live = sub.drain(b"kv")
        assert live and live[0][0] > 0
        dealer = ctx.socket(zmq.DEALER)  # many replies to one request: not a REQ socket
        dealer.connect(f"ipc://{tmp_path}/replay")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:  # vLLM 0.32's replies: [b"", topic, seq, payload], end [b"", b"", -1, b""]
            assert dealer.poll(5000)
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == b"kv"
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert replayed[-len(live):] == live  # the same bytes
        missed = replayed[:-len(live)]
        assert [s for s, _ in missed] == list(range(live[0][0]))
        # raw decode: [ts, [{"type": tag, field: value, ...}], rank], None defaults omitted
        ts, events, rank = msgspec.msgpack.decode(missed[0][1])
        assert rank == 0 and abs(ts - time.time()) < 60
        first = tok(PROMPTS[0]).input_ids
        blocks = chain(first)
        assert events == [{"type": "BlockStored", "block_hashes": [h for h, _, _ in blocks],
                           "parent_block_hash": None,
                           "token_ids": first[:len(blocks) * BLOCK_SIZE],
                           "block_size": BLOCK_SIZE, "lora_id": None, "medium": "CPU",
                           "lora_name": None, "extra_keys": [None] * len(blocks),
                           "group_idx": 0}]
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)


def test_reload_weights_clears_the_blocks(tiny, tmp_path):
    """``reload_weights`` forgets the prefix cache (its K/V were the old weights'): one
    ``AllBlocksCleared`` at once (else a router sends prompts here for blocks no longer
    served), and the same prompt is stored again, same hashes."""
    llm = make_llm(tiny, tmp_path)
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, f"ipc://{tmp_path}/pub")
        llm.generate(PROMPTS[:1], ONE_TOKEN, use_tqdm=False)
        stored = stored_blocks(events_of(sub.drain()))
        assert stored
        assert llm.collective_rpc("reload_weights") == [None]
        assert [type(e) for e in events_of(sub.drain())] == [AllBlocksCleared]
        llm.generate(PROMPTS[:1], ONE_TOKEN, use_tqdm=False)
        assert stored_blocks(events_of(sub.drain())) == stored
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)


def test_reload_weights_clears_the_blocks_a_running_request_holds(tiny, tmp_path):
    """A request running across ``reload_weights`` held its prompt's published blocks, which
    stayed indexed (and announced: no event went out) and served the old weights' K/V once
    it ended: the reload is one ``AllBlocksCleared``, the request's blocks filled after it
    are never stored, and its freed blocks are never removed (they were cleared)."""
    tok = AutoTokenizer.from_pretrained(tiny.path)
    llm = make_llm(tiny, tmp_path)
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, f"ipc://{tmp_path}/pub")
        engine = llm.engine
        engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True))
        engine.step()  # the prompt's blocks computed, held by the running request
        ids = tok(PROMPTS[0]).input_ids
        assert set(stored_blocks(events_of(sub.drain()))) == {h for h, _, _ in chain(ids)}
        assert llm.collective_rpc("reload_weights") == [None]
        assert [type(e) for e in events_of(sub.drain())] == [AllBlocksCleared]
        while engine.has_unfinished_requests():  # fills more blocks, then frees them all
            engine.step()
        assert events_of(sub.drain()) == []
        assert not llm.engine.core.kv_cache_manager.pool._cached
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)


def test_an_unloaded_adapters_blocks_are_removed(tiny, tmp_path):
    """``remove_lora``: every block stored under the adapter goes (``BlockRemoved``), those
    a request still running with it holds included, and nothing more of that request is
    stored; the base model's blocks stay. Before, they stayed announced and indexed, and a
    folder rewritten in place hit them."""
    folder = make_adapter(tiny.path, str(tmp_path / "adapter"), 1, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj"])
    lora = LoRARequest("a", 3, folder)
    llm = LLM(model=tiny.path, dtype="float32", block_size=BLOCK_SIZE,
              num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=True, enable_lora=True,
              max_lora_rank=4, kv_events_config={"enable_kv_cache_events": True,
                                                 "endpoint": f"ipc://{tmp_path}/pub"})
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, f"ipc://{tmp_path}/pub")
        llm.generate(PROMPTS[:1], ONE_TOKEN, use_tqdm=False)  # the base model's blocks
        llm.generate(PROMPTS[:1], ONE_TOKEN, lora_request=lora, use_tqdm=False)
        engine = llm.engine
        engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True), lora_request=lora)
        engine.step()  # held by the running request
        stored = [e for e in events_of(sub.drain()) if isinstance(e, BlockStored)]
        base = {h for e in stored if e.lora_id is None for h in e.block_hashes}
        adapter = {h for e in stored if e.lora_id == 3 for h in e.block_hashes}
        assert base and adapter and not base & adapter

        assert llm.engine.core.remove_lora(3)
        events = events_of(sub.drain())
        assert all(isinstance(e, BlockRemoved) for e in events)
        assert {h for e in events for h in e.block_hashes} == adapter
        while engine.has_unfinished_requests():  # fills more blocks: none stored
            engine.step()
        assert events_of(sub.drain()) == []
        pool = llm.engine.core.kv_cache_manager.pool
        assert {h & (2**64 - 1) for h in pool._cached} == base
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)


def test_off_by_default_creates_no_events(tiny):
    llm = LLM(model=tiny.path, dtype="float32", block_size=BLOCK_SIZE,
              num_kv_blocks=NUM_KV_BLOCKS)
    llm.generate(PROMPTS, ONE_TOKEN, use_tqdm=False)
    core = llm.engine.core
    assert core.kv_event_publisher is None and core.kv_cache_manager.pool.kv_events is None
    assert len(core.kv_cache_manager.pool._cached) > 0  # blocks were cached, silently


def test_null_publisher_records_and_drops(tiny):
    llm = LLM(model=tiny.path, dtype="float32", block_size=BLOCK_SIZE,
              num_kv_blocks=NUM_KV_BLOCKS,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
    llm.generate(PROMPTS[:1], ONE_TOKEN, use_tqdm=False)
    pool = llm.engine.core.kv_cache_manager.pool
    assert pool.kv_events == []  # drained after the step
    assert pool._published == set(pool._cached)


@pytest.mark.parametrize(("value", "field"), [
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
    ({"enable_kv_cache_events": True, "endpoint": "localhost:5557"}, "endpoint"),
    ({"enable_kv_cache_events": True, "endpoint": "tcp://*:99999"}, "endpoint"),
    ({"enable_kv_cache_events": True, "replay_endpoint": "http://x:1"}, "replay_endpoint"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps"),
    ({"enable_kv_cache_events": True, "hwm": -1}, "hwm"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
    ({"enable_kv_cache_events": True, "endpont": "tcp://*:1"}, "endpont"),
    ('{"enable_kv_cache_events": true,', "kv_events_config is not valid JSON"),
    ("[1]", "kv_events_config must be a JSON object"),
])
def test_bad_config_is_refused_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(model="x", kv_events_config=value)


def test_cli_flag_and_defaults():
    from kvflow.entrypoints.cli import build_parser

    flag = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6001", "topic": "t"}'
    args = build_parser().parse_args(["serve", "--kv-events-config", flag])
    kc = EngineConfig.from_cli_args(args).kv_events_config
    assert (kc.publisher, kc.endpoint, kc.topic, kc.replay_endpoint) == \
        ("zmq", "tcp://*:6001", "t", None)
    assert (kc.buffer_steps, kc.hwm, kc.max_queue_size) == (10_000, 100_000, 100_000)
    assert KVEventsConfig().publisher == "null"  # vLLM: zmq only once events are on
    default = build_parser().parse_args(["serve"])
    assert EngineConfig.from_cli_args(default).kv_events_config is None


def test_endpoint_in_use_and_data_parallel_offsets(tmp_path):
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    try:
        for field, cfg in (("endpoint", {"endpoint": f"tcp://*:{port}"}),
                           ("replay_endpoint", {"endpoint": f"ipc://{tmp_path}/a",
                                                "replay_endpoint": f"tcp://*:{port}"})):
            with pytest.raises(ValueError, match=f"{field}=.*cannot (bind|connect)"):
                ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, **cfg))
    finally:
        ctx.destroy(linger=0)
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://kv", 3) == "inproc://kv_dp3"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"


EXIT_WITHOUT_SHUTDOWN = """
import sys
from kvflow.config import KVEventsConfig
from kvflow.core.kv_event_publisher import ZmqEventPublisher
from kvflow.core.kv_events import EventBatch
publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=sys.argv[1]))
print("bound", flush=True)
sys.stdin.readline()  # the subscriber is connected
for i in range(500):
    publisher.publish(EventBatch(ts=float(i), events=[]))
"""


def test_a_process_exiting_without_shutdown_sends_what_is_queued(tmp_path):
    """A process that ends without shutting its publisher down (an ``LLM`` script's last
    steps, no ``del llm``) still sends every batch it published: the exit waits for the
    publisher thread. Was: the interpreter ended the thread and the never-closed socket,
    and the subscriber got none of the 500."""
    endpoint = f"ipc://{tmp_path}/pub"
    child = subprocess.Popen([sys.executable, "-c", EXIT_WITHOUT_SHUTDOWN, endpoint],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        assert child.stdout.readline() == "bound\n"
        sub = Subscriber(ctx, endpoint)
        child.stdin.write("go\n")
        child.stdin.close()
        seqs = [seq for seq, _ in sub.drain()]
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        ctx.destroy(linger=0)
    assert seqs == list(range(500))


def test_prefix_caching_off_is_refused(tiny):
    with pytest.raises(ValueError, match="enable_kv_cache_events=true needs prefix caching"):
        LLM(model=tiny.path, dtype="float32", block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=False,
            kv_events_config={"enable_kv_cache_events": True})


def test_batch_round_trip_types():
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored([1, 2], None, [5] * 8, 4, 7, "GPU", "ad", [("ad", "salt"), ("ad",)],
                    group_idx=0, session_id="s"),
        BlockRemoved([2], "GPU"), AllBlocksCleared()], data_parallel_rank=1)
    raw = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(raw) == [1.5, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [5] * 8, "block_size": 4, "lora_id": 7, "medium": "GPU",
         "lora_name": "ad", "extra_keys": [["ad", "salt"], ["ad"]], "group_idx": 0,
         "session_id": "s"},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
        {"type": "AllBlocksCleared"}], 1]
    assert decode_kv_event_batch(raw) == batch  # extra keys typed back as tuples


def test_a_replicas_publisher_binds_its_endpoint_and_stamps_its_rank(tmp_path):
    """What each data-parallel replica's engine core builds (``make_kv_event_publisher`` with
    its ``data_parallel_rank``): replica 1's publisher binds the endpoint with ``_dp1`` (ipc)
    and stamps rank 1 on the batches that carry none, leaving a rank a batch carries. The
    two-replica engine run is in scripts/test_distributed_slow.sh (below); this case, the
    offsets above and the one-replica engine cases keep its code paths in the default run."""
    base = f"ipc://{tmp_path}/pub"
    publisher = make_kv_event_publisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=base), data_parallel_rank=1)
    ctx = zmq.Context()
    try:
        assert publisher.endpoint == base + "_dp1"
        sub = Subscriber(ctx, base + "_dp1")
        stored = BlockStored([7, 8], None, [5] * 8, BLOCK_SIZE, None, "CPU", None)
        publisher.publish(KVEventBatch(ts=1.0, events=[stored]))
        publisher.publish(KVEventBatch(ts=2.0, events=[AllBlocksCleared()],
                                       data_parallel_rank=3))
        batches = [decode_kv_event_batch(p) for _, p in sub.drain()]
        assert [(b.ts, b.data_parallel_rank) for b in batches] == [(1.0, 1), (2.0, 3)]
        assert batches[0].events == [stored]
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


@pytest.mark.distributed_slow
@pytest.mark.skipif(os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") != "1",
                    reason="slow: run scripts/test_distributed_slow.sh")
def test_data_parallel_replicas_publish_on_their_own_endpoints(tiny, tmp_path):
    """Two replicas: replica r binds the endpoint with ``_dp{r}`` (ipc) and stamps rank r.
    Two prompts with no common first block go to replica 0 then 1 (no prefix affinity; least
    depth), so each replica stores exactly its prompt's chain. In
    scripts/test_distributed_slow.sh (two engine-core processes: ~6 s on 2 quiet cores); the
    default run keeps the publisher of replica 1 (above) and data-parallel routing
    (tests/e2e/test_data_parallel.py)."""
    prompts = [PROMPTS[0], "prefix caching reuses them, chunked prefill splits long prompts"]
    tok = AutoTokenizer.from_pretrained(tiny.path)
    base = f"ipc://{tmp_path}/pub"
    llm = LLM(model=tiny.path, dtype="float32", block_size=BLOCK_SIZE,
              num_kv_blocks=NUM_KV_BLOCKS, data_parallel_size=2,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": base})
    ctx = zmq.Context()
    try:
        subs = [Subscriber(ctx, base), Subscriber(ctx, base + "_dp1")]
        llm.generate(prompts, ONE_TOKEN, use_tqdm=False)
        for rank, (sub, prompt) in enumerate(zip(subs, prompts)):
            batches = [decode_kv_event_batch(p) for _, p in sub.drain()]
            assert batches and all(b.data_parallel_rank == rank for b in batches)
            stored = stored_blocks([e for b in batches for e in b.events])
            assert stored == {h: (parent, block)
                              for h, parent, block in chain(tok(prompt).input_ids)}
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)
