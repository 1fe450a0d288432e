"""Cost of KV cache events: the same offline batch with events off and on, alternating rounds
on one engine (machines are noisy; compare medians). The engine starts with events on (ZeroMQ
publisher on an ipc:// socket, read by a SUB socket in another process, as a router would);
an "off" round detaches the publisher and the pool's event list, which is what an engine
started without events runs (one engine, so start-up choices such as timed kernels cannot
differ between the two modes).

Each round's prompts are new (a shared 64-word prefix, then words drawn for the round), and
the pool is small (``--num-kv-blocks``), so every round stores blocks and evicts earlier
rounds' blocks: BlockStored and BlockRemoved both flow. The host time of the engine's own
event work (recording a request's stored blocks, draining and queueing each step's batch) is
timed too: on a shared machine that figure is steadier than the tok/s ratio. Evictions'
``BlockRemoved`` records are inside the pool's eviction and not timed apart.

    .venv/bin/python benchmarks/kv_events_overhead.py --model out/smollm2-hf --rounds 4
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import tempfile
import time

import zmq

from kvflow import LLM, SamplingParams
from kvflow.core.kv_events import BlockRemoved, BlockStored, decode_kv_event_batch

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "pages",
         "of", "keys", "and", "values", "move", "through", "blocks", "of", "tokens", "and",
         "prefix", "caching", "reuses", "them"]


def prompts_for(round_index: int, num_prompts: int) -> list[str]:
    rng = random.Random(round_index)
    prefix = " ".join(WORDS[i % len(WORDS)] for i in range(64))
    return [prefix + " " + " ".join(rng.choice(WORDS) for _ in range(48))
            for _ in range(num_prompts)]


def read_events(endpoint: str, ready, stop, totals) -> None:
    """A SUB socket (its own process): counts batches, blocks stored and removed, bytes."""
    counts = {"batches": 0, "stored": 0, "removed": 0, "bytes": 0}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    ready.set()
    while not stop.is_set() or sock.poll(200):
        if not sock.poll(100):
            continue
        _, _, payload = sock.recv_multipart()
        batch = decode_kv_event_batch(payload)
        counts["batches"] += 1
        counts["bytes"] += len(payload)
        for e in batch.events:
            if isinstance(e, BlockStored):
                counts["stored"] += len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                counts["removed"] += len(e.block_hashes)
    ctx.destroy(linger=0)
    totals.update(counts)


def set_events(llm: LLM, on: bool, publisher) -> None:
    """Events on (the pool records, the publisher sends) or off (as without kv_events_config:
    no publisher, no event list). Hashes evicted while off leave the published set when events
    come back on; those indexed while off are never announced."""
    core, pool = llm.engine.core, llm.engine.core.kv_cache_manager.pool
    core.kv_event_publisher = publisher if on else None
    pool.kv_events = [] if on else None
    pool._published.intersection_update(pool._cached)


EVENT_SECONDS = [0.0]


def timed(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENT_SECONDS[0] += time.perf_counter() - start
    return wrapper


def instrument(llm: LLM) -> None:
    """Time the event work of ``llm``'s engine core (its instance methods wrapped)."""
    core = llm.engine.core
    core._publish_kv_events = timed(core._publish_kv_events)
    core.kv_cache_manager._record_stored = timed(core.kv_cache_manager._record_stored)


def run_round(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    """Generated tokens per second for one batch."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="out/smollm2-hf")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-kv-blocks", type=int, default=160)
    args = ap.parse_args()
    endpoint = f"ipc://{tempfile.mkdtemp()}/kv-events"
    llm = LLM(model=args.model, dtype="float32", block_size=16,
              num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=True,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})
    publisher = llm.engine.core.kv_event_publisher
    mp = multiprocessing.get_context("spawn")
    manager = mp.Manager()
    counts = manager.dict()
    ready, stop = mp.Event(), mp.Event()
    reader = mp.Process(target=read_events, args=(endpoint, ready, stop, counts))
    reader.start()
    ready.wait()
    time.sleep(0.3)
    instrument(llm)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    run_round(llm, prompts_for(-1, 2), params)  # warm-up
    rates: dict[str, list[float]] = {"off": [], "on": []}
    EVENT_SECONDS[0], on_seconds = 0.0, 0.0
    for r in range(args.rounds):
        order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
        for name in order:
            set_events(llm, name == "on", publisher)
            start = time.perf_counter()
            rates[name].append(run_round(llm, prompts_for(r * 2 + (name == "on"),
                                                          args.num_prompts), params))
            on_seconds += time.perf_counter() - start if name == "on" else 0.0
        print(f"round {r}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in order),
              flush=True)
    set_events(llm, True, publisher)
    stop.set()
    reader.join()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"median tok/s: off {off:.1f}, on {on:.1f}, on/off {on / off:.3f}")
    print(f"event work on the engine's thread: {EVENT_SECONDS[0] * 1e3:.1f} ms of "
          f"{on_seconds:.1f} s generating ({EVENT_SECONDS[0] / on_seconds:.2%})")
    print("events received: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    llm.shutdown()


if __name__ == "__main__":
    main()
