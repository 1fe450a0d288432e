"""KV cache events with ``prefix_caching_hash_algo="sha256"``, received over ZeroMQ: a router
recomputes every stored block's hash from the prompt alone.

Oracle, by hand: vLLM's recipe, SHA-256 of ``pickle.dumps((parent, tokens, extra_keys),
protocol=5)`` chained from SHA-256 of the pickled seed ``"vllm-none-hash"`` (PYTHONHASHSEED
unset), with ``extra_keys`` the adapter ``("lora", name, path)`` on every block and
``("cache_salt", salt)`` on the first; an event's hash is the digest's last 8 bytes read
big-endian. The engine runs a LoRA adapter on a 13-token prompt at block size 4: 3 full blocks.
Also: an unknown algorithm is refused before any model loads, naming the choices.
"""

from __future__ import annotations

import hashlib
import pickle
import time

import pytest
import zmq

from kvflow import LLM, SamplingParams
from kvflow.core.kv_events import BlockStored, decode_kv_event_batch
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import make_adapter

PROMPT = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113]
SALT = "tenant-a"


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    return make_adapter(tiny_llama.path, str(tmp_path_factory.mktemp("adapter") / "ad"), 1,
                        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def oracle(lora_path: str) -> list[int]:
    parent = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    out = []
    for i in range(3):
        extra = (("lora", "ad", lora_path),) + ((("cache_salt", SALT),) if i == 0 else ())
        parent = hashlib.sha256(pickle.dumps(
            (parent, tuple(PROMPT[4 * i:4 * i + 4]), extra), protocol=5)).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def test_events_carry_vllms_sha256_hashes(tiny_llama, adapter, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    endpoint = f"ipc://{tmp_path}/pub"
    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=4, num_kv_blocks=40,
              enable_lora=True, max_lora_rank=4, prefix_caching_hash_algo="sha256",
              kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        time.sleep(0.3)  # PUB/SUB: messages sent before the subscription lands are dropped
        llm.generate({"prompt_token_ids": PROMPT, "cache_salt": SALT},
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("ad", 1, adapter))
        events = []
        while sub.poll(1000):
            events += decode_kv_event_batch(sub.recv_multipart()[2]).events
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert len(stored) == 1
        (e,) = stored
        assert e.block_hashes == oracle(adapter) and e.parent_block_hash is None
        assert e.token_ids == PROMPT[:12] and e.lora_id == 1 and e.lora_name == "ad"
        assert e.extra_keys == [("ad", SALT), ("ad",), ("ad",)]
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)


def test_unknown_algo_is_refused_at_start(tiny_llama):
    with pytest.raises(ValueError, match="prefix_caching_hash_algo") as info:
        LLM(model=tiny_llama.path, prefix_caching_hash_algo="sha1")
    assert "sha256_cbor" in str(info.value) and "blake2b" in str(info.value)
