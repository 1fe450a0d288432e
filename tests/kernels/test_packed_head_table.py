"""A CPU LM head packed for kvflow's C GEMM holds the model's only copy of its table: the plain
[vocab, hidden] weight is freed and a tied embedding looks its rows up in the packed panels
(SmolLM2-135M in bf16: 312.6 -> 258.6 MiB of weights).

Oracles: the plain weight itself (rows read back from the panels equal it bit for bit), the
same engine keeping the plain table (bitwise equal logprobs: the lookups are exact), and the
table's size computed by hand (vocab x hidden x 2 bytes freed).
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.kernels.gemm import NativePackedWeight
from kvflow.worker import cpu_setup

pytestmark = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(77, 33), (64, 48), (1, 2)])
def test_rows_read_from_the_panels_are_the_plain_rows(dtype, n, k):
    """Any row count (not a multiple of the panel width) and depth (odd: bf16 k-pairs are
    padded), each dtype's layout: the rows equal the weight's bit for bit, in any order."""
    torch.manual_seed(0)
    weight = torch.randn(n, k).to(dtype)
    packed = NativePackedWeight(weight, native_cpu_kernels())
    ids = torch.cat([torch.arange(n), torch.randint(0, n, (50,)), torch.tensor([n - 1, 0])])
    got = packed.rows(ids)
    assert got.dtype == dtype and got.shape == (len(ids), k)
    assert torch.equal(got, weight[ids])


def test_rows_outside_the_weight_are_refused():
    packed = NativePackedWeight(torch.randn(20, 8), native_cpu_kernels())
    for bad in ([0, 20], [-1]):
        with pytest.raises(ValueError, match=r"\[0, 20\)"):
            packed.rows(torch.tensor(bad))


def _engine(path: str, keep_plain: bool, monkeypatch) -> LLM:
    with monkeypatch.context() as patch:
        if keep_plain:  # the behaviour before the plain table was freed
            patch.setattr(cpu_setup, "drop_plain_head_weight", lambda model, head: 0)
        return LLM(model=path, dtype="bfloat16", device="cpu", num_kv_blocks=64)


def test_tied_bf16_head_keeps_one_table(tiny_model_factory, monkeypatch):
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "native")
    tiny = tiny_model_factory("llama_tied")
    kept, dropped = (_engine(tiny.path, keep, monkeypatch) for keep in (True, False))
    model = dropped.engine.core.executor.runner.model
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.weight.numel() == 0 and embed.weight.numel() == 0
    assert embed.packed_weight is head.packed_weight
    hf_table = tiny.hf_model.model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(embed(torch.arange(hf_table.shape[0])), hf_table)
    vocab, hidden = hf_table.shape
    assert kept.engine.core.weight_bytes - dropped.engine.core.weight_bytes == vocab * hidden * 2
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [[5, 9, 23, 41, 7], [100, 3, 77]]
    ref, got = (llm.generate(prompts, params, use_tqdm=False) for llm in (kept, dropped))
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in g.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in step.items()} for step in r.outputs[0].logprobs]


def test_untied_head_frees_its_plain_weight_and_onednn_keeps_it(tiny_model_factory,
                                                                 monkeypatch):
    """An untied bf16 head packed natively needs no plain weight either (the embedding has its
    own table); a oneDNN-packed head (fp32, opaque) keeps the tied table."""
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "native")
    tiny = tiny_model_factory("llama")
    model = LLM(model=tiny.path, dtype="bfloat16", device="cpu",
                num_kv_blocks=64).engine.core.executor.runner.model
    assert model.lm_head.weight.numel() == 0
    assert torch.equal(model.model.embed_tokens.weight,
                       tiny.hf_model.model.embed_tokens.weight.to(torch.bfloat16))
    monkeypatch.setenv("KVFLOW_CPU_GEMM", "onednn")
    tied = tiny_model_factory("llama_tied")
    model = LLM(model=tied.path, dtype="bfloat16", device="cpu",
                num_kv_blocks=64).engine.core.executor.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape[0] == tied.hf_model.config.vocab_size
