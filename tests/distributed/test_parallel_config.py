"""Parallel flags and layouts without starting workers: the config (flags generated from
ParallelConfig), the bad configurations that must fail at start-up with one line, and the
rank arithmetic (groups, pipeline layer ranges, expert placement) against hand-written
layouts."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
import torch

from kvflow import LLM
from kvflow.config import EngineConfig, ParallelConfig
from kvflow.distributed.comm import CommGroup
from kvflow.distributed.parallel_state import ParallelState, group_ranks, pp_layer_range
from kvflow.entrypoints.cli import main
from kvflow.layers.moe import expert_range


def test_flags_are_generated_with_vllm_names():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2", "--pipeline-parallel-size", "3",
                              "--enable-expert-parallel", "--distributed-executor-backend", "mp"])
    pc = EngineConfig.from_cli_args(args).parallel_config
    assert (pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.enable_expert_parallel,
            pc.distributed_executor_backend, pc.world_size) == (2, 3, True, "mp", 6)
    assert ParallelConfig().executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).executor_backend == "mp"


@pytest.mark.parametrize("kwargs, needle", [
    ({"data_parallel_size": 2, "data_parallel_rank": 2}, "outside the 2 data-parallel"),
    ({"context_parallel_size": 2, "pipeline_parallel_size": 2}, "tensor parallelism only"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be >= 1"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "use mp or ray"),
    ({"distributed_executor_backend": "slurm"}, "choose one of"),
])
def test_bad_parallel_config_is_one_value_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as err:
        ParallelConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_ray_backend_without_ray_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs Ray.*pip install 'kvflow\[ray\]'"):
        ParallelConfig(distributed_executor_backend="ray")


@pytest.mark.parametrize("kwargs, needle", [
    ({"tensor_parallel_size": 3}, "does not divide the model's num_attention_heads=4"),
    ({"pipeline_parallel_size": 3}, "pipeline_parallel_size=3 exceeds the model's 2 layers"),
    ({"tensor_parallel_size": 2, "enable_expert_parallel": True},
     "enable_expert_parallel=True, but the model has no experts"),  # was silently ignored
    ({"pipeline_parallel_size": 2, "async_scheduling": True},  # was after the workers loaded
     (r"async-scheduling needs the uni executor.*not available with the mp executor of 2 "
      r"ranks \(pipeline_parallel_size=2\) yet$")),
    # one rank, mp chosen by name: no parallelism to blame (the message named tensor,
    # pipeline or context parallelism, none of which was in use)
    ({"distributed_executor_backend": "mp", "async_scheduling": True},
     (r"async-scheduling needs the uni executor \(one rank in the engine's process\); "
      r"--distributed-executor-backend mp runs the one rank outside the engine's process: "
      r"leave it out \(or give uni\) for async scheduling$")),
])
def test_model_that_does_not_split_fails_before_any_worker_starts(
        tiny_model_factory, monkeypatch, kwargs, needle):
    def no_spawn(*args, **kw):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    with pytest.raises(ValueError, match=needle):
        LLM(model=tiny_model_factory("llama").path, **kwargs)


def test_cli_bad_tensor_parallel_size_exits_2_with_one_line(tiny_llama, capsys):
    rc = main(["generate", "--model", tiny_llama.path, "--prompt", "hi",
               "--tensor-parallel-size", "3"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "--tensor-parallel-size=3 " in err[0]


def test_kv_heads_must_divide_or_be_replicated_evenly():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_attention_heads=12, num_key_value_heads=3, num_hidden_layers=4,
                          intermediate_size=48)
    ParallelConfig(tensor_parallel_size=3).verify_with_model(cfg)  # 1 KV head per rank
    ParallelConfig(tensor_parallel_size=6).verify_with_model(cfg)  # each KV head on 2 ranks
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ParallelConfig(tensor_parallel_size=4).verify_with_model(cfg)


def test_expert_parallel_needs_the_experts_to_divide():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                          intermediate_size=64, num_experts=6, moe_intermediate_size=30)
    ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).verify_with_model(cfg)
    with pytest.raises(ValueError, match="moe_intermediate_size=30"):  # TP splits each expert
        ParallelConfig(tensor_parallel_size=4).verify_with_model(cfg)
    with pytest.raises(ValueError, match="number of experts=6"):
        ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).verify_with_model(
            cfg)


def test_deepseek_experts_are_checked_before_any_worker_starts():
    """DeepSeek names its routed experts ``n_routed_experts`` (transformers' DeepseekV3Config
    has no ``num_experts`` alias) and splits its shared experts over the TP ranks like a
    dense MLP even under expert parallelism: a count or width that does not divide is one
    line naming the field here, not a worker's "input_size 31 not divisible by tp_size 2"
    after the workers started."""
    from transformers import DeepseekV3Config

    def config(**kw):
        return DeepseekV3Config(**{"num_attention_heads": 4, "num_key_value_heads": 4,
                                   "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 2, "n_routed_experts": 8,
                                   "moe_intermediate_size": 32, "n_shared_experts": 1, **kw})

    ep = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    ep.verify_with_model(config())
    ep.verify_with_model(config(moe_intermediate_size=31, n_shared_experts=2))  # 62 splits
    with pytest.raises(ValueError, match=r"n_shared_experts x moe_intermediate_size=31 "):
        ep.verify_with_model(config(moe_intermediate_size=31))
    with pytest.raises(ValueError, match="number of experts=6"):
        ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).verify_with_model(
            config(n_routed_experts=6))
    with pytest.raises(ValueError, match="moe_intermediate_size=31$"):  # TP splits each expert
        ParallelConfig(tensor_parallel_size=2).verify_with_model(
            config(moe_intermediate_size=31, n_shared_experts=0))


def test_expert_parallel_needs_a_model_with_experts():
    """Routed experts are found under Mixtral's, Qwen-MoE's and DeepSeek's names, also in a
    multimodal model's text_config; a dense model refuses the flag instead of ignoring it."""
    from types import SimpleNamespace

    base = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "intermediate_size": 64, "moe_intermediate_size": 32}
    ep = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        ep.verify_with_model(SimpleNamespace(**base, **{name: 4}))
    ep.verify_with_model(SimpleNamespace(**base, text_config=SimpleNamespace(num_experts=4)))
    for dense in (SimpleNamespace(**base), SimpleNamespace(**base, num_experts=0)):
        with pytest.raises(ValueError, match="has no experts"):
            ep.verify_with_model(dense)
    ParallelConfig(tensor_parallel_size=2).verify_with_model(SimpleNamespace(**base))


def test_groups_follow_the_dp_pp_cp_tp_layout():
    sizes = {"dp": 1, "pp": 2, "cp": 1, "tp": 4}
    assert group_ranks(sizes, ("tp",)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group_ranks(sizes, ("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(sizes, ("dp", "cp", "tp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # EP
    sizes = {"dp": 2, "pp": 1, "cp": 1, "tp": 2}
    assert group_ranks(sizes, ("dp",)) == [[0, 2], [1, 3]]
    assert group_ranks(sizes, ("dp", "cp", "tp")) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("layers, stages, expected", [
    (24, 2, [(0, 12), (12, 24)]),
    (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),  # the first 30 % 4 stages take one more
    (2, 2, [(0, 1), (1, 2)]),
])
def test_pipeline_layer_ranges_are_contiguous_and_cover_the_model(layers, stages, expected):
    assert [pp_layer_range(layers, r, stages) for r in range(stages)] == expected
    with pytest.raises(ValueError, match="exceeds"):
        pp_layer_range(2, 0, 3)


def test_experts_are_placed_by_id():
    assert [expert_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="evenly"):
        expert_range(6, 0, 4)


def test_a_one_process_group_is_the_identity():
    state = ParallelState.single()
    x = torch.arange(6.0).reshape(2, 3)
    assert state.tp.all_reduce(x) is x and state.tp.all_gather(x) is x
    assert state.is_driver and state.tp.world_size == state.pp.world_size == 1
    with pytest.raises(ValueError, match="not a member"):
        CommGroup([0, 1], 2, object())


def test_core_process_env_shares_this_process_ray_cluster(monkeypatch):
    """An engine-core process (a data-parallel replica) joins the Ray cluster this process is
    connected to, through RAY_ADDRESS; nothing is passed without ray, with RAY_ADDRESS
    already set (inherited) or without a connected cluster."""
    import sys
    import types

    from kvflow.engine.core_client import core_process_env

    fake = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda:
                                 types.SimpleNamespace(gcs_address="10.0.0.7:6379"))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_config = EngineConfig.from_kwargs(model="x", data_parallel_size=2,
                                          distributed_executor_backend="mp")
    assert core_process_env(ray_config) == {}  # mp: no Ray
    ray_config.parallel_config.distributed_executor_backend = "ray"
    assert core_process_env(ray_config) == {"RAY_ADDRESS": "10.0.0.7:6379"}
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert core_process_env(ray_config) == {}  # the child inherits RAY_ADDRESS itself
    monkeypatch.delenv("RAY_ADDRESS")
    fake.is_initialized = lambda: False
    assert core_process_env(ray_config) == {}


@pytest.mark.parametrize(("backend", "tp", "dp_rank", "local_rank", "device"), [
    ("mp", 2, 1, 1, 3),  # replica 1 of two-rank engines: the machine's devices 2 and 3
    ("mp", 1, 1, 0, 1),  # one-rank replicas (uni executor): device d
    ("ray", 1, 1, 0, 0),  # a Ray actor sees only its own device (was: bound device 1)
    ("ray", 2, 1, 0, 0),  # (was: device 2)
])
def test_each_rank_binds_the_device_it_can_see(backend, tp, dp_rank, local_rank, device):
    """The device a worker binds (hand-worked): data-parallel replica d of W-rank engines
    takes the machine's devices d*W + local_rank under mp and uni; a Ray actor, which Ray
    gives one device (CUDA_VISIBLE_DEVICES), binds it as device 0."""
    from kvflow.worker.worker import Worker

    config = EngineConfig.from_kwargs(model="x", data_parallel_size=2, tensor_parallel_size=tp,
                                      distributed_executor_backend="mp")
    config.parallel_config.distributed_executor_backend = backend  # ray need not be installed
    config.parallel_config.data_parallel_rank = dp_rank
    bound = []
    worker = Worker.__new__(Worker)
    worker.config = config
    worker.platform = type("Recorder", (), {"set_device": lambda self, i: bound.append(i)})()
    worker._init_device(local_rank)
    assert bound == [device]


class _FakeRay:
    """What kvflow calls on the ``ray`` module to start, name and stop a local cluster."""

    def __init__(self) -> None:
        import importlib.machinery

        self.__spec__ = importlib.machinery.ModuleSpec("ray", None)  # "installed"
        self.up, self.inits, self.shutdowns = False, 0, 0
        self.cpus = 64.0

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": self.cpus, "memory": 1e10}

    def is_initialized(self) -> bool:
        return self.up

    def init(self, **kwargs) -> None:
        self.up, self.inits = True, self.inits + 1

    def shutdown(self) -> None:
        self.up, self.shutdowns = False, self.shutdowns + 1

    def get_runtime_context(self):
        import types

        return types.SimpleNamespace(gcs_address="127.0.0.1:6379")


def _ray_dp_config(dp: int = 2, backend: str = "ray") -> EngineConfig:
    config = EngineConfig.from_kwargs(model="x", data_parallel_size=dp,
                                      distributed_executor_backend="mp")
    config.parallel_config.distributed_executor_backend = backend  # ray need not be installed
    return config


def test_ray_replicas_share_one_cluster_started_by_the_front_end(monkeypatch):
    """Data-parallel replicas under the ray backend with no cluster named (RAY_ADDRESS) nor
    connected: the front end's ReplicaSet starts one local cluster, every replica's core
    process gets its address, and close() stops it (was: no address, so each replica's
    executor started a cluster of its own, and on GPUs Ray gave each replica GPU 0)."""
    import sys

    from kvflow.engine import replica_set
    from kvflow.engine.core_client import core_process_env

    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    envs = []
    monkeypatch.setattr(replica_set.CoreProcess, "start", lambda core, *a, **k: envs.append(
        core_process_env(core.config)))
    replicas = replica_set.ReplicaSet(_ray_dp_config(), start_method="spawn")
    try:
        replicas.start()
        assert envs == [{"RAY_ADDRESS": "127.0.0.1:6379"}] * 2 and fake.inits == 1
    finally:
        replicas.close()
    assert fake.shutdowns == 1 and not fake.up


@pytest.mark.parametrize(("dp", "backend", "address", "connected"), [
    (1, "ray", None, False),  # one replica: its executor starts (and stops) its own
    (2, "mp", None, False),  # no Ray at all
    (2, "ray", "10.0.0.7:6379", False),  # the replicas join RAY_ADDRESS themselves
    (2, "ray", None, True),  # this process's cluster: core_process_env names it
])
def test_no_cluster_is_started_where_one_is_named_or_not_shared(monkeypatch, dp, backend,
                                                                address, connected):
    import sys

    from kvflow.engine.core_client import start_ray_for_replicas

    fake = _FakeRay()
    fake.up = connected
    monkeypatch.setitem(sys.modules, "ray", fake)
    if address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    assert start_ray_for_replicas(_ray_dp_config(dp, backend)) is False and fake.inits == 0


def test_llm_refuses_data_parallel_rank_before_starting_anything(tiny_llama):
    """vLLM's ``data_parallel_rank`` engine argument (this process is one rank of a
    deployment balanced outside) is not built; kvflow sets the field for its own replicas.
    Given to LLM it is refused in one line (was: ignored, so the LLM ran every replica)."""
    with pytest.raises(ValueError, match=r"data_parallel_rank=1: kvflow sets each replica's"):
        LLM(model=tiny_llama.path, data_parallel_size=2, data_parallel_rank=1)


def test_an_unknown_option_never_suggests_a_field_kvflow_sets():
    """vLLM's data_parallel_backend (not built) was answered "did you mean
    'data_parallel_rank'?", a field kvflow sets itself and LLM refuses."""
    with pytest.raises(ValueError, match="unknown engine option 'data_parallel_backend'") as e:
        EngineConfig.from_kwargs(model="x", data_parallel_backend="ray")
    assert "data_parallel_rank" not in str(e.value)


def test_a_local_ray_cluster_too_small_is_an_error_at_once(caplog):
    """4 CPU workers (TP=4) on a local Ray cluster of 2 CPUs (the one kvflow starts on a
    2-core machine): a ValueError naming the shortfall and the fix before any placement
    group is made (was: the placement group waited 120 s, then the same shortfall). A
    cluster named in RAY_ADDRESS may grow (an autoscaler): a warning, and the placement
    waits. No Ray: its calls are faked."""
    from kvflow.executor.ray import RayExecutor
    from kvflow.executor.ray_cluster import check_cluster_fits

    executor = RayExecutor.__new__(RayExecutor)
    executor.config = EngineConfig.from_kwargs(model="x", device="cpu")
    executor.ray, executor.world_size, executor._local_cluster = _FakeRay(), 4, True
    executor.ray.cpus = 2
    with pytest.raises(ValueError, match=r"^the Ray cluster has 2 CPU in all, fewer than the "
                                         r"4 workers of \{'CPU': 1\} need; .*ray start --head "
                                         r"--num-cpus 4\) and name it in RAY_ADDRESS$"):
        executor._init_placement_group(120.0)
    with caplog.at_level("WARNING", logger="kvflow.executor.ray_cluster"):
        check_cluster_fits(executor.ray, {"CPU": 1}, 4, local=False, timeout_s=120)
    executor.ray.cpus = 4
    check_cluster_fits(executor.ray, {"CPU": 1}, 4, local=True, timeout_s=120)  # fits
    assert "has 2 CPU in all, fewer than the 4 workers" in caplog.text
    assert "waiting up to 120 s" in caplog.text


def test_data_parallel_replicas_too_many_for_the_local_ray_cluster(monkeypatch):
    """DP=2 x TP=2 under ray with no cluster named: the API process starts a local one for
    both replicas; 4 workers on its 2 CPUs is a ValueError at once and the cluster is
    stopped again (was: replica 1's engine core waited 120 s for its placement group)."""
    import sys

    from kvflow.engine.core_client import start_ray_for_replicas

    fake = _FakeRay()
    fake.cpus = 2
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = EngineConfig.from_kwargs(model="x", device="cpu", data_parallel_size=2,
                                      tensor_parallel_size=2)
    config.parallel_config.distributed_executor_backend = "ray"
    with pytest.raises(ValueError, match="has 2 CPU in all, fewer than the 4 workers"):
        start_ray_for_replicas(config)
    assert not fake.up and fake.shutdowns == 1  # stopped again
    fake.cpus = 4
    assert start_ray_for_replicas(config) is True and fake.up


def test_a_ray_cluster_that_cannot_be_joined_is_bad_input(monkeypatch):
    """RAY_ADDRESS names a cluster that refuses this process (not running, or `ray start`'s
    token authentication without RAY_AUTH_MODE=token here): a ValueError naming the address
    and the likely fixes, so ``kvflow`` prints one line and exits 2 (was: Ray's
    ConnectionError, a traceback and exit 1). No Ray: its ``init`` is faked."""
    from kvflow.executor.ray import RayExecutor

    def refuse(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.7:6379")

    executor = RayExecutor.__new__(RayExecutor)
    executor.ray = _FakeRay()
    executor.ray.init = refuse
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    with pytest.raises(ValueError, match=r"^cannot join the Ray cluster at RAY_ADDRESS="
                                         r"10\.0\.0\.7:6379: Failed to connect to Ray cluster "
                                         r"at 10\.0\.0\.7:6379 \(is it running\? .*"
                                         r"RAY_AUTH_MODE=token"):
        executor._init_ray()
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ConnectionError):  # a local cluster that fails to start: Ray's error
        executor._init_ray()
