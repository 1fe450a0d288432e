"""The CPU prefill attention choice (``attention/prefill_select.py``, ``--cpu-attention``):
the choice logic with faked timings, both candidates against a float64 oracle, the ``cpu``
backend taking the chosen one, and the engine's greedy output with each.

Tolerances: fp32 atol=rtol=1e-5 (fp32 accumulation; only summation order and exp differ).
bf16: :func:`tests.kernels.test_cpu_attention.bf16_dot_bound`'s terms (the output's rounding
to bf16 plus the softmax weights' rounding to bf16, each 2^-9, doubled): both the native
dot-product tiles and oneDNN's bf16 flash attention round P to bf16.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvflow.attention import prefill_select as attention_select
from kvflow.attention.cpu_paged import CpuPagedAttentionBackend
from kvflow.attention.prefill_select import (
    LENGTH_CLASSES,
    PrefillAttentionChoice,
    PrefillShape,
    PrefillTimings,
    length_class,
    prefill_calls,
    prefill_inputs,
)
from kvflow.attention.torch_paged import TorchPagedAttentionBackend
from kvflow.config import EngineConfig, cpu_attention_choice
from kvflow.kernels.cpu_native import native_cpu_kernels

KERNELS = native_cpu_kernels()
native = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels could not be built")


@pytest.mark.parametrize("tokens,cls", [(1, 128), (128, 128), (255, 128), (256, 512),
                                        (1023, 512), (1024, 2048), (2048, 2048),
                                        (100_000, 2048)])
def test_length_class_is_the_nearest_on_a_log_scale(tokens, cls):
    # boundaries: isqrt(128 * 512) = 256, isqrt(512 * 2048) = 1024
    assert length_class(tokens) == cls


def fake_measure(winners: dict[int, str], calls: list):
    """A timer where ``winners[length]`` takes 1 s and the other candidate 2 s."""
    def measure(shape, length, kernels):
        calls.append((shape, length))
        return {c: 1.0 if c == winners[length] else 2.0 for c in ("native", "sdpa")}
    return measure


def test_auto_picks_the_faster_per_length_class_and_caches_the_timings(tmp_path):
    winners = {128: "sdpa", 512: "native", 2048: "sdpa"}
    calls: list = []
    timings = PrefillTimings(tmp_path / "t.json", None, fake_measure(winners, calls))
    choice = PrefillAttentionChoice("auto", timings=timings)
    for tokens, want in [(16, "sdpa"), (128, "sdpa"), (300, "native"), (900, "native"),
                         (2048, "sdpa"), (5000, "sdpa")]:
        assert choice.pick(torch.bfloat16, 9, 3, 64, tokens) == want
    shape = PrefillShape(torch.bfloat16, 3, 64)
    assert calls == [(shape, n) for n in LENGTH_CLASSES]  # each class timed once
    stored = json.loads((tmp_path / "t.json").read_text())
    assert stored["bfloat16|g3|d64|sdpa|128"] == 1.0
    assert stored["bfloat16|g3|d64|native|128"] == 2.0
    # another head shape or dtype is timed on its own; the group is heads / kv_heads
    assert choice.pick(torch.float32, 8, 2, 128, 128) == "sdpa"
    assert calls[-1] == (PrefillShape(torch.float32, 4, 128), 2048)
    # a new start reads the file and measures nothing
    again_calls: list = []
    again = PrefillAttentionChoice("auto", timings=PrefillTimings(
        tmp_path / "t.json", None, fake_measure(winners, again_calls)))
    assert again.pick(torch.bfloat16, 6, 2, 64, 512) == "native" and again_calls == []


def test_damaged_timings_are_measured_again_with_one_warning(tmp_path, caplog):
    """A cache file of ``null`` times (valid JSON) failed the choice with a TypeError; now it
    is read as empty, warned about once (the merge on save reads it quietly), measured
    again with the fake timer (sdpa 1 s, native 2 s) and rewritten with those times."""
    path = tmp_path / "t.json"
    shape = PrefillShape(torch.bfloat16, 3, 64)
    path.write_text(json.dumps({shape.key(c, n): None for c in ("native", "sdpa")
                                for n in LENGTH_CLASSES}))
    calls: list = []
    winners = dict.fromkeys(LENGTH_CLASSES, "sdpa")
    choice = PrefillAttentionChoice("auto", timings=PrefillTimings(
        path, None, fake_measure(winners, calls)))
    assert choice.pick(torch.bfloat16, 9, 3, 64, 128) == "sdpa"
    assert calls == [(shape, n) for n in LENGTH_CLASSES]
    assert json.loads(path.read_text()) == {shape.key(c, n): 1.0 if c == "sdpa" else 2.0
                                            for c in ("native", "sdpa") for n in LENGTH_CLASSES}
    assert caplog.text.count("ignoring 6 of 6 entries") == 1


def test_a_tie_keeps_native(tmp_path):
    timings = PrefillTimings(tmp_path / "t.json", None,
                             lambda shape, length, kernels: {"native": 1.0, "sdpa": 1.0})
    assert PrefillAttentionChoice("auto", timings=timings).pick(
        torch.float32, 4, 4, 64, 128) == "native"


@pytest.mark.parametrize("forced", ["native", "sdpa"])
def test_a_forced_choice_measures_nothing(forced, tmp_path):
    calls: list = []
    timings = PrefillTimings(tmp_path / "t.json", None,
                             fake_measure(dict.fromkeys(LENGTH_CLASSES, "sdpa"), calls))
    choice = PrefillAttentionChoice(forced, timings=timings)
    assert {choice.pick(torch.bfloat16, 9, 3, 64, n) for n in (10, 500, 4000)} == {forced}
    assert calls == [] and not (tmp_path / "t.json").exists()


def test_bad_choices_raise_value_error_naming_the_source(monkeypatch):
    with pytest.raises(ValueError, match="cpu_attention"):
        PrefillAttentionChoice("onednn")
    with pytest.raises(ValueError, match="cpu_attention"):
        EngineConfig.from_kwargs(cpu_attention="flash")
    monkeypatch.setenv("KVFLOW_CPU_ATTENTION", "native")
    assert cpu_attention_choice() == "native"
    assert cpu_attention_choice("sdpa") == "sdpa"  # the flag wins over the variable
    monkeypatch.setenv("KVFLOW_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="KVFLOW_CPU_ATTENTION"):
        cpu_attention_choice()
    with pytest.raises(ValueError, match="KVFLOW_CPU_ATTENTION"):
        EngineConfig.from_kwargs()
    monkeypatch.delenv("KVFLOW_CPU_ATTENTION")
    assert cpu_attention_choice() == "auto"


def test_deterministic_mode_refuses_forced_sdpa(tiny_llama):
    from kvflow import LLM

    with pytest.raises(ValueError, match="cpu_attention='sdpa'"):
        LLM(model=tiny_llama.path, device="cpu", deterministic=True, kv_cache_memory="16MiB",
            cpu_attention="sdpa")


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_reqs: int, length: int,
           scale: float) -> torch.Tensor:
    """Causal attention of ``num_reqs`` whole prompts in float64: q [T, Hq, D], k/v [T, Hkv, D]
    -> [T, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().view(num_reqs, length, x.shape[1], x.shape[2]).transpose(1, 2)
                  for x in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    scores = (qd @ kd.transpose(-1, -2)) * scale
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return (probs @ vd).transpose(1, 2).reshape(q.shape)


def bound(dtype: torch.dtype, ref: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if dtype == torch.float32:
        return 1e-5 + 1e-5 * ref.abs()
    return 2**-8 * ref.abs() + 2**-8 * v.double().abs().max() + 1e-6


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (1, 128), (2, 16)])
def test_timed_candidates_match_the_float64_oracle(dtype, group, head_dim):
    """The two calls :func:`prefill_calls` times compute the same attention (16 prompts of
    128 tokens, one KV head, q/k/v views of one fused row per token)."""
    shape = PrefillShape(dtype, group, head_dim)
    calls = prefill_calls(shape, 128, KERNELS)
    q, k, v, _, _ = prefill_inputs(shape, 128)
    ref = oracle(q, k, v, 16, 128, head_dim ** -0.5)
    for name, call in calls.items():
        err = (call().double() - ref).abs()
        assert (err <= bound(dtype, ref, v)).all(), (name, err.max().item())


def uniform_batch(num_reqs: int, length: int, heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype):
    """q/k/v of ``num_reqs`` whole prompts and the metadata of an empty paged cache."""
    meta = attention_select._uniform_meta(num_reqs, length)
    gen = torch.Generator().manual_seed(1)
    n = meta.num_actual_tokens
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    k, v = torch.randn(2, n, kv_heads, head_dim, generator=gen).to(dtype)
    cache = torch.zeros(2, meta.block_table.numel(), 16, kv_heads, head_dim, dtype=dtype)
    return q, k, v, cache, meta


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("forced", ["native", "sdpa"])
def test_cpu_backend_takes_the_chosen_path_and_matches_the_oracle(dtype, forced, monkeypatch):
    """A batch of whole prompts through the ``cpu`` backend: SDPA is called exactly when the
    choice says ``sdpa``, and either way the output matches the float64 oracle and the
    prompts' K/V land in the cache."""
    sdpa_calls = []
    real = TorchPagedAttentionBackend.uniform_prompt_attention
    monkeypatch.setattr(TorchPagedAttentionBackend, "uniform_prompt_attention",
                        staticmethod(lambda *a: sdpa_calls.append(1) or real(*a)))
    backend = CpuPagedAttentionBackend(KERNELS, prefill=PrefillAttentionChoice(forced, KERNELS))
    q, k, v, cache, meta = uniform_batch(4, 40, 9, 3, 64, dtype)
    backend.prepare(meta, 16)
    out = backend.forward(q, k, v, cache, meta, 0.125)
    assert len(sdpa_calls) == (forced == "sdpa")
    ref = oracle(q, k, v, 4, 40, 0.125)
    assert ((out.double() - ref).abs() <= bound(dtype, ref, v)).all()
    stored = cache[0].view(-1, 3, 64).index_select(0, meta.slot_mapping)
    assert torch.equal(stored, k)


@native
def test_deterministic_backend_never_takes_sdpa(monkeypatch):
    monkeypatch.setattr(TorchPagedAttentionBackend, "uniform_prompt_attention",
                        staticmethod(lambda *a: pytest.fail("SDPA under batch_invariant")))
    backend = CpuPagedAttentionBackend(KERNELS, batch_invariant=True,
                                       prefill=PrefillAttentionChoice("sdpa", KERNELS))
    q, k, v, cache, meta = uniform_batch(2, 20, 4, 2, 32, torch.float32)
    backend.prepare(meta, 16)
    out = backend.forward(q, k, v, cache, meta, 0.2)
    torch.testing.assert_close(out.double(), oracle(q, k, v, 2, 20, 0.2), atol=1e-5, rtol=1e-5)


def _greedy(path: str, cpu_attention: str, backend: str):
    from kvflow import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              device="cpu", cpu_attention=cpu_attention)
    assert llm.engine.core.executor.runner.attn_ctx.backend.name == backend
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(24)] for i in range(4)]  # equal lengths
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logprobs=0), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs]
    return tokens, torch.tensor(logprobs)


def test_engine_greedy_output_is_the_same_with_either_choice(tiny_llama, cpu_kernels):
    """Four equal whole prompts (one uniform prefill step, then decodes): the same greedy
    tokens and logprobs with ``--cpu-attention native`` and ``sdpa``, and HF's greedy tokens;
    with ``KVFLOW_NATIVE_CPU=0`` ``native`` is refused (it cannot run) and the torch backend
    runs."""

    backend = "cpu" if cpu_kernels == "native" else "torch"
    sdpa_tokens, sdpa_logprobs = _greedy(tiny_llama.path, "sdpa", backend)
    if cpu_kernels == "native":
        tokens, logprobs = _greedy(tiny_llama.path, "native", backend)
        assert tokens == sdpa_tokens
        torch.testing.assert_close(logprobs, sdpa_logprobs, atol=1e-4, rtol=1e-4)
    else:
        with pytest.raises(ValueError, match="KVFLOW_NATIVE_CPU=0 turns off"):
            _greedy(tiny_llama.path, "native", backend)
        tokens = sdpa_tokens
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(24)] for i in range(4)]
    with torch.no_grad():
        hf = tiny_llama.hf_model.generate(torch.tensor(prompts), max_new_tokens=6,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens == hf[:, 24:].tolist()
