"""CPU step graphs (kvflow/worker/cpu_graphs.py) stay on for INT8 weights loaded pre-quantized
from a checkpoint (compressed-tensors pack-quantized W8A16 per channel or group, GPTQ 8-bit
symmetric per channel or group), as they do for ``--quantization int8`` of float weights.

Oracles: the same engine with ``enforce_eager=True`` (tokens and every logprob bit for bit: a
replay runs the same kernels on the same inputs) and transformers on the dequantized weights
(greedy tokens)."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.quant.gptq_awq import GPTQInt8Method
from kvflow.quant.pack_quantized import PackedInt8Method
from tests.quant.test_gptq_awq import _build as build_gptq
from tests.quant.test_pack_quantized import _build as build_pack_quantized
from tests.quant.test_pack_quantized import _dequantized_reference

pytestmark = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")

PROMPTS = [[5, 9, 23, 41, 7], [100, 3, 77], [8, 8, 15, 16, 23, 42, 4], [61, 2]]
MAX_TOKENS = [12, 9, 14, 6]


def _engine(path: str, dtype: str, **kwargs) -> LLM:
    return LLM(model=path, dtype=dtype, device="cpu", num_kv_blocks=64, block_size=4, **kwargs)


def _generate(llm: LLM) -> list:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
              for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def _hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("fmt,dtype", [("pack-quantized-w8a16-channel", "float32"),
                                       ("gptq-int8-sym-channel", "float32"),
                                       ("pack-quantized-w8a16-channel", "bfloat16"),
                                       ("pack-quantized-w8a16-group32", "float32"),
                                       ("gptq-int8-sym-group64", "float32"),
                                       ("gptq-int8-sym-group32", "bfloat16")])
def test_prequantized_int8_decode_steps_replay(tiny_model_factory, tmp_path, fmt, dtype):
    """Step graphs were turned off ("a replay did not reproduce the eager step") for these
    folders; now several batch sizes are trusted and replayed (one C run each, the INT8
    products included), with the eager engine's tokens and logprobs bit for bit and (fp32)
    transformers' greedy tokens on the dequantized weights. bf16 where the CPU has no bf16
    dot products (AVX2) widens activations with a torch operator: every size is refused and
    runs eagerly, with the same results (as in tests/test_cpu_graphs.py). Group scales were
    one INT8 product per group summed by torch (every size refused); now one grouped native
    call per layer, replayed from C."""
    tiny = tiny_model_factory("llama")
    folder = str(tmp_path / "ckpt")
    group = int(fmt.rsplit("group", 1)[1]) if "group" in fmt else None
    if fmt.startswith("pack"):
        build_pack_quantized(tiny, 8, group, folder)
        ref, method = _dequantized_reference(tiny, folder, 8).eval(), PackedInt8Method
    else:
        _, ref = build_gptq(tiny, folder, "gptq", group or -1, sym=True, bits=8)
        method = GPTQInt8Method
    eager = _engine(folder, dtype, enforce_eager=True)
    expected = _generate(eager)
    del eager
    llm = _engine(folder, dtype)
    runner = llm.engine.core.executor.runner
    assert type(runner.model.model.layers[0].mlp.down_proj.quant_method) is method
    got = _generate(llm)
    graphs = runner.graph_runner
    assert graphs.disabled is None
    if dtype == "bfloat16" and \
            native_cpu_kernels().gemm_x_dtype(torch.bfloat16) != torch.bfloat16:
        assert graphs.refused and graphs.replayed_steps == 0 and not graphs.programs
    else:
        assert not graphs.refused and graphs.replayed_steps > 0 and len(graphs.programs) >= 2
    entry = "kvflow_int8_gemm_grouped" if group else "kvflow_int8_gemm"
    for program in graphs.programs.values():  # INT8 products included, all run from C
        assert entry in program.segments[0][1]
        assert len(program.segments) == 1 and isinstance(program.segments[0][0], torch.Tensor)
    assert got == expected
    if dtype == "bfloat16":
        return
    for prompt, n, (tokens, _) in zip(PROMPTS, MAX_TOKENS, got, strict=True):
        assert tokens == _hf_greedy(ref, prompt, n)
