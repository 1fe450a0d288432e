"""The scheduler with a KV connector (SharedStorageConnector's scheduler half), no model: the
fake runner (``tests/core/conftest.py``) checks every step's block tables and reads back
each request's tokens through its fake KV cache, and here also plays the connector's worker
half over a fake store (key -> the block's tokens; the folder holds an empty file per key,
which is all the scheduler half looks at). A wrong load (wrong block, wrong key, a block
loaded after the step that reads it) is a wrong read; a wrong save is a wrong read when a
later engine loads it. Outputs equal the no-connector oracle, ``num_cached_tokens`` is the
hand count ``(L - 1) // 4 * 4``, the steps compute only the tails, and every block is free
at the end (the fixtures' leak check)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from kvflow.config import KVTransferConfig
from kvflow.distributed.kv_transfer.shared_storage import SharedStorageScheduler
from kvflow.distributed.kv_transfer.storage_paths import block_path
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sched_output import SchedulerOutput
from tests.core.conftest import BLOCK_SIZE, FakeDriver


@dataclass
class StorageDriver(FakeDriver):
    """FakeDriver plus the worker half: loads before the step, saves after it."""

    store: dict[str, list[int | None]] = field(default_factory=dict)
    root: str = ""

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        meta = sched_out.kv_connector_metadata
        for load in meta.loads:
            for block_id, key in zip(load.block_ids, load.keys):
                self.kv_mem[block_id] = list(self.store[key])
        out = super().execute(sched_out)
        for save in meta.saves:
            for block_id, key in zip(save.block_ids, save.keys):
                assert key not in self.store, "a block saved twice"
                self.store[key] = list(self.kv_mem[block_id])
                open(block_path(self.root, key), "wb").close()
        return out


def _engine(make_scheduler, folder: str, role: str, store: dict, **kwargs) -> StorageDriver:
    sched = make_scheduler(**kwargs)
    sched.connector = SharedStorageScheduler(KVTransferConfig(
        "SharedStorageConnector", role, {"shared_storage_path": folder}), BLOCK_SIZE, "auto")
    return StorageDriver(sched, {}, store=store, root=folder)


def _prompts() -> list[list[int]]:
    """Prompts of 30, 13, 16, 3 and 26 tokens; the last shares its first 5 blocks with the
    first."""
    base = [list(range(10 + 40 * i, 10 + 40 * i + n)) for i, n in enumerate((30, 13, 16, 3))]
    return [*base, base[0][:20] + list(range(500, 506))]


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("consumer_blocks", [1000, 14])  # 14: preemptions
def test_consumer_loads_what_a_chunked_producer_saved(make_scheduler, make_request, oracle,
                                                      tmp_path, prefix_caching,
                                                      consumer_blocks):
    prompts, store = _prompts(), {}
    producer = _engine(make_scheduler, str(tmp_path), "kv_producer", store,
                       max_num_batched_tokens=7)  # blocks complete mid-chunk
    for i, p in enumerate(prompts):
        producer.add(make_request(f"p{i}", p, max_tokens=1))
    producer.run()
    assert len(store) == 7 + 3 + 4 + 0 + 6 - 5 == producer.scheduler.connector.num_saved_blocks
    assert all(None not in tokens for tokens in store.values())

    consumer = _engine(make_scheduler, str(tmp_path), "kv_consumer", store,
                       num_blocks=consumer_blocks, enable_prefix_caching=prefix_caching,
                       max_num_batched_tokens=8)
    for i, p in enumerate(prompts):
        consumer.add(make_request(f"c{i}", p, max_tokens=6))
    results = consumer.run()
    for i, p in enumerate(prompts):
        assert results[f"c{i}"].output_token_ids == oracle(p, 6)
        assert results[f"c{i}"].num_cached_tokens == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
    preemptions = consumer.scheduler.num_preemptions
    assert (preemptions > 0) == (consumer_blocks == 14)
    if preemptions == 0:  # only the tails and the decodes were computed
        assert sum(r.total for r in consumer.steps) == \
            sum(len(p) % BLOCK_SIZE or BLOCK_SIZE for p in prompts) + 5 * len(prompts)
    assert consumer.scheduler.connector.num_saved_blocks == 0


def test_local_hits_come_first(make_scheduler, make_request, oracle, tmp_path):
    """kv_both with prefix caching: a prompt's blocks still in the local prefix cache are
    not loaded; only those past them are (here: none, the same engine computed them)."""
    store: dict = {}
    engine = _engine(make_scheduler, str(tmp_path), "kv_both", store)
    prompt = list(range(50, 71))  # 21 tokens: 5 blocks stored, 5 reusable
    engine.add(make_request("a", prompt, max_tokens=2))
    engine.run()
    assert len(store) == 5
    engine.add(make_request("b", prompt, max_tokens=2))
    engine.run()
    assert engine.results["b"].num_cached_tokens == 20
    assert engine.results["b"].output_token_ids == oracle(prompt, 2)
    assert engine.scheduler.connector.num_loaded_blocks == 0
    assert engine.scheduler.kv.num_hits == 20
    assert os.path.exists(block_path(str(tmp_path), next(iter(store))))


def test_a_key_that_failed_to_load_is_saved_over_once_and_again_if_dropped(tmp_path,
                                                                            make_request):
    """kv_both: every stored block of a 13-token prompt has a file; block 1's load failed.
    Once the recompute has computed the prompt, the step's save names block 1 only (0 and 2
    are stored), to be written over its file; a dropped save plans it again, a save that
    ran does not (another request of the prompt saves nothing). A consumer never saves."""
    folder = str(tmp_path)

    def connector(role: str) -> SharedStorageScheduler:
        return SharedStorageScheduler(KVTransferConfig(
            "SharedStorageConnector", role, {"shared_storage_path": folder}), BLOCK_SIZE, "auto")

    both = connector("kv_both")
    prompt = list(range(10, 23))
    first = make_request("a", prompt)
    keys = both._state(first).keys
    for key in keys:
        open(block_path(folder, key), "wb").close()
    assert both.load_failed(first, keys[1]) == 1
    first.num_computed_tokens = len(prompt)
    tables = {"a": [5, 6, 7, 8], "b": [9, 10, 11, 12]}
    (save,) = both.build_connector_meta([first], tables.get).saves
    assert (save.block_ids, save.keys, save.rewrite) == ([6], [keys[1]], [keys[1]])
    both.saves_dropped(first)  # e.g. it read a block another load left unfilled
    (save,) = both.build_connector_meta([first], tables.get).saves
    assert (save.block_ids, save.rewrite) == ([6], [keys[1]])
    second = make_request("b", prompt)
    second.num_computed_tokens = len(prompt)
    assert both.build_connector_meta([second], tables.get).saves == []
    assert both.get_num_new_matched_tokens(second, 0) == BLOCK_SIZE  # still not offered here
    consumer = connector("kv_consumer")
    consumer.load_failed(second, keys[1])
    assert consumer.build_connector_meta([second], tables.get).saves == []
