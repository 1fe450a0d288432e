"""Gemma 2's attention-logit soft-capping (``attn_logit_softcapping``) runs on the torch
attention backend only: the engine picks it by itself, and refuses another
``--attention-backend``, ``--deterministic`` or context parallelism naming the field; an attention layer built on a
backend without it refuses too (a draft model's, say). A config whose cap is null runs the
default backend and still equals transformers. (tests/models/test_parity.py checks the capped
model's tokens and logprobs against transformers.)"""

from __future__ import annotations

import os

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.attention.backend import AttentionBackend
from kvflow.attention.layer import Attention, AttentionContext
from tests.folder_edits import copy_with_json


@pytest.mark.parametrize("kwargs, message", [
    ({"attention_backend": "cpu"},
     (r"--attention-backend cpu: the 'cpu' backend does not compute this model's "
     r"attn_logit_softcapping")),
    ({"attention_backend": "triton"}, r"--attention-backend triton: .*attn_logit_softcapping"),
    ({"deterministic": True}, r"--deterministic .* attn_logit_softcapping"),
], ids=["cpu", "triton", "deterministic"])
def test_soft_capped_model_refuses_other_backends(tiny_model_factory, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_model_factory("gemma2").path, dtype="float32", device="cpu",
            num_kv_blocks=16, block_size=4, **kwargs)


def test_context_parallelism_is_refused_naming_the_field(tiny_model_factory):
    from kvflow.worker.attention_backends import make_context_parallel_backend

    config = tiny_model_factory("gemma2").hf_model.config
    with pytest.raises(ValueError, match=r"context_parallel_size > 1 is not available for this "
                                         r"model's attn_logit_softcapping"):
        make_context_parallel_backend(None, config, 4)


class _StubBackend(AttentionBackend):
    name = "stub"

    def forward(self, *args, **kwargs):  # pragma: no cover - never reached
        raise AssertionError


def test_attention_layer_refuses_a_backend_without_soft_cap():
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=2.0: the 'stub' attention "
                                         r"backend does not soft-cap attention logits"):
        Attention(4, 2, 16, 0.25, AttentionContext(_StubBackend()), logits_soft_cap=2.0)


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
