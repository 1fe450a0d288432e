"""Config variations real checkpoints use, beyond the architectures of ``test_parity.py``:
each variant's prompt logprobs equal HF transformers' log-softmax of its logits (fp32, CPU),
and a variant kvflow does not compute is refused when the model loads, with an error naming the
config field (never computed as something else). One short prompt per model keeps this fast."""

from __future__ import annotations

import os

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.folder_edits import copy_with_json

ATOL = 1e-4


def _prompt(vocab: int, length: int = 20) -> list[int]:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(2, vocab, (length,), generator=gen).tolist()


@pytest.mark.parametrize("name", [
    "llama_gelu_bias", "deepseek_v2_mlp_bias", "deepseek_v3_moe_layer_freq",
    # was refused: the empty shared-expert tensors matched no parameter
    pytest.param("deepseek_v2_no_shared", marks=pytest.mark.filterwarnings(
        "ignore:Initializing zero-element tensors:UserWarning")),  # transformers' build
    # was refused the same way (and its shared_expert_gate with it)
    pytest.param("qwen2_moe_no_shared", marks=pytest.mark.filterwarnings(
        "ignore:Initializing zero-element tensors:UserWarning"))])
def test_prompt_logprobs_match_hf(tiny_model_factory, name):
    tiny = tiny_model_factory(name)
    prompt = _prompt(tiny.vocab_size)
    with torch.no_grad():
        logits = tiny.hf_model(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=32, block_size=4)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                   prompt_logprobs=0), use_tqdm=False)
    got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    want = [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=ATOL)
    top2 = ref[-1].topk(2).values
    assert float(top2[0] - top2[1]) > 2 * ATOL  # no near-tie: the greedy token is defined
    assert out.outputs[0].token_ids == [int(ref[-1].argmax())]


def _edited_copy(tiny, folder, **changes) -> str:
    """A copy of the tiny model's folder with ``changes`` written into its config.json."""
    return os.path.dirname(copy_with_json(tiny.path, folder, **changes))


@pytest.mark.parametrize("name, changes, message", [
    ("llama", {"hidden_act": "relu"}, r"hidden_act='relu' is not supported"),
    ("mixtral", {"hidden_act": "gelu"},
     r"hidden_act='gelu' is not supported for MixtralForCausalLM"),
    ("qwen2_moe", {"hidden_act": "gelu"},
     r"hidden_act='gelu' is not supported for Qwen2MoeForCausalLM"),
    ("deepseek_v3", {"hidden_act": "gelu"},
     r"hidden_act='gelu' is not supported for DeepseekV3ForCausalLM"),
    ("gemma3", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=True"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50.0"),
    ("gemma2", {"use_bidirectional_attention": True},
     r"Gemma 2 use_bidirectional_attention=True is not supported"),
    ("granite_moe", {"hidden_act": "gelu"},
     r"hidden_act='gelu' is not supported for GraniteMoeForCausalLM"),
    # counts no routing can use: these loaded, then the first step failed in torch.topk
    # ("selected index k out of range", a RuntimeError)
    ("deepseek_v2", {"topk_group": 5}, r"topk_group=5 must be between 1 and n_group=4"),
    ("deepseek_v3", {"n_group": 8},
     (r"noaux_tc scores a routing group by its two best experts: n_group=8 leaves 1 of the 8 "
      r"experts per group")),
    ("qwen3_moe", {"num_experts_per_tok": 9},
     r"num_experts_per_tok=9 must be between 1 and the layer's 8 experts"),
    ("mixtral", {"num_experts_per_tok": 5},
     r"num_experts_per_tok=5 must be between 1 and the layer's 4 experts"),
], ids=["llama_relu", "mixtral_gelu", "qwen2_moe_gelu", "deepseek_gelu", "gemma3_bidirectional",
        "gemma3_attn_softcap", "gemma2_bidirectional", "granite_moe_gelu",
        "deepseek_topk_group", "deepseek_v3_one_expert_groups",
        "qwen3_moe_top_k", "mixtral_top_k"])
def test_unsupported_variant_is_refused_naming_the_field(tiny_model_factory, tmp_path, name,
                                                         changes, message):
    path = _edited_copy(tiny_model_factory(name), tmp_path / "model", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)


@pytest.mark.parametrize("name, changes, message", [
    # narrowing the 32-row k_proj / the 320-row table loaded part of each, silently
    ("llama", {"num_key_value_heads": 1},
     r"'model.layers.0.self_attn.k_proj.weight': shape \(32, 64\): the config gives it 16 rows"),
    ("llama", {"vocab_size": 300},
     r"'lm_head.weight': shape \(320, 64\): the config gives .* = \[300, 64\]"),
    # these were RuntimeErrors from copy_ naming no tensor, or expert errors naming none
    ("llama", {"intermediate_size": 96},
     r"'model.layers.0.mlp.down_proj.weight': shape \(64, 128\) does not fit the \(64, 96\)"),
    ("deepseek_v2", {"v_head_dim": 8},
     r"'model.layers.0.self_attn.kv_b_proj.weight': shape \(112, 32\): .* = \[96, 32\]"),
    ("mixtral", {"intermediate_size": 32},
     r"checkpoint tensor 'model.layers.0.mlp.experts.* expert weight w\d has shape"),
], ids=["kv_heads", "vocab_size", "intermediate_size", "deepseek_v_head_dim", "mixtral_experts"])
def test_config_that_does_not_describe_the_weights_is_refused(tiny_model_factory, tmp_path,
                                                              name, changes, message):
    """HF transformers refuses such a checkpoint ('size mismatch'); kvflow names the tensor."""
    path = _edited_copy(tiny_model_factory(name), tmp_path / "model", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)


@pytest.mark.parametrize("architectures, message", [
    (["GPTNeoXForCausalLM"],
     r"unsupported model architecture \['GPTNeoXForCausalLM'\]; kvflow supports \[.*'Llama"),
    (None, r"config.json has no \"architectures\" list"),
    ([], r"config.json has no \"architectures\" list"),
], ids=["unknown", "missing", "empty"])
def test_architecture_not_served_is_named(tiny_llama, tmp_path, architectures, message):
    path = _edited_copy(tiny_llama, tmp_path / "model", architectures=architectures)
    with pytest.raises(ValueError, match=message):
        LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)


def test_bert_decoder_is_refused(tiny_tokenizer, tmp_path):
    """transformers' BertModel with ``is_decoder`` attends causally; kvflow's encoder would
    attend both ways."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=128, is_decoder=True,
                        architectures=["BertModel"])
    saved = tmp_path / "bert"
    BertModel(config).save_pretrained(saved)
    tiny_tokenizer.save_pretrained(saved)
    with pytest.raises(ValueError, match="BERT is_decoder=True"):
        LLM(model=str(saved), dtype="float32", device="cpu")
    # a vocab_size that does not describe the table: named (was copy_'s RuntimeError)
    path = _edited_copy(type("Saved", (), {"path": str(saved)}), tmp_path / "vocab",
                        is_decoder=False, vocab_size=300)
    with pytest.raises(ValueError, match=r"'embeddings.word_embeddings.weight': shape "
                                         r"\(320, 64\) does not fit the \(300, 64\)"):
        LLM(model=path, dtype="float32", device="cpu")
