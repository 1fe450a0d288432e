"""CPU step graphs (kvflow/worker/cpu_graphs.py): decode steps replay their recorded native calls.

Oracles: transformers' greedy continuation (the tokens), the same engine with
``enforce_eager=True`` (every logprob bit for bit: a replay runs the same kernels on the same
inputs), hand-built arenas and pointers for the guards, and the step counts the engine reports.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.worker import cpu_graphs
from kvflow.worker.cpu_graphs import MAX_MISMATCHES, CpuGraphRunner, same_bits
from kvflow.worker.cpu_step_record import (
    ForwardWatch,
    NotReplayable,
    Recording,
    StepProgram,
    StepRecorder,
    normalize,
    plan_program,
)

pytestmark = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")

# prompts of different lengths and budgets: the batch shrinks as requests finish, so several
# batch sizes are recorded, trusted and replayed
PROMPTS = [[5, 9, 23, 41, 7], [100, 3, 77], [8, 8, 15, 16, 23, 42, 4], [61, 2]]
MAX_TOKENS = [12, 9, 14, 6]


def _engine(path: str, dtype: str, **kwargs) -> LLM:
    return LLM(model=path, dtype=dtype, device="cpu", num_kv_blocks=64, block_size=4, **kwargs)


def _graphs(llm: LLM) -> CpuGraphRunner | None:
    return llm.engine.core.executor.runner.graph_runner


def _generate(llm: LLM) -> list:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
              for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def _count_recordings(monkeypatch) -> list[int]:
    """A list that gets one item each time a step runs under a recorder (from now on)."""
    recorded: list[int] = []

    class Counting(StepRecorder):
        def __enter__(self):
            recorded.append(1)
            return super().__enter__()
    monkeypatch.setattr(cpu_graphs, "StepRecorder", Counting)
    return recorded


def _hf_greedy(tiny, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                     eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name,dtype", [("llama", "float32"), ("llama_tied", "bfloat16")])
def test_replayed_decode_steps_match_eager_and_transformers(tiny_model_factory, name, dtype,
                                                            assert_no_leaks):
    """Untied fp32 (table looked up by the C embedding) and tied bf16 (rows read from the
    packed head): the replayed engine's tokens equal transformers' greedy ones (fp32) and its
    logprobs equal the eager engine's bit for bit. Where the CPU has no bf16 dot products
    (AVX2), a bf16 step widens its activations with a torch operator before each GEMM: every
    batch size is refused and runs eagerly, with the same results."""
    tiny = tiny_model_factory(name)
    eager = _engine(tiny.path, dtype, enforce_eager=True)
    assert _graphs(eager) is None
    # twice each: the second run reuses the trusted programs with new requests (and is
    # compared with the eager engine's second run: it hits the prefix cache, so its prompts'
    # last tokens are computed alone, which moves the last bits of their logprobs)
    expected = [_generate(eager), _generate(eager)]
    llm = _engine(tiny.path, dtype)
    got = [_generate(llm)]
    graphs = _graphs(llm)
    replayed = graphs.replayed_steps
    got.append(_generate(llm))
    assert graphs.disabled is None
    if dtype == "float32" or native_cpu_kernels().gemm_x_dtype(torch.bfloat16) == torch.bfloat16:
        assert not graphs.refused
        assert replayed > 0 and graphs.replayed_steps > replayed and len(graphs.programs) >= 2
    else:
        assert graphs.refused and graphs.replayed_steps == 0 and not graphs.programs
    assert got == expected
    if dtype == "float32":
        for prompt, n, (tokens, _) in zip(PROMPTS, MAX_TOKENS, got[0], strict=True):
            assert tokens == _hf_greedy(tiny, prompt, n)
    assert_no_leaks(llm)


def test_forward_with_a_torch_operator_is_not_replayed(tiny_model_factory, monkeypatch):
    """oneDNN GEMMs are torch operators: each batch size is refused (eager steps, same
    results), nothing is replayed."""
    tiny = tiny_model_factory("llama")
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "onednn")
    expected = _generate(_engine(tiny.path, "float32", enforce_eager=True))
    llm = _engine(tiny.path, "float32")
    assert _generate(llm) == expected
    graphs = _graphs(llm)
    assert graphs.replayed_steps == 0 and not graphs.programs
    assert {threads for _, threads in graphs.refused} == {torch.get_num_threads()}
    assert {size for size, _ in graphs.refused} >= {1, 4}


def test_a_call_the_recording_misses_turns_graphs_off(tiny_model_factory, monkeypatch):
    """SiLU-and-mul through a Python callable instead of the bound C entry point: the recorder
    does not see it, the check replay on a NaN-filled arena differs from the eager step, and the
    runner turns itself off; every result still equals the eager engine's."""
    tiny = tiny_model_factory("llama")
    expected = _generate(_engine(tiny.path, "float32", enforce_eager=True))
    llm = _engine(tiny.path, "float32")
    kernels = _graphs(llm).kernels
    entry = kernels._silu_and_mul
    monkeypatch.setattr(kernels, "_silu_and_mul", lambda *args: entry(*args))
    assert _generate(llm) == expected
    graphs = _graphs(llm)
    assert graphs.disabled == "a replay did not reproduce the eager step"
    assert graphs.replayed_steps == 0 and not graphs.programs


def test_recorder_keeps_allocations_and_notes_computing_operators():
    kernels = native_cpu_kernels()
    x = torch.randn(4, 8)
    with StepRecorder(kernels) as recorder:
        y = kernels.silu_and_mul(x)              # one C call into a fresh allocation
        view = y.view(2, 8)[0].reshape(8)         # views compute nothing
        assert recorder.watch.refused is None
        _ = x + 1                                 # a torch operator that computes
    assert [b.data_ptr() for b in recorder.watch.blocks] == [y.data_ptr()]
    assert view.data_ptr() == y.data_ptr()
    assert recorder.watch.refused == "aten.add.Tensor"
    assert [fn.__name__ for fn, _ in recorder.calls] == ["kvflow_silu_and_mul"]
    assert recorder.calls[0][1][0] == x.data_ptr() and recorder.calls[0][1][2] == y.data_ptr()
    assert isinstance(kernels._silu_and_mul, ctypes._CFuncPtr)  # restored
    gate, up = x[:, :4], x[:, 4:]
    torch.testing.assert_close(y, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_pointers_are_named_by_allocation_and_unknown_memory_is_refused():
    fn = native_cpu_kernels()._silu_and_mul  # pointers at arguments 0 (x) and 2 (out)
    blocks = [torch.empty(64, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)]
    weight, stranger = torch.zeros(16), torch.zeros(16)
    regions = [(weight.data_ptr(), weight.data_ptr() + 64)]
    calls = [(fn, (weight.data_ptr() + 4, 4, blocks[0].data_ptr() + 8, 1, 2, 0, 1)),
             (fn, (blocks[0].data_ptr(), 4, blocks[1].data_ptr(), 1, 2, 0, 1))]
    rec = normalize(calls, blocks, regions)
    assert rec.calls[0][1] == (weight.data_ptr() + 4, 4, ("block", 0, 8), 1, 2, 0, 1)
    assert rec.calls[1][1][0] == ("block", 0, 0) and rec.calls[1][1][2] == ("block", 1, 0)
    assert rec.sizes == [64, 32] and rec.uses == [(0, 1), (1, 1)]
    with pytest.raises(NotReplayable, match="kvflow_silu_and_mul"):
        normalize([(fn, (stranger.data_ptr(), 4, blocks[0].data_ptr(), 1, 2, 0, 1))],
                  blocks, regions)


def test_plan_shares_bytes_between_allocations_that_are_never_live_together():
    """Hand-built lifetimes: a [call 0], b [0, 1], c [1, end] (c holds the hidden states).
    a at 0; b live with a -> 128 (100 B rounded up to the 64 B alignment); c live with b only
    -> back at 0, where a was. 228 bytes instead of 300."""
    fn = native_cpu_kernels()._silu_and_mul
    calls = [(fn, (("block", 0, 0), 4, ("block", 1, 0), 1, 2, 0, 1)),
             (fn, (("block", 1, 0), 4, ("block", 2, 4), 1, 2, 0, 1))]
    rec = Recording(calls, [100, 100, 100], [1000, 2000, 3000], [(0, 0), (0, 1), (1, 1)])
    program = plan_program(rec, _at(torch.empty(4, 2), 3004))  # hidden states at c + 4
    assert program.size == 228
    assert [r for _, _, r in program.template] == [[(0, 0), (2, 128)], [(0, 128), (2, 4)]]
    buffer = torch.empty(program.size, dtype=torch.uint8)
    program.bind(buffer)
    base = buffer.data_ptr()
    assert program.calls[1][1][:3] == (base + 128, 4, base + 4)
    assert program.hidden_states.data_ptr() == base + 4 and program.hidden_states.shape == (4, 2)


class _at:
    """A stand-in for a tensor at ``address`` (plan_program reads its address and layout)."""

    def __init__(self, like: torch.Tensor, address: int) -> None:
        self.shape, self.dtype, self._address, self._stride = like.shape, like.dtype, address, \
            like.stride()

    def data_ptr(self) -> int:
        return self._address

    def stride(self) -> tuple[int, ...]:
        return self._stride


def test_a_step_of_one_token_prompts_does_not_refuse_its_batch_size(tiny_model_factory):
    """With SDPA forced for whole prompts, a lone 1-token prompt's prefill (one query token, no
    context) is a torch operator; it runs eagerly outside the runner, so batch 1's decode steps
    that follow are still recorded and replayed, with the eager engine's results."""
    tiny = tiny_model_factory("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(llm: LLM) -> list:
        out = llm.generate([[42]], params, use_tqdm=False)[0].outputs[0]
        return [out.token_ids, [{t: lp.logprob for t, lp in s.items()} for s in out.logprobs]]
    expected = run(_engine(tiny.path, "float32", enforce_eager=True, cpu_attention="sdpa"))
    llm = _engine(tiny.path, "float32", cpu_attention="sdpa")
    assert run(llm) == expected
    graphs = _graphs(llm)
    assert not graphs.refused and graphs.replayed_steps == 8 - 1 - 3  # an eager step, 2 recorded


def test_a_size_whose_recordings_keep_differing_is_refused(tiny_model_factory, monkeypatch):
    """Recordings that never match (as if the calls depended on the step's values): batch 4's
    5 decode steps (the shortest request's 6 tokens: one from the prefill, 5 decoded by all
    four) are a first step without a recorder, then 1 + MAX_MISMATCHES recordings, after which
    the size is refused; every result equals the eager engine's."""
    tiny = tiny_model_factory("llama")
    expected = _generate(_engine(tiny.path, "float32", enforce_eager=True))
    monkeypatch.setattr(Recording, "same_as", lambda self, other: False)
    recorded = _count_recordings(monkeypatch)
    llm = _engine(tiny.path, "float32")
    sizes: list[int] = []
    run = CpuGraphRunner._record
    monkeypatch.setattr(CpuGraphRunner, "_record",
                        lambda self, key, static: sizes.append(key[0]) or run(self, key, static))
    assert _generate(llm) == expected
    graphs = _graphs(llm)
    assert sizes.count(4) == 1 + MAX_MISMATCHES and len(recorded) == len(sizes)
    assert (4, torch.get_num_threads()) in graphs.refused
    assert graphs.replayed_steps == 0 and not graphs.recorded.get((4, torch.get_num_threads()))


def test_a_forward_watch_does_not_import_dynamo():
    """A fresh interpreter's first ForwardWatch (the first recorded step of an engine) keeps
    its allocation and names the computing operator without importing torch._dynamo (which
    TorchDispatchMode's default wrapper does at its first call: ~0.5 s of a first request)."""
    code = textwrap.dedent("""
        import sys, torch
        from kvflow.worker.cpu_step_record import ForwardWatch
        with ForwardWatch() as watch:
            x = torch.empty(3)
            y = x.view(3, 1) + 1
        print(len(watch.blocks), watch.refused, "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["1", "aten.add.Tensor", "False"]


def test_same_bits_compares_bit_patterns():
    """NaN equals the same NaN (torch.equal says no), -0.0 is not 0.0, dtypes must agree."""
    a = torch.tensor([1.0, float("nan"), -0.0], dtype=torch.bfloat16)
    assert not torch.equal(a, a.clone()) and same_bits(a, a.clone())
    assert not same_bits(a, torch.tensor([1.0, float("nan"), 0.0], dtype=torch.bfloat16))
    assert not same_bits(a, a.float())
    assert same_bits(torch.arange(3), torch.arange(3))


def test_recorders_on_two_threads_record_their_own_calls_and_restore_the_kernels():
    """Two engines share the kernels object: a call from another thread while a recorder is
    on is not recorded, a second recorder waits for the first (it would otherwise save and
    later restore the first's wrappers), and afterwards every entry point is the C function
    again. Oracle: SiLU-and-mul in torch."""
    kernels = native_cpu_kernels()
    x = torch.randn(4, 8)
    results: dict[str, torch.Tensor] = {}
    second: list[StepRecorder] = []

    def other_engine_step() -> None:
        results["other"] = kernels.silu_and_mul(x)

    def other_engine_recording() -> None:
        with StepRecorder(kernels) as recorder:
            results["second"] = kernels.silu_and_mul(x)
        second.append(recorder)

    with StepRecorder(kernels) as first:
        thread = threading.Thread(target=other_engine_step)
        thread.start()
        thread.join()
        waiting = threading.Thread(target=other_engine_recording)
        waiting.start()
        results["first"] = kernels.silu_and_mul(x)
        assert not second  # still waiting for this recorder
    waiting.join(timeout=60)
    assert len(first.calls) == 1 and first.calls[0][1][2] == results["first"].data_ptr()
    assert len(second) == 1 and len(second[0].calls) == 1
    assert isinstance(kernels._silu_and_mul, ctypes._CFuncPtr)
    reference = torch.nn.functional.silu(x[:, :4]) * x[:, 4:]
    for y in results.values():
        torch.testing.assert_close(y, reference, rtol=1e-6, atol=1e-6)


def test_a_sizes_first_step_runs_without_a_recorder(tiny_model_factory, monkeypatch):
    """One request, 8 greedy tokens: its 7 decode steps (batch 1) are one eager step without a
    recorder, two recorded steps (the second trusts the size after its check replay) and 4
    replays; the tokens equal transformers' greedy ones."""
    tiny = tiny_model_factory("llama")
    recorded = _count_recordings(monkeypatch)
    llm = _engine(tiny.path, "float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == _hf_greedy(tiny, PROMPTS[0], 8)
    graphs = _graphs(llm)
    assert len(recorded) == 2 and graphs.replayed_steps == 4
    assert list(graphs.programs) == [(1, torch.get_num_threads())]


def test_a_failing_check_replay_leaves_the_size_untrusted(tiny_model_factory, monkeypatch):
    """The check replay that would trust a size fails (its scratch could not be allocated):
    that step keeps its eager result and the size is not trusted; one request's 9 decode
    steps are then an eager step, two recordings (the failed check), two more (a good check)
    and 4 replays, with transformers' greedy tokens and the eager engine's logprobs."""
    tiny = tiny_model_factory("llama")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run(llm: LLM) -> list:
        out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
        return [list(out.token_ids), [{t: lp.logprob for t, lp in s.items()} for s in out.logprobs]]
    expected = run(_engine(tiny.path, "float32", enforce_eager=True))
    assert expected[0] == _hf_greedy(tiny, PROMPTS[0], 10)
    failures: list[int] = []
    replay = StepProgram.replay

    def fail_once(self):
        if not failures:
            failures.append(1)
            raise RuntimeError("replayed native call kvflow_gemm failed")
        return replay(self)
    monkeypatch.setattr(StepProgram, "replay", fail_once)
    llm = _engine(tiny.path, "float32")
    assert run(llm) == expected
    graphs = _graphs(llm)
    assert failures == [1] and graphs.disabled is None and graphs.replayed_steps == 4


def test_a_failing_replay_runs_the_step_eagerly(tiny_model_factory, monkeypatch):
    """A replayed call that fails (its scratch could not be allocated) does not fail the step:
    it runs eagerly, with the eager engine's results, and counts as no replay. (Prefix caching
    off: the second batch must prefill as the first did.)"""
    tiny = tiny_model_factory("llama")
    expected = _generate(_engine(tiny.path, "float32", enforce_eager=True))
    llm = _engine(tiny.path, "float32", enable_prefix_caching=False)
    assert _generate(llm) == expected
    graphs = _graphs(llm)
    replayed = graphs.replayed_steps
    assert replayed > 0 and graphs.programs

    def fail(self):
        raise RuntimeError("replayed native call kvflow_gemm failed")
    monkeypatch.setattr(StepProgram, "replay", fail)
    assert _generate(llm) == expected
    assert graphs.replayed_steps == replayed and graphs.disabled is None


def test_a_watch_over_its_budget_lets_its_allocations_go():
    """Allocations are kept up to max_bytes (bytes of the storages: 4 * 64 per fp32 [64]);
    the one that crosses it drops them all and sets over_budget, later ones are not kept."""
    with ForwardWatch(max_bytes=600) as watch:
        a, b = torch.empty(64), torch.empty(64)
        assert [x.data_ptr() for x in watch.blocks] == [a.data_ptr(), b.data_ptr()]
        assert watch.kept_bytes == 512
        torch.empty(64)
        assert watch.over_budget and watch.blocks == []
        torch.empty(1)
        assert watch.blocks == []
    with ForwardWatch() as unlimited:
        kept = [torch.empty(1 << 16) for _ in range(4)]
    assert len(unlimited.blocks) == len(kept) and not unlimited.over_budget


def test_a_recording_over_budget_refuses_its_size_and_larger_ones(tiny_model_factory):
    """With a 1-byte budget the first recording (batch 4) goes over: batch 4 is refused, the
    smaller batches that follow still record (budget permitting: here they go over too), and
    every step's results equal the eager engine's."""
    tiny = tiny_model_factory("llama")
    expected = _generate(_engine(tiny.path, "float32", enforce_eager=True))
    llm = _engine(tiny.path, "float32")
    graphs = _graphs(llm)
    graphs.max_recording_bytes = 1
    assert _generate(llm) == expected
    threads = torch.get_num_threads()
    assert graphs.refused == {(n, threads) for n in (4, 3, 2, 1)}
    assert graphs.max_recorded_rows == 0 and graphs.replayed_steps == 0 and not graphs.programs


def _recorded_chain(kernels, x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor):
    """RMSNorm (with a residual: a float argument and NULL-free pointers), a GEMM with no
    bias (a NULL pointer) and SiLU-and-mul on kernels' wrappers, recorded: (calls, the
    outputs the calls wrote, the residual). Every tensor a call reads stays alive."""
    residual = x * 0.5
    with StepRecorder(kernels) as recorder:
        normed, summed = kernels.rms_norm(x, w, 1e-5, residual=residual)
        up = kernels.gemm(normed, packed, 2 * x.shape[1])
        act = kernels.silu_and_mul(up)
    calls = [c for c in recorder.calls if c[0].__name__ in  # not the size look-ups
             ("kvflow_rms_norm", "kvflow_gemm", "kvflow_silu_and_mul")]
    assert len(calls) == 3
    return calls, (normed, summed, up, act), residual


def test_calls_replayed_from_c_write_what_the_python_calls_wrote():
    """The C replay loop (csrc/cpu_replay.c) runs the same entry points with the same
    arguments as the recorded Python calls: every output is the same bit for bit when the
    outputs are cleared and the encoded calls run again, and equal to a plain-torch oracle
    within float32 rounding. A call the table lacks (here a ctypes entry point bound to a
    Python callback) stays a Python call between two encoded runs."""
    kernels = native_cpu_kernels()
    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.randn(64)
    weight = torch.randn(128, 64)
    packed = kernels.gemm_pack(weight)
    calls, outs, _residual = _recorded_chain(kernels, x, w, packed)
    expected = [o.clone() for o in outs]
    mid = x.new_zeros(1)

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    def marker(address):
        ctypes.c_float.from_address(address).value = 7.0
        return 0
    marker.argtypes = [ctypes.c_void_p]
    calls = [*calls[:2], (marker, (mid.data_ptr(),)), *calls[2:]]
    replayer = kernels.replayer
    segments = replayer.encode(calls)
    assert [isinstance(s[0], torch.Tensor) for s in segments] == [True, False, True]
    assert segments[0][1] == ["kvflow_rms_norm", "kvflow_gemm"]
    for o in outs:
        o.fill_(float("nan"))
    replayer.run(segments)
    assert all(same_bits(o, e) for o, e in zip(outs, expected, strict=True))
    assert mid.item() == 7.0
    s = x + x * 0.5
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    up = ref @ weight.T
    torch.testing.assert_close(outs[1], s)
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[2], up, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[3], torch.nn.functional.silu(up[:, :64]) * up[:, 64:],
                               rtol=1e-4, atol=1e-4)


def test_a_failing_call_replayed_from_c_is_named_and_stops_the_run():
    """A call that returns a nonzero status (kvflow_gemm given an x dtype its weight does not
    take) raises RuntimeError naming it, and the calls after it do not run."""
    kernels = native_cpu_kernels()
    x, w = torch.randn(2, 32), torch.randn(32)
    packed = kernels.gemm_pack(torch.randn(64, 32))
    calls, outs, _residual = _recorded_chain(kernels, x, w, packed)
    fn, args = calls[1]
    assert fn.__name__ == "kvflow_gemm"
    calls[1] = (fn, (*args[:2], 99, *args[3:]))  # xdt: no dtype code
    outs[3].fill_(-1.0)
    with pytest.raises(RuntimeError, match="replayed native call kvflow_gemm failed"):
        kernels.replayer.run(kernels.replayer.encode(calls))
    assert (outs[3] == -1.0).all()


def test_replayed_steps_run_from_c(tiny_model_factory):
    """The engine's trusted programs are bound to the C replayer, each one encoded run (every
    call of a Llama decode step is in the table), and the greedy outputs equal the eager
    engine's (the oracle test above compares against transformers)."""
    tiny = tiny_model_factory("llama")
    expected = _generate(_engine(tiny.path, "float32", enforce_eager=True))
    llm = _engine(tiny.path, "float32")
    assert _generate(llm) == expected
    graphs = _graphs(llm)
    assert graphs.replayed_steps > 0 and graphs.programs
    for program in graphs.programs.values():
        assert program.replayer is not None
        assert len(program.segments) == 1 and isinstance(program.segments[0][0], torch.Tensor)
