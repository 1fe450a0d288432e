"""EAGLE-3 speculative decoding (``method: eagle3``) through the whole engine, on tiny random
Llamas and tiny EAGLE-3 heads saved here in vLLM's ``Eagle3LlamaForCausalLM`` key layout
(EAGLE's ``midlayer.*`` names, fc [H, 3H], q/k/v over 2H, hidden_norm, its own draft vocabulary
through ``d2t``, the target's embedding shared).

Oracles: a plain-torch EAGLE-3 forward written from the paper / vLLM's layout, fed
transformers' ``output_hidden_states`` (the residual stream entering the tapped layers), gives
for every context the engine drafted at the same greedy drafts and the same draft
distributions (fp32 tolerance); greedy output equals plain greedy output token for token; the
acceptance counters equal the prefix of each step's drafts that the output confirms, and a
head built to agree with a one-layer target gets drafts accepted.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_native import native_cpu_kernels
from kvflow.models.eagle3 import default_aux_layer_ids
from kvflow.worker.cpu_graphs import CpuGraphRunner
from tests.spec_decode.head_reference import expected_counts, ref_rollout
from tests.spec_decode.test_eagle_engine import (
    _record_proposals,
    _ref_decoder_layer,
    _rms,
)
from tests.spec_decode.test_ngram_engine import PROMPTS, _drafted, _same_outputs

DRAFT_VOCAB = 200  # of the tokenizer's 320


def _head_config(target_path: str, layer_ids: list[int] | None) -> dict:
    with open(os.path.join(target_path, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"],
                  draft_vocab_size=DRAFT_VOCAB)
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    return config


def _draft_ids(vocab: int, seed: int, always: list[int] = ()) -> torch.Tensor:
    """DRAFT_VOCAB distinct target ids, sorted, containing ``always``."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
    rest = [t for t in perm if t not in always][:DRAFT_VOCAB - len(always)]
    return torch.tensor(sorted([*always, *rest]), dtype=torch.int64)


def _save(folder: str, config: dict, tensors: dict) -> dict:
    """Save ``tensors`` with EAGLE's ``midlayer.`` names for ``layers.0.``."""
    os.makedirs(folder, exist_ok=True)
    save_file({n.replace("layers.0.", "midlayer."): t.contiguous() for n, t in tensors.items()},
              os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return {"config": config, "tensors": tensors}


def _save_random_head(folder: str, target_path: str, seed: int, layer_ids=(1, 0, 1)) -> dict:
    config = _head_config(target_path, list(layer_ids) if layer_ids else None)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    ids = _draft_ids(config["vocab_size"], seed)
    tensors = {"fc.weight": rand(h, 3 * h, scale=0.1),
               "layers.0.self_attn.q_proj.weight": rand(heads * d, 2 * h),
               "layers.0.self_attn.k_proj.weight": rand(kv * d, 2 * h),
               "layers.0.self_attn.v_proj.weight": rand(kv * d, 2 * h),
               "layers.0.self_attn.o_proj.weight": rand(h, heads * d),
               "layers.0.mlp.gate_proj.weight": rand(inter, h),
               "layers.0.mlp.up_proj.weight": rand(inter, h),
               "layers.0.mlp.down_proj.weight": rand(h, inter),
               "layers.0.input_layernorm.weight": 1 + rand(h, scale=0.1),
               "layers.0.hidden_norm.weight": 1 + rand(h, scale=0.1),
               "layers.0.post_attention_layernorm.weight": 1 + rand(h, scale=0.1),
               "norm.weight": 1 + rand(h, scale=0.1),
               "lm_head.weight": rand(DRAFT_VOCAB, h, scale=0.3),
               "d2t": ids - torch.arange(DRAFT_VOCAB),
               "t2d": torch.zeros(config["vocab_size"], dtype=torch.bool).index_fill_(0, ids, True)}
    return _save(folder, config, tensors)


def _quiet_target(folder: str, target) -> object:
    """The one-layer tiny Llama with its embedding scaled by 0.02: the residual stream is then
    (nearly) the attention's and MLP's outputs, which a head can copy (``_save_mimic_head``)."""
    hf = copy.deepcopy(target.hf_model)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(0.02)
    hf.save_pretrained(folder)
    for name in os.listdir(target.path):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(target.path, name), folder)
    return hf


def _save_mimic_head(folder: str, target_path: str, hf) -> dict:
    """A head holding the quiet target's layer (q/k/v over the embedding half only, fc nearly
    0) and LM head rows: ``h'[p]`` is about the target's state at p + 1 over x[1..p+1], so its
    first draft is often right."""
    config = _head_config(target_path, [0, 0, 0])
    sd = {n[len("model."):]: t.clone() for n, t in hf.state_dict().items()
          if n.startswith("model.layers.0.") or n == "model.norm.weight"}
    h = config["hidden_size"]
    for p in ("q", "k", "v"):
        w = sd[f"layers.0.self_attn.{p}_proj.weight"]
        sd[f"layers.0.self_attn.{p}_proj.weight"] = torch.cat([w, torch.zeros_like(w)], 1)
    g = torch.Generator().manual_seed(5)
    sd["fc.weight"] = 0.002 * torch.randn(h, 3 * h, generator=g)
    sd["layers.0.hidden_norm.weight"] = torch.ones(h)
    ids = _draft_ids(config["vocab_size"], 9, always=list(range(120)))
    sd["lm_head.weight"] = hf.lm_head.weight[ids].clone()
    sd["d2t"] = ids - torch.arange(DRAFT_VOCAB)
    return _save(folder, config, sd)


def _ref_layer(head: dict, embed: torch.Tensor, ids_next: list[int],
               feats: torch.Tensor) -> torch.Tensor:
    """Plain-torch EAGLE-3 layer over positions 0..T-1: tokens x[p+1], features [T, H] ->
    pre-norm h'[p] (vLLM's Eagle3 LlamaDecoderLayer, norm after residual): attention over
    concat(input_layernorm(embed), hidden_norm(features)) [T, 2H], the features as residual."""
    t, eps = head["tensors"], head["config"]["rms_norm_eps"]
    u = torch.cat([_rms(embed[ids_next], t["layers.0.input_layernorm.weight"], eps),
                   _rms(feats, t["layers.0.hidden_norm.weight"], eps)], -1)
    return _ref_decoder_layer(head, u, feats)


def _ref_logits(hf_model, head: dict, context: list[int], k: int,
                drafts: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """EAGLE-3's k drafts after ``context`` (x[0..n]) and their distributions over the whole
    vocabulary [k, V] (zero outside the draft vocabulary): features fc(taps) of transformers'
    hidden states entering the tapped layers, then the head's own pre-norm outputs fed back
    (no fc); each draft the argmax, or ``drafts[i]`` where given."""
    cfg, t = head["config"], head["tensors"]
    ids_map = torch.arange(DRAFT_VOCAB) + t["d2t"]
    with torch.no_grad():
        out = hf_model(torch.tensor([context[:-1]]), output_hidden_states=True)
        taps = torch.cat([out.hidden_states[i][0]
                          for i in cfg["eagle_aux_hidden_state_layer_ids"]], -1)
    embed = hf_model.get_input_embeddings().weight

    def readout(last: torch.Tensor) -> tuple[torch.Tensor, int]:
        logits = _rms(last, t["norm.weight"], cfg["rms_norm_eps"]) @ t["lm_head.weight"].T
        full = torch.zeros(cfg["vocab_size"])
        full[ids_map] = logits.softmax(-1)
        return full, int(ids_map[logits.argmax()])

    return ref_rollout(lambda ids, feats: _ref_layer(head, embed, ids, feats), readout,
                       context, taps @ t["fc.weight"].T, k, drafts)


def _engine(path: str, head: str | None, k: int = 3, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 96)
    spec = None if head is None else {"method": "eagle3", "model": head,
                                      "num_speculative_tokens": k, "adaptive": False}
    return LLM(model=path, dtype="float32", block_size=4, speculative_config=spec, **kw)


@pytest.fixture(scope="module", params=["random", "mimic"])
def pair(request, tiny_model_factory, tmp_path_factory):
    """(hf target, head dict, plain engine, EAGLE-3 engine, kind, target folder, head folder):
    a random head on the two-layer tiny Llama (taps 1, 0, 1), or the near-right head on the
    quiet one-layer Llama."""
    folder = str(tmp_path_factory.mktemp(f"eagle3_{request.param}"))
    if request.param == "random":
        target = tiny_model_factory("llama")
        path, hf = target.path, target.hf_model
        head = _save_random_head(folder, path, seed=7)
    else:
        path = str(tmp_path_factory.mktemp("quiet_llama"))
        hf = _quiet_target(path, tiny_model_factory("llama_1layer"))
        head = _save_mimic_head(folder, path, hf)
    return hf, head, _engine(path, None), _engine(path, folder), request.param, path, folder


def test_drafts_and_distributions_match_a_plain_torch_eagle3(pair, monkeypatch):
    """Greedy requests' drafts are the reference's; sampled ones' q (softmax of the head's
    logits over its draft vocabulary, placed through d2t) matches within fp32 tolerance."""
    hf, head, _, eagle, *_ = pair
    seen = _record_proposals(monkeypatch)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eagle.generate(PROMPTS[:2], greedy, use_tqdm=False)
    assert len(seen) >= 4
    for context, drafts, _ in seen:
        assert drafts == _ref_logits(hf, head, context, len(drafts))[0]
    seen.clear()
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True)
               for s in range(3)]
    eagle.generate(PROMPTS[:3], sampled, use_tqdm=False)
    assert len(seen) >= 6
    for context, drafts, q in seen:
        _, ref = _ref_logits(hf, head, context, len(drafts), drafts)
        torch.testing.assert_close(q, ref, atol=2e-5, rtol=1e-3)
        assert set(drafts) <= set((torch.arange(DRAFT_VOCAB) + head["tensors"]["d2t"]).tolist())


def test_greedy_equals_plain_greedy(pair, assert_no_leaks, monkeypatch):
    _, _, base, eagle, kind, *_ = pair
    seen = _record_proposals(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = base.generate(PROMPTS, params, use_tqdm=False)
    got = eagle.generate(PROMPTS, params, use_tqdm=False)
    _same_outputs(ref, got)
    drafted, accepted = expected_counts(seen, got)  # drafts up to the first the output refutes
    assert _drafted(got) == (drafted, accepted)
    assert drafted > 0
    if kind == "mimic":
        assert accepted >= 0.1 * drafted, (accepted, drafted)
    assert_no_leaks(eagle)


def test_step_graphs_replay_verification_steps_as_the_eager_run(pair, monkeypatch):
    """CPU step graphs (on by default) record and replay the EAGLE-3 engine's verification
    steps (every request 1 + k tokens), the target's layer taps included: proposals (context,
    drafts, draft distributions), output tokens and drafted / accepted counts equal an
    ``enforce_eager`` engine's, bit for bit."""
    if native_cpu_kernels() is None:
        pytest.skip("no C compiler: no CPU step graphs")
    *_, kind, path, folder = pair
    # fresh engines: the pair's has cached blocks, whose stale head K/V change the drafts. One
    # GEMM kernel for both: `--cpu-gemm auto` weighs the step graphs' margin only where graphs
    # run, so the two engines could pick different kernels (other last bits) per shape.
    # And one thread (the suite's default, which an earlier test may have changed): at two
    # threads the two engines' kernels split the work differently (last bits differ).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare_graph_and_eager_engines(path, folder, kind, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _compare_graph_and_eager_engines(path, folder, kind, monkeypatch):
    eagle = _engine(path, folder, cpu_gemm="native")
    eager = _engine(path, folder, enforce_eager=True, cpu_gemm="native")
    graphs = eagle.engine.core.executor.runner.graph_runner
    assert isinstance(graphs, CpuGraphRunner)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)] * 2
    seen = _record_proposals(monkeypatch)
    before = graphs.replayed_steps
    got = eagle.generate(PROMPTS, params, use_tqdm=False)
    replayed, graph_seen = graphs.replayed_steps - before, list(seen)
    seen.clear()
    ref = eager.generate(PROMPTS, params, use_tqdm=False)
    assert eager.engine.core.executor.runner.graph_runner is None
    assert replayed >= 4, replayed
    _same_outputs(ref, got)
    assert _drafted(got) == _drafted(ref)
    assert len(graph_seen) == len(seen) >= 16
    for (context, drafts, q), (ref_context, ref_drafts, ref_q) in zip(graph_seen, seen,
                                                                        strict=True):
        assert (context, drafts) == (ref_context, ref_drafts)
        assert (q is None and ref_q is None) or torch.equal(q, ref_q)
    if kind == "mimic":  # drafts accepted: the replayed taps feed the right features
        assert _drafted(got)[1] > 0


def test_default_layer_ids_are_vllms():
    # vLLM's Llama default (2, num_layers // 2, num_layers - 3): Llama-3.1-8B's 2, 16, 29
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(80) == (2, 40, 77)


@pytest.mark.parametrize("change, needle", [
    ("default_ids", r"default EAGLE-3 layer ids .*\[2, 1, -1\]: layer ids must be in \[0, 2\)"),
    ("bad_ids", r"eagle_aux_hidden_state_layer_ids=\[0, 5, 1\]: layer ids must be in \[0, 2\)"),
    ("d2t_twice", "d2t maps its 200 draft ids .* twice onto one token"),
    ("d2t_short", (r"'d2t' has 199 entries; the head's draft_vocab_size is 200 \(its lm_head "
                  r"rows\): d2t needs one entry per draft id \(draft id i is target token "
                  r"i \+ d2t\[i\]\)")),
    ("d2t_2d", (r"'d2t' of shape \(1, 200\) is not a vector; the head's draft_vocab_size is "
               r"200 \(its lm_head rows\): d2t needs one entry per draft id")),
    ("no_aux", "use_aux_hidden_state=false"),
    ("extra", (r"'layers.1.mlp.up_proj.weight' matches no parameter of an EAGLE-3 head \(fc, "
              r"layers.0, norm, embed_tokens, lm_head, d2t\)$")),
    ("missing", r"lacks \['fc.weight'\]"),
])
def test_head_errors_name_the_field(tiny_llama, tmp_path, change, needle):
    head = _save_random_head(str(tmp_path), tiny_llama.path, seed=3,
                             layer_ids=None if change == "default_ids" else (0, 5, 1)
                             if change == "bad_ids" else (1, 0, 1))
    config, tensors = head["config"], head["tensors"]
    if change == "d2t_twice":
        tensors["d2t"] = tensors["d2t"].clone()
        tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft id 1 -> draft id 0's token
    elif change == "d2t_short":
        tensors["d2t"] = tensors["d2t"][:-1].clone()
    elif change == "d2t_2d":
        tensors["d2t"] = tensors["d2t"][None].clone()
    elif change == "no_aux":
        config["eagle_config"] = {"use_aux_hidden_state": False}
    elif change == "extra":
        tensors["layers.1.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"].clone()
    elif change == "missing":
        del tensors["fc.weight"]
    _save(str(tmp_path), config, tensors)
    with pytest.raises(ValueError, match=f"speculative_config model .*{needle}"):
        _engine(tiny_llama.path, str(tmp_path))


@pytest.mark.parametrize("pair", ["random"], indirect=True)
def test_preemption_and_prefix_cache_keep_greedy_output(pair, assert_no_leaks):
    """Recomputed (preempted) requests and a prefix-cache hit: the head's features come
    from the target's taps of whatever the target computes; the output stays plain greedy."""
    _, _, base, _, _, path, folder = pair
    prompts = [PROMPTS[i % 4] + " " + "ab" * (i % 3) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = base.generate(prompts, params, use_tqdm=False)
    spec = _engine(path, folder, num_kv_blocks=30, max_num_seqs=8)
    got = spec.generate(prompts, params, use_tqdm=False)
    _same_outputs(ref, got)
    assert spec.engine.core.scheduler.num_preemptions > 0
    again = spec.generate(prompts[-1:], params, use_tqdm=False)  # a prefix-cache hit
    _same_outputs(ref[-1:], again)
    assert_no_leaks(spec)


def test_a_target_of_another_decoder_stack_is_refused(tiny_model_factory, tiny_llama,
                                                      tmp_path):
    """The taps hook layers called as LlamaModel calls them; Gemma 3's stack is refused."""
    target = tiny_model_factory("gemma3")
    _save_random_head(str(tmp_path), tiny_llama.path, seed=3)  # a Llama head, same sizes
    with pytest.raises(ValueError, match="EAGLE-3 taps need a target whose decoder stack is "
                                         "kvflow's LlamaModel .*Gemma3ForCausalLM has another"):
        _engine(target.path, str(tmp_path))
