"""Sleep mode (vLLM's LLM.sleep / wake_up / collective_rpc("reload_weights")) on the tiny Llama:
greedy output after a wake-up equals the output before the sleep and transformers' greedy
decoding; the KV tensors (and, at level 2, the weights) are really let go while asleep;
requests are refused while asleep and a sleep is refused while requests run."""

from __future__ import annotations

import gc
import os
import platform
import sys
import threading
import weakref

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.platforms import cpu_memory

# prompts of whole blocks (block_size 4): a prefix cache that survived the sleep would hit
PROMPTS = [[5, 9, 23, 41, 7, 77, 120, 3, 64, 200, 11, 12],
           [5, 9, 23, 41, 7, 77, 120, 3, 90, 31],
           [150, 2, 88, 17, 240, 33]]
MAX_TOKENS = 8
NUM_BLOCKS = 64


def _engine(path: str, **kwargs) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=NUM_BLOCKS,
               block_size=4, enable_sleep_mode=True, **kwargs)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params,
                                                                use_tqdm=False)]


def _hf_greedy(tiny) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            seq = tiny.hf_model.generate(torch.tensor([ids]), do_sample=False,
                                         max_new_tokens=MAX_TOKENS, eos_token_id=None,
                                         pad_token_id=0)
            out.append(seq[0, len(ids):].tolist())
    return out


def _runner(llm: LLM):
    return llm.engine.core.executor.runner


def _kv_bytes(llm: LLM) -> int:
    return sum(llm.collective_rpc("kv_cache_bytes"))


@pytest.fixture(scope="module")
def refusing_engine(tiny_llama):
    """One sleep-mode engine for the refused-call cases (each leaves it awake and as it was,
    which the cases check), and transformers' greedy tokens: an engine per case cost ~2 s."""
    llm = _engine(tiny_llama.path)
    yield llm, _hf_greedy(tiny_llama)
    llm.shutdown()


def test_level_1_frees_the_kv_cache_and_wakes_to_the_same_greedy_output(
        tiny_llama, assert_no_leaks):
    llm = _engine(tiny_llama.path)
    expected = _hf_greedy(tiny_llama)
    assert _greedy(llm) == expected  # fills the prefix cache too
    runner = _runner(llm)
    shapes = llm.collective_rpc("kv_cache_shapes")
    kv_bytes = _kv_bytes(llm)
    assert kv_bytes == sum(c.numel() * c.element_size() for c in runner.kv_caches) > 0
    had_graphs = runner.graph_runner is not None
    assert had_graphs == (native_cpu_kernels() is not None)  # CPU step graphs: remade below
    old_kv = [weakref.ref(c) for c in runner.kv_caches]
    weight = weakref.ref(runner.model.model.layers[0].mlp.down_proj.weight)
    assert not llm.is_sleeping()

    llm.sleep(level=1)
    gc.collect()
    assert llm.is_sleeping()
    assert _kv_bytes(llm) == 0 and runner.kv_caches == []
    assert all(ref() is None for ref in old_kv), "a KV tensor is still referenced"
    assert weight() is not None  # level 1 on a CPU device keeps the weights
    with pytest.raises(ValueError, match="asleep.*wake_up"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_leaks(llm)

    llm.wake_up()
    assert not llm.is_sleeping()
    assert llm.collective_rpc("kv_cache_shapes") == shapes  # as many blocks as before
    assert _kv_bytes(llm) == kv_bytes
    assert (runner.graph_runner is not None) == had_graphs
    assert llm.engine.core.kv_cache_manager.pool.num_usable_blocks == NUM_BLOCKS - 1
    assert _greedy(llm) == expected
    assert_no_leaks(llm)


def test_level_2_drops_the_weights_until_reload_weights(tiny_llama, assert_no_leaks):
    llm = _engine(tiny_llama.path)
    expected = _hf_greedy(tiny_llama)
    assert _greedy(llm) == expected
    runner = _runner(llm)
    weight = weakref.ref(runner.model.model.layers[0].mlp.down_proj.weight)
    weight_bytes = llm.engine.core.weight_bytes

    llm.sleep(level=2)
    gc.collect()
    assert weight() is None, "the dropped weights are still referenced"
    assert runner.model is None and _kv_bytes(llm) == 0
    with pytest.raises(ValueError, match="reload_weights"):  # asleep weights: wake first
        llm.collective_rpc("reload_weights")

    llm.wake_up()
    assert not llm.is_sleeping()
    with pytest.raises(ValueError, match="reload_weights"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.collective_rpc("reload_weights") == [None]
    assert llm.engine.core.weight_bytes == weight_bytes
    assert (runner.graph_runner is not None) == (native_cpu_kernels() is not None)
    assert _greedy(llm) == expected
    assert_no_leaks(llm)


def test_weights_then_kv_cache_woken_separately(tiny_llama):
    """The RLHF order: wake the weights (reload / update them), then the KV cache."""
    llm = _engine(tiny_llama.path)
    expected = _greedy(llm)
    llm.sleep(level=2)
    assert llm.wake_up(tags=["weights"]) is False  # vLLM's return: not fully awake yet
    assert llm.is_sleeping() and _kv_bytes(llm) == 0
    llm.collective_rpc("reload_weights")  # no KV tensor to rebind yet
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.wake_up(tags=["kv_cache"]) is True
    assert not llm.is_sleeping() and _kv_bytes(llm) > 0
    assert _greedy(llm) == expected


def test_sleep_with_a_request_in_flight_is_refused(tiny_llama, assert_no_leaks):
    llm = _engine(tiny_llama.path)
    expected = _greedy(llm)
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match=r"1 request\(s\) in flight"):
        llm.sleep()
    assert not llm.is_sleeping() and _kv_bytes(llm) > 0
    while engine.has_unfinished_requests():  # it finishes normally
        engine.step()
    llm.sleep()
    llm.wake_up()
    assert _greedy(llm) == expected
    assert_no_leaks(llm)


def test_double_sleep_and_wake_while_awake_are_no_ops(tiny_llama, caplog):
    llm = _engine(tiny_llama.path)
    expected = _greedy(llm)
    assert llm.wake_up() is True  # awake: nothing to do (was None: vLLM returns a bool)
    assert not llm.is_sleeping() and _kv_bytes(llm) > 0
    llm.sleep(1)
    with caplog.at_level("WARNING", logger="kvflow"):
        llm.sleep(2)  # asleep already: stays at level 1 (vLLM's behaviour), weights kept
    assert "asleep already" in caplog.text
    assert _runner(llm).model is not None
    llm.wake_up()
    llm.wake_up()
    assert _greedy(llm) == expected


REFUSED = [
    (lambda llm: llm.sleep(level=3), "sleep level=3"),
    (lambda llm: llm.sleep(level=0), "sleep level=0"),
    (lambda llm: llm.wake_up(tags=["weights", "kv"]), r"unknown \['kv'\]"),
    (lambda llm: llm.wake_up(tags="weights"), "non-empty list"),
    (lambda llm: llm.collective_rpc("no_such_method"), "not a Worker method"),
    (lambda llm: llm.collective_rpc("_init_device"), "not a Worker method"),
    (lambda llm: llm.collective_rpc("kv_cache_bytes", timeout=5.0), "timeout"),
    (lambda llm: llm.collective_rpc("kv_cache_bytes", kwargs={"x": 1}), "unexpected keyword"),
    # args that are not the objects the method reads (an AttributeError in the worker: it
    # was raised as such offline, and over HTTP it ended the engine core: a 503 for good)
    (lambda llm: llm.collective_rpc("determine_available_memory", args=("x",)),
     "determine_available_memory: AttributeError"),
]


def test_bad_arguments_are_refused(refusing_engine):
    """Each ``REFUSED`` call raises its ValueError asleep, then awake. One sleep serves them
    all (they were one case each: a sleep's gc.collect took ~0.7 s on the whole suite's
    heap)."""
    llm, _ = refusing_engine
    for state, change in (("asleep", llm.sleep), ("awake", llm.wake_up)):
        change()
        for call, match in REFUSED:
            with pytest.raises(ValueError, match=match):
                call(llm)
                pytest.fail(f"{state}: no ValueError matching {match!r}")


@pytest.mark.parametrize(("method", "args"), [
    ("sleep", (1,)), ("wake_up", ()), ("execute_model", (None,)), ("shutdown", ()),
    ("initialize_kv_cache", (None,)), ("add_lora", (None,)), ("run_method", ("sleep",)),
    ("time_draft_passes", ()), ("freeze_startup_heap", ()),
])
def test_collective_rpc_refuses_what_the_engine_drives(refusing_engine, method, args):
    """A worker's sleep called behind the engine's back freed the KV cache the engine still
    scheduled on: the next step failed (IndexError) and the engine died. Refused, the
    engine is untouched: same greedy output, KV cache kept, not asleep."""
    llm, expected = refusing_engine
    kv = _kv_bytes(llm)
    with pytest.raises(ValueError, match=f"method='{method}' is driven by the engine"):
        llm.collective_rpc(method, args=args)
    assert _kv_bytes(llm) == kv > 0 and not llm.is_sleeping()
    assert _greedy(llm) == expected


def test_sleep_needs_enable_sleep_mode(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep()
    assert not llm.is_sleeping()


def test_collective_rpc_runs_a_callable_in_process(tiny_llama):
    llm = _engine(tiny_llama.path)
    assert llm.collective_rpc(lambda worker, k: worker.rank + k, args=(10,)) == [10]
    assert llm.collective_rpc("weight_bytes") == [llm.engine.core.weight_bytes]


def test_worker_processes_sleep_and_wake(tiny_llama):
    """The mp executor, two tensor-parallel ranks: the calls reach both worker processes; a
    callable is refused there."""
    llm = _engine(tiny_llama.path, distributed_executor_backend="mp", tensor_parallel_size=2)
    try:
        expected = _hf_greedy(tiny_llama)
        assert _greedy(llm) == expected
        kv_bytes = _kv_bytes(llm)
        assert all(b > 0 for b in llm.collective_rpc("kv_cache_bytes"))
        llm.sleep(level=2)
        assert llm.collective_rpc("kv_cache_bytes") == [0, 0]
        assert llm.collective_rpc("weight_bytes") == [0, 0]
        llm.wake_up()
        llm.collective_rpc("reload_weights")
        assert _kv_bytes(llm) == kv_bytes
        assert _greedy(llm) == expected
        with pytest.raises(ValueError, match="in-process executor"):
            llm.collective_rpc(lambda worker: worker.rank)
        with pytest.raises(ValueError, match="not a Worker method"):
            llm.collective_rpc("no_such_method")
        with pytest.raises(ValueError, match="kv_cache_bytes: TypeError"):
            llm.collective_rpc("kv_cache_bytes", args=(1,))  # answered by the worker
        assert _greedy(llm) == expected  # which lives on
    finally:
        llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_a_draft_model_wakes_to_the_same_output(tiny_llama, level):
    """A self-draft: its own layers and KV tensors, rebuilt and rebound at level 2."""
    spec = {"method": "draft_model", "model": tiny_llama.path, "num_speculative_tokens": 2,
            "adaptive": False, "quantization": "none"}
    llm = _engine(tiny_llama.path, speculative_config=spec)
    expected = _hf_greedy(tiny_llama)
    assert _greedy(llm) == expected
    kv_bytes = _kv_bytes(llm)
    assert len(_runner(llm).kv_caches) == 4  # two target layers, two draft layers
    drafter = weakref.ref(_runner(llm).drafter)
    llm.sleep(level=level)
    gc.collect()
    assert _kv_bytes(llm) == 0 and (drafter() is None) == (level == 2)
    llm.wake_up()
    if level == 2:
        llm.collective_rpc("reload_weights")
    assert _kv_bytes(llm) == kv_bytes and _runner(llm).drafter is not None
    assert _greedy(llm) == expected


@pytest.mark.parametrize("level", [1, 2])
def test_async_scheduling_wakes_to_the_same_output(tiny_llama, level):
    """With async scheduling a step is launched ahead: none may outlive the sleep."""
    llm = _engine(tiny_llama.path, async_scheduling=True)
    expected = _hf_greedy(tiny_llama)
    assert _greedy(llm) == expected
    llm.sleep(level=level)
    llm.wake_up()
    if level == 2:
        llm.collective_rpc("reload_weights")
    assert _greedy(llm) == expected


def test_level_2_keeps_the_lora_adapters_loaded(tiny_llama, tmp_path):
    from kvflow.lora.request import LoRARequest
    from tests.lora.adapters import MAX_TOKENS as LORA_TOKENS
    from tests.lora.adapters import make_adapter, peft_greedy

    folder = make_adapter(tiny_llama.path, str(tmp_path / "all"), 1, r=8, lora_alpha=16,
                          target_modules=["q_proj", "v_proj", "down_proj"])
    lora = LoRARequest("all", 1, folder)
    llm = _engine(tiny_llama.path, enable_lora=True, max_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=LORA_TOKENS, ignore_eos=True)
    expected = peft_greedy(tiny_llama.path, folder, PROMPTS[0])

    def run() -> list[int]:
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=lora)
        return list(out[0].outputs[0].token_ids)

    assert run() == expected
    llm.sleep(level=2)
    llm.wake_up()
    llm.sleep(level=2)  # the weights gone already: the second sleep forgot the adapters
    llm.wake_up()
    llm.collective_rpc("reload_weights")
    assert _runner(llm).lora_manager.adapters.keys() == {1}
    assert run() == expected


def test_adapters_while_the_weights_are_dropped(tiny_llama, tmp_path):
    """An adapter unloaded after a level-2 sleep came back with reload_weights (kept aside
    by the sleep) while the engine had forgotten it, so the id loaded again for another
    folder served the old adapter's weights; one loaded meanwhile was refused as if LoRA
    were off."""
    from kvflow.lora.request import LoRARequest
    from tests.lora.adapters import MAX_TOKENS as LORA_TOKENS
    from tests.lora.adapters import make_adapter, peft_greedy

    targets = ["q_proj", "v_proj", "down_proj"]
    old = make_adapter(tiny_llama.path, str(tmp_path / "old"), 1, r=8, lora_alpha=16,
                       target_modules=targets)
    new = make_adapter(tiny_llama.path, str(tmp_path / "new"), 2, r=8, lora_alpha=16,
                       target_modules=targets)
    llm = _engine(tiny_llama.path, enable_lora=True, max_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=LORA_TOKENS, ignore_eos=True)

    def run(lora: LoRARequest) -> list[int]:
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=lora)
        return list(out[0].outputs[0].token_ids)

    assert run(LoRARequest("old", 1, old)) == peft_greedy(tiny_llama.path, old, PROMPTS[0])
    core = llm.engine.core
    llm.sleep(level=2)
    assert core.remove_lora(1) is True  # the server's /v1/unload_lora_adapter
    llm.wake_up()
    with pytest.raises(ValueError, match=r"dropped \(sleep\(level=2\)\).*reload_weights"):
        core.add_lora(LoRARequest("new", 1, new))
    llm.collective_rpc("reload_weights")
    assert _runner(llm).lora_manager.adapters.keys() == set()
    assert run(LoRARequest("new", 1, new)) == peft_greedy(tiny_llama.path, new, PROMPTS[0])


def test_level_1_after_dropped_weights_offloads_nothing(tiny_llama):
    """sleep(level=2), wake_up() without reload_weights, then sleep(level=1): on an
    accelerator the offload walked the dropped model (AttributeError: 'NoneType' object has
    no attribute 'modules', the engine dead). The runner's device reads as CUDA for that
    sleep, so the CPU run takes the accelerator's branch."""
    llm = _engine(tiny_llama.path)
    expected = _greedy(llm)
    runner = _runner(llm)
    llm.sleep(level=2)
    llm.wake_up()
    cpu, runner.device = runner.device, torch.device("cuda")
    try:
        llm.sleep(level=1)
    finally:
        runner.device = cpu
    assert llm.is_sleeping() and runner.model is None
    llm.wake_up()
    with pytest.raises(ValueError, match="reload_weights"):  # still dropped
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.collective_rpc("reload_weights")
    assert _greedy(llm) == expected


@pytest.mark.parametrize(("argv", "expected"), [
    ([], False), (["--enable-sleep-mode"], True), (["--no-enable-sleep-mode"], False)])
def test_flag_parses(argv, expected):
    import argparse

    from kvflow.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(argv))
    assert config.model_config.enable_sleep_mode is expected


def test_relocated_tensors_keep_their_values_identity_and_aliasing():
    """What level 1 does on a GPU (weights to host memory and back), as CPU-to-CPU copies:
    parameters keep their identity, a tied weight stays one parameter, and a weight's view
    kept as a plain attribute (a packed or transposed copy) still aliases the weight."""
    from kvflow.worker.sleep_mode import collect_tensors, offload_weights, relocate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
    model[1].weight = model[0].weight  # tied
    model[1].register_buffer("scale", torch.tensor([2.0, 3.0]))
    model[1].weight_t = model[1].weight.t()  # a view as a plain attribute
    before = {n: t.clone() for n, t in model.state_dict().items()}
    weight, old_ptr = model[0].weight, model[0].weight.data_ptr()

    assert offload_weights([model], torch.device("cpu")) == []  # on the host already
    moved = collect_tensors([model], lambda t: True)
    assert sorted((m.kind, m.name) for m in moved) == [
        ("attr", "weight_t"), ("buffer", "scale"), ("param", "bias"), ("param", "weight")]
    for target in (torch.device("cpu"), None):  # there, then back to each one's device
        relocate(moved, target)
        assert model[0].weight is weight and model[1].weight is weight
        assert weight.data_ptr() != old_ptr
        old_ptr = weight.data_ptr()
        assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
        assert model[1].weight_t.untyped_storage().data_ptr() == \
            weight.untyped_storage().data_ptr()
        with torch.no_grad():
            weight[0, 1] += 1.0  # an in-place weight update reaches the view
        assert model[1].weight_t[1, 0] == weight[0, 1]
        with torch.no_grad():
            weight[0, 1] -= 1.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not os.path.exists("/proc/self/statm"),
                    reason="malloc_trim and /proc/self/statm: glibc on Linux")
def test_level_1_hands_the_kv_memory_back_to_the_kernel(tiny_llama):
    # per-layer KV tensors of 8 MiB stay under the 32 MiB mmap threshold malloc_env raises,
    # so once it is raised they live in the heap: without malloc_trim the process keeps them after the sleep
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", block_size=16,
              num_kv_blocks=2048, enable_sleep_mode=True)
    llm.sleep(level=1)  # the KV tensors the wake-up allocates come from the heap malloc_env set:
    llm.wake_up()       # (start-up's came before it, from mmap, and would be unmapped anyway)
    kv_bytes = _kv_bytes(llm)
    per_tensor = [c.numel() * c.element_size() for c in _runner(llm).kv_caches]
    assert max(per_tensor) < 32 << 20 and kv_bytes >= 16 << 20
    _greedy(llm)  # touch every page the engine uses
    for cache in _runner(llm).kv_caches:
        cache.fill_(1.0)  # every KV page resident, so freeing it shows in the RSS
    del cache
    gc.collect()
    before = _rss_bytes()
    llm.sleep(level=1)
    dropped = before - _rss_bytes()
    assert dropped >= 0.9 * kv_bytes, (dropped, kv_bytes)
    llm.wake_up()
    assert _greedy(llm) == _hf_greedy(tiny_llama)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the KV prefault thread: Linux")
def test_sleep_returns_once_the_prefault_thread_lets_go_of_the_kv_cache(tiny_llama, monkeypatch):
    """The KV prefault thread (``platforms/cpu_memory.py``) holds a KV tensor while it backs a
    chunk of it, and runs at nice 19: on busy cores (two pytest-xdist workers) it held one
    across a sleep, which returned with the KV memory still mapped (the RSS test above
    failed). Here its chunk stays open until the thread is told to stop: the sleep must stop
    it and wait, so the tensors are gone when it returns."""
    if not cpu_memory.populate(torch.zeros(1)):
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14): no prefault thread")
    entered, real = threading.Event(), cpu_memory.populate

    def held_open(t: torch.Tensor) -> bool:
        thread = threading.current_thread()
        if thread.name == "kvflow-kv-prefault":
            entered.set()
            thread.stop.wait(120)
        return real(t)

    monkeypatch.setattr(cpu_memory, "populate", held_open)
    try:  # KV planes of 4 MiB: the thread has more than the first 2 MiB page of each to back
        llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", block_size=16,
                  num_kv_blocks=2048, enable_sleep_mode=True)
        assert entered.wait(120), "the prefault thread never started a chunk"
        old_kv = [weakref.ref(c) for c in _runner(llm).kv_caches]
        assert old_kv
        llm.sleep(level=1)
        assert [ref() is None for ref in old_kv] == [True] * len(old_kv)
        llm.wake_up()
        assert _greedy(llm) == _hf_greedy(tiny_llama)
    finally:  # the old behaviour leaves the thread waiting: let it go
        for thread in threading.enumerate():
            if thread.name == "kvflow-kv-prefault":
                thread.stop.set()
