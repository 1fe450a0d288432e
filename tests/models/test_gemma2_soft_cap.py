"""Gemma 2's attention-logit soft-capping (``attn_logit_softcapping``) runs on the cpu, triton
and torch attention backends: on the native CPU one (and --deterministic) the prompt logprobs
equal transformers'; a backend without the cap is refused when named (else torch serves), as is
context parallelism, naming the field; an attention layer built on a backend without it refuses
too (a draft model's, say). A config whose cap is null runs the default backend and still
equals transformers. (tests/models/test_parity.py checks the capped model's tokens and
logprobs against transformers on the cpu and torch backends; tests/kernels/
test_engine_triton_cpu.py on triton.)"""

from __future__ import annotations

import os

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.attention.backend import AttentionBackend
from kvflow.attention.layer import Attention, AttentionContext
from tests.folder_edits import copy_with_json


def _hf_prompt_logprobs(folder: str, prompt: list[int]) -> torch.Tensor:
    import transformers

    hf = transformers.Gemma2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("kwargs", [{"attention_backend": "cpu"}, {"deterministic": True},
                                    {"attention_backend": "cpu", "kv_cache_dtype": "int8"}],
                         ids=["cpu", "deterministic", "cpu_int8_cache"])
def test_native_cpu_backend_soft_caps_like_hf(tiny_model_factory, kwargs):
    """The native CPU kernels compute the cap: prompt logprobs (a 20-token prefill, then one
    decode) equal transformers' (eager Gemma 2 attention, capped) on the cpu backend, its
    batch-invariant (--deterministic) mode, and over an INT8 cache (looser: the cache rounds
    K/V to 8 bits)."""
    from kvflow.kernels.cpu_native import native_cpu_kernels

    if native_cpu_kernels() is None:
        pytest.skip("native CPU kernels could not be built")
    tiny = tiny_model_factory("gemma2")
    assert tiny.hf_model.config.attn_logit_softcapping == 2.0
    prompt = torch.randint(2, 320, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = _hf_prompt_logprobs(tiny.path, prompt)
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=32, block_size=4,
              max_num_batched_tokens=8, **kwargs)  # chunks of 8: cached prefix + new tokens
    assert llm.engine.core.executor.runner.attn_ctx.backend.name == "cpu"
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                   prompt_logprobs=0), use_tqdm=False)
    got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    want = [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    tol = 3e-2 if "kv_cache_dtype" in kwargs else 1e-4
    assert got == pytest.approx(want, abs=tol)
    assert out.outputs[0].token_ids[0] == int(ref[-1].argmax())


class _NoCapBackend(AttentionBackend):
    name = "nocap"

    def forward(self, *args, **kwargs):  # pragma: no cover - never reached
        raise AssertionError


def test_backend_without_the_cap_is_refused_when_named_else_replaced_by_torch():
    from kvflow.worker.attention_backends import soft_cap_backend

    with pytest.raises(ValueError, match=r"--attention-backend flashinfer: the 'nocap' backend "
                                         r"does not compute this model's "
                                         r"attn_logit_softcapping"):
        soft_cap_backend(_NoCapBackend(), "flashinfer")
    assert soft_cap_backend(_NoCapBackend(), None).name == "torch"
    capped = type("Capped", (_NoCapBackend,), {"supports_logits_soft_cap": True})()
    assert soft_cap_backend(capped, "cpu") is capped


def test_context_parallelism_is_refused_naming_the_field(tiny_model_factory):
    from kvflow.worker.attention_backends import make_context_parallel_backend

    config = tiny_model_factory("gemma2").hf_model.config
    with pytest.raises(ValueError, match=r"context_parallel_size > 1 is not available for this "
                                         r"model's attn_logit_softcapping"):
        make_context_parallel_backend(None, config, 4)


def test_attention_layer_refuses_a_backend_without_soft_cap():
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=2.0: the 'nocap' attention "
                                         r"backend does not soft-cap attention logits"):
        Attention(4, 2, 16, 0.25, AttentionContext(_NoCapBackend()), logits_soft_cap=2.0)


def test_null_cap_runs_the_default_backend_and_matches_hf(tiny_model_factory, tmp_path):
    """``attn_logit_softcapping: null``: no cap anywhere (transformers' eager attention skips
    it), so the native CPU backend serves; prompt logprobs equal transformers' on the same
    folder."""
    import transformers

    folder = os.path.dirname(copy_with_json(tiny_model_factory("gemma2").path,
                                            tmp_path / "gemma2-no-cap",
                                            attn_logit_softcapping=None))
    hf = transformers.Gemma2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.config.attn_logit_softcapping is None
    prompt = torch.randint(2, 320, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    llm = LLM(model=folder, dtype="float32", device="cpu", num_kv_blocks=32, block_size=4)
    backend = llm.engine.core.executor.runner.attn_ctx.backend.name
    assert backend in ("cpu", "torch")  # "torch" only where the native kernels cannot build
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                   prompt_logprobs=0), use_tqdm=False)
    got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    want = [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-4)
