"""DeepSeek-V2/V3 (MLA + DeepSeekMoE) end to end against transformers on tiny random models
(fp32, CPU; tests/conftest.py: ``deepseek_v2`` = V2-Lite style with YaRN and group-limited
softmax routing, ``deepseek_v3`` = q LoRA and sigmoid noaux_tc routing with a correction bias).

Greedy tokens and each token's logprob must equal transformers' (the helpers of
test_parity.py) for mixed batches, whole prompts, chunked prefill, prefix-cache hits,
preemption and blocks of 16 and 32 tokens; the paged cache must hold one latent vector per
token (sizes checked by hand); an explicit attention backend without an MLA path is refused;
no KV block leaks.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvflow import LLM
from kvflow.kv_cache_interface import MLAAttentionSpec
from tests.models.test_parity import _prompts, assert_matches_hf, greedy

MLA_ARCHS = ["deepseek_v2", "deepseek_v3"]


@pytest.fixture(params=MLA_ARCHS)
def tiny(request, tiny_model_factory):
    return tiny_model_factory(request.param)


def make_llm(tiny, **kwargs) -> LLM:
    """fp32 on CPU, blocks of 4 tokens, at most 8 sequences (as test_parity.py)."""
    kwargs = {"num_kv_blocks": 128, "block_size": 4, "max_num_seqs": 8, **kwargs}
    return LLM(model=tiny.path, dtype="float32", device="cpu", **kwargs)


def runner_of(llm: LLM):
    return llm.engine.core.executor.runner


def test_batch_of_different_lengths(tiny, assert_no_leaks, cpu_kernels):
    """Mixed prefill and decode steps; the MLA backend whatever the CPU default is, with the
    other native kernels (GEMM, norms, rotary) on and off."""
    llm = make_llm(tiny)
    assert runner_of(llm).attn_ctx.backend.name == "torch_mla"
    prompts = _prompts([1, 5, 13, 22, 9], tiny.vocab_size, seed=2)
    for out in llm.generate(prompts, greedy(), use_tqdm=False):
        assert_matches_hf(tiny, out)
    assert_no_leaks(llm)


def test_whole_prompts_of_one_length(tiny, assert_no_leaks):
    llm = make_llm(tiny, attention_backend="torch")  # the one explicit choice MLA accepts
    for out in llm.generate(_prompts([11, 11, 11], tiny.vocab_size, seed=3), greedy(),
                            use_tqdm=False):
        assert_matches_hf(tiny, out)
    assert_no_leaks(llm)


def test_chunked_prefill(tiny, assert_no_leaks):
    """A 16-token budget splits prompts over steps (one runs past YaRN's original 64
    positions) and mixes chunks with decodes."""
    llm = make_llm(tiny, max_num_batched_tokens=16, enable_prefix_caching=False)
    for out in llm.generate(_prompts([70, 7, 23, 16], tiny.vocab_size, seed=3), greedy(),
                            use_tqdm=False):
        assert_matches_hf(tiny, out)
    assert_no_leaks(llm)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["pc_on", "pc_off"])
def test_shared_prefix(tiny, prefix_caching, assert_no_leaks):
    """Prompts sharing a 26-token prefix, run twice: with prefix caching the latent blocks are
    reused (hits), and the outputs equal transformers' either way."""
    llm = make_llm(tiny, enable_prefix_caching=prefix_caching, max_num_batched_tokens=32)
    prefix = _prompts([26], tiny.vocab_size, seed=4)[0]
    prompts = [prefix + s for s in _prompts([3, 7, 12], tiny.vocab_size, seed=5)]
    prompts += [prefix[:21], prefix[:24]]  # ends inside a block / on a block boundary
    first = llm.generate(prompts, greedy(), use_tqdm=False)
    second = llm.generate(prompts, greedy(), use_tqdm=False)
    for a, b in zip(first, second):
        assert_matches_hf(tiny, a)
        assert_matches_hf(tiny, b)
    assert (llm.engine.core.kv_cache_manager.num_hits > 0) == prefix_caching
    assert_no_leaks(llm)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["pc_on", "pc_off"])
def test_preemption(tiny, prefix_caching, assert_no_leaks):
    """7 usable blocks of 4 tokens for 4 requests growing to 18-24 tokens: preempted and
    recomputed, still transformers' outputs."""
    llm = make_llm(tiny, num_kv_blocks=8, enable_prefix_caching=prefix_caching,
                   max_num_batched_tokens=16)
    outs = llm.generate(_prompts([9, 14, 8, 11], tiny.vocab_size, seed=6), greedy(),
                        use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out in outs:
        assert_matches_hf(tiny, out)
    assert_no_leaks(llm)


@pytest.mark.parametrize("block_size", [16, 32])
def test_block_sizes_of_serving(tiny, block_size, assert_no_leaks):
    """The latent cache in blocks of 16 and 32 tokens (the other tests use 4): a 70-token
    prompt in chunks of 24, prompts sharing a 40-token prefix (hits inside and at the end of a
    block on the second run) and 20 decode steps each, all transformers' tokens."""
    llm = make_llm(tiny, block_size=block_size, num_kv_blocks=32, max_num_batched_tokens=24)
    prompts = _prompts([70, 3, 33], tiny.vocab_size, seed=5)
    prompts += [prompts[0][:40] + [5, 6, 7], prompts[0][:40] + [9]]
    for _ in range(2):
        for out in llm.generate(prompts, greedy(20), use_tqdm=False):
            assert_matches_hf(tiny, out, 20)
    assert llm.engine.core.kv_cache_manager.num_hits > 0
    assert_no_leaks(llm)


def test_v3_variant_rope_halves_all_moe_one_group(tiny_model_factory, assert_no_leaks):
    """V3 with rope_interleave false, no dense layer and one routing group: chunked prefill and
    decodes in one engine."""
    tiny = tiny_model_factory("deepseek_v3_variant")
    llm = make_llm(tiny, max_num_batched_tokens=16)
    for out in llm.generate(_prompts([30, 5, 13], tiny.vocab_size, seed=7), greedy(),
                            use_tqdm=False):
        assert_matches_hf(tiny, out)
    assert_no_leaks(llm)


def test_latent_cache_size_by_hand(tiny_model_factory):
    """Per layer and token the cache holds kv_lora_rank + qk_rope_head_dim = 32 + 8 values, no
    K/V pair, no heads: 40 x 4 bytes (fp32) x 2 layers = 320 bytes per token, so a 64 KiB
    budget in blocks of 4 tokens is 65536 // 1280 = 51 blocks. A per-head cache of the same
    attention (4 heads x (24-value keys + 12-value values)) would take 4 x 36 x 4 x 2 = 1152
    bytes per token, 3.6x as much."""
    tiny = tiny_model_factory("deepseek_v3")
    llm = make_llm(tiny, num_kv_blocks=None, kv_cache_memory="64KiB")
    config = runner_of(llm).kv_cache_config
    (group,) = config.kv_cache_groups
    assert group.kv_cache_spec == MLAAttentionSpec(4, 1, 40, torch.float32)
    assert group.page_size_bytes // 4 == 320
    assert llm.engine.core.kv_bytes_per_token == 320  # what the log and /metrics report
    assert config.num_blocks == 51
    caches = runner_of(llm).kv_caches
    assert [tuple(c.shape) for c in caches] == [(51, 4, 40)] * 2
    assert sum(c.numel() * c.element_size() for c in caches) == 51 * 4 * 320


def test_the_cache_holds_the_normalized_latent_and_rotated_key(tiny_model_factory):
    """After a prefill, the slots of the prompt's tokens hold transformers' kv_a_layernorm
    output and its rotated RoPE key (V2's interleaved layout, as transformers writes it)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    tiny = tiny_model_factory("deepseek_v2")
    prompt = _prompts([10], tiny.vocab_size, seed=9)[0]
    llm = make_llm(tiny, num_kv_blocks=16)
    llm.generate([prompt], greedy(max_tokens=1), use_tqdm=False)
    hf, seen = tiny.hf_model, {}
    attn = hf.model.layers[1].self_attn
    hooks = [attn.kv_a_layernorm.register_forward_hook(lambda m, i, o: seen.update(latent=o)),
             attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, o: seen.update(kv=o))]
    with torch.no_grad():
        hf(torch.tensor([prompt]))
        freqs = hf.model.rotary_emb(seen["kv"], torch.arange(10)[None])
        k_rope = seen["kv"][..., 32:].view(1, 1, 10, 8)
        _, k_rope = apply_rotary_emb(k_rope, k_rope, freqs)
    for h in hooks:
        h.remove()
    expected = torch.cat([seen["latent"][0], k_rope[0, 0]], dim=-1)  # [10, 40]
    cache = runner_of(llm).kv_caches[1].view(-1, 40)
    rows = [i for i in range(cache.shape[0]) if cache[i].abs().sum() > 0]
    assert len(rows) == 10  # one vector per prompt token, nothing else written
    torch.testing.assert_close(cache[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_backend_without_mla_is_refused(tiny_model_factory, backend):
    with pytest.raises(ValueError, match=f"--attention-backend {backend} has no multi-head "
                                         "latent attention"):
        make_llm(tiny_model_factory("deepseek_v2"), attention_backend=backend)


def test_multi_token_prediction_layers_are_skipped(tiny_model_factory, tmp_path):
    """DeepSeek-V3 checkpoints carry MTP layers past num_hidden_layers (model.layers.61 for
    61 layers); they load without error and change nothing."""
    from safetensors.torch import save_file

    tiny = tiny_model_factory("deepseek_v3")
    for name in os.listdir(tiny.path):
        os.symlink(os.path.join(tiny.path, name), tmp_path / name)
    save_file({"model.layers.2.self_attn.kv_b_proj.weight": torch.ones(3, 3),
               "model.layers.2.enorm.weight": torch.ones(64)},
              str(tmp_path / "model-mtp.safetensors"))
    llm = make_llm(tiny)
    llm_mtp = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=128, block_size=4)
    prompt = _prompts([12], tiny.vocab_size, seed=8)
    (a,) = llm.generate(prompt, greedy(), use_tqdm=False)
    (b,) = llm_mtp.generate(prompt, greedy(), use_tqdm=False)
    assert_matches_hf(tiny, b)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
