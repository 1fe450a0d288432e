"""Multi-LoRA against transformers + peft: the tiny Llama with two random PEFT adapters (made
with peft itself) and the base model in one batch give the same greedy tokens as peft's
``PeftModel`` running each adapter alone; bad adapters fail at load with one clear line."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.lora.request import LoRARequest
from tests.folder_edits import copy_with_json
from tests.lora.adapters import MAX_TOKENS, make_adapter, peft_greedy

PROMPTS = ["the quick brown fox jumps over", "prefix caching reuses them, chunked prefill",
           "a lazy dog while kvflow pages keys and values through blocks"]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        # every linear layer, rank 8, alpha 16
        "all": make_adapter(tiny_llama.path, str(root / "all"), 1, r=8, lora_alpha=16,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj"]),
        # only q and v (part of the fused qkv_proj) and down, rank 4, rsLoRA scaling
        "qv": make_adapter(tiny_llama.path, str(root / "qv"), 2, r=4, lora_alpha=8,
                           use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
               block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8)


def _requests(adapters: dict[str, str]) -> list[LoRARequest]:
    return [LoRARequest("all", 1, adapters["all"]), LoRARequest("qv", 2, adapters["qv"])]


def test_two_adapters_and_base_in_one_batch_match_peft(llm, tiny_llama, adapters,
                                                       assert_no_leaks):
    lora_all, lora_qv = _requests(adapters)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    runner = llm.engine.core.executor.runner
    seen: list[int] = []  # adapters per step, as the runner mapped them
    original = runner._lora_mapping

    def spy(inputs):
        mapping = original(inputs)
        seen.append(0 if mapping is None else len(mapping.segments))
        return mapping

    runner._lora_mapping = spy
    try:
        outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                       ignore_eos=True),
                            lora_request=[lora_all, lora_qv, None], use_tqdm=False)
    finally:
        runner._lora_mapping = original
    assert seen and max(seen) == 2  # both adapters ran in the same steps
    got = [o.outputs[0].token_ids for o in outs]
    expected = [peft_greedy(tiny_llama.path, adapters["all"], prompt_ids[0]),
                peft_greedy(tiny_llama.path, adapters["qv"], prompt_ids[1]),
                peft_greedy(tiny_llama.path, None, prompt_ids[2])]
    assert got == expected
    # the adapters matter: the same prompt without them decodes otherwise
    assert peft_greedy(tiny_llama.path, None, prompt_ids[0]) != expected[0]
    assert peft_greedy(tiny_llama.path, None, prompt_ids[1]) != expected[1]
    assert_no_leaks(llm)


def test_prefix_cache_keys_include_the_adapter(llm, tiny_llama, adapters, assert_no_leaks):
    """The same long prompt first without, then with each adapter: a prefix hit across
    adapters would reuse the base model's K/V and change the adapted output."""
    lora_all, lora_qv = _requests(adapters)
    ids = llm.get_tokenizer().encode(" ".join(PROMPTS))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core = llm.engine.core
    for lora in (None, lora_all, lora_qv, lora_all):
        hits_before = core.kv_cache_manager.num_hits
        out = llm.generate([ids], params, lora_request=lora, use_tqdm=False)[0]
        expected = peft_greedy(tiny_llama.path, None if lora is None else lora.lora_path, ids)
        assert out.outputs[0].token_ids == expected, lora
    assert core.kv_cache_manager.num_hits > hits_before  # the repeated adapter hit its blocks
    assert_no_leaks(llm)


def test_one_slot_serializes_adapters(tiny_llama, adapters, assert_no_leaks):
    """max_loras=1: requests of the second adapter wait until the first adapter's finish;
    outputs are unchanged."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
              block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8)
    lora_all, lora_qv = _requests(adapters)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_ids, params, lora_request=[lora_all, lora_qv, lora_all],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        peft_greedy(tiny_llama.path, adapters["all"], prompt_ids[0]),
        peft_greedy(tiny_llama.path, adapters["qv"], prompt_ids[1]),
        peft_greedy(tiny_llama.path, adapters["all"], prompt_ids[2])]
    assert_no_leaks(llm)


def test_removed_adapter_leaves_its_slot(llm, tiny_llama, adapters, assert_no_leaks):
    """An id unloaded and loaded again for another folder runs the new weights: the slot
    still holding the old adapter's was taken for it (another prompt, so that no prefix hit
    is involved: see the next test for that)."""
    tok = llm.get_tokenizer()
    first, second = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate([first], params, lora_request=LoRARequest("old", 50, adapters["all"]),
                 use_tqdm=False)
    assert llm.engine.core.remove_lora(50)
    out = llm.generate([second], params, lora_request=LoRARequest("new", 50, adapters["qv"]),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == peft_greedy(tiny_llama.path, adapters["qv"], second)
    assert llm.engine.core.remove_lora(50)
    assert_no_leaks(llm)


def test_adapter_removed_while_its_request_waits_is_not_kept(tiny_llama, adapters,
                                                             assert_no_leaks):
    """max_loras=1: a request of ``qv`` waits behind one of ``all``, and both adapters are
    removed meanwhile. The waiting request still runs with its adapter (read again: peft's
    tokens), but the runner keeps no copy once it is done (it used to keep the unloaded
    weights in host memory for good: a server loading and unloading adapters with requests
    queued grew without bound), and the id loaded again for another folder runs that
    folder's weights, not the stale copy's."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
              block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8)
    engine, core = llm.engine, llm.engine.core
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora_all, lora_qv = _requests(adapters)
    engine.add_request({"prompt_token_ids": ids}, params, "all", lora_request=lora_all)
    engine.add_request({"prompt_token_ids": ids}, params, "qv", lora_request=lora_qv)
    engine.step()  # "all" runs, "qv" waits for the slot
    assert core.remove_lora(1) and core.remove_lora(2)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert outs == {"all": peft_greedy(tiny_llama.path, adapters["all"], ids),
                    "qv": peft_greedy(tiny_llama.path, adapters["qv"], ids)}
    assert core.executor.runner.lora_manager.adapters == {}
    again = llm.generate([ids], params, lora_request=LoRARequest("all", 2, adapters["all"]),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert again == outs["all"]
    assert_no_leaks(llm)


@pytest.mark.parametrize("algo", ["blake2b", "sha256"])
def test_reused_id_and_name_miss_the_old_adapters_blocks(llm, tiny_llama, adapters, algo,
                                                         assert_no_leaks):
    """The same prompt under an id (and name) unloaded and loaded again for another folder:
    its blocks are cached under the old adapter's K/V, so a hit would decode the old
    adapter's tokens; the block key carries the folder, so it misses and peft's tokens for
    the new folder come out (kvflow's hash and vLLM's sha256 alike)."""
    if algo != "blake2b":
        llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
                  block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8,
                  prefix_caching_hash_algo=algo)
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core = llm.engine.core
    old = llm.generate([ids], params, lora_request=LoRARequest("x", 60, adapters["all"]),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert old == peft_greedy(tiny_llama.path, adapters["all"], ids)
    assert core.remove_lora(60)
    hits_before = core.kv_cache_manager.num_hits
    new = llm.generate([ids], params, lora_request=LoRARequest("x", 60, adapters["qv"]),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert new == peft_greedy(tiny_llama.path, adapters["qv"], ids) != old
    assert core.kv_cache_manager.num_hits == hits_before  # no block of the old adapter hit
    assert core.remove_lora(60)
    assert_no_leaks(llm)


def _edit_config(src: str, dst: str, **changes: Any) -> str:
    return os.path.dirname(copy_with_json(src, dst, "adapter_config.json", **changes))


def test_bad_adapters_fail_at_load(llm, tiny_llama, adapters, tmp_path):
    params = SamplingParams(max_tokens=2)
    cases = {
        "exceeds max_lora_rank=8": make_adapter(tiny_llama.path, str(tmp_path / "r16"), 3,
                                                r=16, target_modules=["q_proj"]),
        "cannot be applied": make_adapter(tiny_llama.path, str(tmp_path / "head"), 4, r=4,
                                          target_modules=["q_proj", "lm_head"]),
        "DoRA": _edit_config(adapters["qv"], str(tmp_path / "dora"), use_dora=True),
        "no adapter_config.json": str(tmp_path),
    }
    for i, (message, path) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            llm.generate("hi", params, lora_request=LoRARequest(f"bad{i}", 100 + i, path))
    # id 1 taken by "all" (also when this test runs alone), then claimed by another name
    llm.generate("hi", params, lora_request=LoRARequest("all", 1, adapters["all"]))
    with pytest.raises(ValueError, match="already used"):
        llm.generate("hi", params, lora_request=LoRARequest("other", 1, adapters["qv"]))
    assert not llm.engine.core.has_unfinished_requests()


def test_rank_error_names_the_adapter(llm, tiny_llama, tmp_path):
    """A rank above --max-lora-rank: the error names the adapter and its folder (it named
    neither), whether adapter_config.json says so or only the weights do."""
    params = SamplingParams(max_tokens=2)
    path = make_adapter(tiny_llama.path, str(tmp_path / "r16"), 3, r=16,
                        target_modules=["q_proj"])
    with pytest.raises(ValueError) as exc:
        llm.generate("hi", params, lora_request=LoRARequest("wide", 80, path))
    config_path = os.path.join(path, "adapter_config.json")
    assert str(exc.value) == (f"LoRA adapter 'wide' ({config_path!r}): rank 16 exceeds "
                              "max_lora_rank=8 (start the engine with --max-lora-rank 16 or "
                              "more)")
    lying = _edit_config(path, str(tmp_path / "lying"), r=4)  # the weights still have 16
    with pytest.raises(ValueError) as exc:
        llm.generate("hi", params, lora_request=LoRARequest("lying", 81, lying))
    assert str(exc.value).startswith("LoRA adapter 'lying' (module ") and \
        f"of {lying!r}): rank 16 exceeds max_lora_rank=8" in str(exc.value), exc.value
    assert not llm.engine.core.has_unfinished_requests()


def test_rank_and_alpha_patterns_match_peft(llm, tiny_llama, tmp_path):
    """Per-module ranks and alphas (peft's rank_pattern / alpha_pattern, a suffix and a
    one-layer key): the weights' ranks agree with the config (the check above accepts them)
    and the greedy tokens equal peft's."""
    path = make_adapter(tiny_llama.path, str(tmp_path / "patterns"), 5, r=8, lora_alpha=16,
                        target_modules=["q_proj", "v_proj", "down_proj"],
                        rank_pattern={"v_proj": 4, "layers.1.self_attn.q_proj": 2},
                        alpha_pattern={"down_proj": 4})
    ids = llm.engine.tokenizer.encode(PROMPTS[0])
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       lora_request=LoRARequest("patterns", 95, path))
    assert out[0].outputs[0].token_ids == peft_greedy(tiny_llama.path, path, ids)


@pytest.mark.parametrize("changes, rank", [({"r": 2}, 2), ({"rank_pattern": {"v_proj": 8}}, 8)],
                         ids=["r", "rank_pattern"])
def test_config_rank_that_contradicts_the_weights_is_refused(llm, tiny_llama, adapters,
                                                             tmp_path, changes, rank):
    """adapter_config.json's rank (r, or rank_pattern for a module) differs from the rank of
    the weights (4), both within --max-lora-rank: it was served, scaled by lora_alpha over the
    weights' rank, which is neither what the config says nor loadable: peft refuses it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = _edit_config(adapters["qv"], str(tmp_path / "contradicts"), **changes)
    with pytest.raises(RuntimeError, match="size mismatch"):
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama.path), path)
    with pytest.raises(ValueError) as exc:
        llm.generate("hi", SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("contradicts", 90 + rank, path))
    assert "has rank 4" in str(exc.value) and f"says {rank}" in str(exc.value), exc.value
    assert not llm.engine.core.has_unfinished_requests()


@pytest.mark.parametrize("size", [500, 8], ids=["500_bytes", "8_bytes"])
def test_truncated_adapter_names_the_file(llm, adapters, tmp_path, size):
    import shutil

    path = shutil.copytree(adapters["qv"], str(tmp_path / "cut"))
    weights = os.path.join(path, "adapter_model.safetensors")
    os.truncate(weights, size)
    with pytest.raises(ValueError, match="truncated or corrupt") as exc:
        llm.generate("hi", SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("cut", 50 + size, path))
    assert str(exc.value).startswith(f"LoRA adapter file {weights!r} ")
    assert not llm.engine.core.has_unfinished_requests()


@pytest.mark.parametrize("changes, field", [
    ({"r": "eight"}, "r='eight'"),
    ({"r": None}, "r=None"),
    ({"r": 0}, "r=0"),
    ({"rank_pattern": {"q_proj": 2.5}}, "rank_pattern['q_proj']=2.5"),
    ({"rank_pattern": ["q_proj"]}, "rank_pattern=['q_proj']"),
    ({"lora_alpha": "16"}, "lora_alpha='16'"),
    ({"alpha_pattern": {"v_proj": True}}, "alpha_pattern['v_proj']=True"),
])
def test_bad_adapter_config_values_name_field_and_file(llm, adapters, tmp_path, changes, field):
    path = _edit_config(adapters["qv"], str(tmp_path / "bad"), **changes)
    with pytest.raises(ValueError) as exc:
        llm.generate("hi", SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("bad", 60, path))
    config_path = os.path.join(path, "adapter_config.json")
    assert str(exc.value).startswith(f"{config_path!r} {field}: "), exc.value


@pytest.mark.parametrize("changes, field", [
    # peft applies an activated LoRA only from its invocation tokens on: run on every token
    # it would change outputs silently
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens=[5, 6]"),
    ({"lora_bias": True}, "lora_bias=True"),
    # layer 1 replaced by a copy of layer 0: same layer count, different model
    ({"layer_replication": [[0, 1], [0, 1]]}, "layer_replication=[[0, 1], [0, 1]]"),
    ({"target_parameters": ["experts.gate_up_proj"]},
     "target_parameters=['experts.gate_up_proj']"),
    ({"trainable_token_indices": [3, 4]}, "trainable_token_indices=[3, 4]"),
    # peft rebuilds a PiSSA / OLoRA base (W minus the initial adapter) when it loads one
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4'"),
    ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
    ({"init_lora_weights": "loftq"}, "init_lora_weights='loftq'"),
], ids=["alora", "lora_bias", "layer_replication", "target_parameters", "trainable_tokens",
        "pissa", "olora", "loftq"])
def test_unsupported_peft_features_name_field_and_file(llm, adapters, tmp_path, changes, field):
    path = _edit_config(adapters["qv"], str(tmp_path / "unsupported"), **changes)
    with pytest.raises(ValueError) as exc:
        llm.generate("hi", SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("unsupported", 80, path))
    config_path = os.path.join(path, "adapter_config.json")
    assert str(exc.value).startswith(f"{config_path!r} {field}: "), exc.value
    assert not llm.engine.core.has_unfinished_requests()


def test_adapter_config_that_is_not_an_object(llm, tmp_path):
    (tmp_path / "adapter_config.json").write_text("[8]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        llm.generate("hi", SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("list", 70, str(tmp_path)))
    (tmp_path / "adapter_config.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="cannot read .*adapter_config.json"):
        llm.generate("hi", SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("binary", 71, str(tmp_path)))


def test_lora_needs_enable_lora(tiny_llama, adapters):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate("hi", SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("all", 1, adapters["all"]))


def test_phi3_fused_checkpoint_modules(tiny_model_factory, tmp_path, assert_no_leaks):
    """Phi-3 checkpoints fuse q/k/v and gate/up, so its adapters target ``qkv_proj`` and
    ``gate_up_proj`` whole (one A and B for the fused layer)."""
    tiny = tiny_model_factory("phi3_longrope")
    path = make_adapter(tiny.path, str(tmp_path / "phi3"), 7, r=4, lora_alpha=8,
                        target_modules=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"])
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, enable_lora=True, max_lora_rank=4)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    out = llm.generate([ids, ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True),
                       lora_request=[LoRARequest("phi", 1, path), None], use_tqdm=False)
    expected = peft_greedy(tiny.path, path, ids)
    assert out[0].outputs[0].token_ids == expected != peft_greedy(tiny.path, None, ids)
    assert out[1].outputs[0].token_ids == peft_greedy(tiny.path, None, ids)
    assert_no_leaks(llm)


def _peft_prompt_logprobs(base, adapter: str | None, ids: list[int]) -> list[float]:
    """log p(ids[p] | ids[:p]) for p >= 1 under transformers + peft (fp32; ``adapter``
    None: the base model alone)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))]


def test_deepseek_mla_projections_match_peft(tiny_model_factory, tmp_path):
    """DeepSeek-V3's MLA takes adapters on q_a/q_b, kv_a_proj_with_mqa and o_proj (prompt
    logprobs equal peft's); one on kv_b_proj (absorbed into the queries and the output, never
    a matmul here) is refused."""
    tiny = tiny_model_factory("deepseek_v3")
    path = make_adapter(tiny.path, str(tmp_path / "mla"), 9, r=4, lora_alpha=8,
                        target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"])
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=32,
              block_size=4, enable_lora=True, max_lora_rank=4)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          lora_request=LoRARequest("mla", 1, path), use_tqdm=False)
    got = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    assert got == pytest.approx(_peft_prompt_logprobs(tiny.path, path, ids), abs=1e-4)
    kv_b = make_adapter(tiny.path, str(tmp_path / "kv_b"), 10, r=4,
                        target_modules=["q_a_proj", "kv_b_proj"])
    with pytest.raises(ValueError, match=r"'base_model.model.model.layers.0.self_attn.kv_b_proj' "
                                         r"cannot be applied"):
        llm.generate("hi", SamplingParams(max_tokens=2), lora_request=LoRARequest("kvb", 2, kv_b))


def test_gemma3_adapter_matches_peft(tiny_model_factory, tmp_path):
    """Gemma 3 (GeGLU, four norms per layer, local/global layers, soft-capped logits) takes
    the Llama family's adapters: q/k/v, o, gate/up and down; prompt logprobs equal peft's on a
    prompt longer than its sliding window."""
    tiny = tiny_model_factory("gemma3")
    path = make_adapter(tiny.path, str(tmp_path / "gemma3"), 8, r=4, lora_alpha=8,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"])
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=32,
              block_size=4, enable_lora=True, max_lora_rank=4)
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    assert len(ids) > tiny.hf_model.config.sliding_window
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          lora_request=LoRARequest("gemma", 1, path), use_tqdm=False)
    got = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    assert got == pytest.approx(_peft_prompt_logprobs(tiny.path, path, ids), abs=1e-4)


_DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("name, targets", [
    ("gemma2", _DENSE), ("granite", _DENSE), ("olmo2", _DENSE),
    # GLM's checkpoints fuse gate/up (as Phi-3's): its adapters target gate_up_proj whole
    ("glm4", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]),
    ("granite_moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),
])
def test_llama_variant_adapters_match_peft(tiny_model_factory, tmp_path, name, targets):
    """Gemma 2 (soft-capped attention), Granite (multipliers), OLMo 2 (post-norms, whole
    projection q/k norm), GLM-4-0414 and Granite MoE take the Llama family's adapters:
    prompt logprobs equal peft's."""
    tiny = tiny_model_factory(name)
    path = make_adapter(tiny.path, str(tmp_path / name), 11, r=4, lora_alpha=8,
                        target_modules=targets)
    llm = LLM(model=tiny.path, dtype="float32", device="cpu", num_kv_blocks=32,
              block_size=4, enable_lora=True, max_lora_rank=4)
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    (out,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          lora_request=LoRARequest(name, 1, path), use_tqdm=False)
    got = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    want = _peft_prompt_logprobs(tiny.path, path, ids)
    assert got == pytest.approx(want, abs=1e-4)
    assert want != pytest.approx(_peft_prompt_logprobs(tiny.path, None, ids), abs=1e-3)


def test_adapter_folder_given_as_the_model_says_how_to_serve_it(tiny_llama, adapters):
    with pytest.raises(ValueError, match="has no config.json") as exc:
        LLM(model=adapters["qv"], device="cpu")
    assert (f"It is a LoRA adapter (adapter_config.json): serve {tiny_llama.path!r} with "
            f"--enable-lora --lora-modules NAME={adapters['qv']}") in str(exc.value)


@pytest.fixture(scope="module")
def peft_first_prompt(tiny_llama, adapters) -> tuple[list[int], dict[str | None, list[int]]]:
    """PROMPTS[0]'s ids and peft's greedy tokens for it under each adapter and none."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_llama.path).encode(PROMPTS[0])
    expected = {name: peft_greedy(tiny_llama.path, adapters.get(name), ids)
                for name in ("all", "qv", None)}
    assert len({tuple(v) for v in expected.values()}) == 3  # the adapters change the tokens
    return ids, expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_adapters_under_preemption_match_peft(tiny_llama, adapters, peft_first_prompt,
                                              monkeypatch, mode, assert_no_leaks):
    """One prompt under both adapters and the base model, twice each, in a 12-block pool:
    requests are preempted (recomputed, or swapped out and back in, where the swapped-in
    blocks are indexed for prefix caching again) and their blocks shared by prefix caching
    only with requests of the same adapter. Tokens equal peft's, each adapter alone."""
    from tests.core.swap_checks import always_swap

    if mode == "swap":
        always_swap(monkeypatch)
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=12,
              block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8,
              preemption_mode=mode, **({"swap_space": "1MiB"} if mode == "swap" else {}))
    ids, expected = peft_first_prompt
    loras = [*_requests(adapters), None] * 2
    outs = llm.generate([ids] * 6, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True),
                        lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == \
        [expected[None if a is None else a.lora_name] for a in loras]
    sched = llm.engine.core.scheduler
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.swap.num_swapped_out > 0
        sched.swap.release_read_blocks()
        assert sched.swap.host.num_free_blocks == sched.swap.host.num_blocks
    assert_no_leaks(llm)


def test_adapters_with_ngram_speculation_match_peft(llm, tiny_llama, adapters,
                                                    peft_first_prompt, assert_no_leaks):
    """LoRA with n-gram speculative decoding: each request's drafts are verified with its own
    adapter, so greedy tokens equal peft's (each adapter alone) and logprobs and prompt
    logprobs equal the run without speculation."""
    spec = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
               block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 1, "adaptive": False})
    ids, expected = peft_first_prompt
    loras = [*_requests(adapters), None]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    got = spec.generate([ids] * 3, params, lora_request=loras, use_tqdm=False)
    plain = llm.generate([ids] * 3, params, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == \
        [expected[None if a is None else a.lora_name] for a in loras]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    for s, p in zip(got, plain):
        for rows in ((s.outputs[0].logprobs, p.outputs[0].logprobs),
                     (s.prompt_logprobs[1:], p.prompt_logprobs[1:])):
            for a, b in zip(*rows):
                assert {t: x.logprob for t, x in a.items()} == \
                    pytest.approx({t: x.logprob for t, x in b.items()}, abs=1e-5)
    assert_no_leaks(spec)


def test_parallel_samples_and_logprobs_of_each_adapter_match_peft(llm, tiny_llama, adapters,
                                                                  tmp_path, assert_no_leaks):
    """n=2 greedy samples, their logprobs and the prompt logprobs of one prompt under each of
    three adapters of different ranks and targets (two slots: the third waits for one) and
    the base model, in one call: every sample is peft's greedy tokens, every logprob peft's
    within 1e-4 (teacher forcing, fp32), and no sample or prompt shares K/V across adapters
    (the prompt is the same for all four)."""
    from tests.lora.adapters import peft_logprobs

    r2 = make_adapter(tiny_llama.path, str(tmp_path / "r2"), 3, r=2, lora_alpha=4,
                      target_modules=["k_proj", "up_proj"])
    loras = [*_requests(adapters), LoRARequest("r2", 60, r2), None]
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    params = SamplingParams(temperature=0, n=2, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=1, prompt_logprobs=1)
    outs = llm.generate([ids] * 4, params, lora_request=loras, use_tqdm=False)
    for lora, out in zip(loras, outs):
        path = None if lora is None else lora.lora_path
        expected = peft_greedy(tiny_llama.path, path, ids)
        ref = peft_logprobs(tiny_llama.path, path, ids + expected)
        assert [list(c.token_ids) for c in out.outputs] == [expected] * 2, lora
        for sample in out.outputs:
            got = [entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs)]
            want = [ref[len(ids) - 1 + i, t].item() for i, t in enumerate(expected)]
            assert got == pytest.approx(want, abs=1e-4), lora
        got = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
        assert got == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                    abs=1e-4), lora
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 4  # each adapter matters
    assert llm.engine.core.remove_lora(60)
    assert_no_leaks(llm)


def test_chat_takes_a_lora_request(llm, tiny_llama, adapters):
    """``LLM.chat(..., lora_request=...)`` (vLLM's offline chat argument) renders each
    conversation and decodes it with its adapter: peft's greedy tokens for the rendered ids
    (it was a TypeError)."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    lora_all, _ = _requests(adapters)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True),
                    use_tqdm=False, chat_template=template, lora_request=[lora_all, None])
    for out, adapter in zip(outs, (adapters["all"], None)):
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama.path, adapter,
                                                       out.prompt_token_ids)
    assert outs[0].prompt == f"<user>{PROMPTS[0]}\n"


def test_engine_stats_name_the_running_and_waiting_adapters(llm, adapters, assert_no_leaks):
    """What vLLM's ``lora_requests_info`` gauge shows: requests of both adapters and one of
    the base model, queued: both adapters waiting (sorted, each once), none running; after
    one step all three run; once they finish, neither list names one."""
    from kvflow.engine.core_stats import collect_stats

    lora_all, lora_qv = _requests(adapters)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for lora in (lora_qv, lora_all, None, lora_qv):
        llm.engine.add_request(PROMPTS[0], params, lora_request=lora)
    stats = collect_stats(llm.engine.core)
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == ([], ["all", "qv"])
    llm.engine.step()
    stats = collect_stats(llm.engine.core)
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (["all", "qv"], [])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    stats = collect_stats(llm.engine.core)
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == ([], [])
    assert_no_leaks(llm)


@pytest.mark.parametrize(("algo", "new_id"), [("blake2b", 70), ("sha256", 71)])
def test_an_adapter_folder_rewritten_between_loads_misses_its_old_blocks(
        tiny_llama, adapters, tmp_path, algo, new_id, assert_no_leaks):
    """An adapter unloaded, its folder rewritten (a training loop's next checkpoint), and
    loaded again under the same name and folder: the blocks its old weights filled were
    still indexed under the same key (vLLM's hashes key name + folder; kvflow's also the id,
    which an offline caller may reuse) and served a hit, so the old adapter's tokens came
    out. Oracle: peft's greedy tokens on the new files."""
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=128,
              block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8,
              prefix_caching_hash_algo=algo)
    folder = str(tmp_path / "adapter")
    shutil.copytree(adapters["all"], folder)
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core = llm.engine.core
    old = llm.generate([ids], params, lora_request=LoRARequest("x", 70, folder),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert old == peft_greedy(tiny_llama.path, adapters["all"], ids)
    assert core.remove_lora(70)
    shutil.rmtree(folder)
    shutil.copytree(adapters["qv"], folder)
    hits_before = core.kv_cache_manager.num_hits
    new = llm.generate([ids], params, lora_request=LoRARequest("x", new_id, folder),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert new == peft_greedy(tiny_llama.path, adapters["qv"], ids) != old
    assert core.kv_cache_manager.num_hits == hits_before  # no block of the old files hit
    assert_no_leaks(llm)
    llm.shutdown()
