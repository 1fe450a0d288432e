"""CPU step graphs replay the decode steps of GeGLU models (native GELU-and-mul,
kernels/csrc/cpu_gelu.c): before it, the MLP's ``F.gelu`` made every batch size unreplayable.

Model: the tiny Llama with a GeGLU MLP (``llama_gelu_bias``: erf GELU, biases, one KV head),
and the same weights with ``hidden_act=gelu_pytorch_tanh`` (Gemma's tanh GeGLU). Oracle:
transformers' greedy tokens, and its log-softmax of the prompt plus those tokens for every
sampled token's logprob (fp32 both: the kernels' and transformers' summation orders differ in
the last bits, a few 1e-6 in a logprob here, so 1e-4 bounds it with room).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_native import native_cpu_kernels
from tests.folder_edits import copy_with_json

pytestmark = pytest.mark.skipif(native_cpu_kernels() is None, reason="no C compiler")

PROMPTS = [[5, 9, 23, 41, 7], [100, 3, 77], [8, 8, 15, 16, 23, 42, 4]]
MAX_TOKENS = [10, 7, 12]


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh"])
def test_geglu_decode_steps_replay_and_match_transformers(tiny_model_factory, tmp_path,
                                                          hidden_act, assert_no_leaks):
    import transformers

    tiny = tiny_model_factory("llama_gelu_bias")
    folder = tiny.path if hidden_act == "gelu" else os.path.dirname(
        copy_with_json(tiny.path, tmp_path / "tanh", hidden_act=hidden_act))
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.config.hidden_act == hidden_act
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
              for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    graphs = llm.engine.core.executor.runner.graph_runner
    assert graphs.disabled is None and not graphs.refused and graphs.replayed_steps > 0
    for prompt, n, out in zip(PROMPTS, MAX_TOKENS, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        assert tokens == greedy
        want = torch.log_softmax(logits.double(), dim=-1)[torch.arange(n), tokens].tolist()
        got = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        assert got == pytest.approx(want, abs=1e-4)
    assert_no_leaks(llm)
