"""EAGLE-1 speculative decoding through the whole engine, on the tiny random Llama and a tiny
random EAGLE head saved here in the EAGLE-1 key layout (fc.weight [H, 2H] + fc.bias,
layers.0.* without input_layernorm, the target's embedding and LM head shared).

Oracles: a plain-torch EAGLE-1 forward fed HF transformers' final hidden states gives, for
every context the engine drafted at, the same draft tokens; greedy output equals plain greedy
output (and transformers' greedy continuation); the acceptance counters equal the prefix of
each step's drafts that the final output confirms.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from kvflow import LLM, SamplingParams
from kvflow.spec_decode.eagle import EagleDrafter
from tests.spec_decode.head_reference import expected_counts, ref_rollout
from tests.spec_decode.test_ngram_engine import PROMPTS, _drafted, _same_outputs


def _save_head(folder: str, target_path: str, seed: int, bias: bool = True) -> dict:
    """A random EAGLE-1 head for the target at ``target_path``; returns its tensors."""
    with open(os.path.join(target_path, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 1
    config["architectures"] = ["EagleLlamaForCausalLM"]
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or \
        config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    tensors = {"fc.weight": rand(h, 2 * h, scale=0.1),
               "layers.0.self_attn.q_proj.weight": rand(heads * d, h),
               "layers.0.self_attn.k_proj.weight": rand(kv * d, h),
               "layers.0.self_attn.v_proj.weight": rand(kv * d, h),
               "layers.0.self_attn.o_proj.weight": rand(h, heads * d),
               "layers.0.mlp.gate_proj.weight": rand(inter, h),
               "layers.0.mlp.up_proj.weight": rand(inter, h),
               "layers.0.mlp.down_proj.weight": rand(h, inter),
               "layers.0.post_attention_layernorm.weight": 1 + rand(h, scale=0.05)}
    if bias:
        tensors["fc.bias"] = rand(h, scale=0.05)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return {"config": config, "tensors": tensors}


def _save_mimic_head(folder: str, target) -> dict:
    """A head holding a ONE-layer target's layer, norms and fc = [I | small]: (nearly) the
    embedding only, so h'[p] is about the target's pre-norm state at p + 1 over x[1..p+1]
    (it lacks x[0]) and its drafts are often right."""
    sd = target.hf_model.state_dict()
    with open(os.path.join(target.path, "config.json")) as f:
        config = json.load(f)
    assert config["num_hidden_layers"] == 1
    config["architectures"] = ["EagleLlamaForCausalLM"]
    h = config["hidden_size"]
    tensors = {name[len("model."):]: t.clone() for name, t in sd.items()
               if name.startswith("model.layers.0.") or name == "model.norm.weight"}
    g = torch.Generator().manual_seed(11)  # features matter, a little
    tensors["fc.weight"] = torch.cat([torch.eye(h), 0.002 * torch.randn(h, h, generator=g)], 1)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return {"config": config, "tensors": tensors}


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF Llama's rotate-half RoPE of x [T, heads, d] at positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].float()
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].float()
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _ref_head(head: dict, embed: torch.Tensor, ids_next: list[int],
              feats: torch.Tensor) -> torch.Tensor:
    """Plain-torch EAGLE-1 over positions 0..T-1: tokens x[p+1], features f[p] -> h'[p]."""
    t, eps = head["tensors"], head["config"]["rms_norm_eps"]
    x = torch.cat([embed[ids_next], feats], -1) @ t["fc.weight"].T + t.get("fc.bias", 0)
    a = _rms(x, t["layers.0.input_layernorm.weight"], eps) \
        if "layers.0.input_layernorm.weight" in t else x
    return _ref_decoder_layer(head, a, x)


def _ref_decoder_layer(head: dict, attn_in: torch.Tensor, residual: torch.Tensor
                       ) -> torch.Tensor:
    """Plain-torch Llama decoder layer 0 of ``head`` (its config and tensors) over positions
    0..T-1, causal: attention over ``attn_in`` [T, in] (q/k/v projections, RoPE, GQA), plus
    ``residual`` [T, H], then the post-attention RMSNorm + SwiGLU MLP with its residual."""
    cfg, t = head["config"], head["tensors"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    n, eps = attn_in.shape[0], cfg["rms_norm_eps"]
    pos = torch.arange(n)
    theta = cfg.get("rope_theta", 10000.0)
    q = _rope((attn_in @ t["layers.0.self_attn.q_proj.weight"].T).view(n, heads, d), pos, theta)
    k = _rope((attn_in @ t["layers.0.self_attn.k_proj.weight"].T).view(n, kv, d), pos, theta)
    v = (attn_in @ t["layers.0.self_attn.v_proj.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    h = o @ t["layers.0.self_attn.o_proj.weight"].T + residual
    hn = _rms(h, t["layers.0.post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(hn @ t["layers.0.mlp.gate_proj.weight"].T) *
           (hn @ t["layers.0.mlp.up_proj.weight"].T)) @ t["layers.0.mlp.down_proj.weight"].T
    return mlp + h


def _ref_logits(hf_model, head: dict, context: list[int], k: int,
                drafts: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """EAGLE-1's k drafts after ``context`` (x[0..n]) and their logits [k, V]: the head over
    positions 0..n-1 with transformers' final (post-norm) hidden states, then its own outputs
    fed back with each draft: the argmax, or ``drafts[i]`` where given (sampled drafts)."""
    t, eps = head["tensors"], head["config"]["rms_norm_eps"]
    with torch.no_grad():
        out = hf_model(torch.tensor([context[:-1]]), output_hidden_states=True)
    embed = hf_model.get_input_embeddings().weight
    lm_head = hf_model.get_output_embeddings().weight

    def readout(last: torch.Tensor) -> tuple[torch.Tensor, int]:
        if "norm.weight" in t:  # before the LM head only
            last = _rms(last, t["norm.weight"], eps)
        logits = last @ lm_head.T
        return logits, int(logits.argmax())

    return ref_rollout(lambda ids, feats: _ref_head(head, embed, ids, feats), readout, context,
                       out.hidden_states[-1][0], k, drafts)  # features after the final norm


def _ref_drafts(hf_model, head: dict, context: list[int], k: int) -> list[int]:
    """EAGLE-1's k greedy drafts after ``context`` (``_ref_logits``)."""
    return _ref_logits(hf_model, head, context, k)[0]


def _engine(path: str, head: str | None, k: int = 3, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 96)
    spec = None if head is None else {"method": "eagle", "model": head,
                                      "num_speculative_tokens": k, "adaptive": False}
    return LLM(model=path, dtype="float32", block_size=4, speculative_config=spec, **kw)


@pytest.fixture(scope="module", params=["random", "mimic"])
def pair(request, tiny_model_factory, tmp_path_factory):
    """(target TinyModel, head folder, head tensors, plain engine, EAGLE engine): a random
    head (fc bias, no norms) on the tiny Llama, or the near-right head (both norms) on the
    one-layer Llama."""
    folder = str(tmp_path_factory.mktemp(f"eagle_{request.param}"))
    if request.param == "random":
        target = tiny_model_factory("llama")
        head = _save_head(folder, target.path, seed=7)
    else:
        target = tiny_model_factory("llama_1layer")
        head = _save_mimic_head(folder, target)
    return (target, folder, head, _engine(target.path, None), _engine(target.path, folder),
            request.param)


def _record_proposals(monkeypatch) -> list[tuple[list[int], list[int], torch.Tensor | None]]:
    """Spy on EagleDrafter.propose: (context x[0..n], drafts, their q [k, V] or None) of
    every drafting request."""
    seen: list[tuple[list[int], list[int], torch.Tensor | None]] = []
    original = EagleDrafter.propose

    def spy(self, batch, *args, **kwargs):
        contexts = {rid: batch.token_ids[row, :batch.num_tokens[row]].tolist()
                    for rid, row in batch.req_id_to_index.items()}
        proposal = original(self, batch, *args, **kwargs)
        seen.extend((contexts[rid], tokens, proposal.probs.get(rid))
                    for rid, tokens in proposal.token_ids.items())
        return proposal

    monkeypatch.setattr(EagleDrafter, "propose", spy)
    return seen


def test_drafts_match_a_plain_torch_eagle_head(pair, monkeypatch):
    target, _, head, _, eagle, _ = pair
    seen = _record_proposals(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eagle.generate(PROMPTS[:2], params, use_tqdm=False)
    assert len(seen) >= 4
    for context, drafts, _ in seen:
        assert drafts == _ref_drafts(target.hf_model, head, context, len(drafts))


def test_sampled_draft_distributions_match_the_reference(pair, monkeypatch):
    """Sampled requests: each draft's q (softmax of the head's logits at temperature 1) is the
    reference head's, after contexts where earlier drafts were accepted too (the head's K/V of
    accepted drafts is computed again from the target's features)."""
    target, _, head, _, eagle, _ = pair
    seen = _record_proposals(monkeypatch)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=25, ignore_eos=True)
              for s in range(len(PROMPTS))]
    got = eagle.generate(PROMPTS, params, use_tqdm=False)
    assert _drafted(got)[1] > 0  # some accepted: later contexts follow accepted drafts
    assert len(seen) >= 8
    for context, drafts, q in seen:
        _, logits = _ref_logits(target.hf_model, head, context, len(drafts), drafts)
        torch.testing.assert_close(q, logits.softmax(-1), atol=2e-5, rtol=1e-3)


@pytest.mark.parametrize("max_tokens", [1, 7, 30])
def test_greedy_equals_plain_greedy_and_transformers(pair, assert_no_leaks, monkeypatch,
                                                     max_tokens):
    target, _, _, base, eagle, kind = pair
    seen = _record_proposals(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = base.generate(PROMPTS, params, use_tqdm=False)
    got = eagle.generate(PROMPTS, params, use_tqdm=False)
    _same_outputs(ref, got)
    for o in got[:1]:  # transformers' own greedy continuation
        prompt = torch.tensor([o.prompt_token_ids])
        hf = target.hf_model.generate(prompt, max_new_tokens=max_tokens, do_sample=False,
                                      min_new_tokens=max_tokens)
        assert o.outputs[0].token_ids == hf[0, prompt.shape[1]:].tolist()
    # the counters: each step's drafts accepted up to the first the output contradicts
    expected_drafted, expected_accepted = expected_counts(seen, got)
    assert _drafted(got) == (expected_drafted, expected_accepted)
    if max_tokens == 30:
        assert expected_drafted > 0
        if kind == "mimic":  # near the one-layer target (x[0] missing): 23% measured,
            assert expected_accepted >= 0.08 * expected_drafted  # the random head's 0.3%
    assert_no_leaks(eagle)


def test_preemption_and_prefix_cache_keep_greedy_output(pair, assert_no_leaks):
    target, folder, _, base, _, _ = pair
    prompts = [PROMPTS[i % 4] + " " + "ab" * (i % 3) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = base.generate(prompts, params, use_tqdm=False)
    spec = _engine(target.path, folder, num_kv_blocks=30, max_num_seqs=8)
    got = spec.generate(prompts, params, use_tqdm=False)
    _same_outputs(ref, got)
    assert spec.engine.core.scheduler.num_preemptions > 0
    again = spec.generate(prompts[-1:], params, use_tqdm=False)  # a prefix-cache hit
    _same_outputs(ref[-1:], again)
    assert_no_leaks(spec)


def test_sampling_keeps_the_target_distribution(tiny_model_factory, tmp_path):
    """Temperature 0.8, top_k=5; the near-right head drafts 2 tokens from its own top 5. The
    second token's marginal over 2,000 requests must match sum_t1 p(t1) p(t2 | t1) from
    transformers (chi-square, p > 0.001), with drafts both accepted and rejected."""
    from tests.spec_decode.test_draft_model_engine import second_token_marginal
    from tests.spec_decode.test_rejection_sampler import assert_sampled_token_follows

    target = tiny_model_factory("llama_1layer")
    _save_mimic_head(str(tmp_path / "head"), target)
    prompt, top_k, temperature, n = [5, 17, 42, 99, 7, 23], 5, 0.8, 2000
    marginal = second_token_marginal(target.hf_model, prompt, top_k, temperature)
    spec = _engine(target.path, str(tmp_path / "head"), k=2, num_kv_blocks=4000,
                   max_num_seqs=256)
    outs = spec.generate([prompt] * n, SamplingParams(temperature=temperature, top_k=top_k,
                                                      max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
    assert_sampled_token_follows(outs, 1, marginal)
    drafted, accepted = _drafted(outs)
    assert drafted >= n and 0 < accepted < drafted


def test_pytorch_model_bin_head_with_model_prefix(tiny_model_factory, tmp_path, monkeypatch):
    """EAGLE's own releases ship a pytorch_model.bin; names may carry ``model.``: the head
    loads the same and drafts as the reference does."""
    target = tiny_model_factory("llama_1layer")
    head = _save_mimic_head(str(tmp_path / "st"), target)
    folder = tmp_path / "bin"
    folder.mkdir()
    torch.save({f"model.{n}": t for n, t in head["tensors"].items()},
               folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(head["config"]))
    seen = _record_proposals(monkeypatch)
    llm = _engine(target.path, str(folder))
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    assert len(seen) >= 4
    for context, drafts, _ in seen:
        assert drafts == _ref_drafts(target.hf_model, head, context, len(drafts))


@pytest.mark.parametrize("change, needle", [
    ("hidden", "does not fit the target's"),
    ("extra", (r"'layers.1.mlp.up_proj.weight' matches no parameter of an EAGLE-1 head \(fc, "
              r"layers.0, norm, embed_tokens, lm_head\)$")),
    ("missing", "lacks \\['fc.weight'\\]"),
    # one part of the fused qkv_proj: the head ran with k's rows uninitialized
    ("missing_part", "lacks \\['layers.0.self_attn.k_proj.weight'\\]"),
])
def test_head_checkpoint_errors_name_the_head(tiny_llama, tmp_path, change, needle):
    head = _save_head(str(tmp_path), tiny_llama.path, seed=3, bias=False)
    tensors = head["tensors"]
    if change == "hidden":
        head["config"]["hidden_size"] = 32
        (tmp_path / "config.json").write_text(json.dumps(head["config"]))
    elif change == "extra":
        tensors["layers.1.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"].clone()
    elif change == "missing_part":
        del tensors["layers.0.self_attn.k_proj.weight"]
    else:
        del tensors["fc.weight"]
    save_file(tensors,
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"speculative_config model .*{needle}"):
        _engine(tiny_llama.path, str(tmp_path))


def test_constrained_greedy_equals_plain_constrained(pair, assert_no_leaks, monkeypatch):
    """A regex-constrained request: every verified position is masked, so the output is plain
    constrained greedy output; the head drafts for it too, each draft within the grammar's row
    after the drafts before it (so every draft is a token the grammar allows there)."""
    import regex

    from kvflow.structured import StructuredOutputsParams
    from tests.spec_decode.test_draft_constrained import REGEX

    _, _, _, base, eagle, _ = pair
    seen = _record_proposals(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    ref = base.generate(PROMPTS, params, use_tqdm=False)
    got = eagle.generate(PROMPTS, params, use_tqdm=False)
    _same_outputs(ref, got)
    tokenizer = eagle.get_tokenizer()
    for out in got:
        assert out.outputs[0].finish_reason == "stop"
        assert regex.fullmatch(REGEX, out.outputs[0].text)
    assert _drafted(got)[0] > 0
    assert len(seen) > 0
    for context, drafts, _ in seen:  # draft 1 keeps the text a prefix of a match (or EOS)
        prompt_len = next(len(o.prompt_token_ids) for o in got
                          if context[:len(o.prompt_token_ids)] == o.prompt_token_ids)
        text = tokenizer.decode(context[prompt_len:] + drafts[:1], skip_special_tokens=True)
        assert regex.fullmatch(REGEX, text, partial=True), text
    assert_no_leaks(eagle)



def test_head_declaring_fewer_positions_than_the_target_drafts_everywhere(tiny_model_factory,
                                                                          tmp_path,
                                                                          assert_no_leaks):
    """A head whose config declares 32 positions (the common Llama 3 EAGLE heads declare
    2048 for 8k-128k targets) on a target of 256: its rotary table is extended to the
    target's, so prompts of 40-60 tokens draft exactly as a head declaring 256 does (same
    drafts, same acceptance), with plain greedy output. Its table had 32 rows: the first
    step past position 31 raised "rotary: positions must lie in [0, 32)", failing its
    requests."""
    target = tiny_model_factory("llama_1layer")
    full, short = str(tmp_path / "head256"), str(tmp_path / "head32")
    _save_mimic_head(full, target)
    _save_mimic_head(short, target)
    with open(os.path.join(short, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(short, "config.json"), "w") as f:
        json.dump({**config, "max_position_embeddings": 32}, f)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, target.vocab_size, (n,), generator=gen).tolist()
               for n in (40, 60)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = _engine(target.path, None).generate(prompts, params, use_tqdm=False)
    runs = {}
    for name, head in (("full", full), ("short", short)):
        llm = _engine(target.path, head)
        runs[name] = llm.generate(prompts, params, use_tqdm=False)
        _same_outputs(ref, runs[name])
        assert_no_leaks(llm)
    assert _drafted(runs["short"]) == _drafted(runs["full"])
    assert _drafted(runs["short"])[1] > 0


@pytest.mark.parametrize("prompts_and_lengths", [((16, 12),), ((17, 5), (9, 20))],
                         ids=["last_token_alone", "one_token_chunks"])
def test_chunked_prompts_draft_as_the_reference_head(pair, monkeypatch, assert_no_leaks,
                                                     prompts_and_lengths):
    """Chunked prefill, 5 tokens a step ((prompt length, max_tokens) per request).

    last_token_alone: a 16-token prompt goes in chunks of 5, 5, 5, then its last token
    alone, verifying 3 drafts after it: the mirror pass reads the feature of the chunk
    before's last position again (draft 1's logits). It had been dropped, and the step
    failed ("EAGLE: request '0' has target features for positions 15..14, not 14..14").

    one_token_chunks: beside the first request's 1 + 3 tokens a step, the second prompt
    goes in one-token chunks, then (the first done) its last 2 tokens: the head read none
    of those one-token chunks, so its K/V there held whatever the blocks held and its
    drafts were not the reference head's (the output stayed exact).

    Oracle: every proposal is the plain-torch head's over the whole context; greedy output
    is plain greedy output."""
    target, folder, head, base, _, _ = pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, target.vocab_size, (n,), generator=gen).tolist()
               for n, _ in prompts_and_lengths]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for _, m in prompts_and_lengths]
    seen = _record_proposals(monkeypatch)
    eagle = _engine(target.path, folder, max_num_batched_tokens=5)
    got = eagle.generate(prompts, params, use_tqdm=False)
    _same_outputs(base.generate(prompts, params, use_tqdm=False), got)
    for prompt in prompts:  # each request drafted
        assert any(c[:len(prompt)] == prompt for c, _, _ in seen)
    for context, drafts, _ in seen:
        assert drafts == _ref_drafts(target.hf_model, head, context, len(drafts))
    assert_no_leaks(eagle)
