"""Copies of one prefix-cache block, end to end (tiny random Llama, block size 4).

A prompt of exactly 3 full blocks (12 tokens) sent again hits only its first 2 blocks (one
token is always left to compute): the second request computes its own copy of block 3, and
the pool indexes it next to the first request's (vLLM's ``BlockHashToBlockMap`` rule), as it
does any block two requests compute alike. Once the first request's copy is evicted, a third
prompt starting with those 12 tokens still hits all of them (hand-computed: 12 cached tokens)
through the copy the second request holds, and the block the second request generated after
it keeps an announced parent.

Oracles: HF transformers' greedy continuations (EOS ignored); the hit counts by hand; the KV
events replayed as a router would (every stored block's parent stored before it, and no
block's parent removed while the block is stored: no orphans); every usable block free at
the end.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BLOCK_SIZE = 4
SHARED = 12  # tokens: 3 full blocks
NUM_KV_BLOCKS = 16  # 15 usable


def hf_greedy(tiny, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy continuation of ``prompt``: ``n`` tokens, EOS ignored."""
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                     max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                     pad_token_id=0)
    return out[0, len(prompt):].tolist()


class EventReplay:
    """A router's view of the prefix cache, built from the KV events: hash -> parent hash."""

    def __init__(self) -> None:
        self.stored: dict[int, int | None] = {}

    def apply(self, events: list) -> None:
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.stored.clear()
            elif isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    assert h not in self.stored, "a block stored twice"
                    assert parent is None or parent in self.stored, "stored after a removed parent"
                    self.stored[h], parent = parent, h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert self.stored.pop(h, "gone") != "gone", "a block removed twice"
        orphans = {h for h, p in self.stored.items() if p is not None and p not in self.stored}
        assert not orphans, f"stored blocks whose parent was removed: {orphans}"


def recording_llm(tiny, monkeypatch, **kwargs) -> tuple[LLM, EventReplay]:
    """An engine with KV events on (null publisher) whose every drained batch is replayed."""
    llm = LLM(model=tiny.path, dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=True,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "null"}, **kwargs)
    kv, replay = llm.engine.core.kv_cache_manager, EventReplay()
    take = kv.take_kv_events

    def take_and_replay() -> list:
        events = take()
        replay.apply(events)
        return events

    monkeypatch.setattr(kv, "take_kv_events", take_and_replay)
    return llm, replay


def finish(engine) -> dict[str, object]:
    """Step the engine until every request finished; their final outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def test_a_recomputed_block_hits_after_the_first_copy_is_evicted(tiny_llama, monkeypatch,
                                                                   assert_no_leaks):
    gen = torch.Generator().manual_seed(44)
    shared = torch.randint(2, tiny_llama.vocab_size, (SHARED,), generator=gen).tolist()
    llm, replay = recording_llm(tiny_llama, monkeypatch, num_kv_blocks=NUM_KV_BLOCKS,
                                max_num_batched_tokens=64, max_model_len=60)
    engine, pool = llm.engine, llm.engine.core.kv_cache_manager.pool
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request({"prompt_token_ids": shared}, short, "first")
    outs = {o.request_id: o for o in engine.step()}  # 3 blocks cached, then freed
    assert outs["first"].finished
    engine.add_request({"prompt_token_ids": shared}, long, "again")
    outs.update({o.request_id: o for o in engine.step()})  # hits 2 blocks, computes the 3rd
    assert outs["again"].metrics.num_cached_tokens == 2 * BLOCK_SIZE
    for _ in range(4):  # again's 4th block (4 sampled tokens) fills: its parent is block 3
        outs.update({o.request_id: o for o in engine.step()})
    assert len(outs["again"].outputs[0].token_ids) == 5 and pool.num_free_blocks > 1
    # free: the never used blocks, then first's copy of block 3; "again" takes one of them
    # to grow into this step, a prompt the rest: first's copy is evicted
    filler = torch.randint(2, tiny_llama.vocab_size, (4 * (pool.num_free_blocks - 1),),
                           generator=gen).tolist()
    engine.add_request({"prompt_token_ids": filler}, short, "filler")
    outs.update({o.request_id: o for o in engine.step()})
    assert outs["filler"].finished and not outs["again"].finished
    engine.add_request({"prompt_token_ids": shared + [9]}, long, "third")
    outs.update(finish(engine))
    assert outs["third"].metrics.num_cached_tokens == SHARED  # again's copy serves block 3
    for rid, prompt, n in [("first", shared, 1), ("again", shared, 12),
                           ("third", shared + [9], 12), ("filler", filler, 1)]:
        assert outs[rid].outputs[0].token_ids == hf_greedy(tiny_llama, prompt, n), rid
    assert llm.engine.core.scheduler.num_preemptions == 0 and replay.stored
    assert_no_leaks(llm)


@pytest.mark.parametrize("num_kv_blocks", [10, 14])
def test_kv_events_have_no_orphans_under_heavy_preemption(tiny_llama, monkeypatch,
                                                           assert_no_leaks, num_kv_blocks):
    """Twelve prompts, each sent twice, over three 8-token prefixes (some whole blocks, so a
    repeat recomputes the last one; the twins decode the same blocks in the same steps), in a
    pool that holds about two of them: copies, preemptions and evictions interleave; every
    event batch is replayed and checked (``EventReplay``), and the outputs are HF's greedy
    ones."""
    gen = torch.Generator().manual_seed(num_kv_blocks)
    prefixes = [torch.randint(2, tiny_llama.vocab_size, (8,), generator=gen).tolist()
                for _ in range(3)]
    prompts = [prefixes[i % 3] + torch.randint(2, tiny_llama.vocab_size, (i % 4,),
                                               generator=gen).tolist() for i in range(12)]
    llm, replay = recording_llm(tiny_llama, monkeypatch, num_kv_blocks=num_kv_blocks,
                                max_num_batched_tokens=32, max_model_len=32)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    twice = [p for p in prompts for _ in range(2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in twice], params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert replay.stored  # events were replayed
    expected = {tuple(p): hf_greedy(tiny_llama, p, 10) for p in prompts}
    for prompt, out in zip(twice, outs):
        assert out.outputs[0].token_ids == expected[tuple(prompt)]
    assert_no_leaks(llm)
