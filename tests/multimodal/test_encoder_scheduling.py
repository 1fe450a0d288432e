"""The scheduler's encoder budget and encoder-cache mirror (core/encoder_cache_manager.py),
with a real Scheduler over a fake KV config. Oracle: hand-computed chunk boundaries, encode
lists and cache contents."""

from __future__ import annotations

from kvflow.config import SchedulerConfig
from kvflow.core.encoder_cache_manager import EncoderCacheManager
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.request import Request
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sampling_params import SamplingParams
from kvflow.sched_output import SchedulerOutput
from tests.core.fake_kv import fake_kv_cache_config

IMG = 7  # placeholder token id


def feature(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, offset, length, b"", (0, 0), (1, 2, 2))


def request(rid: str, layout: list[tuple[str, int]], max_tokens: int = 2) -> Request:
    """A prompt from (kind, count) runs: ("t", n) text tokens, (identifier, n) an image."""
    tokens, features = [], []
    for kind, n in layout:
        if kind != "t":
            features.append(feature(kind, len(tokens), n))
        tokens.extend([IMG if kind != "t" else 3] * n)
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=max_tokens),
                   mm_features=features or None)


def scheduler(budget: int, encoder_budget: int, cache_size: int = 1000,
              num_blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(fake_kv_cache_config(num_blocks, 4), enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, 512)
    s.encoder = EncoderCacheManager(encoder_budget, cache_size)
    return s


def finish_step(s: Scheduler, out) -> None:
    """Feed back a sampled token for every request that caught up."""
    done = [rid for rid in out.num_scheduled_tokens
            if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens]
    s.update_from_output(out, ModelRunnerOutput(done, [[5] for _ in done], {}, {}))


def test_chunk_is_cut_before_an_image_over_the_budget():
    s = scheduler(budget=100, encoder_budget=20)
    s.add_request(request("a", [("t", 4), ("x", 16), ("t", 2), ("y", 16), ("t", 3)]))
    out = s.schedule()
    # x (16) fits the 20-token budget, y (16) does not: the chunk stops at y's offset 22
    assert out.num_scheduled_tokens == {"a": 22}
    assert out.scheduled_encoder_inputs == {"a": [0]}
    finish_step(s, out)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 19} and out.scheduled_encoder_inputs == {"a": [1]}


def test_an_image_larger_than_the_budget_runs_alone():
    s = scheduler(budget=100, encoder_budget=8)
    s.add_request(request("a", [("t", 2), ("x", 16), ("t", 2)]))
    s.add_request(request("b", [("y", 4), ("t", 2)]))
    out = s.schedule()
    # x alone exceeds the budget but is the step's first image; b's y must wait
    assert out.scheduled_encoder_inputs == {"a": [0]}
    assert out.num_scheduled_tokens == {"a": 20}
    finish_step(s, out)
    out = s.schedule()
    assert out.scheduled_encoder_inputs == {"b": [0]}


def test_shared_image_encoded_once_and_cached_for_reuse():
    s = scheduler(budget=100, encoder_budget=50)
    s.add_request(request("a", [("t", 1), ("x", 8), ("t", 1)]))
    s.add_request(request("b", [("t", 2), ("x", 8), ("t", 1)]))
    out = s.schedule()
    assert out.scheduled_encoder_inputs == {"a": [0]}  # b reuses the same step's encode
    enc = s.encoder
    assert (enc.num_encoded, enc.num_queries, enc.num_hits) == (1, 2, 1)
    while s.has_unfinished_requests():
        finish_step(s, out)
        out = s.schedule()
    assert "x" in enc.cached and not enc.pins  # unpinned, kept for reuse
    s.add_request(request("c", [("x", 8), ("t", 1)]))
    out = s.schedule()
    assert out.scheduled_encoder_inputs == {} and enc.num_hits == 2


def test_eviction_over_the_cache_size_is_sent_with_the_next_step():
    s = scheduler(budget=100, encoder_budget=50, cache_size=10)
    s.add_request(request("a", [("x", 8), ("t", 1)], max_tokens=1))
    out = s.schedule()
    finish_step(s, out)  # a finishes: x unpinned (8 <= 10 tokens kept)
    s.add_request(request("b", [("y", 8), ("t", 1)], max_tokens=1))
    out = s.schedule()
    # y's chunk completes it in this step: unpinned, 16 > 10 tokens: x (oldest) evicted,
    # but the drop goes with the next step
    assert out.free_encoder_mm_hashes == [] and set(s.encoder.cached) == {"y"}
    finish_step(s, out)
    assert s.schedule().free_encoder_mm_hashes == ["x"]


def test_preempted_request_reencodes_an_evicted_image():
    s = scheduler(budget=100, encoder_budget=50, cache_size=1)
    s.add_request(request("a", [("t", 1), ("x", 8), ("t", 1)], max_tokens=5))
    out = s.schedule()
    assert out.scheduled_encoder_inputs == {"a": [0]}
    finish_step(s, out)
    s._preempt(s.running.pop(), SchedulerOutput())  # as when the KV pool runs dry
    assert "x" not in s.encoder.cached  # unpinned, over the 1-token cache: evicted
    out = s.schedule()
    assert out.free_encoder_mm_hashes == ["x"]  # dropped before...
    assert out.scheduled_encoder_inputs == {"a": [0]}  # ...it is encoded again


def test_running_decodes_keep_their_token_every_step_while_images_are_encoded():
    """A decoding request gets its token in every step while a newcomer's two images are
    encoded one per step (each fills the 8-token encoder budget)."""
    s = scheduler(budget=100, encoder_budget=8)
    s.add_request(request("d", [("t", 3)], max_tokens=10))
    out = s.schedule()
    finish_step(s, out)  # d is decoding now
    s.add_request(request("a", [("t", 1), ("x", 8), ("t", 1), ("y", 8), ("t", 1)]))
    steps = []
    for _ in range(3):
        out = s.schedule()
        steps.append((dict(out.num_scheduled_tokens), dict(out.scheduled_encoder_inputs)))
        finish_step(s, out)
    assert steps == [({"d": 1, "a": 10}, {"a": [0]}),  # cut before y
                     ({"d": 1, "a": 9}, {"a": [1]}),
                     ({"d": 1, "a": 1}, {})]  # a's first decode



def test_image_evicted_between_plan_and_commit_is_kept_for_the_chunk():
    """Priority policy, small KV pool, 1-token encoder cache. b (low priority) has encoded x
    and pins it (x comes again later in b); a (high priority, so ahead of b in the running
    order) reaches x: the plan finds a hit. Making room for a's chunk preempts b, which
    unpins x and evicts it. Committing a's chunk must keep x (the runners still hold it
    this step: the drop is cancelled): it scheduled a chunk over rows the runners dropped
    next step, and the scheduler raised KeyError when a released x."""
    kv = KVCacheManager(fake_kv_cache_config(11, 4), enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32, policy="priority"), kv, 512)
    s.encoder = EncoderCacheManager(8, 1)
    b = request("b", [("x", 4), ("t", 1), ("y", 8), ("t", 1), ("z", 8), ("t", 1), ("x", 4),
                      ("t", 1)], max_tokens=3)
    b.priority = 5
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 5}  # x encoded, cut before y (encoder budget)
    a = request("a", [("t", 25), ("x", 4), ("t", 1)], max_tokens=3)
    s.add_request(a)
    finish_step(s, out)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 9, "a": 23}  # b cut before z; a before x
    finish_step(s, out)
    out = s.schedule()  # a reaches x (a hit), needs room: b preempted, x evicted
    assert out.num_scheduled_tokens == {"a": 7} and out.preempted_ids == ["b"]
    assert out.scheduled_encoder_inputs == {} and out.free_encoder_mm_hashes == ["y"]
    while s.has_unfinished_requests():
        finish_step(s, out)
        out = s.schedule()
    assert not s.encoder.pins and s.encoder.num_cached_tokens <= 4
