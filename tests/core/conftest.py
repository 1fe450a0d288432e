"""Helpers for the scheduler / KV-cache tests: a fake KV config, no model.

Everything a test needs comes through fixtures (``make_request``, ``make_pool``, ``make_kv``,
``make_scheduler``, ``make_driver``). Every pool they build is checked for leaks after the test:
remaining scheduler requests are aborted, then every block's ref count must be 0,
``check_invariants`` must pass and every usable block must be free.

``FakeDriver`` plays the model runner. Like a real runner it only gets each step's changes
(``kvflow/sched_output.py``): it keeps its own mirror of every request's tokens, block tables and
computed count, built from those messages alone, and checks the mirror against the scheduler's
own state every step (so a diff the scheduler forgets to send fails here). It also keeps its own
copy of every block's token slots (a simulated KV cache): each step it first writes every
scheduled token into its slot (as every attention layer does), then checks that each scheduled
request reads back exactly its own token history through its block table, and "samples" a
deterministic function of what it read. A wrong prefix hit, a block reused while still in use,
or a lost/duplicated token therefore shows up as a wrong read or as output that differs from an
oracle run.

With speculative decoding the driver plays a greedy target: a request's scheduled draft tokens
are written to the fake KV after its tokens, read back, and accepted while each equals what
``default_sample`` (or the script) gives after the drafts before it; the first mismatch is
replaced by that token, and full acceptance adds the next one (the bonus token). The output
must therefore equal the oracle's, however many drafts were right.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.kv_cache_interface import SlidingWindowSpec
from kvflow.request import Request, RequestStatus
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sampling_params import SamplingParams
from kvflow.sched_output import SchedulerOutput
from tests.core.fake_kv import fake_kv_cache_config

BLOCK_SIZE = 4
EOS = 1
VOCAB = 1000
FIRST_SAMPLED_ID = 100  # default samples lie in [100, 100 + VOCAB): never EOS


def default_sample(history: list[int]) -> int:
    """Deterministic stand-in for a model: a polynomial hash of the token history.

    It depends only on the tokens (not on batching, chunking or block ids), so two runs of the
    same request must produce the same tokens whatever the scheduler does.
    """
    h = 7
    for t in history:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return FIRST_SAMPLED_ID + h % VOCAB


def expected_output(prompt: list[int], num_tokens: int) -> list[int]:
    """The ``num_tokens`` tokens ``default_sample`` generates for ``prompt`` (an oracle)."""
    history = list(prompt)
    for _ in range(num_tokens):
        history.append(default_sample(history))
    return history[len(prompt):]


@dataclass
class StepRecord:
    """What one engine step did: tokens scheduled per request, samples, preemptions."""

    num_scheduled: dict[str, int]
    num_computed_before: dict[str, int]
    do_sample: dict[str, bool]
    sampled: dict[str, int]
    preempted: list[str]
    finished_ids: set[str]
    outputs: list[EngineCoreOutput]

    @property
    def total(self) -> int:
        return sum(self.num_scheduled.values())


@dataclass
class Result:
    """Final state of one request after a driven run."""

    output_token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int = 0


@dataclass
class Mirror:
    """The driver's copy of one request, built from the scheduler's messages only."""

    prompt: list[int]
    tokens: list[int]
    block_ids: list[list[int]]
    num_computed: int = 0


@dataclass
class Scheduled:
    """One request's share of a step, as the driver reconstructs it from the diffs."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]
    do_sample: bool
    draft_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class FakeDriver:
    """Plays the model runner for a Scheduler and checks the KV cache it is handed.

    Args:
        scheduler: the scheduler to drive.
        script: request id -> tokens to emit, indexed by output position; positions past the
            script (and unscripted requests) use ``default_sample``.
    """

    scheduler: Scheduler
    script: dict[str, list[int]] = field(default_factory=dict)
    history: dict[str, list[int]] = field(default_factory=dict)
    prompt_len: dict[str, int] = field(default_factory=dict)
    results: dict[str, Result] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    kv_mem: dict[int, list[int | None]] = field(default_factory=dict)
    mirror: dict[str, Mirror] = field(default_factory=dict)
    last_scheduled: list[Scheduled] = field(default_factory=list)
    prepared: dict[int, list[Scheduled]] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return self.scheduler.kv.block_size

    def add(self, request: Request) -> None:
        """Add a request to the scheduler and start tracking its token history."""
        self.history[request.request_id] = list(request.all_token_ids)
        self.prompt_len[request.request_id] = request.num_prompt_tokens
        self.results[request.request_id] = Result([], None, None)
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests through the scheduler and record them as aborted."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            if rid in self.results and self.results[rid].finish_reason is None:
                self.results[rid].finish_reason = "abort"

    def step(self) -> StepRecord:
        """One schedule -> (fake) execute -> update round, with the KV checks described above."""
        sched_out = self.scheduler.schedule()
        sampled = self.execute(sched_out)
        scheduled = self.last_scheduled
        outputs = self.scheduler.update_from_output(sched_out, sampled)
        for out in outputs:
            self.history[out.request_id].extend(out.new_token_ids)
            res = self.results[out.request_id]
            res.output_token_ids.extend(out.new_token_ids)
            res.finish_reason, res.stop_reason = out.finish_reason, out.stop_reason
            res.num_cached_tokens = out.num_cached_tokens
        self.check_ref_counts()
        record = StepRecord(
            num_scheduled={s.request_id: s.num_scheduled_tokens for s in scheduled},
            num_computed_before={s.request_id: s.num_computed_tokens for s in scheduled},
            do_sample={s.request_id: s.do_sample for s in scheduled},
            sampled=dict(zip(sampled.req_ids, (t[0] for t in sampled.sampled_token_ids))),
            preempted=list(sched_out.preempted_ids),
            finished_ids=set(sched_out.finished_ids),
            outputs=outputs)
        self.steps.append(record)
        return record

    def apply_diffs(self, sched_out: SchedulerOutput) -> list[Scheduled]:
        """Update the mirror from the step's message, check it against the scheduler's own
        state, and return each scheduled request's share of the step."""
        for rid in sched_out.finished_ids:
            self.mirror.pop(rid, None)
        for rid in sched_out.preempted_ids:  # a runner drops the row and generated tokens
            m = self.mirror[rid]
            m.tokens, m.block_ids = list(m.prompt), []
        for rid, num_blocks in sched_out.truncated_block_tables.items():  # rejected drafts
            if rid in self.mirror:
                self.mirror[rid].block_ids = [t[:num_blocks] for t in self.mirror[rid].block_ids]
        for new in sched_out.scheduled_new_reqs:
            self.mirror[new.req_id] = Mirror(list(new.prompt_token_ids),
                                             list(new.prompt_token_ids),
                                             [list(ids) for ids in new.block_ids],
                                             new.num_computed_tokens)
        cached = sched_out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            m = self.mirror[rid]
            if rid in cached.resumed_req_ids:
                m.tokens = m.prompt + list(cached.new_token_ids[rid])
                m.block_ids = [list(ids) for ids in cached.new_block_ids[rid]]
            else:
                for table, ids in zip(m.block_ids, cached.new_block_ids.get(rid, ())):
                    table.extend(ids)
                start = cached.num_computed_tokens[i]
                for j, token in enumerate(cached.new_token_ids.get(rid, ())):
                    if start + j < len(m.tokens):
                        assert m.tokens[start + j] == token, rid
                    else:
                        m.tokens.append(token)
            m.num_computed = cached.num_computed_tokens[i]
        assert sched_out.total_num_scheduled_tokens == \
            sum(sched_out.num_scheduled_tokens.values())
        drafts = sched_out.scheduled_spec_decode_tokens
        return [self._scheduled(rid, n, drafts.get(rid, []))
                for rid, n in sched_out.num_scheduled_tokens.items()]

    def _scheduled(self, rid: str, num_new: int, draft_ids: list[int]) -> Scheduled:
        m = self.mirror[rid]
        tables, start = self._nulled(m), m.num_computed
        request = self.scheduler.requests.get(rid)  # None: aborted after schedule()
        if request is not None:  # the mirror may hold tokens not folded in yet (async)
            known = request.all_token_ids
            assert m.tokens[:len(known)] == known, f"{rid}: mirror tokens differ"
            assert len(m.tokens) - len(known) <= request.num_output_placeholders, rid
            assert tables == self.scheduler.kv.get_block_ids(rid), f"{rid}: mirror blocks differ"
            assert start + num_new == request.num_computed_tokens, rid
        if draft_ids:  # drafts are the last scheduled tokens and follow all known ones
            assert start + num_new == len(m.tokens) + len(draft_ids), rid
        return Scheduled(rid, (m.tokens + draft_ids)[start:start + num_new], start, tables,
                         start + num_new >= len(m.tokens), list(draft_ids))

    def _nulled(self, m: Mirror) -> tuple[list[int], ...]:
        """The mirror's tables with the blocks before a sliding window nulled (as a runner
        does from the spec)."""
        out = []
        for g, table in enumerate(m.block_ids):
            spec = self.scheduler.kv.kv_cache_config.kv_cache_groups[g].kv_cache_spec
            first = spec.first_needed_block(m.num_computed) \
                if isinstance(spec, SlidingWindowSpec) else 0
            out.append([0] * min(first, len(table)) + table[first:])
        return tuple(out)

    def prepare(self, sched_out: SchedulerOutput) -> list[Scheduled]:
        """Apply a step's diffs as soon as it is scheduled (a runner receives the steps in
        order; with several steps in flight they are executed later) and check them."""
        scheduled = self.apply_diffs(sched_out)
        self._check_block_tables(scheduled)
        self.prepared[id(sched_out)] = scheduled
        return scheduled

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's diffs (unless ``prepare`` did), write all scheduled tokens into
        the fake KV, then read back and sample."""
        if id(sched_out) not in self.prepared:
            self.prepare(sched_out)
        scheduled = self.prepared.pop(id(sched_out))
        self.last_scheduled = scheduled
        bs = self.block_size
        holders = self._block_holders()
        for s in scheduled:  # every layer stores the step's new K/V first ...
            history = self.mirror[s.request_id].tokens + s.draft_ids  # + unfolded samples
            start = s.num_computed_tokens
            assert s.token_ids == history[start:start + len(s.token_ids)], s.request_id
            for pos in range(start, start + len(s.token_ids)):
                block_id = s.block_ids[0][pos // bs]
                assert block_id != 0, "the null block must never be written"
                for rid in holders.get(block_id, ()):  # sharers must agree on the slot
                    other = self.mirror[rid].tokens if rid in self.mirror else self.history[rid]
                    assert pos >= len(other) or other[pos] == history[pos], \
                        f"{s.request_id} writes {history[pos]} at {pos}: clobbers {rid}"
                self.kv_mem.setdefault(block_id, [None] * bs)[pos % bs] = history[pos]
        out = ModelRunnerOutput()
        for s in scheduled:  # ... then reads it back through the block table
            end = s.num_computed_tokens + s.num_scheduled_tokens
            seen = [self.kv_mem.get(s.block_ids[0][p // bs], [None] * bs)[p % bs]
                    for p in range(end)]
            truth = (self.mirror[s.request_id].tokens + s.draft_ids)[:end]
            assert seen == truth, f"{s.request_id} reads wrong KV: {seen} != {truth}"
            if s.do_sample:
                tokens = self._verify(s.request_id, seen, s.draft_ids)
                self.mirror[s.request_id].tokens.extend(tokens)  # a runner keeps its samples
                out.req_ids.append(s.request_id)
                out.sampled_token_ids.append(tokens)
        return out

    def _verify(self, request_id: str, seen: list[int], draft_ids: list[int]) -> list[int]:
        """A greedy target's tokens after ``seen`` (which ends with ``draft_ids``): the drafts
        while each is what the target gives, then the target's own token."""
        base = seen[:len(seen) - len(draft_ids)]
        tokens = []
        for i in range(len(draft_ids) + 1):
            token = self._sample(request_id, base + draft_ids[:i], offset=i)
            tokens.append(token)
            if i == len(draft_ids) or token != draft_ids[i]:
                return tokens
        return tokens

    def _sample(self, request_id: str, seen: list[int], offset: int = 0) -> int:
        """The scripted token for this output position (``offset`` tokens past the history),
        else ``default_sample(seen)``."""
        num_out = len(self.mirror[request_id].tokens) - self.prompt_len[request_id] + offset
        script = self.script.get(request_id, [])
        return script[num_out] if num_out < len(script) else default_sample(seen)

    def _block_holders(self) -> dict[int, list[str]]:
        """Block id -> ids of the running requests whose block table holds it."""
        holders: dict[int, list[str]] = {}
        for req in self.scheduler.running:
            for b in self.scheduler.kv.get_block_ids(req.request_id)[0]:
                holders.setdefault(b, []).append(req.request_id)
        return holders

    def _check_block_tables(self, scheduled: list[Scheduled]) -> None:
        """Each block table covers exactly the tokens computed through this step, without
        duplicates or the null block."""
        bs = self.block_size
        for s in scheduled:
            end = s.num_computed_tokens + s.num_scheduled_tokens
            (table,) = s.block_ids  # one KV-cache group
            assert len(table) == -(-end // bs), (s.request_id, table, end)
            assert len(set(table)) == len(table) and 0 not in table

    def check_ref_counts(self) -> None:
        """Every block's ref count equals the number of running requests holding it."""
        kv = self.scheduler.kv
        holders = self._block_holders()
        for req in self.scheduler.waiting:
            assert kv.get_block_ids(req.request_id) == ([],), f"waiting {req} holds blocks"
        for block in kv.pool.blocks[1:]:
            assert block.ref_cnt == len(holders.get(block.block_id, ())), block
        kv.pool.check_invariants()

    def run(self, max_steps: int = 10_000) -> dict[str, Result]:
        """Step until every request has finished; fail on a step that schedules nothing."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return self.results
            record = self.step()
            assert record.total > 0 or record.preempted, "no progress: scheduler is stuck"
        raise AssertionError(f"not finished after {max_steps} steps")


def _assert_pool_clean(pool: BlockPool) -> None:
    """No reference left: invariants hold, every ref count is 0, every usable block free."""
    pool.check_invariants()
    leaked = [b for b in pool.blocks[1:] if b.ref_cnt != 0]
    assert not leaked, f"leaked blocks: {leaked}"
    assert pool.num_free_blocks == pool.num_usable_blocks


@pytest.fixture
def _leak_registry():
    """Collects pools/managers/schedulers built by the factories; checks them after the test."""
    registry: dict[str, list] = {"pools": [], "schedulers": []}
    yield registry
    for sched in registry["schedulers"]:
        sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
        assert not sched.running and not sched.waiting and not sched.requests
    for pool in registry["pools"]:
        _assert_pool_clean(pool)


@pytest.fixture
def make_request():
    """Factory: ``make_request(rid, prompt, **kw)`` -> Request with increasing arrival times.

    Keywords: ``max_tokens`` (default 16), ``eos`` (default ``EOS``), ``arrival``, ``priority``,
    ``parent_id``, ``sample_index``, ``cache_salt``; anything else goes to SamplingParams.
    """
    clock = itertools.count()

    def factory(rid: str, prompt: list[int], *, max_tokens: int = 16, eos: int | None = EOS,
                arrival: float | None = None, priority: int = 0, parent_id: str | None = None,
                sample_index: int = 0, cache_salt: str | None = None, **params) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, **params)
        when = float(next(clock)) if arrival is None else arrival
        return Request(rid, prompt, sp, eos_token_id=eos, arrival_time=when, priority=priority,
                       parent_id=parent_id, sample_index=sample_index, cache_salt=cache_salt)

    return factory


@pytest.fixture
def make_pool(_leak_registry):
    """Factory: ``make_pool(num_blocks, enable_caching=True)`` -> leak-checked BlockPool."""
    def factory(num_blocks: int, enable_caching: bool = True) -> BlockPool:
        pool = BlockPool(num_blocks, enable_caching)
        _leak_registry["pools"].append(pool)
        return pool

    return factory


@pytest.fixture
def make_kv(_leak_registry):
    """Factory: ``make_kv(num_blocks, block_size=4, enable_prefix_caching=True)``."""
    def factory(num_blocks: int, block_size: int = BLOCK_SIZE,
                enable_prefix_caching: bool = True) -> KVCacheManager:
        kv = KVCacheManager(fake_kv_cache_config(num_blocks, block_size),
                            enable_prefix_caching)
        _leak_registry["pools"].append(kv.pool)
        return kv

    return factory


@pytest.fixture
def make_scheduler(_leak_registry):
    """Factory for a Scheduler over a fake KV config (block size 4 by default).

    ``max_model_len`` defaults to the pool's capacity in tokens, as EngineCore caps it.
    """
    def factory(num_blocks: int = 1000, block_size: int = BLOCK_SIZE,
                max_num_batched_tokens: int = 4096, max_num_seqs: int = 256,
                policy: str = "fcfs", max_model_len: int | None = None,
                enable_prefix_caching: bool = True,
                async_scheduling: bool = False,
                long_prefill_token_threshold: int = 0) -> Scheduler:
        kv = KVCacheManager(fake_kv_cache_config(num_blocks, block_size),
                            enable_prefix_caching)
        cfg = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, policy=policy,
                              async_scheduling=async_scheduling,
                              long_prefill_token_threshold=long_prefill_token_threshold)
        sched = Scheduler(cfg, kv, max_model_len or (num_blocks - 1) * block_size)
        _leak_registry["pools"].append(kv.pool)
        _leak_registry["schedulers"].append(sched)
        return sched

    return factory


@pytest.fixture
def make_driver():
    """Factory: ``make_driver(scheduler, script=None)`` -> FakeDriver."""
    def factory(scheduler: Scheduler, script: dict[str, list[int]] | None = None) -> FakeDriver:
        return FakeDriver(scheduler, script or {})

    return factory


@pytest.fixture
def oracle():
    """``oracle(prompt, n)``: the first ``n`` tokens ``default_sample`` generates."""
    return expected_output
