"""vLLM 0.32's waiting reasons (``num_requests_waiting_by_reason``): a waiting request that
admission passed over for a transient constraint (no free LoRA slot, its grammar still
compiling) is ``deferred`` until it is admitted or freed, as vLLM's ``deferred_waiting`` set
keeps it; the rest of the waiting queue is ``capacity``. Hand-built scheduler runs on the fake
KV config; the gauges from the engine's stats on the server's registry."""

from __future__ import annotations

from kvflow.engine_outputs import EngineStats
from kvflow.lora.request import LoRARequest
from kvflow.metrics.server import ServerMetrics
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


class _Compiling:
    """A structured-output state whose grammar is still compiling."""

    is_ready = False


def _request(rid: str, base: int, adapter: int | None = None) -> Request:
    lora = None if adapter is None else LoRARequest(f"adapter{adapter}", adapter, "/unused")
    return Request(rid, list(range(base, base + 6)),
                   SamplingParams(max_tokens=2, ignore_eos=True), lora_request=lora)


def test_deferred_until_admitted_or_freed(make_scheduler, make_driver):
    sched = make_scheduler()
    sched.max_loras = 1  # one adapter per step
    drv = make_driver(sched)
    first, other = _request("first", 10, adapter=1), _request("other", 20, adapter=2)
    compiling, plain, late = _request("compiling", 30), _request("plain", 40), \
        _request("late", 50, adapter=2)
    compiling.structured_output = _Compiling()
    for request in (first, other, compiling, plain):
        drv.add(request)
    drv.step()
    # first and plain run; other waits for the adapter slot, compiling for its grammar
    assert {r.request_id for r in sched.running} == {"first", "plain"}
    assert (sched.num_waiting, sched.deferred) == (2, {"other", "compiling"})
    compiling.structured_output = None  # compiled: admitted next step, no longer deferred
    drv.step()
    assert "compiling" in {r.request_id for r in sched.running}
    assert sched.deferred == {"other"}
    drv.add(late)  # not yet looked at by admission: waiting for capacity, not deferred
    assert (sched.num_waiting, sched.deferred) == (2, {"other"})
    drv.abort(["other"])  # freed while deferred
    assert sched.deferred == set()
    drv.run()  # first finishes, the slot frees, late runs
    assert sched.deferred == set() and not sched.requests


def test_gauges_split_the_waiting_requests_by_reason():
    metrics = ServerMetrics("m")
    metrics.record_engine_stats(EngineStats(num_waiting=5, num_waiting_deferred=2), 1)

    def waiting(reason: str) -> float:
        return metrics.registry.get_sample_value(
            "kvflow:num_requests_waiting_by_reason",
            {"model_name": "m", "engine": "1", "reason": reason})

    assert (waiting("capacity"), waiting("deferred")) == (3, 2)
    metrics.reset_engine(1)  # a replaced core: nothing waits in it
    assert (waiting("capacity"), waiting("deferred")) == (0, 0)
